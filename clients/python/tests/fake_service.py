"""An in-process stand-in for kernelkite-service's submission API with its fair queue
(`user`/`priority`/`cache` in the POST, a quota's 429 with `Retry-After`, `place`,
`cached_from` and `finished_at` in the submission, the `queue` event without an `id:` line),
for the client's side of that contract where the test must decide each place, cut stream and
answer, which the real service's queue gives only by timing; the rest of the suite runs
against the real service.

A plain HTTP/1.1 server on loopback (one request per connection), driven by the test: `move`
a submission to a state, `set_place` while it waits, `raw` to send any SSE frame, `cut` open
streams. Streams replay as the service does: the state changes after `Last-Event-ID`, then
the current place while queued, then whatever happens next. `GET ?wait=` holds until the
submission ends or the wait is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

from stack import LoopbackServer

TERMINAL = {"succeeded", "failed", "canceled", "timed_out"}
REASONS = {200: "OK", 202: "Accepted", 401: "Unauthorized", 404: "Not Found"}


def now_text(delta_s: float = 0.0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=delta_s)).isoformat().replace("+00:00", "Z")


@dataclass
class FakeSubmission:
    id: str
    body: dict[str, Any]
    state: str = "queued"
    history: list[dict[str, str]] = field(default_factory=list)
    place: dict[str, Any] | None = None
    cached_from: str | None = None
    result: Any = None
    error: str | None = None
    # What the streams send, in order: ("state", seq, frame) ("end" for the terminal one),
    # ("queue", None, frame), ("raw", None, frame).
    log: list[tuple[str, int | None, str]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    streams: set[asyncio.StreamWriter] = field(default_factory=set)

    def json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "queue": self.body.get("queue"),
            "run_id": self.body.get("run_id") or self.id,
            "timeout_s": self.body.get("timeout_s"),
            "user": self.body.get("user"),
            "priority": self.body.get("priority")
            or ("ranked" if self.body.get("config", {}).get("mode") == "leaderboard" else "test"),
            "cached_from": self.cached_from,
            "finished_at": self.history[-1]["at"] if self.state in TERMINAL else None,
            "place": self.place if self.state == "queued" else None,
            "build": None,
            "result": self.result,
            "error": self.error,
            "history": list(self.history),
        }

    def _append(self, kind: str, seq: int | None, frame: str) -> None:
        self.log.append((kind, seq, frame))
        self.changed.set()
        self.changed = asyncio.Event()

    def move(
        self,
        state: str,
        *,
        result: Any = None,
        error: str | None = None,
        cached_from: str | None = None,
    ) -> None:
        """The submission enters `state` (a terminal one with its result or error)."""
        self.state = state
        if state != "queued":
            self.place = None
        self.result, self.error = result, error
        if cached_from is not None:
            self.cached_from = cached_from
        seq = len(self.history)
        at = now_text()
        self.history.append({"state": state, "at": at})
        data: dict[str, Any] = {"id": self.id, "seq": seq, "state": state, "at": at}
        if state in TERMINAL:
            data["submission"] = self.json()
        kind = "end" if state in TERMINAL else "state"
        self._append(kind, seq, f"event: {state}\nid: {seq}\ndata: {json.dumps(data)}\n\n")

    def set_place(self, position: int, wait_s: float | None) -> None:
        """The submission's place while queued (the GET's `place`, and a `queue` event)."""
        self.place = {
            "position": position,
            "estimated_wait_s": wait_s,
            "estimated_start_at": None if wait_s is None else now_text(wait_s),
        }
        self._append("queue", None, self._queue_frame())

    def _queue_frame(self) -> str:
        return f"event: queue\ndata: {json.dumps({'id': self.id, **(self.place or {})})}\n\n"

    def raw(self, frame: str) -> None:
        """Any frame, sent as it is to open streams (and replayed to later ones)."""
        self._append("raw", None, frame)

    def cut(self) -> int:
        """Closes the open event streams; how many there were."""
        n = len(self.streams)
        for w in list(self.streams):
            w.transport.abort()
        self.streams.clear()
        return n


class FakeService(LoopbackServer):
    """The stand-in service. `quota = (message, retry_after)` answers the next POSTs `429`;
    `refuse_events` answers `/events` with `503` (so `follow` falls back to long-polling);
    `on_submit(sub)` runs for each new submission (a cached answer moves it on at once);
    `delete_cancels` plays a service from before `POST /v1/submissions/{id}/cancel`, whose
    cancel was `DELETE /v1/submissions/{id}`."""

    def __init__(self, token: str = "kk-test-token") -> None:
        self.token = token
        self.submissions: dict[str, FakeSubmission] = {}
        self.posts: list[dict[str, Any]] = []
        self.requests: list[str] = []
        self.quota: tuple[str, str | None] | None = None
        self.refuse_events = False
        self.delete_cancels = False
        self.on_submit: Any = None

    async def aclose(self) -> None:
        for sub in self.submissions.values():
            sub.cut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def submission(self, index: int = 0, within: float = 10.0) -> FakeSubmission:
        """The `index`th submission made, waiting for it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while len(self.submissions) <= index:
            if loop.time() > deadline:
                raise AssertionError(f"no submission #{index} within {within} s")
            await asyncio.sleep(0.01)
        return list(self.submissions.values())[index]

    async def streaming(self, sub: FakeSubmission, within: float = 10.0) -> None:
        """Waits until an event stream of `sub` is open."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not sub.streams:
            if loop.time() > deadline:
                raise AssertionError(f"no event stream of {sub.id} within {within} s")
            await asyncio.sleep(0.01)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if not line:
                return
            method, target, _ = line.decode("latin-1").split(" ", 2)
            headers: dict[str, str] = {}
            while True:
                h = await reader.readline()
                if h in (b"\r\n", b"\n", b""):
                    break
                k, _, v = h.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            body = await reader.readexactly(int(headers.get("content-length") or 0))
            self.requests.append(f"{method} {target}")
            await self._route(method, target, headers, body, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _route(
        self,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
        writer: asyncio.StreamWriter,
    ) -> None:
        if headers.get("authorization") != f"Bearer {self.token}":
            return await _answer(writer, 401, {"error": "a bearer token is required"})
        url = urlsplit(target)
        parts = url.path.strip("/").split("/")
        if method == "POST" and url.path == "/v1/submissions":
            doc = json.loads(body)
            self.posts.append(doc)
            if self.quota is not None:
                message, retry_after = self.quota
                extra = {"Retry-After": retry_after} if retry_after is not None else {}
                return await _answer(writer, 429, {"error": message}, extra)
            sub = FakeSubmission(id=str(uuid.uuid4()), body=doc)
            self.submissions[sub.id] = sub
            sub.move("queued")
            if self.on_submit is not None:
                self.on_submit(sub)
            accepted = {
                "id": sub.id,
                "state": "queued",
                "status_url": f"/v1/submissions/{sub.id}",
                "place": sub.place,
            }
            return await _answer(writer, 202, accepted)
        if len(parts) < 3 or parts[:2] != ["v1", "submissions"] or parts[2] not in self.submissions:
            return await _answer(writer, 404, {"error": "no such submission"})
        sub = self.submissions[parts[2]]
        if method == "GET" and len(parts) == 3:
            wait = float(parse_qs(url.query).get("wait", ["0"])[0])
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        while sub.state not in TERMINAL:
                            await sub.changed.wait()
            return await _answer(writer, 200, sub.json())
        cancel_route = (
            (method == "DELETE" and len(parts) == 3)
            if self.delete_cancels
            else (method == "POST" and parts[3:] == ["cancel"])
        )
        if cancel_route:
            if sub.state not in TERMINAL:
                sub.move("canceled", error="canceled")
            return await _answer(writer, 200, sub.json())
        if method == "GET" and parts[3:] == ["events"]:
            if self.refuse_events:
                return await _answer(writer, 503, {"error": "shutting down"}, {"Retry-After": "1"})
            return await self._stream(sub, headers.get("last-event-id"), writer)
        return await _answer(writer, 404, {"error": "no such route"})

    async def _stream(
        self, sub: FakeSubmission, last_event_id: str | None, writer: asyncio.StreamWriter
    ) -> None:
        last = int(last_event_id) if last_event_id is not None else -1
        replay = [f for kind, seq, f in sub.log if kind in ("state", "end") and seq > last]
        replay += [f for kind, _, f in sub.log if kind == "raw"]
        if sub.state == "queued" and sub.place is not None:
            replay.append(sub._queue_frame())
        seen = len(sub.log)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Connection: close\r\n\r\n"
        )
        sub.streams.add(writer)
        try:
            for frame in replay:
                writer.write(frame.encode())
            await writer.drain()
            if sub.state in TERMINAL:
                return
            while True:
                changed = sub.changed
                while seen < len(sub.log):
                    kind, _, frame = sub.log[seen]
                    seen += 1
                    writer.write(frame.encode())
                    await writer.drain()
                    if kind == "end":
                        return
                await changed.wait()
        finally:
            sub.streams.discard(writer)


async def _answer(
    writer: asyncio.StreamWriter,
    status: int,
    doc: Any,
    extra: dict[str, str] | None = None,
) -> None:
    body = json.dumps(doc).encode()
    head = [
        f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (extra or {}).items()),
    ]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    await writer.drain()
