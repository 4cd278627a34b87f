"""An async client for kernelkite-service's HTTP API (`service/README.md` in the repository).

`KernelkiteClient` maps each route to one method that makes one request: `submit` (with an
`Idempotency-Key`), `get` (optionally long-polling with `wait`), `cancel`, `queue_status`, and
`events` (one server-sent-events connection, resumable with `Last-Event-ID`). `follow` is the
one method that keeps going across failures: it yields every state change of a submission
exactly once, in order, reconnecting the event stream where it broke off and falling back to
long-polling when the stream keeps failing. Both also yield `QueueEvent`s: the submission's
place in the service's queue while it waits there.

Every request has a timeout. Error answers raise `ServiceError` subclasses carrying the
service's own message; a service that cannot be reached raises `Unreachable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from kernelkite.sse import SSEDecoder

log = logging.getLogger(__name__)

TERMINAL_STATES = frozenset({"succeeded", "failed", "canceled", "timed_out"})
"""States a submission never leaves."""

STATES = ("queued", "scheduled", "running", "fetching", *sorted(TERMINAL_STATES))
"""Every state, the in-flight ones in the order a submission goes through them."""

PRIORITIES = ("admin", "ranked", "test")
"""The priority classes a submission may ask for (`submit(priority=...)`), first served first."""

_STATE_EVENT_TYPES = frozenset({*STATES, "message"})
"""The stream's event types that are state changes (each is named after its state)."""


def valid_queue_name(name: str) -> bool:
    """Whether the service takes `name` as a queue: 1-64 of `A-Za-z0-9._-`."""
    return 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "-_.") for c in name)


class KernelkiteError(Exception):
    """Base of the errors this client raises."""


class Unreachable(KernelkiteError):
    """No answer: the connection failed, broke, or timed out (or what came back was no answer
    this client can read). The message names the request (`POST http://…/v1/submissions`);
    `url` is the URL it went to (None when no request is to blame), `reason` what went wrong."""

    def __init__(self, reason: str, *, method: str | None = None, url: str | None = None) -> None:
        request = " ".join(part for part in (method, url) if part)
        super().__init__(f"{request}: {reason}" if request else reason)
        self.reason = reason
        self.url = url


