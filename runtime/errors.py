"""The one error type for bad caller input, raised anywhere in the runtime."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad input from a caller; `param` names the offending field for the error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
