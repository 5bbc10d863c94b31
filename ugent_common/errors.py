"""The one error type every room raises; the hub renders it as the OpenAI-style error object."""
from __future__ import annotations

TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                  404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error"}


class ApplicationError(Exception):
    """A refusal or failure the client sees, with its HTTP status and code."""

    def __init__(self, message: str, *, status: int = 400, code: str | None = None,
                 param: str | None = None, extra: dict | None = None, headers: dict | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        # the error object's type: by the status (TYPE_BY_STATUS), unless an OpenAI endpoint's own answer
        # types it otherwise (OpenAI's 404 model_not_found is an invalid_request_error)
        self.type = type_
        self.code = code
        self.param = param
        self.extra = extra or {}
        self.headers = headers or {}

    def body(self) -> dict:
        err = {"message": self.message, "type": self.type or TYPE_BY_STATUS.get(self.status, "api_error"),
               "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}
