"""The client's side of the service's fair queue (issue 25): the place in the queue (`queue`
events, the long-poll's `place`) reaching `follow` and kernelbot's status line, a quota's
`429`, cached answers, and `user`/`priority`/`cache` in the POST. Against the in-process
stand-in in fake_service.py, where the test decides each place, cut stream and answer (the
real service's queue, quotas and cache: test_launcher.py, test_quickstart.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from email.utils import format_datetime

import pytest
import pytest_asyncio
from conftest import make_launcher
from fake_service import FakeService, FakeSubmission
from kernelbot_standins import KiteGPU, RecordingReporter, gpu
from samples import result_json, sample_config
from stack import wait_until

from kernelkite import (
    KernelkiteClient,
    QueueEvent,
    QuotaExceeded,
    ServerError,
    StateEvent,
)
from kernelkite.client import NotFound, parse_retry_after
from kernelkite.kernelbot_launcher import (
    RunFailed,
    _View,
    about,
    cached_run_wording,
    ordinal,
    wait_wording,
)

H100 = gpu(KiteGPU.H100_KK)
RESULT = json.loads(result_json())


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeService]:
    service = await FakeService().start()
    try:
        yield service
    finally:
        await service.aclose()


@pytest_asyncio.fixture
async def kite(fake: FakeService) -> AsyncIterator[KernelkiteClient]:
    async with KernelkiteClient(fake.url, fake.token, request_timeout_s=5.0) as c:
        yield c


def summary(events: list[StateEvent | QueueEvent]) -> list[str]:
    """`queued`, `#3 40.0`, ...: what `follow` yielded, in order."""
    return [
        f"#{e.position} {e.estimated_wait_s}" if isinstance(e, QueueEvent) else e.state
        for e in events
    ]


# -- wording -------------------------------------------------------------------------------


def test_ordinals():
    cases = {1: "1st", 2: "2nd", 3: "3rd", 4: "4th", 10: "10th", 11: "11th", 12: "12th"}
    cases |= {13: "13th", 21: "21st", 22: "22nd", 23: "23rd", 100: "100th", 101: "101st"}
    cases |= {111: "111th", 112: "112th", 113: "113th", 1002: "1002nd"}
    assert {n: ordinal(n) for n in cases} == cases


def test_wait_wording():
    cases = {
        0.0: "starting now",
        0.99: "starting now",
        1.0: "about 1 s",
        7.6: "about 8 s",
        37.0: "about 35 s",
        42.4: "about 40 s",
        88.0: "about 90 s",
        90.0: "about 2 min",
        185.0: "about 3 min",
        89 * 60.0: "about 89 min",
        90 * 60.0: "about 2 h",
        5 * 3600.0 + 100: "about 5 h",
    }
    assert {s: wait_wording(s) for s in cases} == cases
    assert wait_wording(None) == "" and wait_wording(float("nan")) == ""
    assert about(-3) == "about 1 s"


def test_the_queued_line_shows_place_and_wait():
    def line(position: int | None, wait: float | None = None) -> str:
        place = None if position is None else QueueEvent("s", position, wait)
        return _View(gpu="H100_KK", place=place).message()

    assert line(None) == "⏳ Queued for H100_KK"
    assert line(3, 40.2) == "⏳ 3rd in line for H100_KK, about 40 s"
    assert line(1, 42) == "⏳ Next in line for H100_KK, about 40 s"
    assert line(1, 0.4) == "⏳ Next in line for H100_KK, starting now"
    assert line(12, 600) == "⏳ 12th in line for H100_KK, about 10 min"
    assert line(22, None) == "⏳ 22nd in line for H100_KK"
    # The wait counts down from when the place arrived, between the service's updates.
    counted = _View(gpu="H100_KK", place=QueueEvent("s", 2, 100.0), place_at=time.monotonic() - 40)
    assert counted.message() == "⏳ 2nd in line for H100_KK, about 60 s"
    assert _View(gpu="H100_KK", state="scheduled", place=QueueEvent("s", 2, 5)).message() == (
        "⏳ Waiting for a free H100_KK GPU"
    ), "the place is for the queued line only"


def test_retry_after_in_seconds_or_as_a_date():
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=300), usegmt=True)
    assert 290 <= parse_retry_after(later) <= 300
    earlier = format_datetime(datetime.now(UTC) - timedelta(seconds=300), usegmt=True)
    assert parse_retry_after(earlier) == 0.0


# -- the client ----------------------------------------------------------------------------


async def test_submit_sends_user_priority_and_cache_only_when_given(
    fake: FakeService, kite: KernelkiteClient
):
    await kite.submit(sample_config(), "h100")
    await kite.submit(sample_config(), "h100", user="alice#1", priority="admin", cache=False)
    await kite.submit(sample_config(), "h100", cache=True)
    plain, given, cache_only = fake.posts
    assert not {"user", "priority", "cache"} & plain.keys()
    assert (given["user"], given["priority"], given["cache"]) == ("alice#1", "admin", False)
    assert cache_only["cache"] is True and not {"user", "priority"} & cache_only.keys()
    sub = await kite.get(list(fake.submissions)[1])
    assert (sub["user"], sub["priority"], sub["cached_from"]) == ("alice#1", "admin", None)


async def test_a_quota_refusal_is_raised_with_its_message_and_retry_after(
    fake: FakeService, kite: KernelkiteClient
):
    fake.quota = ("user alice is over 20 runs an hour; the next frees at 14:05Z", "120")
    with pytest.raises(QuotaExceeded) as e:
        await kite.submit(sample_config(), "h100", user="alice")
    assert not isinstance(e.value, ServerError), "not a transient failure to retry"
    assert (e.value.status, e.value.retry_after_s) == (429, 120.0)
    assert e.value.message == "user alice is over 20 runs an hour; the next frees at 14:05Z"
    fake.quota = ("the service takes no more submissions now", None)
    with pytest.raises(QuotaExceeded) as e:
        await kite.submit(sample_config(), "h100")
    assert e.value.retry_after_s is None
    assert fake.submissions == {}


async def test_follow_yields_each_place_once_in_order_and_ignores_unknown_events(
    fake: FakeService, kite: KernelkiteClient
):
    sid = (await kite.submit(sample_config(), "h100"))["id"]
    sub = fake.submissions[sid]
    seen: list[StateEvent | QueueEvent] = []

    async def follow() -> None:
        async with contextlib.aclosing(kite.follow(sid)) as stream:
            async for ev in stream:
                seen.append(ev)

    task = asyncio.create_task(follow())
    await fake.streaming(sub)
    sub.set_place(3, 40.0)
    sub.set_place(3, 40.0)  # the same again: no news
    sub.raw('event: log\ndata: {"line": "hello"}\n\n')  # a type this client does not know
    sub.raw("event: queue\ndata: not json\n\n")  # an unreadable place is skipped
    sub.raw(": a comment\n\n")
    sub.set_place(2, 20.0)
    await wait_until(lambda: len(seen) == 3, what="queued and two places")
    assert sub.cut() == 1
    # The new stream starts with the current place again (#2): not repeated.
    await fake.streaming(sub)
    sub.move("scheduled")
    sub.raw(f"event: queue\ndata: {json.dumps({'id': sid, 'position': 1})}\n\n")  # too late
    sub.move("running")
    sub.move("succeeded", result=RESULT)
    await asyncio.wait_for(task, 10)
    assert summary(seen) == ["queued", "#3 40.0", "#2 20.0", "scheduled", "running", "succeeded"]
    assert [e.seq for e in seen if isinstance(e, StateEvent)] == [0, 1, 2, 3]
    place = seen[1]
    assert isinstance(place, QueueEvent) and place.submission_id == sid and not place.terminal
    assert place.estimated_start_at is not None and place.estimated_start_at.tzinfo is not None
    # Resumed after the place: Last-Event-ID is the last state's seq (queue events have none).
    assert len([r for r in fake.requests if r.endswith("/events")]) == 2
    # Without places: the states alone.
    states = [e async for e in kite.follow(sid, after_seq=0, queue_events=False)]
    assert summary(states) == ["scheduled", "running", "succeeded"]


async def test_events_yields_queue_events_and_skips_other_types(
    fake: FakeService, kite: KernelkiteClient
):
    sid = (await kite.submit(sample_config(), "h100"))["id"]
    sub = fake.submissions[sid]
    sub.raw("event: log\ndata: {}\n\n")
    sub.set_place(1, 0.5)
    sub.move("succeeded", result=RESULT, cached_from="earlier-id")
    events = [e async for e in kite.events(sid)]
    assert summary(events) == ["queued", "succeeded"], "the place went with the queued state"
    assert events[-1].submission["cached_from"] == "earlier-id"


async def test_long_poll_fallback_yields_place_changes_from_get(
    fake: FakeService, kite: KernelkiteClient
):
    fake.refuse_events = True
    sid = (await kite.submit(sample_config(), "h100"))["id"]
    sub = fake.submissions[sid]
    sub.set_place(4, 90.0)
    seen: list[StateEvent | QueueEvent] = []

    async def follow() -> None:
        stream = kite.follow(sid, sse_failures_before_poll=1, poll_wait_s=0.1)
        async with contextlib.aclosing(stream):
            async for ev in stream:
                seen.append(ev)

    task = asyncio.create_task(follow())
    await wait_until(lambda: len(seen) == 2, what="queued and the first place")
    polls = len([r for r in fake.requests if "?wait=" in r])
    await wait_until(
        lambda: len([r for r in fake.requests if "?wait=" in r]) >= polls + 3,
        what="more polls answering the same place",
    )
    sub.set_place(2, 30.0)
    await wait_until(lambda: len(seen) == 3, what="the second place")
    sub.move("scheduled")
    sub.move("succeeded", result=RESULT)
    await asyncio.wait_for(task, 10)
    assert summary(seen) == ["queued", "#4 90.0", "#2 30.0", "scheduled", "succeeded"]
    assert seen[-1].submission["result"]["success"] is True


# -- the launcher --------------------------------------------------------------------------


async def test_the_status_line_follows_the_place_in_order_without_repeats(fake: FakeService):
    launcher = make_launcher(fake.url, fake.token, progress_interval_s=60)
    reporter = RecordingReporter()
    task = asyncio.create_task(launcher.run_submission(sample_config(), H100, reporter))
    sub = await fake.submission()
    await fake.streaming(sub)
    for position, wait in [(3, 40.0), (3, 40.0), (2, 200.0), (1, 0.4)]:
        sub.set_place(position, wait)
    await wait_until(lambda: len(reporter.texts()) == 4, what="three places shown")
    sub.move("scheduled")
    sub.move("running")
    sub.move("fetching")
    sub.move("succeeded", result=RESULT)
    result = await asyncio.wait_for(task, 10)
    assert result.success
    texts = reporter.texts()
    assert texts[:-1] == [
        "⏳ Queued for H100_KK",
        "⏳ 3rd in line for H100_KK, about 40 s",
        "⏳ 2nd in line for H100_KK, about 3 min",
        "⏳ Next in line for H100_KK, starting now",
        "⏳ Waiting for a free H100_KK GPU",
        "⏳ Running on H100_KK (0s)",
        "⏳ Reading the result from H100_KK",
    ]
    assert texts[-1].startswith("✅ Finished on H100_KK in ") and "cached" not in texts[-1]
    assert reporter.calls[0][0] == "push" and len(reporter.lines) == 1
    # A test-mode run: no user (kernelbot's config names none), the service's own priority.
    assert not {"user", "priority", "cache"} & fake.posts[0].keys()


async def test_the_status_line_shows_places_over_long_poll(fake: FakeService):
    fake.refuse_events = True
    launcher = make_launcher(
        fake.url, fake.token, progress_interval_s=60, sse_failures_before_poll=1, poll_wait_s=0.1
    )
    reporter = RecordingReporter()
    task = asyncio.create_task(launcher.run_submission(sample_config(), H100, reporter))
    sub = await fake.submission()
    sub.set_place(5, 300.0)
    await wait_until(lambda: "⏳ 5th in line for H100_KK, about 5 min" in reporter.texts())
    sub.set_place(2, 12.0)
    await wait_until(lambda: "⏳ 2nd in line for H100_KK, about 10 s" in reporter.texts())
    sub.move("scheduled")
    sub.move("succeeded", result=RESULT)
    await asyncio.wait_for(task, 10)
    assert reporter.texts()[:4] == [
        "⏳ Queued for H100_KK",
        "⏳ 5th in line for H100_KK, about 5 min",
        "⏳ 2nd in line for H100_KK, about 10 s",
        "⏳ Waiting for a free H100_KK GPU",
    ]


async def test_a_cached_answer_names_its_original_by_mode_and_time_and_is_stored_as_now(
    fake: FakeService,
):
    """The result is the original's (its start 2026-11-22 10:40, UTC): the line says so, not
    the service's id of it; kernelbot stores the runs' start and end, so they are when the
    service answered, not the original's (kernelbot's stats would take the difference to the
    submission's time as a negative wait, and its duration as GPU time used again)."""

    def answer_from_cache(sub: FakeSubmission) -> None:
        sub.move("succeeded", result=RESULT, cached_from="0190-earlier")

    fake.on_submit = answer_from_cache
    launcher = make_launcher(fake.url, fake.token)
    reporter = RecordingReporter()
    before = datetime.now(UTC)
    result = await launcher.run_submission(sample_config(), H100, reporter)
    assert result.success and result.runs["test"].run.passed
    assert result.runs["test"].run.duration == 3.53, "the measurements are the original's"
    run = result.runs["test"]
    assert run.start == run.end and before - timedelta(seconds=1) <= run.start, run
    assert run.start <= datetime.now(UTC) and run.start.tzinfo is not None
    last = reporter.texts()[-1]
    assert last.startswith("✅ Finished on H100_KK in ")
    assert last.endswith("s (cached result of an identical test run from 2026-11-22 10:40 UTC)"), (
        last
    )
    assert "0190" not in last


