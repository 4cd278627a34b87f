"""KernelkiteLauncher as kernelbot drives it, against a real kernelkite-service and the fake
Buildkite (kernelbot's classes: the stand-ins in kernelbot_standins.py)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from datetime import UTC, datetime, timedelta

import pytest
from conftest import make_launcher
from kernelbot_standins import (
    EvalResult,
    FullResult,
    KiteGPU,
    RecordingReporter,
    RunnerQueueStatus,
    gpu,
)
from samples import result_json, sample_config
from stack import Stack, TcpProxy, wait_until

from kernelkite import KernelkiteClient, NotFound, Unreachable
from kernelkite.kernelbot_launcher import RunFailed

H100 = gpu(KiteGPU.H100_KK)


async def raised(task_or_coro, within: float = 20) -> RunFailed:
    """The `RunFailed` a run raises (kernelbot marks the job failed with its text)."""
    with pytest.raises(RunFailed) as e:
        await asyncio.wait_for(task_or_coro, within)
    return e.value


def assert_not_finished(reporter: RecordingReporter) -> None:
    texts = reporter.texts()
    assert not any(t.startswith("✅") for t in texts), texts
    assert texts[-1].startswith("❌") and "not your code" in texts[-1], texts


async def run_in_background(launcher, reporter, config=None):
    return asyncio.create_task(launcher.run_submission(config or sample_config(), H100, reporter))


async def the_build(stack: Stack, count: int = 1) -> dict:
    return (await stack.fake.wait_builds(count))[count - 1]


def assert_in_order(texts: list[str], prefixes: list[str]) -> None:
    """Each prefix matches a later message than the one before."""
    i = 0
    for p in prefixes:
        while i < len(texts) and not texts[i].startswith(p):
            i += 1
        assert i < len(texts), f"no {p!r} after the earlier ones in {texts}"
        i += 1


async def test_success_over_sse_reports_each_state_in_order(stack: Stack):
    launcher = make_launcher(stack.url, stack.token)
    reporter = RecordingReporter()
    task = await run_in_background(launcher, reporter)
    build = await the_build(stack)
    await wait_until(lambda: any("Waiting for a free" in t for t in reporter.texts()))
    await stack.fake.start(build["number"])
    await wait_until(lambda: any("Running on" in t for t in reporter.texts()))
    await asyncio.sleep(1.5)  # the elapsed time is refreshed while it runs
    await stack.fake.finish(build["number"], "passed", result_json())
    result = await asyncio.wait_for(task, 20)

    assert isinstance(result, FullResult) and result.success and result.error == ""
    assert isinstance(result.runs["test"], EvalResult) and result.runs["test"].run.passed
    assert result.runs["test"].start.tzinfo is not None
    assert reporter.calls[0] == ("push", "⏳ Queued for H100_KK")
    assert [kind for kind, _ in reporter.calls[1:]] == ["update"] * (len(reporter.calls) - 1)
    link = f"build [#{build['number']}](<{build['web_url']}>)"
    texts = reporter.texts()
    assert_in_order(
        texts,
        [
            "⏳ Queued for H100_KK",
            f"⏳ Waiting for a free H100_KK GPU: {link}",
            f"⏳ Running on H100_KK: {link} (",
            "✅ Finished on H100_KK in ",
        ],
    )
    assert texts[-1].startswith("✅ Finished on H100_KK") and texts[-1].endswith(link)
    assert len([t for t in texts if t.startswith("⏳ Running")]) >= 2, texts
    assert len(reporter.lines) == 1, "one line, updated in place"
    # The submission carried the run's deadline as its timeout.
    sub_id = build["meta_data"]["kernelkite_submission_id"]
    async with KernelkiteClient(stack.url, stack.token) as c:
        assert (await c.get(sub_id))["timeout_s"] == 60


async def test_where_the_run_ran_is_a_line_of_its_own_under_the_result(stack: Stack):
    """The node's provenance.json (uploaded beside result.json) reaches kernelbot's report as
    one line under the run's: the service's summary, then what looked unhealthy. The result
    kernelbot gets is the runner's, untouched."""
    provenance = {
        "format": 1,
        "kernelkite_version": "0.1.0",
        "node": "dgx01",
        "agent": "dgx01-gpu3",
        "slice": {"index": 3, "cpus": [12, 13], "memory_bytes": 1},
        "driver": "550.54.15",
        "gpus": [
            {
                "vendor": "nvidia",
                "name": "NVIDIA H100 80GB HBM3",
                "uuid": "GPU-3",
                "start": {"sm_clock_mhz": 1980, "temperature_c": 60},
                "end": {"sm_clock_mhz": 1410, "temperature_c": 91, "throttle": ["hw_slowdown"]},
            }
        ],
        # What a node writes here is replaced by the service's own reading.
        "summary": "forged by the node",
        "concerns": [],
    }
    launcher = make_launcher(stack.url, stack.token)
    reporter = RecordingReporter()
    task = await run_in_background(launcher, reporter)
    build = await the_build(stack)
    await stack.fake.finish(
        build["number"], "passed", result_json(), provenance=json.dumps(provenance)
    )
    result = await asyncio.wait_for(task, 20)
    assert isinstance(result, FullResult) and result.success
    assert len(reporter.lines) == 2, reporter.lines
    assert reporter.lines[0].startswith("> ✅ Finished on H100_KK"), reporter.lines
    line = reporter.lines[1].removeprefix("> ")
    assert line.startswith("🖥️ `ran on dgx01/dgx01-gpu3 slice 3: NVIDIA H100 80GB HBM3 (GPU-3)"), (
        line
    )
    assert "60→91 °C" in line and "driver 550.54.15" in line, line
    assert "forged" not in line, line
    assert "⚠️" in line and "91 °C" in line and "hw_slowdown" in line, line
    # Without a provenance (an older node), the run's line stays the only one.
    reporter = RecordingReporter()
    task = await run_in_background(launcher, reporter)
    build = await the_build(stack, 2)
    await stack.fake.finish(build["number"], "passed", result_json())
    await asyncio.wait_for(task, 20)
    assert len(reporter.lines) == 1, reporter.lines


