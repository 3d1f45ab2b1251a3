"""One error type with a status code for every service.

Logic and servicers raise :class:`PalisadeError` with a :class:`Code` (this module
never imports grpc); the error interceptor of every server
(``services.common.grpcserver.ErrorInterceptor``) turns it into the gRPC status.
Messages say what is wrong and what to do about it.
"""

from __future__ import annotations

import enum


class Code(enum.StrEnum):
    """The gRPC status code (by name) an error maps to."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"


class PalisadeError(Exception):
    """A request that cannot be served; ``code`` says how the API answers it."""

    code: Code = Code.INTERNAL

    def __init__(self, message: str, code: Code | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


#: gRPC truncates nothing itself but refuses trailers over its metadata limit (8 KiB by default):
#: a message that echoes a huge input must be cut, or the caller sees RESOURCE_EXHAUSTED instead.
MAX_MESSAGE = 2000


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"
