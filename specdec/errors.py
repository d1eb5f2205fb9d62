"""Errors raised by the core; each gRPC adapter maps them to one status code."""

from __future__ import annotations


class SpecDecError(Exception):
    """Base class; the message is shown to the caller as-is."""


class InvalidArgument(SpecDecError, ValueError):
    """A request field is malformed (INVALID_ARGUMENT). The message names the field. A
    ValueError too, as vLLM's SamplingParams raises, so `except ValueError` catches it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.detail = field, message  # apart, for callers that name the field their own way


class OutOfRange(SpecDecError):
    """A length or position lies outside what the session holds (OUT_OF_RANGE)."""


class SessionNotFound(SpecDecError):
    """The session id is unknown, closed, expired or evicted (NOT_FOUND)."""


class SessionClosed(SessionNotFound):
    """The session was closed while this call was in flight: its client gave up on it
    (NOT_FOUND; counted apart from engine failures)."""


class SessionBusy(SpecDecError):
    """Another call on the same session is in flight (FAILED_PRECONDITION)."""


class CallCancelled(SpecDecError):
    """The caller gave up on its call (cancelled it, or its deadline passed) before the engine
    finished it: the rest of its work is dropped (CANCELLED; counted apart from engine failures)."""


class ResourceExhausted(SpecDecError):
    """No room for another session or for the requested length (RESOURCE_EXHAUSTED)."""


class EngineStopped(SpecDecError):
    """The engine thread stopped on an error: nothing more can run here (UNAVAILABLE, so a
    client tries another replica; the process exits)."""


SHOWN_ID_CHARS = 64  # the ids the session store issues are 32 hex characters


def display_id(session_id: str) -> str:
    """A caller's session id as messages and logs show it: quoted and escaped (a newline in
    it forged a log line) and cut (a 20 kB id, echoed in the status details, passed gRPC's
    metadata limit: RESOURCE_EXHAUSTED instead of NOT_FOUND)."""
    if len(session_id) <= SHOWN_ID_CHARS:
        return repr(session_id)
    return f"{session_id[:SHOWN_ID_CHARS]!r}... ({len(session_id)} characters)"


def display_value(value: object) -> str:
    """A caller's value as an error message shows it: a string as `display_id` shows it, anything
    else cut past SHOWN_ID_CHARS characters the same way (a 5,000-digit logit_bias key came back whole)."""
    if isinstance(value, str):
        return display_id(value)
    text = str(value)
    return text if len(text) <= SHOWN_ID_CHARS else f"{text[:SHOWN_ID_CHARS]}... ({len(text)} characters)"


def invalid_text(text: str) -> str | None:
    """Where `text` is no valid Unicode, e.g. "'\\ud800' at character 3" (a lone surrogate:
    JSON's "\\ud800", or bytes of a command-line argument that are not UTF-8); None if it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{exc.object[exc.start]!r} at character {exc.start}"
    return None