async def test_a_cut_event_stream_is_resumed_and_each_state_reported_once(stack: Stack):
    proxy = await TcpProxy(stack.service.port).start()
    try:
        launcher = make_launcher(proxy.url, stack.token, progress_interval_s=60)
        reporter = RecordingReporter()
        task = await run_in_background(launcher, reporter)
        build = await the_build(stack)
        await wait_until(lambda: any("Waiting for a free" in t for t in reporter.texts()))
        await wait_until(lambda: [h for h in proxy.heads if "/events " in h], what="the stream")
        proxy.cut()
        await stack.fake.start(build["number"])
        await stack.fake.finish(build["number"], "passed", result_json())
        result = await asyncio.wait_for(task, 20)
    finally:
        await proxy.aclose()
    assert result.success, result.error
    kinds = [t.split(" on ")[0].split(" for ")[0] for t in reporter.texts()]
    assert kinds == [
        "⏳ Queued",
        "⏳ Waiting",
        "⏳ Running",
        "⏳ Reading the result from H100_KK: build [#1](<https://buildkite.com/kernelkite/submissions/builds/1>)",
        "✅ Finished",
    ], reporter.texts()
    streams = [h for h in proxy.heads if "/events " in h]
    assert len(streams) == 2 and "last-event-id: 1\r\n" in streams[1].lower(), streams


async def test_a_rate_limited_build_creation_is_waited_out(stack: Stack):
    await stack.fake.fault("create_build", rate_limited_s=1)
    await stack.fake.autoplay({"state": "passed", "result": result_json()})
    launcher = make_launcher(stack.url, stack.token)
    reporter = RecordingReporter()
    result = await asyncio.wait_for(launcher.run_submission(sample_config(), H100, reporter), 20)
    assert result.success, result.error
    creates = await stack.fake.requests("create_build")
    assert [r["status"] for r in creates][:1] == [429] and len(creates) == 2
    assert reporter.texts()[0] == "⏳ Queued for H100_KK"


