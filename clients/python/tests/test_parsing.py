"""The pure parts: the SSE decoder, rebuilding FullResult, the default deadline, and the
launcher's checks of its queue mapping."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from kernelbot_standins import TYPES, EvalResult, FullResult, KiteGPU, RunResult, SystemInfo
from samples import result_json

from kernelkite.kernelbot_launcher import (
    KernelkiteLauncher,
    UnreadableResult,
    default_deadline_s,
    full_result_from_json,
)
from kernelkite.sse import SSEDecoder


def decode(text: str) -> list:
    d = SSEDecoder()
    out = [d.feed(line) for line in text.split("\n")]
    return [e for e in out if e is not None]


def test_sse_decoder_follows_the_event_stream_rules():
    events = decode(
        ": keep-alive\n"
        'event: running\nid: 2\ndata: {"a":\ndata:  1}\n\n'
        "retry: 1500\nid: 3\ndata:x\n\n"
        "event: ignored-no-data\n\n"
        "id: bad\0id\ndata: y\nretry: soon\n\n"
    )
    assert [(e.event, e.data, e.id, e.retry_ms) for e in events] == [
        ("running", '{"a":\n 1}', "2", None),
        ("message", "x", "3", 1500),
        ("message", "y", "3", 1500),
    ]


def test_full_result_keeps_the_runners_verdict_and_makes_times_aware():
    r = full_result_from_json(json.loads(result_json(success=False, error="boom")), TYPES)
    assert isinstance(r, FullResult) and isinstance(r.system, SystemInfo)
    assert (r.success, r.error) == (False, "boom")
    run = r.runs["test"]
    assert isinstance(run, EvalResult) and isinstance(run.run, RunResult)
    assert run.compilation is None and run.profile is None
    assert run.run.result == {"check": "fail", "test-count": "1"}
    assert run.start == datetime(2026, 11, 22, 10, 40, 0, 123456, tzinfo=UTC)
    naive = full_result_from_json(json.loads(result_json(naive_times=True)), TYPES)
    assert naive.runs["test"].end.tzinfo is not None, "a time without offset is read as UTC"
    assert naive.runs["test"].end == datetime(2026, 11, 22, 10, 40, 3, 654321, tzinfo=UTC)


def test_full_result_drops_fields_a_newer_runner_added_and_refuses_missing_ones():
    data = json.loads(result_json())
    data["new_top"] = 1
    data["system"]["new_field"] = "x"
    data["runs"]["test"]["run"]["new_field"] = 2
    data["runs"]["test"]["new_part"] = {}
    r = full_result_from_json(data, TYPES)
    assert r.success and r.runs["test"].run.duration == 3.53
    del data["runs"]["test"]["run"]["passed"]
    with pytest.raises(UnreadableResult, match=r"runs\.test\.run lacks passed"):
        full_result_from_json(data, TYPES)
    for bad in [
        None,
        [],
        {"success": "yes", "error": ""},
        {"success": True, "error": "", "runs": []},
    ]:
        with pytest.raises(UnreadableResult):
            full_result_from_json(bad, TYPES)
    bad_time = json.loads(result_json())
    bad_time["runs"]["test"]["start"] = "yesterday"
    with pytest.raises(UnreadableResult, match="start/end"):
        full_result_from_json(bad_time, TYPES)


def test_default_deadline_covers_the_modes_time_limits_and_the_queue():
    assert default_deadline_s({"mode": "test", "test_timeout": 60}, 600) == 60 + 120 + 600 + 60
    lb = {"mode": "leaderboard", "test_timeout": 10, "benchmark_timeout": 20, "ranked_timeout": 30}
    assert default_deadline_s(lb, 0) == 10 + 20 + 30 + 3 * 120 + 60
    prof = {"mode": "profile", "benchmarks": [{}, {}], "benchmark_timeout": 100}
    assert default_deadline_s(prof, 0) == 2 * 220 + 60
    assert default_deadline_s({"mode": "benchmark", "benchmark_timeout": None}, 0) == 180 + 180


def test_queue_mapping_must_cover_the_enum_with_valid_queues():
    def launcher(queues):
        return KernelkiteLauncher("http://127.0.0.1:9", "t", KiteGPU, queues, types=TYPES)

    ok = launcher({KiteGPU.H100_KK: "h100", "B200_KK": "b200.x"})
    assert ok.queue_for(KiteGPU.H100_KK) == "h100" and ok.queue_for("B200_KK") == "b200.x"
    assert (ok.name, ok.gpus) == ("Kernelkite", KiteGPU)
    with pytest.raises(ValueError, match="no kernelkite queue for B200_KK"):
        launcher({KiteGPU.H100_KK: "h100"})
    with pytest.raises(ValueError, match="not a member of KiteGPU"):
        launcher({"H100_KK": "h100", "B200_KK": "b", "A100": "a"})
    with pytest.raises(ValueError, match="must be 1-64"):
        launcher({"H100_KK": "h100", "B200_KK": "b 200"})