def test_a_cached_answer_s_wording():
    at = datetime(2026, 11, 22, 11, 40, 59, tzinfo=UTC) + timedelta(hours=1)
    assert cached_run_wording("benchmark", at) == (
        "an identical benchmark run from 2026-11-22 12:40 UTC"
    )
    other_zone = at.astimezone(timezone(timedelta(hours=5, minutes=30)))
    assert cached_run_wording("private", other_zone) == (
        "an identical secret leaderboard run from 2026-11-22 12:40 UTC"
    )
    assert cached_run_wording(None, None) == "an identical run from earlier"


@pytest.mark.parametrize(
    ("cache", "sent"),
    [
        (None, [None, None]),
        (False, [False, False]),
        (True, [True, True]),
        (lambda config: config["mode"] == "test" or None, [True, None]),
    ],
    ids=["default", "never", "always", "chosen"],
)
async def test_the_cache_option_is_sent_as_chosen(fake: FakeService, cache, sent):
    fake.on_submit = lambda sub: sub.move("succeeded", result=RESULT)
    launcher = make_launcher(fake.url, fake.token, cache=cache)
    for mode in ("test", "leaderboard"):
        await launcher.run_submission(sample_config(mode=mode), H100, RecordingReporter())
    assert [p.get("cache") for p in fake.posts] == sent
    assert all(("cache" in p) == (p.get("cache") is not None) for p in fake.posts)


