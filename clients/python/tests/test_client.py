"""The plain client against a real kernelkite-service and the fake Buildkite."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
from samples import result_json, sample_config
from stack import Stack, TcpProxy, free_port, wait_until

from kernelkite import (
    TERMINAL_STATES,
    Conflict,
    Invalid,
    KernelkiteClient,
    NotFound,
    Unauthorized,
    Unreachable,
)


async def test_submit_get_wait_and_cancel(stack: Stack, client: KernelkiteClient):
    accepted = await client.submit(sample_config(), "h100", run_id="lb-1", timeout_s=120)
    assert accepted["state"] == "queued"
    sid = accepted["id"]
    build = await stack.fake.build_for(sid)
    assert build["env"]["KERNELBOT_RUN_ID"] == "lb-1"
    sub = await client.get(sid)
    assert (sub["id"], sub["queue"], sub["timeout_s"]) == (sid, "h100", 120)
    short = await client.get(sid, wait=0.2)
    assert short["state"] not in TERMINAL_STATES, "the wait ends without an end"
    canceled = await client.cancel(sid)
    assert canceled["state"] == "canceled"
    assert (await client.cancel(sid))["state"] == "canceled", "canceling again is no error"
    await wait_until(
        lambda: stack.fake.requests("cancel_build"), what="Buildkite's cancel of the build"
    )
    with pytest.raises(NotFound):
        await client.get(str(uuid.uuid4()))


async def test_a_finished_submission_cannot_be_canceled(stack: Stack, client: KernelkiteClient):
    sid = (await client.submit(sample_config(), "h100"))["id"]
    build = await stack.fake.build_for(sid)
    await stack.fake.finish(build["number"], "passed", result_json())
    done = await client.get(sid, wait=10)
    assert done["state"] == "succeeded"
    with pytest.raises(Conflict):
        await client.cancel(sid)


async def test_a_wrong_token_is_refused(stack: Stack):
    async with KernelkiteClient(stack.url, "not-the-token") as bad:
        with pytest.raises(Unauthorized) as e:
            await bad.submit(sample_config(), "h100")
        assert e.value.status == 401 and "bearer token" in e.value.message
        with pytest.raises(Unauthorized):
            await bad.queue_status("h100")
    async with KernelkiteClient(stack.url, None) as none:
        with pytest.raises(Unauthorized):
            await none.get(str(uuid.uuid4()))
    assert await stack.fake.requests("create_build") == []


async def test_a_config_the_runner_refuses_is_invalid(stack: Stack, client: KernelkiteClient):
    with pytest.raises(Invalid) as e:
        await client.submit(sample_config(ranking_by="median"), "h100")
    assert e.value.status == 422 and "ranking_by" in e.value.message
    with pytest.raises(Invalid):
        await client.submit(sample_config(), "no queue")
    assert await stack.fake.requests("create_build") == []


async def test_idempotency_key_returns_the_same_submission(stack: Stack, client: KernelkiteClient):
    key = str(uuid.uuid4())
    first = await client.submit(sample_config(), "h100", idempotency_key=key)
    second = await client.submit(sample_config(), "h100", idempotency_key=key)
    if second["id"] != first["id"]:
        await client.cancel(second["id"])
        pytest.skip(
            "this build's service ignores Idempotency-Key (it comes with the durable store)"
        )
    with pytest.raises(Conflict):
        await client.submit(sample_config(seed=7), "h100", idempotency_key=key)
    assert len(await stack.fake.builds()) == 1


async def test_events_replay_the_history_and_resume_after_last_event_id(
    stack: Stack, client: KernelkiteClient
):
    sid = (await client.submit(sample_config(), "h100"))["id"]
    build = await stack.fake.build_for(sid)
    await stack.fake.start(build["number"])
    await stack.fake.finish(build["number"], "passed", result_json())
    await client.get(sid, wait=10)
    events = [e async for e in client.events(sid)]
    assert [e.state for e in events] == ["queued", "scheduled", "running", "fetching", "succeeded"]
    assert [e.seq for e in events] == [0, 1, 2, 3, 4]
    assert all(e.at.tzinfo is not None for e in events)
    assert events[-1].submission["result"]["success"] is True
    assert events[0].submission is None
    resumed = [e async for e in client.events(sid, last_event_id=2)]
    assert [e.seq for e in resumed] == [3, 4]


async def test_sse_cut_midway_resumes_without_a_lost_or_repeated_event(
    stack: Stack, client: KernelkiteClient
):
    # The proxy sees each connection's first request: follow with a client of its own.
    proxy = await TcpProxy(stack.service.port).start()
    seen = []
    try:
        sid = (await client.submit(sample_config(), "h100"))["id"]
        build = await stack.fake.build_for(sid)
        async with KernelkiteClient(proxy.url, stack.token) as via_proxy:

            async def follow() -> None:
                async with contextlib.aclosing(via_proxy.follow(sid)) as stream:
                    async for ev in stream:
                        seen.append(ev)

            task = asyncio.create_task(follow())
            await wait_until(lambda: len(seen) >= 2, what="queued and scheduled")
            assert proxy.cut() == 1, "the stream was open"
            await stack.fake.start(build["number"])
            await stack.fake.finish(build["number"], "passed", result_json())
            await asyncio.wait_for(task, 20)
    finally:
        await proxy.aclose()
    assert [e.state for e in seen] == ["queued", "scheduled", "running", "fetching", "succeeded"]
    assert [e.seq for e in seen] == list(range(5))
    assert len(proxy.heads) == 2, "one reconnection"
    assert "last-event-id" not in proxy.heads[0].lower()
    assert "/events " in proxy.heads[1] and "last-event-id: 1\r\n" in proxy.heads[1].lower()


async def test_follow_falls_back_to_long_poll_when_the_stream_keeps_failing(
    stack: Stack, client: KernelkiteClient
):
    proxy = await TcpProxy(stack.service.port).start()
    proxy.refuse_containing = "/events"
    try:
        sid = (await client.submit(sample_config(), "h100"))["id"]
        build = await stack.fake.build_for(sid)
        await stack.fake.start(build["number"])

        async def finish_soon() -> None:
            await asyncio.sleep(0.5)
            await stack.fake.finish(build["number"], "passed", result_json())

        finisher = asyncio.create_task(finish_soon())
        async with KernelkiteClient(proxy.url, stack.token) as via_proxy:
            follow = via_proxy.follow(sid, sse_failures_before_poll=2, poll_wait_s=5)
            seen = [e async for e in follow]
        await finisher
    finally:
        await proxy.aclose()
    assert [e.state for e in seen] == ["queued", "scheduled", "running", "fetching", "succeeded"]
    assert seen[-1].submission["result"]["success"] is True
    assert len([h for h in proxy.heads if "/events " in h]) == 2, "two stream failures"
    assert "?wait=5 " in proxy.heads[2], proxy.heads


async def test_queue_status_counts_and_agents(stack: Stack, client: KernelkiteClient):
    await stack.fake.set_agents(
        [
            {"name": "g1", "queue": "h100", "busy": True},
            {"name": "g2", "queue": "h100"},
            {"name": "g3", "queue": "h100"},
            {"name": "g4", "queue": "b200"},
            {"name": "gone", "queue": "h100", "connection_state": "disconnected"},
        ]
    )
    a = (await client.submit(sample_config(), "h100"))["id"]
    await client.submit(sample_config(), "h100")
    build = await stack.fake.build_for(a)
    await stack.fake.start(build["number"])
    await wait_until(lambda: _state_is(client, a, "running"), what="the first submission running")
    status = await client.queue_status("h100")
    assert (status["queue"], status["queued"], status["running"]) == ("h100", 1, 1)
    assert status["agents"] == {"idle": 2, "busy": 1, "total": 3}
    for _ in range(5):
        assert (await client.queue_status("b200"))["agents"] == {"idle": 1, "busy": 0, "total": 1}
    assert len(await stack.fake.requests("list_agents")) == 1, "one Buildkite call, not one each"


async def _state_is(client: KernelkiteClient, sid: str, state: str) -> bool:
    return (await client.get(sid))["state"] == state


async def test_unreachable_names_the_url_it_tried():
    base = f"http://127.0.0.1:{free_port()}"
    async with KernelkiteClient(base + "/", "t", request_timeout_s=0.5) as kite:
        with pytest.raises(Unreachable) as e:
            await kite.submit(sample_config(), "h100")
        assert e.value.url == f"{base}/v1/submissions"
        assert str(e.value).startswith(f"POST {base}/v1/submissions: ConnectError"), e.value
        assert e.value.reason.startswith("ConnectError") and base not in e.value.reason
        with pytest.raises(Unreachable) as e:
            async for _ in kite.events("abc"):
                pass
        assert str(e.value).startswith(f"GET {base}/v1/submissions/abc/events: "), e.value
