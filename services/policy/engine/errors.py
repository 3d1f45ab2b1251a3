"""Errors the policy state gives for requests it cannot answer."""

from __future__ import annotations

from services.common.errors import Code, PalisadeError


class RequestError(PalisadeError):
    """A request the state cannot answer: INVALID_ARGUMENT, or NOT_FOUND (``not_found``) for unknown objects."""

    def __init__(self, message: str, *, not_found: bool = False) -> None:
        super().__init__(message, Code.NOT_FOUND if not_found else Code.INVALID_ARGUMENT)