async def test_success_over_long_poll(stack: Stack):
    launcher = make_launcher(stack.url, stack.token, sse_failures_before_poll=0, poll_wait_s=2)
    reporter = RecordingReporter()
    task = await run_in_background(launcher, reporter)
    build = await the_build(stack)
    await stack.fake.start(build["number"])
    await wait_until(lambda: any("Running on" in t for t in reporter.texts()))
    await stack.fake.finish(build["number"], "passed", result_json())
    result = await asyncio.wait_for(task, 20)
    assert result.success, result.error
    assert_in_order(
        reporter.texts(),
        ["⏳ Queued", "⏳ Waiting for a free H100_KK GPU: build [#1]", "⏳ Running on", "✅"],
    )


async def test_a_result_the_runner_could_not_evaluate_raises_not_your_code(stack: Stack):
    # kernelbot's evaluator raises where the runner writes success=false (the machine or the
    # task's configuration failed): kernelbot must mark the job failed with the reason, and
    # the status line must not say "Finished".
    launcher = make_launcher(stack.url, stack.token)
    reporter = RecordingReporter()
    task = await run_in_background(launcher, reporter)
    build = await the_build(stack)
    failing = result_json(success=False, error="no GPU found; check the node's driver")
    # The runner exits non-zero when the evaluation fails; its result.json still counts.
    await stack.fake.finish(build["number"], "failed", failing)
    e = await raised(task)
    assert "could not be evaluated" in str(e) and "no GPU found" in str(e)
    assert "not your code" in str(e) and build["web_url"] in str(e)
    assert e.http_code == 502
    assert_not_finished(reporter)


async def test_a_failed_build_without_artifact_raises_not_your_code(stack: Stack):
    launcher = make_launcher(stack.url, stack.token)
    reporter = RecordingReporter()
    task = await run_in_background(launcher, reporter)
    build = await the_build(stack)
    await stack.fake.start(build["number"])
    await stack.fake.finish(build["number"], "failed", None)
    e = await raised(task)
    assert "ended without a result" in str(e) and "not your code" in str(e)
    assert "without result.json" in str(e) and build["web_url"] in str(e)
    assert "please resubmit" in str(e)
    assert reporter.texts()[-1].startswith("❌ Failed on H100_KK")
    assert_not_finished(reporter)


async def test_the_deadline_cancels_the_build(stack: Stack):
    launcher = make_launcher(stack.url, stack.token, deadline_s=1.5)
    reporter = RecordingReporter()
    started = time.monotonic()
    task = await run_in_background(launcher, reporter)
    build = await the_build(stack)
    await stack.fake.start(build["number"])
    e = await raised(task)
    assert time.monotonic() - started < 10
    # The runner stops each run at its own limit (a result); the whole submission's deadline
    # passing while running is not the kernel's fault.
    assert "did not finish within 2 s" in str(e) and "not your code" in str(e), e
    assert e.http_code == 503
    await wait_until(lambda: stack.fake.requests("cancel_build"), what="the build's cancel")
    assert await stack.fake.state(build["number"]) == "canceled"
    assert reporter.texts()[-1].startswith("❌ Timed out on H100_KK")
    assert_not_finished(reporter)


async def test_a_run_that_never_got_a_gpu_says_so(stack: Stack):
    launcher = make_launcher(stack.url, stack.token, deadline_s=1)
    reporter = RecordingReporter()
    e = await raised(launcher.run_submission(sample_config(), H100, reporter))
    assert "No H100_KK GPU became free within 1 s" in str(e), e
    assert e.http_code == 503
    last = reporter.texts()[-1]
    assert last.startswith("❌ Timed out on H100_KK") and last.endswith("(not your code)"), last
    await wait_until(lambda: stack.fake.requests("cancel_build"), what="the build's cancel")


