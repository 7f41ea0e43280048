"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

import asyncio
import re

import msgspec
import structlog
from aiohttp import WSCloseCode, web

from runtime.sampling_params import InvalidRequestError

log = structlog.get_logger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)  # routes that answer errors in Anthropic's shape
WEBSOCKET = "pagedserve.websocket"  # a request's key for its WebSocket, once upgraded: errors then go in frames


class UnavailableError(Exception):
    """Nothing can answer this request now (no worker reachable, its worker lost): 503 with Retry-After."""

    retry_after_s = 2


class APIError(Exception):
    """An error to send to the client as is."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)

    def anthropic_body(self) -> dict:
        """The error in Anthropic's shape (the Messages API): {"type": "error", "error": {"type", "message"}}."""
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(self.status, "invalid_request_error"),
                                           "message": self.message}}

    def anthropic_response(self) -> web.Response:
        return web.json_response(self.anthropic_body(), status=self.status, headers=self.headers)


def from_invalid_request(exc: InvalidRequestError) -> APIError:
    return APIError(400, exc.message, exc.param, exc.code)


_AT_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")


def from_validation_error(exc: msgspec.ValidationError) -> APIError:
    """msgspec's message names the path ("... - at `$.messages[0].role`"): use it as `param`."""
    message = str(exc)
    unknown = _UNKNOWN_FIELD.search(message)
    at = _AT_PATH.search(message)
    param = None
    if at and at.group(1):
        param = at.group(1)
    if unknown:
        param = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
    return APIError(400, message, param, "invalid_value" if not unknown else "unknown_parameter")


def from_exception(exc: Exception) -> APIError:
    """Any exception as the APIError a client should see (500 only for our own bugs)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return from_invalid_request(exc)
    if isinstance(exc, msgspec.ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, msgspec.DecodeError):
        return APIError(400, f"request body is not valid JSON: {exc}", None, "invalid_json")
    if isinstance(exc, UnavailableError):
        return APIError(503, f"{exc}; retry shortly", None, "service_unavailable",
                        {"Retry-After": str(exc.retry_after_s)})
    return APIError(500, "internal error while generating; the request was stopped", None, "internal_error")


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn every error into the OpenAI error shape (Anthropic's on its routes); aiohttp's own HTTP errors included."""
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        error = _as_api_error(request, exc)
        ws = request.get(WEBSOCKET)
        if ws is not None and ws.prepared:  # no HTTP into an upgraded socket: close it, saying why
            await ws.close(code=WSCloseCode.INTERNAL_ERROR if error.status >= 500 else WSCloseCode.POLICY_VIOLATION,
                           message=error.message[:120].encode())
            return ws
        return error.anthropic_response() if request.path.startswith(ANTHROPIC_PATHS) else error.response()


def _as_api_error(request: web.Request, exc: Exception) -> APIError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.app._client_max_size
        return APIError(413, f"request body too large (limit {limit} bytes)", None, "request_too_large")
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return APIError(exc.status, exc.reason or "error", None, None, allow)
    if not isinstance(exc, (APIError, InvalidRequestError, UnavailableError, msgspec.ValidationError,
                            msgspec.DecodeError)):
        log.error("unhandled error", path=request.path, error_type=type(exc).__name__, exc_info=exc)
    return from_exception(exc)