class ServiceError(KernelkiteError):
    """The service answered with an error status; `message` is its `{"error"}` text,
    `retry_after_s` its `Retry-After` in seconds (None without one)."""

    def __init__(
        self,
        status: int,
        message: str,
        method: str,
        path: str,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{method} {path}: {status}: {message}")
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


class Unauthorized(ServiceError):
    """401 (missing or wrong token) or 403 (no token configured, and not a loopback client)."""


class NotFound(ServiceError):
    """404: the service does not know the submission."""


class Invalid(ServiceError):
    """400, 413 or 422: the request was refused as it is; sending it again will not help."""


class Conflict(ServiceError):
    """409: the submission already ended (cancel), or an idempotency key was reused for a
    different request."""


class ServerError(ServiceError):
    """5xx, or a 429 other than a submission's quota refusal: the service has a problem now;
    the same request may work later."""


class QuotaExceeded(ServiceError):
    """429 to `POST /v1/submissions`: the submission's user (or the service) is over a quota.
    `message` says which limit and when it frees, `retry_after_s` how long until then. Not a
    `ServerError`: sending the same submission again before then is refused the same way."""


def _error_for(status: int, method: str = "", path: str = "") -> type[ServiceError]:
    if status == 429 and method == "POST" and path == "/v1/submissions":
        return QuotaExceeded
    if status in (401, 403):
        return Unauthorized
    if status == 404:
        return NotFound
    if status in (400, 413, 422):
        return Invalid
    if status == 409:
        return Conflict
    if status >= 500 or status == 429:
        return ServerError
    return ServiceError


def parse_time(text: str) -> datetime:
    """An ISO 8601 time as a timezone-aware datetime (a time without offset is UTC)."""
    t = datetime.fromisoformat(text)
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def parse_retry_after(value: str | None) -> float | None:
    """A `Retry-After` header in seconds: its delay-seconds, or the time until its HTTP date
    (never below 0); None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


@dataclass(frozen=True)
class StateEvent:
    """A submission entered `state` at `at`; `seq` is the change's index in its history.

    The terminal event carries the whole submission (the body of `GET /v1/submissions/{id}`).
    """

    submission_id: str
    seq: int
    state: str
    at: datetime
    submission: dict[str, Any] | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


@dataclass(frozen=True)
class QueueEvent:
    """The submission's place while it waits in the service's queue: the `queue` event of the
    stream, or the `place` of a long-poll's answer. Not a state change: it has no `seq`.

    `position` 1 starts next. `estimated_wait_s` is the service's estimate, when it sent it, of
    the seconds until the submission starts, `estimated_start_at` the same as a time; either
    may be None (the service does not know).
    """

    submission_id: str
    position: int
    estimated_wait_s: float | None = None
    estimated_start_at: datetime | None = None

    @property
    def terminal(self) -> bool:
        return False

    @classmethod
    def from_json(cls, submission_id: str, data: Any) -> QueueEvent:
        """From a `queue` event's data or a submission's `place`; `ValueError`, `KeyError`
        or `TypeError` when it has no integer position."""
        position = data["position"]
        if isinstance(position, bool) or not isinstance(position, int):
            raise TypeError(f"position is not an integer: {position!r}")
        wait = data.get("estimated_wait_s")
        start = data.get("estimated_start_at")
        return cls(
            submission_id=str(data.get("id") or submission_id),
            position=position,
            estimated_wait_s=None if wait is None else float(wait),
            estimated_start_at=None if start is None else parse_time(start),
        )

    def same_place(self, other: QueueEvent | None) -> bool:
        """Whether `other` says the same (position and wait; the start time moves with the
        clock when the service computes it as now plus the wait)."""
        return (
            other is not None
            and other.position == self.position
            and other.estimated_wait_s == self.estimated_wait_s
        )


def backoff_s(attempt: int, base: float = 0.1, cap: float = 5.0) -> float:
    """Seconds before retry `attempt` (1-based): doubling from `base`, capped, ±25 % jitter."""
    d = min(cap, base * (2 ** max(0, attempt - 1)))
    return d * (0.75 + random.random() / 2)


class KernelkiteClient:
    """One service, one token, one connection pool. Use it as an async context manager (or
    call `aclose`).

    `request_timeout_s` bounds every request (connect, send, each read); an event stream may
    stay silent for `sse_read_timeout_s` (the service sends a keep-alive every 15 s) before it
    counts as broken; a long-poll may take its `wait` plus `request_timeout_s`.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        request_timeout_s: float = 10.0,
        sse_read_timeout_s: float = 45.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Accept": "application/json", "User-Agent": "kernelkite-python/0.1"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.base_url = base_url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.sse_read_timeout_s = sse_read_timeout_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(request_timeout_s),
            transport=transport,
            follow_redirects=False,
        )

    async def __aenter__(self) -> KernelkiteClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _unreachable(self, method: str, path: str, reason: str) -> Unreachable:
        """`Unreachable` for a request to `path`, naming the URL it went to."""
        return Unreachable(reason, method=method, url=f"{self.base_url}{path}")

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        read_timeout: httpx.Timeout | None = None,
    ) -> httpx.Response:
        try:
            resp = await self._http.request(
                method,
                path,
                json=json_body,
                params=params,
                headers=headers,
                timeout=read_timeout if read_timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TransportError as e:
            raise self._unreachable(method, path, _transport_reason(e)) from e
        if resp.status_code >= 400:
            raise _error_for(resp.status_code, method, path)(
                resp.status_code,
                _message(resp.content),
                method,
                path,
                parse_retry_after(resp.headers.get("Retry-After")),
            )
        return resp

    async def submit(
        self,
        config: Mapping[str, Any],
        queue: str,
        *,
        run_id: str | None = None,
        timeout_s: int | None = None,
        callback_url: str | None = None,
        idempotency_key: str | None = None,
        user: str | None = None,
        priority: str | None = None,
        cache: bool | None = None,
    ) -> dict[str, Any]:
        """`POST /v1/submissions`: `{"id", "state", "status_url", "place"}`.

        With `idempotency_key`, sending the same request again (after a timeout, say) returns
        the submission the first one made instead of a second one.

        `user` (the backend's user id, 1-128 characters, no control characters) is who the
        service's fair share and quotas count the run for; `priority` its class (`PRIORITIES`;
        the service's default: `ranked` for a `leaderboard` or `private` config, else `test`);
        `cache` False never answers it from the service's result cache, True lets the cache
        answer a run of any mode. Each is sent only when given. Over a quota the service refuses
        with `QuotaExceeded` (429), saying which limit and when it frees.
        """
        body: dict[str, Any] = {"config": dict(config), "queue": queue}
        optional = {
            "run_id": run_id,
            "timeout_s": timeout_s,
            "callback_url": callback_url,
            "user": user,
            "priority": priority,
            "cache": cache,
        }
        body.update((k, v) for k, v in optional.items() if v is not None)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        resp = await self._request("POST", "/v1/submissions", json_body=body, headers=headers)
        return _json(resp)

    async def get(self, submission_id: str, *, wait: float | None = None) -> dict[str, Any]:
        """`GET /v1/submissions/{id}`; with `wait`, held until the submission ends or `wait`
        seconds pass (the service caps it), then answered either way."""
        params = None
        long_read = None
        if wait is not None:
            params = {"wait": f"{wait:g}"}
            long_read = httpx.Timeout(self.request_timeout_s, read=wait + self.request_timeout_s)
        resp = await self._request(
            "GET", f"/v1/submissions/{submission_id}", params=params, read_timeout=long_read
        )
        return _json(resp)

    async def cancel(self, submission_id: str) -> dict[str, Any]:
        """`POST /v1/submissions/{id}/cancel`: the submission, now `canceled`. `Conflict` when it
        already ended otherwise.

        A service from before that route (where the cancel was `DELETE /v1/submissions/{id}`)
        answers it `404` or `405`; the cancel is then sent the old way, so a client upgraded
        before its service still cancels. `NotFound` when neither knows the submission."""
        try:
            return _json(await self._request("POST", f"/v1/submissions/{submission_id}/cancel"))
        except ServiceError as first:
            if first.status not in (404, 405):
                raise
            try:
                return _json(await self._request("DELETE", f"/v1/submissions/{submission_id}"))
            except ServiceError as old_way:
                if old_way.status == 405:
                    # This service has the route: the submission is what it does not know.
                    raise first from None
                raise

    async def queue_status(self, queue: str) -> dict[str, Any]:
        """`GET /v1/queues/{queue}`: `{"queue", "queued", "running", "agents", "updated_at"}`,
        `agents` being `{"idle", "busy", "total"}` or null when unknown."""
        return _json(await self._request("GET", f"/v1/queues/{queue}"))

    async def events(
        self,
        submission_id: str,
        *,
        last_event_id: int | None = None,
        queue_events: bool = True,
    ) -> AsyncIterator[StateEvent | QueueEvent]:
        """One connection to `GET /v1/submissions/{id}/events`: the state changes after
        `last_event_id` (all of them without it), ending after the terminal one or when the
        stream ends, and (unless `queue_events` is False) each `queue` event: the place while
        the submission waits in the service's queue. Events of other types are skipped.
        Raises `Unreachable` when the connection fails or breaks, or a state event cannot be
        read."""
        path = f"/v1/submissions/{submission_id}/events"
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        timeout = httpx.Timeout(self.request_timeout_s, read=self.sse_read_timeout_s)
        try:
            async with self._http.stream("GET", path, headers=headers, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    body = await resp.aread()
                    raise _error_for(resp.status_code, "GET", path)(
                        resp.status_code,
                        _message(body),
                        "GET",
                        path,
                        parse_retry_after(resp.headers.get("Retry-After")),
                    )
                decoder = SSEDecoder()
                async for line in resp.aiter_lines():
                    ev = decoder.feed(line)
                    if ev is None:
                        continue
                    if ev.event == "queue":
                        if not queue_events:
                            continue
                        try:
                            yield QueueEvent.from_json(submission_id, json.loads(ev.data))
                        except (ValueError, KeyError, TypeError, AttributeError):
                            # A place is only news: one that cannot be read is skipped, not
                            # a reason to drop the stream.
                            log.debug("skipped an unreadable queue event: %r", ev.data)
                        continue
                    if ev.event not in _STATE_EVENT_TYPES:
                        continue  # an event type this client does not know
                    try:
                        data = json.loads(ev.data)
                        state_event = StateEvent(
                            submission_id=str(data.get("id", submission_id)),
                            seq=int(data["seq"]),
                            state=str(data["state"]),
                            at=parse_time(data["at"]),
                            submission=data.get("submission"),
                        )
                    except (ValueError, KeyError, TypeError, AttributeError) as e:
                        raise self._unreachable(
                            "GET", path, f"an event that is not a state change: {e}"
                        ) from e
                    yield state_event
                    if state_event.terminal:
                        return
        except httpx.TransportError as e:
            raise self._unreachable("GET", path, _transport_reason(e)) from e

    async def follow(
        self,
        submission_id: str,
        *,
        sse_failures_before_poll: int = 3,
        poll_wait_s: float = 30.0,
        after_seq: int = -1,
        queue_events: bool = True,
    ) -> AsyncIterator[StateEvent | QueueEvent]:
        """Every state change after `after_seq`, each once and in order, until the terminal
        one (which carries the submission); and, unless `queue_events` is False, a
        `QueueEvent` each time the submission's place in the service's queue changes while it
        is `queued` (never a repeat of the one before, never after a later state).

        Follows the event stream; when it breaks, reconnects with `Last-Event-ID` (after a
        short backoff), so no state change is lost or repeated. After
        `sse_failures_before_poll` connections in a row that failed without bringing a new
        event, it long-polls `GET ?wait=` instead, turning each answer's history into the same
        events and its `place` into a `QueueEvent`. Connection failures and 5xx/429 answers
        are retried without end: bound the call with a timeout (`asyncio.timeout`).
        `NotFound`, `Unauthorized` and `Invalid` are raised.
        """
        next_seq = after_seq + 1
        failures = 0
        state: str | None = None  # the last state yielded
        place: QueueEvent | None = None  # the last place yielded while in that state

        def news(ev: QueueEvent) -> bool:
            nonlocal place
            if state not in (None, "queued") or ev.same_place(place):
                return False
            place = ev
            return True

        while True:
            if failures < sse_failures_before_poll:
                progressed = False
                try:
                    last = next_seq - 1 if next_seq > 0 else None
                    stream = self.events(
                        submission_id, last_event_id=last, queue_events=queue_events
                    )
                    async with contextlib.aclosing(stream):
                        async for ev in stream:
                            if isinstance(ev, QueueEvent):
                                if news(ev):
                                    yield ev
                                continue
                            if ev.seq < next_seq:
                                continue
                            next_seq = ev.seq + 1
                            progressed = True
                            if ev.state != state:
                                state, place = ev.state, None
                            yield ev
                            if ev.terminal:
                                return
                except (Unreachable, ServerError):
                    pass
                # The stream ended or broke before the end. A connection that brought news
                # was not a failure (a server shutting down ends streams on purpose).
                failures = 0 if progressed else failures + 1
                await asyncio.sleep(backoff_s(max(1, failures)))
                continue
            try:
                sub = await self.get(submission_id, wait=poll_wait_s)
            except (Unreachable, ServerError):
                failures += 1
                await asyncio.sleep(backoff_s(failures - sse_failures_before_poll + 1))
                continue
            history = sub.get("history") or []
            for seq in range(next_seq, len(history)):
                entry = history[seq]
                ev = StateEvent(
                    submission_id=submission_id,
                    seq=seq,
                    state=str(entry["state"]),
                    at=parse_time(entry["at"]),
                    submission=sub if entry["state"] in TERMINAL_STATES else None,
                )
                next_seq = seq + 1
                if ev.state != state:
                    state, place = ev.state, None
                yield ev
                if ev.terminal:
                    return
            if queue_events and sub.get("state") == "queued" and sub.get("place") is not None:
                try:
                    ev = QueueEvent.from_json(submission_id, sub["place"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    log.debug("skipped an unreadable place: %r", sub["place"])
                    continue
                if news(ev):
                    yield ev


def _transport_reason(e: httpx.TransportError) -> str:
    """What went wrong with a connection, in a few words (`ConnectError: ... refused`)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _json(resp: httpx.Response) -> dict[str, Any]:
    method, url = resp.request.method, str(resp.request.url)
    try:
        value = resp.json()
    except ValueError as e:
        raise Unreachable(f"the answer is not JSON: {e}", method=method, url=url) from e
    if not isinstance(value, dict):
        raise Unreachable("the answer is not a JSON object", method=method, url=url)
    return value


def _message(body: bytes) -> str:
    try:
        value = json.loads(body)
        if isinstance(value, dict) and isinstance(value.get("error"), str):
            return value["error"]
    except ValueError:
        pass
    text = body.decode("utf-8", "replace").strip()
    return text[:300] or "no message"