async def test_a_config_the_service_refuses_raises(stack: Stack):
    launcher = make_launcher(stack.url, stack.token)
    reporter = RecordingReporter()
    e = await raised(launcher.run_submission(sample_config(ranking_by="median"), H100, reporter))
    assert str(e).startswith("Kernelkite refused the run: ")
    assert "ranking_by" in str(e) and "report this to the organizers" in str(e)
    assert e.http_code == 500
    assert reporter.calls == [("push", "❌ Failed on H100_KK (not your code)")]
    assert await stack.fake.builds() == []


async def test_a_wrong_token_raises(stack: Stack):
    launcher = make_launcher(stack.url, "wrong-token")
    e = await raised(launcher.run_submission(sample_config(), H100, RecordingReporter()))
    assert "refused the bot's credentials" in str(e) and "bearer token" in str(e)
    status = await launcher.get_queue_status(H100)
    assert isinstance(status, RunnerQueueStatus)
    assert (status.status, status.queued_jobs) == ("unavailable", None)
    assert "401" in status.error


@pytest.mark.parametrize("how", ["wait_for", "task.cancel"])
async def test_task_cancellation_cancels_the_submission(stack: Stack, how: str):
    launcher = make_launcher(stack.url, stack.token)
    reporter = RecordingReporter()
    run = launcher.run_submission(sample_config(), H100, reporter)
    if how == "wait_for":
        started = asyncio.create_task(stack.fake.wait_builds(1))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run, 1.0)
        build = (await started)[0]
    else:
        task = asyncio.create_task(run)
        build = await the_build(stack)
        await stack.fake.start(build["number"])
        await wait_until(lambda: any("Running" in t for t in reporter.texts()))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # The cancel went out before the cancellation finished.
    sub_id = build["meta_data"]["kernelkite_submission_id"]
    async with KernelkiteClient(stack.url, stack.token) as c:
        sub = await c.get(sub_id)
    assert sub["state"] == "canceled", sub
    await wait_until(lambda: stack.fake.requests("cancel_build"), what="the build's cancel")
    assert await stack.fake.state(build["number"]) == "canceled"


async def test_a_service_that_stops_answering_hits_the_deadline(stack: Stack):
    launcher = make_launcher(
        stack.url, stack.token, deadline_s=2, deadline_grace_s=1, request_timeout_s=0.5
    )
    task = await run_in_background(launcher, RecordingReporter())
    build = await the_build(stack)
    stack.service.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        e = await raised(task, 15)
        waited = time.monotonic() - started
    finally:
        stack.service.signal(signal.SIGCONT)
    assert "No answer from the Kernelkite service" in str(e) and e.http_code == 503
    assert waited < 6, waited
    # Once it answers again the build does not run on: the service's own timeout cancels it.
    await wait_until(
        lambda: stack.fake.requests("cancel_build"), within=10, what="the build's cancel"
    )
    assert await stack.fake.state(build["number"]) == "canceled"


async def test_a_service_restart_during_the_wait(stack: Stack):
    launcher = make_launcher(stack.url, stack.token, poll_wait_s=2)
    reporter = RecordingReporter()
    task = await run_in_background(launcher, reporter)
    build = await the_build(stack)
    sub_id = build["meta_data"]["kernelkite_submission_id"]
    await stack.fake.start(build["number"])
    await wait_until(lambda: any("Running" in t for t in reporter.texts()))
    # A restart as systemd does it: SIGTERM (a service that still drains its event streams
    # after 2 s is killed), then a new process on the same port and data dir.
    stack.service.stop(signal.SIGTERM, grace_s=2)
    stack.service.start()
    async with KernelkiteClient(stack.url, stack.token) as c:
        try:
            await c.get(sub_id)
        except NotFound:
            # The launcher's side of it still holds: the lost run raises, saying so.
            e = await raised(task, 30)
            assert "no longer knows your run on H100_KK" in str(e), e
            pytest.skip(
                "needs the durable store: this build's restarted service answers 404 for "
                "submissions that were in flight"
            )
    await stack.fake.finish(build["number"], "passed", result_json())
    result = await asyncio.wait_for(task, 30)
    assert result.success, result.error
    assert reporter.texts()[-1].startswith("✅ Finished")


