"""The launcher with kernelbot's own `Launcher` base class, dataclasses and reporter, where a
kernelbot checkout is at hand (`KERNELBOT_SRC`; `KERNELBOT_PYTHON`: an interpreter that loads it,
Python >= 3.12 with httpx); skipped, and counted as skipped, where not."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from samples import result_json
from stack import Stack

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    not os.environ.get("KERNELBOT_SRC"),
    reason="KERNELBOT_SRC is not set (a gpu-mode/kernelbot checkout runs this test)",
)


async def test_the_launcher_inside_kernelbot(stack: Stack):
    src = os.environ["KERNELBOT_SRC"]
    if not (Path(src) / "src" / "libkernelbot" / "launchers" / "launcher.py").is_file():
        pytest.fail(f"KERNELBOT_SRC={src} is not a kernelbot checkout (no src/libkernelbot)")
    await stack.fake.autoplay({"state": "passed", "result": result_json()})
    await stack.fake.set_agents([{"name": "g1", "queue": "h100"}])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), str(HERE)]))
    python = os.environ.get("KERNELBOT_PYTHON") or sys.executable
    proc = await asyncio.create_subprocess_exec(
        python,
        str(HERE / "kernelbot_check.py"),
        stack.url,
        stack.token,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()
    got = json.loads(stdout)
    if "skip" in got:
        pytest.skip(got["skip"])
    assert got["is_launcher"] and all(got["types"]), got
    assert got["success"] and got["aware"]
    assert got["short_report"] == ["✅ Testing successful"], got
    assert got["message"].startswith("**H100_KK on Kernelkite**\n> ✅ Finished on H100_KK in ")
    assert got["status"] == {
        "runner": "Kernelkite",
        "gpu": "H100_KK",
        "queued_jobs": 0,
        "running_jobs": 0,
        "available_runners": 1,
        "status": "available",
        "error": None,
    }