def test_a_cache_option_of_another_type_is_refused():
    with pytest.raises(TypeError, match="cache is True, False, None or a callable"):
        make_launcher("http://127.0.0.1:1", None, cache="yes")


async def test_a_quota_refusal_fails_the_run_with_the_services_message(fake: FakeService):
    fake.quota = ("user 42 is over 20 runs an hour; the next frees at 14:05Z", "150")
    launcher = make_launcher(fake.url, fake.token, user_of=lambda config: 42)
    reporter = RecordingReporter()
    with pytest.raises(RunFailed) as e:
        await asyncio.wait_for(launcher.run_submission(sample_config(), H100, reporter), 10)
    assert e.value.http_code == 429
    assert str(e.value) == (
        "Kernelkite did not start your run on H100_KK: user 42 is over 20 runs an hour; the "
        "next frees at 14:05Z. Please try again in about 3 min."
    )
    assert reporter.texts()[-1] == (
        "❌ Not started on H100_KK: user 42 is over 20 runs an hour; the next frees at 14:05Z"
    )
    assert len(fake.posts) == 1, "refused once, not retried"
    assert fake.posts[0]["user"] == "42"


async def test_user_of_and_priority_of_choose_what_is_sent(fake: FakeService):
    fake.on_submit = lambda sub: sub.move("succeeded", result=RESULT)
    reporter = RecordingReporter()

    default = make_launcher(fake.url, fake.token)
    for mode in ("leaderboard", "private", "benchmark"):
        await default.run_submission(sample_config(mode=mode), H100, reporter)
    assert [p.get("priority") for p in fake.posts] == ["ranked", "ranked", None]
    assert all("user" not in p for p in fake.posts)

    fake.posts.clear()
    chosen = make_launcher(
        fake.url,
        fake.token,
        user_of=lambda config: config.get("user_hint"),
        priority_of=lambda config: "admin",
    )
    await chosen.run_submission(sample_config(user_hint="u-7"), H100, reporter)
    await chosen.run_submission(sample_config(), H100, reporter)
    none = make_launcher(fake.url, fake.token, priority_of=None)
    await none.run_submission(sample_config(mode="leaderboard"), H100, reporter)
    assert [(p.get("user"), p.get("priority")) for p in fake.posts] == [
        ("u-7", "admin"),
        (None, "admin"),
        (None, None),
    ]