async def test_twenty_concurrent_submissions(stack: Stack):
    await stack.fake.autoplay(
        {"start_after_ms": 100, "finish_after_ms": 300, "state": "passed", "result": result_json()}
    )
    launcher = make_launcher(stack.url, stack.token)
    reporters = [RecordingReporter() for _ in range(20)]
    results = await asyncio.wait_for(
        asyncio.gather(
            *(
                launcher.run_submission(sample_config(seed=i), H100, r)
                for i, r in enumerate(reporters)
            )
        ),
        60,
    )
    assert all(r.success for r in results), [r.error for r in results if not r.success]
    builds = await stack.fake.builds()
    assert len(builds) == 20
    assert len({b["env"]["KERNELBOT_RUN_ID"] for b in builds}) == 20, "unique run ids"
    for r in reporters:
        assert r.calls[0][0] == "push" and r.texts()[-1].startswith("✅ Finished")


async def test_queue_status_fills_runner_queue_status_and_is_cached(stack: Stack):
    await stack.fake.set_agents(
        [
            {"name": "g1", "queue": "h100", "busy": True},
            {"name": "g2", "queue": "h100"},
            {"name": "g3", "queue": "h100"},
        ]
    )
    launcher = make_launcher(stack.url, stack.token, queue_status_ttl_s=30)
    task = await run_in_background(launcher, RecordingReporter())
    await the_build(stack)
    status = await launcher.get_queue_status(H100)
    assert status == RunnerQueueStatus(
        runner="Kernelkite",
        gpu="H100_KK",
        queued_jobs=1,
        running_jobs=0,
        available_runners=2,
        status="available",
        error=None,
    )
    b200 = await launcher.get_queue_status(gpu(KiteGPU.B200_KK), {"mode": "test"})
    assert (b200.status, b200.available_runners, b200.queued_jobs) == ("unavailable", 0, 0)
    assert b200.error == "no B200_KK machine is connected to queue b200"
    for _ in range(5):
        assert await launcher.get_queue_status(H100) == status
    reqs = [h for h in await stack.fake.requests("list_agents")]
    assert len(reqs) == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_an_unreachable_service_raises(tmp_path):
    from stack import free_port

    launcher = make_launcher(
        f"http://127.0.0.1:{free_port()}", "t", request_timeout_s=0.5, submit_attempts=2
    )
    reporter = RecordingReporter()
    e = await raised(launcher.run_submission(sample_config(), H100, reporter))
    assert "service could not be reached (ConnectError" in str(e) and e.http_code == 503
    assert "127.0.0.1" not in str(e), "the bot's address of the service is not the competitor's"
    assert isinstance(e.__cause__, Unreachable) and "127.0.0.1" in str(e.__cause__)
    assert_not_finished(reporter)
    status = await launcher.get_queue_status(H100)
    assert status.status == "unavailable" and status.queued_jobs is None


async def test_a_reporter_that_fails_does_not_fail_the_run(stack: Stack):
    class Broken(RecordingReporter):
        async def _update_message(self) -> None:
            raise RuntimeError("Discord is down")

    await stack.fake.autoplay({"state": "passed", "result": result_json()})
    launcher = make_launcher(stack.url, stack.token)
    result = await asyncio.wait_for(launcher.run_submission(sample_config(), H100, Broken()), 20)
    assert result.success, result.error


