"""The datapath's errors: each carries the gRPC status code the servicer answers with.

Built on :class:`services.common.errors.PalisadeError`, so the server's error interceptor
maps every one of them and nothing below the servicer imports grpc. Messages say
what is wrong and what to do about it.
"""

from __future__ import annotations

from services.common.errors import Code, PalisadeError


class EndpointError(PalisadeError):
    """A request about an endpoint that cannot be served."""

    code = Code.INTERNAL


class InvalidRequest(EndpointError):
    code = Code.INVALID_ARGUMENT


class EndpointNotFound(EndpointError):
    code = Code.NOT_FOUND


class EndpointExists(EndpointError):
    code = Code.ALREADY_EXISTS


class PreconditionFailed(EndpointError):
    """The node is not in a state the request can be served in (a namespace or interface in the way)."""

    code = Code.FAILED_PRECONDITION


class UpstreamUnavailable(EndpointError):
    """IPAMService, IdentityService or PolicyService cannot be reached; retrying later may work."""

    code = Code.UNAVAILABLE


class DatapathFailure(EndpointError):
    """The kernel refused a change (netlink, BPF)."""

    code = Code.INTERNAL


class UpstreamError(PalisadeError):
    """A call to another service failed; ``code`` is the status that service answered with.

    Raised by the clients at the edge (``ipamclient``); the endpoint manager decides what
    each code means for the request at hand (an address already held, a pod not known yet).
    """

    def __init__(self, service: str, message: str, code: Code) -> None:
        super().__init__(message, code)
        self.service = service

    def __str__(self) -> str:
        return f"{self.service}: {self.code}: {self.message}"


class OrderError(PalisadeError):
    """An order or resync carries an entry the datapath cannot represent."""

    code = Code.INVALID_ARGUMENT
