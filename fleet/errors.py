"""The error a generation that cannot be served ends with, in the terms every interface maps to its own shape."""

from __future__ import annotations


class GenerationError(Exception):
    """A generation that cannot be served, with an OpenAI-style code and the HTTP status it maps to."""

    def __init__(self, code: str, message: str, *, status: int = 500, param: str | None = None,
                 retry_after: int | None = None, kind: str | None = None):
        super().__init__(message)
        self.code, self.message, self.status, self.param, self.retry_after = code, message, status, param, retry_after
        self.kind = kind or ("invalid_request_error" if 400 <= status < 500 else "server_error")
