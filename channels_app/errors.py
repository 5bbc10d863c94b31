"""One error type and its rendering as the OpenAI-style error object."""
from __future__ import annotations

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response

from ugent_common.errors import TYPE_BY_STATUS, ApplicationError  # noqa: F401  (the hub renders it)

#: On a refusal or failure the client must not send again as it is: the official openai client retries
#: 408, 409, 429 and 5xx unless told not to (a duplicate, or a message that may already have acted).
NO_RETRY = {"x-should-retry": "false"}


REQUEST_TOO_LARGE = ("The request body is larger than this daemon takes: at most {limit} bytes "
                     "(UGENT_MAX_REQUEST_BYTES). Send a file with POST /v1/files and name it by its id.")


def request_too_large() -> ApplicationError:
    """Django's RequestDataTooBig (a body over DATA_UPLOAD_MAX_MEMORY_SIZE, which UGENT_MAX_REQUEST_BYTES
    sets) as an error object: Django alone answers it with an HTML 400."""
    return ApplicationError(REQUEST_TOO_LARGE.format(limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE), status=413,
                            code="request_too_large", headers=NO_RETRY)


def error_response(exc: ApplicationError) -> JsonResponse:
    resp = JsonResponse(exc.body(), status=exc.status)
    for k, v in exc.headers.items():
        resp[k] = v
    return resp


def from_drf(exc: Exception) -> ApplicationError | None:
    if isinstance(exc, ApplicationError):
        return exc
    if isinstance(exc, RequestDataTooBig):  # DRF read the body (request.data)
        return request_too_large()
    if isinstance(exc, drf_exceptions.ValidationError):
        param, message = _first_validation_message(exc.detail)
        return ApplicationError(message, status=400, code="invalid_request", param=param)
    if isinstance(exc, (drf_exceptions.NotAuthenticated, drf_exceptions.AuthenticationFailed)):
        return ApplicationError(str(exc.detail), status=401, code="invalid_api_key")
    if isinstance(exc, drf_exceptions.APIException):
        return ApplicationError(str(exc.detail), status=exc.status_code, code=exc.default_code)
    return None


def _first_validation_message(detail, prefix: str | None = None):
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = key if key != "non_field_errors" else prefix
            if prefix and key != "non_field_errors":
                name = f"{prefix}.{key}"
            return _first_validation_message(value, name)
    if isinstance(detail, list) and detail:
        return _first_validation_message(detail[0], prefix)
    msg = str(detail)
    return prefix, (f"{prefix}: {msg}" if prefix else msg)


def exception_handler(exc, context):
    app_exc = from_drf(exc)
    if app_exc is None:
        return None
    resp = Response(app_exc.body(), status=app_exc.status)
    for k, v in app_exc.headers.items():
        resp[k] = v
    if app_exc.status == 401:
        resp["WWW-Authenticate"] = "Bearer"
    return resp
