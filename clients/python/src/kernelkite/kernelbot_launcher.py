"""kernelbot's launcher for kernelkite: `KernelkiteLauncher` runs a kernelbot run config on a
kernelkite-service and returns kernelbot's own `FullResult`.

This is the only module of the package that imports kernelbot (`libkernelbot`), and it does
so optionally: without kernelbot installed the class still works when it is handed stand-in
types (`KernelbotTypes`), which is how the package's tests run. Inside kernelbot it subclasses
kernelbot's `Launcher`, so `KernelBackend.register_launcher` takes it as it is.

What a run does: submit (with an idempotency key, retried on transient failures), follow the
submission's state changes (server-sent events, resumed with `Last-Event-ID`; long-polling
after repeated stream failures) and its place in the service's queue while it waits, report
them through kernelbot's `RunProgressReporter` (one `push`, then `update`s), and rebuild
`FullResult` from the runner's `result.json`.

Results where kernelbot expects results, exceptions where it expects exceptions: an
evaluation that ran (whatever its tests said, a compile error included) is returned as
kernelbot's `FullResult`. Anything else — the service unreachable or refusing, no GPU free in
time, the machine failing, a `result.json` whose `success` is false — raises `RunFailed`, a
kernelbot `KernelBotError` whose text says what happened and whose fault it is. kernelbot's
background manager then marks the job `failed` with that text (a returned failure would be
marked `succeeded`, or in ranked mode `failed` with a generic reason, its text dropped either
way), its Discord cog shows the text, and its API answers with it.
`asyncio.CancelledError` propagates after the submission is canceled.

`register` makes the launcher's GPU types known to kernelbot and registers it, and
`submitting_user` gives each run its submission's user for the service's fair share and
quotas, so switching is one block in kernelbot's `main.py` (see the README).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import logging
import math
import time
import unicodedata
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from kernelkite.client import (
    PRIORITIES,
    Conflict,
    Invalid,
    KernelkiteClient,
    KernelkiteError,
    NotFound,
    QueueEvent,
    QuotaExceeded,
    ServerError,
    StateEvent,
    Unauthorized,
    Unreachable,
    backoff_s,
    parse_time,
    valid_queue_name,
)


def _kernelbot_present() -> bool:
    try:
        return importlib.util.find_spec("libkernelbot") is not None
    except (ImportError, ValueError):
        return False


if _kernelbot_present():  # be one of kernelbot's launchers, or fail saying why
    try:
        from libkernelbot.launchers.launcher import Launcher as _LauncherBase
        from libkernelbot.utils import KernelBotError as _ErrorBase
    except ImportError as e:
        # kernelbot's launchers package imports its GitHub and Modal launchers (PyGithub,
        # modal): without them a stand-in base would make `isinstance(l, Launcher)` false.
        raise ImportError(
            f"kernelbot's libkernelbot is installed but its launchers do not import ({e}); "
            "install kernelbot's own requirements (its launchers package needs modal and "
            "PyGithub) so KernelkiteLauncher can be one of kernelbot's Launchers"
        ) from e
else:  # kernelbot absent: the same shapes, for use with injected types.

    class _LauncherBase:  # type: ignore[no-redef]
        def __init__(self, name: str, gpus: type[Enum]) -> None:
            self.name = name
            self.gpus = gpus

    class _ErrorBase(Exception):  # type: ignore[no-redef]
        def __init__(self, message: str, code: int = 400) -> None:
            super().__init__(message)
            self.http_code = code


class RunFailed(_ErrorBase):
    """A run that ended without an evaluation: kernelbot's `KernelBotError` (its text is safe
    to show the competitor, and says whose fault it is), `http_code` 503 when trying again
    later may help, 502 when a machine or the service failed, 500 for a problem in the task's
    or the bot's configuration."""

    def __init__(self, message: str, code: int = 502) -> None:
        super().__init__(message, code)


log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 120
"""kernelbot's `Timeout.COMPILE`: the compile step (the Python pre-run) of every run."""

NOT_YOUR_CODE = "not your code"
"""The status line's reason for failures of the machine, the service or the task."""


def ordinal(n: int) -> str:
    """`1st`, `2nd`, `3rd`, `4th`, ..., `11th`, `12th`, `13th`, ..., `21st`, `22nd`, ..."""
    teen = 11 <= n % 100 <= 13
    return f"{n}{'th' if teen else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def about(seconds: float) -> str:
    """A duration as a person reads it: `about 7 s`; to 5 s under 90 s (`about 40 s`); in
    minutes under 90 minutes (`about 3 min`); in hours past that (`about 2 h`)."""
    s = max(0.0, seconds)

    def near(x: float, step: int = 1) -> int:
        return max(step, math.floor(x / step + 0.5) * step)

    if s < 10:
        return f"about {near(s)} s"
    if s < 90:
        return f"about {near(s, 5)} s"
    if s < 90 * 60:
        return f"about {near(s / 60)} min"
    return f"about {near(s / 3600)} h"


