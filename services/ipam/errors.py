"""The error of the allocators: a :class:`~services.common.errors.PalisadeError` that changed nothing.

The allocators never import grpc; the error's :class:`~services.common.errors.Code`
names the status the servicer answers with. Every message says what is wrong and
what to do.
"""

from __future__ import annotations

from services.common.errors import PalisadeError


class IpamError(PalisadeError):
    """A request that cannot be served; nothing was changed in etcd."""
