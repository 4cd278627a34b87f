"""A server-sent events decoder (the WHATWG `text/event-stream` rules), line by line.

Kept apart from the HTTP code so it can be checked on plain strings: comments (`:`) are
skipped, `data:` lines are joined with newlines, one space after the colon is dropped, an
`id` holding NUL is ignored, `retry` is taken only when it is all digits, and an event is
dispatched on a blank line only when it has data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSentEvent:
    """One dispatched event."""

    event: str
    data: str
    id: str | None
    retry_ms: int | None


class SSEDecoder:
    """Feeds lines (without their line break) in; returns each event as it completes."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._last_id: str | None = None
        self._retry_ms: int | None = None

    @property
    def last_event_id(self) -> str | None:
        """The last `id` seen, which a reconnecting client sends as `Last-Event-ID`."""
        return self._last_id

    def feed(self, line: str) -> ServerSentEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "event":
            self._event = value
        elif field == "data":
            self._data.append(value)
        elif field == "id":
            if "\0" not in value:
                self._last_id = value
        elif field == "retry" and value.isdigit():
            self._retry_ms = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._data:
            self._event = ""
            return None
        ev = ServerSentEvent(
            event=self._event or "message",
            data="\n".join(self._data),
            id=self._last_id,
            retry_ms=self._retry_ms,
        )
        self._event = ""
        self._data = []
        return ev
