"""Errors raised by the core; each gRPC adapter maps them to one status code."""

from __future__ import annotations


class SpecDecError(Exception):
    """Base class; the message is shown to the caller as-is."""


class InvalidArgument(SpecDecError):
    """A request field is malformed (INVALID_ARGUMENT). The message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class OutOfRange(SpecDecError):
    """A length or position lies outside what the session holds (OUT_OF_RANGE)."""


class SessionNotFound(SpecDecError):
    """The session id is unknown, closed, expired or evicted (NOT_FOUND)."""


class SessionBusy(SpecDecError):
    """Another call on the same session is in flight (FAILED_PRECONDITION)."""


class ResourceExhausted(SpecDecError):
    """No room for another session or for the requested length (RESOURCE_EXHAUSTED)."""