async def test_the_status_line_shows_the_place_in_the_real_service_s_queue(tmp_path):
    """The fair queue of the real service (one slot on `h100`): a run behind another shows
    its place and wait, then runs; the same run again is answered from the result cache."""
    stack = Stack(tmp_path, {"KERNELKITE_QUEUE_SLOTS": "h100=1", "KERNELKITE_CACHE": "true"})
    try:
        launcher = make_launcher(stack.url, stack.token, user_of=lambda config: "alice")
        first_reporter, second_reporter = RecordingReporter(), RecordingReporter()
        first = await run_in_background(launcher, first_reporter)
        build = await the_build(stack)
        second = await run_in_background(launcher, second_reporter)
        await wait_until(
            lambda: any(
                t.startswith("⏳ Next in line for H100_KK, about") for t in second_reporter.texts()
            ),
            what="the second run's place",
        )
        assert len(await stack.fake.builds()) == 1, (
            "the second waits in the service, not in Buildkite"
        )
        await stack.fake.finish(build["number"], "passed", result_json())
        assert (await asyncio.wait_for(first, 20)).success
        build = await the_build(stack, 2)
        await stack.fake.finish(build["number"], "passed", result_json())
        assert (await asyncio.wait_for(second, 20)).success
        assert_in_order(
            second_reporter.texts(),
            [
                "⏳ Queued for H100_KK",
                "⏳ Next in line for H100_KK",
                "⏳ Waiting for a free H100_KK GPU",
                "✅ Finished",
            ],
        )
        # The same run again: answered from the cache, no third build; the line names the
        # original by its mode and start (result_json's), and the runs are stored as answered.
        third_reporter = RecordingReporter()
        before = datetime.now(UTC)
        third = await run_in_background(launcher, third_reporter)
        cached = await asyncio.wait_for(third, 20)
        assert cached.success and cached.runs["test"].run.duration == 3.53
        assert before - timedelta(seconds=1) <= cached.runs["test"].start
        assert cached.runs["test"].start == cached.runs["test"].end
        assert third_reporter.texts()[-1].endswith(
            "(cached result of an identical test run from 2026-11-22 10:40 UTC)"
        ), third_reporter.texts()
        assert len(await stack.fake.builds()) == 2
        # cache=False: the same run runs again.
        uncached = make_launcher(stack.url, stack.token, user_of=lambda config: "bob", cache=False)
        fourth_reporter = RecordingReporter()
        fourth = await run_in_background(uncached, fourth_reporter)
        build = await the_build(stack, 3)
        await stack.fake.finish(build["number"], "passed", result_json())
        assert (await asyncio.wait_for(fourth, 20)).success
        assert "cached" not in fourth_reporter.texts()[-1], fourth_reporter.texts()
    finally:
        await stack.aclose()


async def test_a_quota_refusal_of_the_real_service_reads_as_a_competitor_reads_it(tmp_path):
    """`KERNELKITE_QUEUE_LIMITS` of one at once: alice's second run is refused with the
    service's words (which limit, when it frees), not retried, and bob's runs."""
    stack = Stack(tmp_path, {"KERNELKITE_QUEUE_LIMITS": "*:queued=1"})
    try:
        launcher = make_launcher(stack.url, stack.token, user_of=lambda config: "alice")
        first = await run_in_background(launcher, RecordingReporter())
        await the_build(stack)
        reporter = RecordingReporter()
        e = await raised(launcher.run_submission(sample_config(seed=2), H100, reporter))
        assert e.http_code == 429
        text = str(e)
        assert text.startswith(
            'Kernelkite did not start your run on H100_KK: user "alice" already has 1 test '
            "submission waiting or running on h100, the most at once; one is expected to end in "
            "about "
        ), text
        assert ". Please try again in about " in text and "node" not in text, text
        assert reporter.texts()[-1].startswith('❌ Not started on H100_KK: user "alice" already')
        bob = make_launcher(stack.url, stack.token, user_of=lambda config: "bob")
        second = await run_in_background(bob, RecordingReporter(), sample_config(seed=3))
        await the_build(stack, 2)
        first.cancel()
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
    finally:
        await stack.aclose()
