"""The launcher against `kernelkite-service serve --executor local`, where the runner really
runs each job on this machine (the runner's CPU-only example task: no GPU needed). Skipped
while the service binary has no local executor."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from conftest import make_launcher
from kernelbot_standins import KiteGPU, RecordingReporter, gpu
from samples import example_config
from stack import API_TOKEN, Service, local_mode_supported, local_service

from kernelkite import KernelkiteClient

H100 = gpu(KiteGPU.H100_KK)


@pytest_asyncio.fixture
async def local(tmp_path: Path) -> AsyncIterator[Service]:
    supported, reason = local_mode_supported()
    if not supported:
        pytest.skip(reason)
    service = local_service(tmp_path)
    service.start()
    try:
        yield service
    finally:
        service.stop(signal.SIGKILL)


async def test_local_success_over_sse(local: Service):
    launcher = make_launcher(local.url, API_TOKEN)
    reporter = RecordingReporter()
    result = await asyncio.wait_for(launcher.run_submission(example_config(), H100, reporter), 120)
    assert result.success, result.error
    run = result.runs["test"]
    assert run.run.passed and run.run.result["check"] == "pass"
    assert run.start.tzinfo is not None
    texts = reporter.texts()
    # Local mode has no page a competitor could open: no link (it used to be a file:// path
    # on the server, deleted after the run).
    assert not any("file:" in t or "build" in t for t in texts), texts
    assert texts[0] == "⏳ Queued for H100_KK"
    assert any(t.startswith("⏳ Running on H100_KK") for t in texts), texts
    # The run's own line ends finished; under it, where it ran (the node's provenance).
    assert texts[-2].startswith("✅ Finished on H100_KK"), texts
    assert texts[-1].startswith("🖥️ `ran on ") and "slice 0" in texts[-1], texts


async def test_local_success_over_long_poll(local: Service):
    launcher = make_launcher(local.url, API_TOKEN, sse_failures_before_poll=0, poll_wait_s=5)
    reporter = RecordingReporter()
    result = await asyncio.wait_for(launcher.run_submission(example_config(), H100, reporter), 120)
    assert result.success, result.error
    assert reporter.texts()[-2].startswith("✅ Finished on H100_KK"), reporter.texts()


async def test_local_failing_submission_keeps_the_runners_result(local: Service):
    config = example_config()
    config["sources"]["submission.py"] = "def custom_kernel(data):\n    return [0 for _ in data]\n"
    launcher = make_launcher(local.url, API_TOKEN)
    result = await asyncio.wait_for(launcher.run_submission(config, H100, RecordingReporter()), 120)
    assert result.success, "the runner ran; the evaluation failed"
    assert result.runs["test"].run.passed is False


async def test_local_task_cancellation_cancels_the_submission(local: Service):
    config = example_config()
    config["sources"]["submission.py"] = (
        "import time\n\ndef custom_kernel(data):\n    time.sleep(60)\n    return data\n"
    )
    launcher = make_launcher(local.url, API_TOKEN)
    reporter = RecordingReporter()
    task = asyncio.create_task(launcher.run_submission(config, H100, reporter))
    async with KernelkiteClient(local.url, API_TOKEN) as c:
        for _ in range(200):
            if any(t.startswith("⏳ Running") for t in reporter.texts()):
                break
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        status = await c.queue_status("h100")
        assert status["queued"] + status["running"] == 0, status


async def test_local_queue_status(local: Service):
    launcher = make_launcher(local.url, API_TOKEN)
    status = await launcher.get_queue_status(H100)
    assert status.runner == "Kernelkite" and status.queued_jobs == 0, status