def wait_wording(seconds: float | None) -> str:
    """The status line's estimate of the wait for a GPU: `starting now` under a second, else
    `about(seconds)`; empty when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return ""
    return "starting now" if seconds < 1 else about(seconds)


def ranked_priority(config: Mapping[str, Any]) -> str | None:
    """`priority_of`'s default: `ranked` for both runs of a leaderboard submission (kernelbot's
    `leaderboard` mode and its secret `private` one), None (the service's default, `test`) for
    every other run."""
    return "ranked" if config.get("mode") in ("leaderboard", "private") else None


MODE_WORDS = {"private": "secret leaderboard"}
"""How a status line names a run config's `mode` where its own name would not do."""


def cached_run_wording(mode: Any, ran_at: datetime | None) -> str:
    """What the status line says of the run whose result answered a submission from the
    service's result cache: `an identical test run from 2026-11-22 10:40 UTC` (the cache answers
    only a byte-for-byte identical run config, so its mode is this run's)."""
    kind = MODE_WORDS.get(mode, mode) if isinstance(mode, str) and mode else None
    what = f"an identical {kind} run" if kind else "an identical run"
    if ran_at is None:
        return f"{what} from earlier"
    return f"{what} from {ran_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC"


def _valid_user(user: str) -> bool:
    """The service's rule for `user`: 1-128 characters, none of them a control character."""
    return 0 < len(user) <= 128 and not any(unicodedata.category(c) == "Cc" for c in user)


@dataclass(frozen=True)
class KernelbotTypes:
    """The kernelbot classes a run builds: its result dataclasses and `RunnerQueueStatus`."""

    FullResult: type
    SystemInfo: type
    EvalResult: type
    CompileResult: type
    RunResult: type
    ProfileResult: type
    RunnerQueueStatus: type

    @classmethod
    def from_kernelbot(cls) -> KernelbotTypes:
        """kernelbot's own classes (`libkernelbot.run_eval`, `libkernelbot.launchers`)."""
        try:
            from libkernelbot.launchers.launcher import RunnerQueueStatus
            from libkernelbot.run_eval import (
                CompileResult,
                EvalResult,
                FullResult,
                ProfileResult,
                RunResult,
                SystemInfo,
            )
        except ImportError as e:
            raise ImportError(
                "KernelkiteLauncher needs kernelbot's libkernelbot on the path (run it inside "
                "kernelbot), or stand-in classes passed as types=KernelbotTypes(...)"
            ) from e
        return cls(
            FullResult=FullResult,
            SystemInfo=SystemInfo,
            EvalResult=EvalResult,
            CompileResult=CompileResult,
            RunResult=RunResult,
            ProfileResult=ProfileResult,
            RunnerQueueStatus=RunnerQueueStatus,
        )


class UnreadableResult(ValueError):
    """`result.json` does not have the shape of kernelbot's `FullResult`."""


def _fields(cls: type, data: Any, where: str) -> dict[str, Any]:
    """`data`'s entries that `cls` has fields for. Fields a newer runner added are dropped
    (kernelbot's `Dataclass(**dict)` would refuse them); a missing required field is an error."""
    if not isinstance(data, dict):
        raise UnreadableResult(f"{where} is not an object")
    known = {f.name: f for f in dataclasses.fields(cls)}
    missing = [
        name
        for name, f in known.items()
        if name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise UnreadableResult(f"{where} lacks {', '.join(missing)}")
    return {k: v for k, v in data.items() if k in known}


def full_result_from_json(data: Any, types: KernelbotTypes) -> Any:
    """kernelbot's `FullResult` from `result.json`'s JSON, as kernelbot's launchers parse it,
    except that the runner's own `success` and `error` are kept and every time is
    timezone-aware (a time without offset is UTC)."""
    if not isinstance(data, dict):
        raise UnreadableResult("the result is not a JSON object")
    if not isinstance(data.get("success"), bool) or not isinstance(data.get("error"), str):
        raise UnreadableResult("the result lacks a boolean success or a string error")
    runs_json = data.get("runs", {})
    if not isinstance(runs_json, dict):
        raise UnreadableResult("runs is not an object")
    runs = {}
    for key, run in runs_json.items():
        where = f"runs.{key}"
        fields = _fields(types.EvalResult, run, where)
        try:
            start, end = parse_time(run["start"]), parse_time(run["end"])
        except (KeyError, TypeError, ValueError) as e:
            raise UnreadableResult(f"{where} has no ISO 8601 start/end: {e}") from e

        def part(name: str, cls: type, run: dict = run, where: str = where) -> Any:
            value = run.get(name)
            return None if value is None else cls(**_fields(cls, value, f"{where}.{name}"))

        fields.update(
            start=start,
            end=end,
            compilation=part("compilation", types.CompileResult),
            run=part("run", types.RunResult),
            profile=part("profile", types.ProfileResult),
        )
        runs[key] = types.EvalResult(**fields)
    system = types.SystemInfo(**_fields(types.SystemInfo, data.get("system", {}), "system"))
    return types.FullResult(success=data["success"], error=data["error"], system=system, runs=runs)


def answered_from_cache(result: Any, submission: Mapping[str, Any]) -> datetime | None:
    """For a submission the service's result cache answered (`cached_from` set): sets every
    run's `start` and `end` in `result` (kernelbot's `FullResult`, changed in place) to when
    the service answered, and returns when the original run started (the earliest `start` the
    result had; None without runs).

    The result is the original run's, byte for byte, times included, and kernelbot stores each
    run's `start` and `end` with the submission: its statistics take `start` less the
    submission's time as the wait for a GPU (negative for a result older than the submission)
    and `end - start` as GPU time used (none was, this time). The measurements themselves (each
    run's `duration`, the benchmarks' timings) are the original's, as they should be."""
    runs = getattr(result, "runs", None) or {}
    ran_at = min((run.start for run in runs.values()), default=None)
    answered_at = _time_or_none(submission.get("finished_at")) or datetime.now(UTC)
    for key, run in list(runs.items()):
        runs[key] = dataclasses.replace(run, start=answered_at, end=answered_at)
    return ran_at


def _time_or_none(text: Any) -> datetime | None:
    try:
        return parse_time(text) if isinstance(text, str) else None
    except ValueError:
        return None


def default_deadline_s(config: Mapping[str, Any], queue_wait_s: float) -> float:
    """How long a run may take in all: the time limits the runner applies to its mode (plus
    the compile step of each run), `queue_wait_s` for a GPU to become free, and a minute for
    setting up and reading the result."""

    def limit(key: str) -> float:
        value = config.get(key)
        return float(value) if isinstance(value, int | float) and value > 0 else 180.0

    mode = config.get("mode")
    if mode == "test":
        run = limit("test_timeout") + COMPILE_TIMEOUT_S
    elif mode == "benchmark":
        run = limit("benchmark_timeout") + COMPILE_TIMEOUT_S
    elif mode in ("leaderboard", "private"):
        run = limit("test_timeout") + limit("benchmark_timeout") + limit("ranked_timeout")
        run += 3 * COMPILE_TIMEOUT_S
    elif mode == "profile":
        count = len(config.get("benchmarks") or []) or 1
        run = count * (limit("benchmark_timeout") + COMPILE_TIMEOUT_S)
    else:
        run = 1800.0
    return run + queue_wait_s + 60.0


def _build_link(build: Mapping[str, Any] | None) -> str:
    """A link to the build's page, for a page competitors can open (http or https): local
    mode's builds have none."""
    if not build or not build.get("number"):
        return ""
    url = build.get("web_url")
    if not isinstance(url, str) or not url.lower().startswith(("https://", "http://")):
        return ""
    return f"build [#{build['number']}](<{url}>)"


class _Progress:
    """The run's line in kernelbot's status message: `push` the first time, `update` after,
    skipping repeats. A reporter that fails (Discord is down) is logged, never fatal."""

    def __init__(self, reporter: Any) -> None:
        self._reporter = reporter
        self._pushed = False
        self._last: str | None = None
        self._noted = False
        self._lock = asyncio.Lock()

    async def show(self, view: _View) -> None:
        """Shows the view's message, computed once the previous call is done, so a message
        never overtakes a later state."""
        async with self._lock:
            text = view.message()
            if text == self._last:
                return
            try:
                if self._pushed:
                    await self._reporter.update(text)
                else:
                    await self._reporter.push(text)
                    self._pushed = True
                self._last = text
            except Exception:
                log.warning("could not report progress %r", text, exc_info=True)
            # Where the run ran: a line of its own under the run's, once, when it ended.
            if view.provenance and not self._noted:
                self._noted = True
                try:
                    await self._reporter.push(view.provenance)
                except Exception:
                    log.warning("could not report %r", view.provenance, exc_info=True)


@dataclass
class _View:
    """What the run knows of its submission, for the messages."""

    gpu: str
    # The run config's mode (test, benchmark, leaderboard, ...).
    mode: str | None = None
    state: str = "queued"
    # Why a failed run failed, in a few words (`NOT_YOUR_CODE`); shown after the state. For a
    # `refused` one, the service's reason.
    why: str | None = None
    build: dict[str, Any] | None = None
    # The place in the service's queue while `queued`, when the service says it.
    place: QueueEvent | None = None
    # When the place arrived (monotonic): the wait shown counts down from it.
    place_at: float | None = None
    # For an answer from the service's result cache: the run whose result it is, in words
    # (`cached_run_wording`).
    cached: str | None = None
    # Where and on what the run ran (`provenance_line`), shown under the run's line once it
    # ended.
    provenance: str | None = None
    running_since: float | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)

    def message(self) -> str:
        link = _build_link(self.build)
        on = f": {link}" if link else ""
        if self.state == "queued":
            if self.place is None:
                return f"⏳ Queued for {self.gpu}"
            pos = self.place.position
            where = "Next in line" if pos <= 1 else f"{ordinal(pos)} in line"
            left = self.place.estimated_wait_s
            if left is not None and self.place_at is not None:
                left = max(0.0, left - (time.monotonic() - self.place_at))
                if left < 1 and pos > 1:
                    # The estimate ran out with others still ahead: it was wrong, say none.
                    left = None
            wait = wait_wording(left)
            return f"⏳ {where} for {self.gpu}" + (f", {wait}" if wait else "")
        if self.state == "scheduled":
            return f"⏳ Waiting for a free {self.gpu} GPU{on}"
        if self.state == "running":
            elapsed = time.monotonic() - (self.running_since or time.monotonic())
            return f"⏳ Running on {self.gpu}{on} ({elapsed:.0f}s)"
        if self.state == "fetching":
            return f"⏳ Reading the result from {self.gpu}{on}"
        because = f" ({self.why})" if self.why else ""
        if self.state == "succeeded":
            total = time.monotonic() - self.started
            cached = f" (cached result of {self.cached})" if self.cached else ""
            return f"✅ Finished on {self.gpu} in {total:.1f}s{on}{cached}"
        if self.state == "refused":
            return f"❌ Not started on {self.gpu}: {_cut(self.why or 'refused', 300)}"
        if self.state == "timed_out":
            return f"❌ Timed out on {self.gpu}{on}{because}"
        if self.state == "canceled":
            return f"❌ Canceled on {self.gpu}{on}{because}"
        return f"❌ Failed on {self.gpu}{on}{because}"


def provenance_line(submission: Mapping[str, Any]) -> str | None:
    """The line that says where and on what an ended submission ran: the service's summary of
    the node's provenance, and what its readings say may have been unhealthy. None for a
    submission without one (it never ran, an answer from the cache, an older node)."""
    p = submission.get("provenance")
    if not isinstance(p, dict) or not isinstance(p.get("summary"), str):
        return None
    # The node wrote what the summary names (its host, its GPUs): shown as code, without
    # backticks or line breaks of its own, so nothing in it can mention, link or format in
    # kernelbot's Discord report.
    line = f"🖥️ `{_plain(_cut(p['summary'], 400))}`"
    concerns = [c for c in p.get("concerns") or [] if isinstance(c, str)]
    if concerns:
        line += f" ⚠️ `{_plain(_cut('; '.join(concerns), 300))}`"
    return line


def _plain(text: str) -> str:
    return "".join(c for c in text if c.isprintable() and c != "`")


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"


def _resolve_queues(gpus: type[Enum], queues: Mapping[Any, str]) -> dict[str, str]:
    """GPU name → queue, from a mapping keyed by members of `gpus` or their names or values."""
    by_key: dict[str, str] = {}
    for key, queue in queues.items():
        member = None
        for m in gpus:
            if key is m or key == m.name or key == m.value:
                member = m
                break
        if member is None:
            raise ValueError(f"queue mapping key {key!r} is not a member of {gpus.__name__}")
        if not isinstance(queue, str) or not valid_queue_name(queue):
            raise ValueError(
                f"queue {queue!r} for {member.name} must be 1-64 letters, digits, '-', '_' or '.'"
            )
        by_key[member.name] = queue
    missing = [m.name for m in gpus if m.name not in by_key]
    if missing:
        raise ValueError(
            f"no kernelkite queue for {', '.join(missing)}; map every member of {gpus.__name__}"
        )
    return by_key


class KernelkiteLauncher(_LauncherBase):
    """Runs kernelbot submissions on a kernelkite-service.

    `gpus` is the kernelbot GPU enum this launcher serves (kernelbot registers it for each
    member); `queues` maps each member (or its name or value) to the kernelkite queue (the
    Buildkite agent queue) of machines with that GPU.

    Time limits: each request `request_timeout_s`; a whole run `deadline_s` (default: from
    the run config, `default_deadline_s`, with `queue_wait_s` to get a GPU). The service gets
    the deadline as the submission's `timeout_s` and cancels the build when it passes; the
    launcher itself gives up `deadline_grace_s` later (a service that stopped answering) and
    cancels the submission then.

    `cuda_include_dirs` are added to every CUDA run's `include_dirs`, as kernelbot's Modal
    launcher adds `/ThunderKittens/include`: directories the GPU machines' image provides
    (the runner fails the job, as the node's fault, when one is missing).

    `user_of(config)` and `priority_of(config)` give each run's `user` (for the service's fair
    share and quotas; kernelbot's run config names no user, so the default `None` sends none)
    and `priority` (`PRIORITIES`; the default, `ranked_priority`, asks `ranked` for both runs of
    a leaderboard submission and leaves the rest to the service). A value the service would
    refuse, or a callable that raises, fails the run as a configuration problem.

    `cache` is each run's `cache`: None (the default) leaves it to the service (its result
    cache may answer `test` and `benchmark` runs, never ranked ones), False never takes a
    result from the cache, True lets the cache answer a run of any mode; or a callable given the
    run config and returning one of those. A run the cache answered is reported as such, named
    by the original run's mode and time, and its runs' `start`/`end` are when it was answered
    (`answered_from_cache`).
    """

    def __init__(
        self,
        service_url: str,
        token: str | None,
        gpus: type[Enum],
        queues: Mapping[Any, str],
        *,
        name: str = "Kernelkite",
        deadline_s: float | None = None,
        queue_wait_s: float = 600.0,
        deadline_grace_s: float = 30.0,
        request_timeout_s: float = 10.0,
        sse_read_timeout_s: float = 45.0,
        sse_failures_before_poll: int = 3,
        poll_wait_s: float = 30.0,
        progress_interval_s: float = 10.0,
        queue_status_ttl_s: float = 5.0,
        submit_attempts: int = 5,
        cuda_include_dirs: Sequence[str] = (),
        user_of: Callable[[dict], str | None] | None = None,
        priority_of: Callable[[dict], str | None] | None = ranked_priority,
        cache: bool | Callable[[dict], bool | None] | None = None,
        types: KernelbotTypes | None = None,
    ) -> None:
        super().__init__(name, gpus)
        self.service_url = service_url.rstrip("/")
        self._token = token
        self._queues = _resolve_queues(gpus, queues)
        self._types = types if types is not None else KernelbotTypes.from_kernelbot()
        self.deadline_s = deadline_s
        self.queue_wait_s = queue_wait_s
        self.deadline_grace_s = deadline_grace_s
        self.request_timeout_s = request_timeout_s
        self.sse_read_timeout_s = sse_read_timeout_s
        self.sse_failures_before_poll = sse_failures_before_poll
        self.poll_wait_s = poll_wait_s
        self.progress_interval_s = progress_interval_s
        self.queue_status_ttl_s = queue_status_ttl_s
        self.submit_attempts = max(1, submit_attempts)
        if isinstance(cuda_include_dirs, str):
            raise TypeError("cuda_include_dirs is a list of directories, not one string")
        self.cuda_include_dirs = list(cuda_include_dirs)
        self.user_of = user_of
        self.priority_of = priority_of
        if not (cache is None or isinstance(cache, bool) or callable(cache)):
            raise TypeError(f"cache is True, False, None or a callable, not {cache!r}")
        self.cache = cache
        self._queue_cache: dict[str, tuple[float, dict[str, Any] | None, str | None]] = {}
        self._queue_locks: dict[str, asyncio.Lock] = {}
        self._cleanups: set[asyncio.Task] = set()

    def queue_for(self, gpu_type: Any) -> str | None:
        """The queue of a GPU (kernelbot's `GPU`, an enum member, or a name)."""
        return self._queues.get(getattr(gpu_type, "name", gpu_type))

    def _client(self) -> KernelkiteClient:
        return KernelkiteClient(
            self.service_url,
            self._token,
            request_timeout_s=self.request_timeout_s,
            sse_read_timeout_s=self.sse_read_timeout_s,
        )

    def _with_include_dirs(self, config: dict) -> dict:
        """`config` with `cuda_include_dirs` added for a CUDA run (a copy: kernelbot's Modal
        launcher changes the caller's dict; this one leaves it as it was)."""
        if config.get("lang") != "cu" or not self.cuda_include_dirs:
            return config
        given = config.get("include_dirs") or []
        extra = [d for d in self.cuda_include_dirs if d not in given]
        return {**config, "include_dirs": [*given, *extra]}

    def _who(self, config: dict) -> tuple[str | None, str | None, bool | None]:
        """The run's `user`, `priority` and `cache` from `user_of`, `priority_of` and `cache`;
        `ValueError` saying what is wrong with any of them."""
        user = priority = None
        if self.user_of is not None:
            try:
                user = self.user_of(config)
            except Exception as e:
                raise ValueError(f"user_of raised {type(e).__name__}: {e}") from e
            if isinstance(user, int) and not isinstance(user, bool):
                user = str(user)  # kernelbot's user ids are ints
            if user is not None and (not isinstance(user, str) or not _valid_user(user)):
                raise ValueError(
                    f"user_of gave {user!r}, not a user id of 1-128 characters without "
                    "control characters"
                )
        if self.priority_of is not None:
            try:
                priority = self.priority_of(config)
            except Exception as e:
                raise ValueError(f"priority_of raised {type(e).__name__}: {e}") from e
            if priority is not None and priority not in PRIORITIES:
                raise ValueError(
                    f"priority_of gave {priority!r}, not one of {', '.join(PRIORITIES)}"
                )
        cache = self.cache
        if callable(cache):
            try:
                cache = cache(config)
            except Exception as e:
                raise ValueError(f"cache raised {type(e).__name__}: {e}") from e
            if cache is not None and not isinstance(cache, bool):
                raise ValueError(f"cache gave {cache!r}, not True, False or None")
        return user, priority, cache

    async def run_submission(self, config: dict, gpu_type: Any, status: Any) -> Any:
        """Runs `config` on `gpu_type`'s queue, reporting progress on `status` (kernelbot's
        `RunProgressReporter`); returns kernelbot's `FullResult` for an evaluation that ran,
        and raises `RunFailed` for anything else."""
        gpu = str(getattr(gpu_type, "name", gpu_type))
        progress = _Progress(status)
        queue = self.queue_for(gpu_type)
        if queue is None:
            await progress.show(_View(gpu=gpu, state="failed", why=NOT_YOUR_CODE))
            raise RunFailed(
                f"{self.name} has no queue for {gpu}; this is a configuration problem on our "
                "side, not your code: please report it to the organizers.",
                500,
            )
        config = self._with_include_dirs(config)
        try:
            who = self._who(config)
        except ValueError as e:
            log.error("kernelkite run on %s: %s", gpu, e)
            await progress.show(_View(gpu=gpu, state="failed", why=NOT_YOUR_CODE))
            raise RunFailed(
                f"{self.name} could not set up the run on {gpu} ({e}); this is a "
                "configuration problem on our side, not your code: please report it to the "
                "organizers.",
                500,
            ) from e
        deadline = self.deadline_s or default_deadline_s(config, self.queue_wait_s)
        timeout_s = max(1, math.ceil(deadline))
        key = str(uuid.uuid4())
        run_id = f"{gpu.lower()}-{key[:12]}"
        mode = config.get("mode")
        view = _View(gpu=gpu, mode=mode if isinstance(mode, str) else None)
        state: dict[str, Any] = {"id": None, "post": None}
        try:
            async with self._client() as client, asyncio.timeout(deadline + self.deadline_grace_s):
                return await self._run(
                    client,
                    config,
                    queue,
                    run_id,
                    timeout_s,
                    key,
                    view,
                    progress,
                    state,
                    who=who,
                )
        except TimeoutError:
            # The service did not end the submission itself within its timeout: it is not
            # answering. Cancel it (best effort) and say so.
            await self._cancel(state)
            view.state, view.why = "timed_out", NOT_YOUR_CODE
            await progress.show(view)
            waited = deadline + self.deadline_grace_s
            raise RunFailed(
                f"No answer from the {self.name} service within {waited:.0f} s; your run was "
                "canceled. This is a problem on our side, not your code: please try again "
                "later.",
                503,
            ) from None
        except asyncio.CancelledError:
            # The caller gave up on the run: its build must not go on running for nobody.
            cleanup = asyncio.ensure_future(self._cancel(state))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(cleanup)
            raise
        except RunFailed:
            # `_result` set the view for it.
            await progress.show(view)
            raise
        except Exception as e:
            if isinstance(e, KernelkiteError):
                log.warning("kernelkite run %s on %s failed: %s", run_id, gpu, e)
            else:
                log.exception("kernelkite run %s on %s failed", run_id, gpu)
            if isinstance(e, QuotaExceeded):
                view.state, view.why = "refused", e.message
            else:
                view.state, view.why = "failed", NOT_YOUR_CODE
            await progress.show(view)
            message, code = self._explain(e, gpu, state["id"])
            raise RunFailed(message, code) from e

    async def _run(
        self,
        client: KernelkiteClient,
        config: dict,
        queue: str,
        run_id: str,
        timeout_s: int,
        key: str,
        view: _View,
        progress: _Progress,
        state: dict[str, Any],
        who: tuple[str | None, str | None, bool | None] = (None, None, None),
    ) -> Any:
        post = asyncio.ensure_future(self._submit(config, queue, run_id, timeout_s, key, who))
        state["post"] = post
        # Shielded: if the run is canceled meanwhile, the cleanup still learns the id.
        accepted = await asyncio.shield(post)
        sub_id = state["id"] = accepted["id"]
        await progress.show(view)
        ticker = asyncio.ensure_future(self._tick(view, progress))
        try:
            final = await self._follow(client, sub_id, view, progress)
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
        view.provenance = provenance_line(final)
        result = self._result(final, view, timeout_s)
        await progress.show(view)
        return result

    async def _submit(
        self,
        config: dict,
        queue: str,
        run_id: str,
        timeout_s: int,
        key: str,
        who: tuple[str | None, str | None, bool | None] = (None, None, None),
    ) -> dict[str, Any]:
        """POSTs the submission, retrying transient failures with the same idempotency key
        (the service then answers with the submission the first try made). A quota refusal
        (`QuotaExceeded`) is no transient failure: it is raised at once."""
        user, priority, cache = who
        # A client of its own: this call may outlive the run's (a canceled run waits for it to
        # learn the id to cancel).
        async with self._client() as client:
            attempt = 0
            while True:
                attempt += 1
                try:
                    return await client.submit(
                        config,
                        queue,
                        run_id=run_id,
                        timeout_s=timeout_s,
                        idempotency_key=key,
                        user=user,
                        priority=priority,
                        cache=cache,
                    )
                except (Unreachable, ServerError):
                    if attempt >= self.submit_attempts:
                        raise
                    await asyncio.sleep(backoff_s(attempt, base=0.5))

    async def _follow(
        self, client: KernelkiteClient, sub_id: str, view: _View, progress: _Progress
    ) -> dict[str, Any]:
        stream = client.follow(
            sub_id,
            sse_failures_before_poll=self.sse_failures_before_poll,
            poll_wait_s=self.poll_wait_s,
        )
        async with contextlib.aclosing(stream):
            async for ev in stream:
                await self._on_event(client, ev, view, progress)
                if ev.terminal:
                    # The terminal event carries the submission; one read where it did not.
                    return ev.submission or await client.get(ev.submission_id)
        raise Unreachable(
            "the event stream ended before the submission did",
            method="GET",
            url=f"{client.base_url}/v1/submissions/{sub_id}/events",
        )

    async def _on_event(
        self,
        client: KernelkiteClient,
        ev: StateEvent | QueueEvent,
        view: _View,
        progress: _Progress,
    ) -> None:
        if isinstance(ev, QueueEvent):
            # `follow` sends places only while queued; the check keeps a late one from
            # turning a later state's line back.
            if view.state == "queued":
                view.place = ev
                view.place_at = time.monotonic()
                await progress.show(view)
            return
        if ev.terminal:
            # The end is shown by `run_submission`, once `_result` has said what it means (a
            # "succeeded" submission whose runner could not evaluate is no "✅ Finished").
            if ev.submission is not None:
                view.build = ev.submission.get("build") or view.build
            return
        view.state = ev.state
        if ev.state != "queued":
            view.place = None
        if ev.state == "running" and view.running_since is None:
            view.running_since = time.monotonic()
        if ev.submission is not None:
            view.build = ev.submission.get("build") or view.build
        elif view.build is None and ev.state in ("scheduled", "running", "fetching"):
            # State events do not carry the build; one read gets its link.
            with contextlib.suppress(KernelkiteError):
                view.build = (await client.get(ev.submission_id)).get("build")
        await progress.show(view)

    async def _tick(self, view: _View, progress: _Progress) -> None:
        """Refreshes the elapsed time of a running submission, and the wait of one in the
        service's queue (it counts down between the service's place updates)."""
        while True:
            await asyncio.sleep(self.progress_interval_s)
            if view.state == "running" or (view.state == "queued" and view.place is not None):
                await progress.show(view)

    def _result(self, sub: dict[str, Any], view: _View, timeout_s: int) -> Any:
        """kernelbot's `FullResult` of an evaluation that ran; `RunFailed` (with the view
        set to say so) for every other end."""
        gpu, state, link = view.gpu, sub.get("state"), _build_link(view.build)
        see = f" ({link})" if link else ""
        view.state, view.why = (state if state != "succeeded" else "failed"), NOT_YOUR_CODE
        if state == "succeeded":
            result = sub.get("result")
            if isinstance(result, dict) and result.get("success") is False:
                # The runner could not evaluate (the machine, or the task's configuration).
                # kernelbot's evaluator raises there, or on Modal returns success=False,
                # whose reason kernelbot's background manager drops: raised, it is kept.
                raise RunFailed(
                    f"Your run on {gpu} could not be evaluated{see}: {result.get('error')}. "
                    "This is a problem with the GPU machine or the task, not your code: "
                    "please resubmit, and report it to the organizers if it happens again."
                )
            try:
                parsed = full_result_from_json(result, self._types)
            except (UnreadableResult, TypeError, ValueError) as e:
                raise RunFailed(
                    f"The result of your run on {gpu} could not be read ({e}){see}. This is a "
                    "problem on our side, not your code: please resubmit, and report it to "
                    "the organizers if it happens again."
                ) from e
            view.state, view.why = "succeeded", None
            if sub.get("cached_from"):
                ran_at = answered_from_cache(parsed, sub)
                view.cached = cached_run_wording(view.mode, ran_at)
            return parsed
        why = sub.get("error") or "no reason given"
        if state == "timed_out":
            ran = any(h.get("state") == "running" for h in sub.get("history") or [])
            if ran:
                # The runner stops each run at the task's own time limit and reports it as
                # the run's timeout (a result, above). Reaching the whole submission's deadline
                # (counted from its creation, the wait for a GPU included) is not the kernel's.
                raise RunFailed(
                    f"Your run on {gpu} did not finish within {timeout_s} s (the wait for a "
                    f"GPU included) and was stopped{see}. This is not your code: each run's "
                    "own time limit is reported as your run's timeout. Please resubmit.",
                    503,
                )
            raise RunFailed(
                f"No {gpu} GPU became free within {timeout_s} s, so your run was canceled "
                "before it started. Please try again later.",
                503,
            )
        if state == "canceled":
            raise RunFailed(
                f"Your run on {gpu} was canceled before it finished ({why}); not your code: "
                "please resubmit.",
                503,
            )
        raise RunFailed(
            f"Your run on {gpu} ended without a result: {why}. This is a problem with the GPU "
            "machine, not your code: please resubmit, and report it to the organizers if it "
            "happens again."
        )

    def _explain(self, e: Exception, gpu: str, sub_id: str | None) -> tuple[str, int]:
        """The competitor's message for an error of the service or the client, and the
        `http_code` for kernelbot's API."""
        if isinstance(e, QuotaExceeded):
            wait = e.retry_after_s
            when = "later" if wait is None else f"in {about(max(1.0, wait))}"
            return (
                f"{self.name} did not start your run on {gpu}: {e.message.rstrip('. ')}. "
                f"Please try again {when}.",
                429,
            )
        if isinstance(e, Invalid):
            return (
                f"{self.name} refused the run: {e.message}. The task's run configuration is "
                "invalid, not your code; please report this to the organizers.",
                500,
            )
        if isinstance(e, Unauthorized):
            return (
                f"The {self.name} service refused the bot's credentials ({e.message}); this is "
                "a configuration problem on our side, not your code: please report it to the "
                "organizers.",
                500,
            )
        if isinstance(e, NotFound):
            return (
                f"The {self.name} service no longer knows your run on {gpu} ({sub_id}); it may "
                "have restarted. Not your code: please resubmit.",
                503,
            )
        if isinstance(e, Unreachable | ServerError):
            # Not the service's URL: the bot's own address for it is no business of a
            # competitor's (the log has it).
            why = e.reason if isinstance(e, Unreachable) else str(e)
            return (
                f"The {self.name} service could not be reached ({why}); not your code. Please "
                "try again later.",
                503,
            )
        if isinstance(e, KernelkiteError):
            return (
                f"The {self.name} service answered unexpectedly ({e}); not your code. Please "
                "try again later.",
                502,
            )
        return (
            f"Running on {self.name} failed unexpectedly ({type(e).__name__}: {e}); not your "
            "code. Please try again, and report it to the organizers if it happens again.",
            502,
        )

    async def _cancel(self, state: dict[str, Any]) -> None:
        """Cancels the submission (learning its id from a POST still in flight first), with a
        client of its own: the run's may be closing. Errors are logged, not raised."""
        sub_id = state.get("id")
        post = state.get("post")
        try:
            if sub_id is None and post is not None:
                try:
                    sub_id = (await asyncio.wait_for(post, self.request_timeout_s * 2))["id"]
                except Exception:
                    return  # never accepted (or unknowable): nothing to cancel
            if sub_id is None:
                return
            async with self._client() as client:
                with contextlib.suppress(Conflict, NotFound):
                    await client.cancel(sub_id)
        except Exception:
            log.warning("could not cancel kernelkite submission %s", sub_id, exc_info=True)

    async def get_queue_status(self, gpu_type: Any, config: dict | None = None) -> Any:
        """kernelbot's `RunnerQueueStatus` for the GPU's queue: this service's queued and
        running submissions there, and its idle agents as `available_runners`. Cached for
        `queue_status_ttl_s` per queue (errors too)."""
        gpu = str(getattr(gpu_type, "name", gpu_type))
        queue = self.queue_for(gpu_type)
        status_cls = self._types.RunnerQueueStatus
        if queue is None:
            return status_cls(
                runner=self.name,
                gpu=gpu,
                queued_jobs=None,
                status="unavailable",
                error=f"{gpu} is not served by {self.name}",
            )
        lock = self._queue_locks.setdefault(queue, asyncio.Lock())
        async with lock:
            cached = self._queue_cache.get(queue)
            if cached is None or time.monotonic() - cached[0] > self.queue_status_ttl_s:
                try:
                    async with self._client() as client:
                        data = await client.queue_status(queue)
                    if not isinstance(data.get("agents"), dict | None):
                        raise Unreachable(
                            f"agents is not an object: {data.get('agents')!r}",
                            method="GET",
                            url=f"{client.base_url}/v1/queues/{queue}",
                        )
                    cached = (time.monotonic(), data, None)
                except KernelkiteError as e:
                    cached = (time.monotonic(), None, f"{self.name} queue status: {e}")
                self._queue_cache[queue] = cached
        _, data, error = cached
        if data is None:
            return status_cls(
                runner=self.name, gpu=gpu, queued_jobs=None, status="unavailable", error=error
            )
        agents = data.get("agents")
        status, error = "available", None
        if agents is not None and agents.get("total") == 0:
            status, error = "unavailable", f"no {gpu} machine is connected to queue {queue}"
        return status_cls(
            runner=self.name,
            gpu=gpu,
            queued_jobs=data.get("queued"),
            running_jobs=data.get("running"),
            available_runners=None if agents is None else agents.get("idle"),
            status=status,
            error=error,
        )


def submitting_user(backend: Any) -> Callable[[dict], str | None]:
    """Wires kernelbot's users into the service's fair share and quotas: wraps
    `backend.submit_full` (kernelbot's `KernelBackend`, the one entry of its API, Discord cog
    and background manager) so that the runs it gathers know the `user_id` of the submission
    they belong to, and returns the `user_of` for `KernelkiteLauncher` that reads it.

    kernelbot hands a launcher only the run config, which names no user; the user is in the
    request `submit_full` gets. The wrapper keeps it in a context variable for the duration of
    the call, and asyncio copies the context into every run `submit_full` starts, so concurrent
    submissions each see their own. Runs started otherwise (kernelbot's admin verification
    runs call `submit_leaderboard`) send no user. Calling this again on the same backend wraps
    nothing twice and returns the same reader."""
    current = backend.submit_full
    reader = getattr(current, "_kernelkite_user_of", None)
    if reader is not None:
        return reader
    user_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
        "kernelkite_submitting_user", default=None
    )

    @functools.wraps(current)
    async def submit_full(req: Any, *args: Any, **kwargs: Any) -> Any:
        given = getattr(req, "user_id", None)
        token = user_id.set(None if given is None else str(given))
        try:
            return await current(req, *args, **kwargs)
        finally:
            user_id.reset(token)

    def user_of(config: dict) -> str | None:
        return user_id.get()

    submit_full._kernelkite_user_of = user_of  # type: ignore[attr-defined]
    backend.submit_full = submit_full
    return user_of


