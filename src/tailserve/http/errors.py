"""The one place where errors become HTTP: status, headers and the OpenAI-style error body.

Maps tailserve.errors (engine side) and the server's own errors below; never lets a traceback or an
internal detail reach the client, and never changes engine state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tailserve.errors import ConflictError, InvalidRequestError, RequestRejectedError, TailserveError

log = logging.getLogger("tailserve.server")


class InvalidJSONError(InvalidRequestError):
    """The body is not UTF-8 JSON (HTTP 400)."""

    code = "invalid_json"


class UnsupportedParameterError(InvalidRequestError):
    """A known OpenAI parameter with a value this server does not implement (HTTP 400)."""

    code = "unsupported_parameter"


class ModelNotFoundError(TailserveError):
    """The `model` field names a model this server does not serve (HTTP 404)."""

    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"The model {model!r} does not exist; this server serves {served!r}")
        self.message = str(self)


class BodyTooLargeError(TailserveError):
    """The request body exceeds --max-body-bytes (HTTP 413)."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"Request body exceeds the limit of {limit_bytes} bytes")
        self.message = str(self)


class UnsupportedMediaTypeError(TailserveError):
    """A POST body declared as anything but application/json (HTTP 415)."""

    def __init__(self, content_type: str) -> None:
        super().__init__(f"Content-Type {content_type!r} is not supported; send application/json")
        self.message = str(self)


class AuthenticationError(TailserveError):
    """Missing or wrong Bearer token (HTTP 401)."""

    def __init__(self) -> None:
        super().__init__("Invalid or missing API key; send 'Authorization: Bearer <key>'")
        self.message = str(self)


class ServiceUnavailableError(TailserveError):
    """Not ready yet or draining for shutdown (HTTP 503); `reason` is `not_ready` or `draining`."""

    def __init__(self, reason: str) -> None:
        text = "the model is still warming up" if reason == "not_ready" else "the server is shutting down"
        super().__init__(f"Service unavailable: {text}")
        self.message = str(self)
        self.reason = reason


@dataclass(frozen=True)
class HTTPError:
    """An error ready to send: status, OpenAI-style body and extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, the shape OpenAI clients parse."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def to_http(exc: BaseException) -> HTTPError:
    """Status, body and headers for any exception; unknown ones become a 500 without details."""
    if isinstance(exc, InvalidRequestError):  # includes ContextLengthExceeded, InvalidJSON, Unsupported
        code = None if type(exc) is InvalidRequestError else exc.code
        return HTTPError(400, error_body(exc.message, "invalid_request_error", exc.param, code), {})
    if isinstance(exc, ModelNotFoundError):
        return HTTPError(
            404, error_body(exc.message, "invalid_request_error", "model", "model_not_found"), {}
        )
    if isinstance(exc, BodyTooLargeError):
        return HTTPError(413, error_body(exc.message, "invalid_request_error", None, "body_too_large"), {})
    if isinstance(exc, UnsupportedMediaTypeError):
        body = error_body(exc.message, "invalid_request_error", None, "unsupported_media_type")
        return HTTPError(415, body, {})
    if isinstance(exc, AuthenticationError):
        return HTTPError(401, error_body(exc.message, "authentication_error", None, "invalid_api_key"), {})
    if isinstance(exc, RequestRejectedError):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        body = error_body(exc.message, "rate_limit_error", None, exc.reason)
        return HTTPError(429, body, {"Retry-After": retry})
    if isinstance(exc, ConflictError):
        return HTTPError(409, error_body(exc.message, "invalid_request_error", None, exc.code), {})
    if isinstance(exc, ServiceUnavailableError):
        body = error_body(exc.message, "service_unavailable_error", None, exc.reason)
        return HTTPError(503, body, {"Retry-After": "1"})
    log.exception("internal error while serving a request", exc_info=exc)
    return HTTPError(500, error_body("Internal server error", "server_error", None, "internal_error"), {})


def route_error(status: int, detail: str, headers: Mapping[str, str] | None = None) -> HTTPError:
    """Errors raised by routing itself (unknown path 404, wrong method 405 with its Allow header)."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return HTTPError(status, error_body(detail, "invalid_request_error", None, code), dict(headers or {}))