@pytest.mark.parametrize(
    ("knobs", "why"),
    [
        ({"user_of": lambda config: ""}, "user_of gave ''"),
        ({"user_of": lambda config: "x" * 129}, "not a user id of 1-128 characters"),
        ({"user_of": lambda config: "bad\nname"}, "without control characters"),
        ({"user_of": lambda config: 1 / 0}, "user_of raised ZeroDivisionError"),
        ({"priority_of": lambda config: "urgent"}, "priority_of gave 'urgent'"),
        ({"cache": lambda config: "yes"}, "cache gave 'yes'"),
        ({"cache": lambda config: 1 / 0}, "cache raised ZeroDivisionError"),
    ],
)
async def test_a_bad_user_or_priority_fails_the_run_before_submitting(
    fake: FakeService, knobs: dict, why: str
):
    launcher = make_launcher(fake.url, fake.token, **knobs)
    reporter = RecordingReporter()
    with pytest.raises(RunFailed) as e:
        await launcher.run_submission(sample_config(), H100, reporter)
    assert e.value.http_code == 500 and why in str(e.value), str(e.value)
    assert "not your code" in str(e.value)
    assert reporter.texts() == ["❌ Failed on H100_KK (not your code)"]
    assert fake.posts == []


@pytest.mark.parametrize("old_service", [False, True], ids=["post", "delete"])
async def test_cancel_reaches_a_service_of_either_release(
    fake: FakeService, kite: KernelkiteClient, old_service: bool
):
    """Issue 34 moved the cancel to `POST .../cancel` (a DELETE removes, and this API keeps the
    submission); a client upgraded before its service still cancels, the old way."""
    fake.delete_cancels = old_service
    sid = (await kite.submit(sample_config(), "h100"))["id"]
    sub = await kite.cancel(sid)
    assert sub["state"] == "canceled"
    with pytest.raises(NotFound):
        await kite.cancel("no-such-submission")