def gpu_types(name: str, gpus: Sequence[str]) -> type[Enum]:
    """The GPU enum a `KernelkiteLauncher` serves, from GPU type names (each its own value,
    as kernelbot's `ModalGPU` and `GitHubGPU` are): `gpu_types("KernelkiteGPU", ["H100_KK"])`."""
    return Enum(name, {g: g for g in gpus})  # type: ignore[return-value]


def _holder(member: Enum, launcher: Any, lookup: dict, launcher_map: dict) -> str | None:
    """Which other launcher serves `member` already, or None. kernelbot finds a GPU by name
    (its lookup) and routes its runs by value (`launcher_map[gpu.value]`): both must be free,
    or the lookup and the routing would disagree."""
    by_name = lookup.get(member.name.lower())
    if by_name is not None and by_name.runner != launcher.name:
        return f"{by_name.runner} launcher (GPU {by_name.name})"
    for g in lookup.values():
        if g.value == member.value and g.runner != launcher.name:
            return f"{g.runner} launcher (GPU {g.name})"
    routed = launcher_map.get(member.value)
    if routed is not None and routed is not launcher:
        return f"{getattr(routed, 'name', routed)} launcher"
    return None


def register(
    backend: Any,
    launcher: KernelkiteLauncher,
    arch: Mapping[str, str | None] | None = None,
    *,
    replace: bool = False,
    consts: Any = None,
) -> None:
    """Registers `launcher` with kernelbot's `KernelBackend` and makes its GPU types known to
    kernelbot, so nothing in kernelbot's source has to change.

    kernelbot knows GPU types only from the enums in its `consts.py`: `get_gpu_by_name` looks
    submissions' GPU names up in a table built from them, and the backend compiles CUDA for
    `consts.GPU_TO_SM[name]` (a `KeyError` for any other name). This adds each member of
    `launcher.gpus` to both (`arch`: its SM architecture, e.g. `{"H100_KK": "90a"}`; a GPU
    left out compiles with `-arch=native`, for the GPU the run is on), then calls
    `backend.register_launcher(launcher)`. Call it where kernelbot's `main.py` registers its
    launchers, before any submission.

    A GPU name another launcher of kernelbot already serves (Modal's `H100`, say) is refused
    unless `replace` is set: registering for it would take those GPUs from that launcher.
    `consts` is kernelbot's `libkernelbot.consts` (given for tests).
    """
    if consts is None:
        from libkernelbot import consts
    arch = dict(arch or {})
    unknown = [g for g in arch if g not in launcher.gpus.__members__]
    if unknown:
        raise ValueError(
            f"arch names {', '.join(unknown)}, which {launcher.name} does not serve "
            f"(its GPU types: {', '.join(launcher.gpus.__members__)})"
        )
    lookup = consts._GPU_LOOKUP  # kernelbot's own table behind get_gpu_by_name
    names = [m.name.lower() for m in launcher.gpus]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"{launcher.name}'s GPU types name {', '.join(twice)} twice (kernelbot looks names "
            "up without case)"
        )
    launcher_map = getattr(backend, "launcher_map", {})
    for member in launcher.gpus:
        holder = _holder(member, launcher, lookup, launcher_map)
        if holder is not None and not replace:
            raise ValueError(
                f"kernelbot's {holder} already serves GPU type {member.name} "
                f"({member.value!r}); give {launcher.name}'s GPU types names and values of "
                f"their own (e.g. {member.name}_KK), or pass replace=True to serve it with "
                "this launcher instead"
            )
    for member in launcher.gpus:
        lookup[member.name.lower()] = consts.GPU(
            name=member.name, value=member.value, runner=launcher.name
        )
        # Changed in place: kernelbot's backend imported this very dict. A replaced GPU
        # keeps its architecture unless `arch` names one.
        if member.name in arch or member.name not in consts.GPU_TO_SM:
            consts.GPU_TO_SM[member.name] = arch.get(member.name)
    backend.register_launcher(launcher)
