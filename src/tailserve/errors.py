"""Typed errors shared by the engine and the server; the server maps them to HTTP in one place.

Every error is raised before any state changes (no KV block taken, no request queued).
"""

from __future__ import annotations


class TailserveError(Exception):
    """Base of every error tailserve raises on purpose."""


class InvalidRequestError(TailserveError):
    """The request cannot be served as sent (HTTP 400); `param` names the offending field."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus max_tokens do not fit the model's context (HTTP 400)."""

    code = "context_length_exceeded"


class RequestRejectedError(TailserveError):
    """Admission control refused the request (HTTP 429); retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float, reason: str = "slo") -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.reason = reason


class ConflictError(TailserveError):
    """The request conflicts with the server's present state (HTTP 409); `code` says which."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class ModelLoadError(TailserveError):
    """The model could not be read (missing file, corrupt weights, bad config)."""


class UnsupportedModelError(ModelLoadError):
    """The model is readable but its architecture or quantization is not supported."""


class ConfigError(TailserveError):
    """A configuration value is out of range; the message says what to change."""
