"""Errors of the allocators, each with the gRPC status code the servicer answers with.

The allocators never import grpc; :class:`ErrorCode` names the status code and the
servicer maps it. Every message says what is wrong and what to do.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """The gRPC status code (by name) an allocation error maps to."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    UNAVAILABLE = "UNAVAILABLE"


class IpamError(Exception):
    """A request that cannot be served; nothing was changed in etcd."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
