"""Errors as users see them: OpenAI's error object on /v1 and the websocket, DRF's shape on /api."""

from __future__ import annotations

import json
import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig, ValidationError
from django.http import Http404, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions, status
from rest_framework.response import Response

log = logging.getLogger("api")


class OpenAIError(Exception):
    """A request that cannot be served, as OpenAI reports it: status, message, type, param, code."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or _type_for(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_generation(cls, exc: Any) -> OpenAIError:
        """From fleet.dispatch.GenerationError (duck-typed: the api does not need the dispatcher to raise)."""
        headers = {"Retry-After": str(exc.retry_after)} if getattr(exc, "retry_after", None) else {}
        return cls(exc.status, exc.message, code=exc.code, param=exc.param, type=exc.kind, headers=headers)


def _type_for(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 403:
        return "permission_error"
    if status_code == 404:
        return "not_found_error"
    if status_code == 429:
        return "rate_limit_error"
    return "invalid_request_error" if 400 <= status_code < 500 else "server_error"


# Anthropic's error types by status (its Messages API's errors); 529 is its "overloaded".
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         529: "overloaded_error"}


def anthropic_status(status: int) -> int:
    """Every lane busy until the deadline (503 on OpenAI's paths) is Anthropic's 529 "overloaded"."""
    return 529 if status == 503 else status


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def openai_error_response(exc: OpenAIError) -> HttpResponse:
    response = HttpResponse(json.dumps(exc.body()), status=exc.status, content_type="application/json")
    for name, value in exc.headers.items():
        response[name] = value
    return response


def invalid(message: str, *, param: str | None = None, code: str | None = "invalid_request") -> OpenAIError:
    """The common case: a 400 about one request parameter."""
    return OpenAIError(400, message, code=code, param=param)


def body_too_large(limit: int) -> OpenAIError:
    """A body over FLEET_MAX_BODY_BYTES (api.limits) or Django's DATA_UPLOAD_MAX_MEMORY_SIZE."""
    return OpenAIError(413, f"The request body is larger than this head accepts ({limit} bytes, "
                       "FLEET_MAX_BODY_BYTES); send less, e.g. fewer or shorter messages.", code="request_too_large")


STORE_RETRY_AFTER_S = 5


def store_unavailable(exc: BaseException) -> OpenAIError | None:
    """A 503 with Retry-After when `exc` says the database or Redis cannot be reached (an outage, a restart), which
    was a bare 500; None for anything else. The head recovers by itself once they are back."""
    from django.db import InterfaceError, OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exc, OperationalError | InterfaceError):
        what = "database"
    elif isinstance(exc, RedisConnectionError | RedisTimeoutError):
        what = "Redis"
    else:
        return None
    return OpenAIError(503, f"The head cannot reach its {what} just now; retry in a few seconds.",
                       code="service_unavailable", headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


def management_exception_handler(exc: Exception, context: dict) -> Response | None:
    """DRF's handler, plus the errors services raise (ValueError, Django's ValidationError) as 400s and a body over
    Django's DATA_UPLOAD_MAX_MEMORY_SIZE as a 413.

    Anything else becomes a logged 500 with a one-line body: a traceback is never shown to a user.
    """
    from rest_framework.views import exception_handler  # not at import: DRF's settings import this module

    if isinstance(exc, RequestDataTooBig):
        error = body_too_large(settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
        return Response({"detail": error.message}, status=error.status)
    if isinstance(exc, ValueError | ValidationError):
        messages = exc.messages if isinstance(exc, ValidationError) else [str(exc)]
        return Response({"detail": " ".join(messages)}, status=status.HTTP_400_BAD_REQUEST)
    response = exception_handler(exc, context)
    if response is not None:
        if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
            response["Retry-After"] = str(max(int(exc.wait), 1))
        return response
    if isinstance(exc, Http404 | PermissionDenied):  # pragma: no cover - DRF handles these above
        return None
    if (unavailable := store_unavailable(exc)) is not None:
        log.warning("api: %s: %s", unavailable.message, exc)
        return Response({"detail": unavailable.message}, status=503, headers=unavailable.headers)
    log.exception("api: unhandled error in %s", context.get("view").__class__.__name__)
    return Response({"detail": "Internal error; it has been logged."}, status=status.HTTP_500_INTERNAL_SERVER_ERROR)


def not_found(request, exception=None) -> HttpResponse:
    """The 404 of a URL no route matches (handler404): the API's own error shape under /v1/ and /api/."""
    if anthropic_path(request.path):
        return JsonResponse(anthropic_body(404, f"There is nothing at {request.path!r}."), status=404)
    if request.path.startswith("/v1/"):
        return openai_error_response(OpenAIError(404, f"There is nothing at {request.path!r}; /v1/openapi.json "
                                                 "lists the paths of this API.", code="not_found"))
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": f"There is nothing at {request.path!r}; /api/schema/ lists the paths of this "
                                       "API."}, status=404)
    return defaults.page_not_found(request, exception)


def server_error(request) -> HttpResponse:
    """A bug outside the views' own handlers (handler500): the API's error shape under /v1/ and /api/."""
    if request.path.startswith("/v1/"):
        return openai_error_response(OpenAIError(500, "The head failed to serve this request; it has been logged.",
                                                 code="internal_error"))
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Internal error; it has been logged."}, status=500)
    return defaults.server_error(request)
