"""Runs the launcher inside kernelbot's own classes (not stand-ins): `test_kernelbot_source.py`
starts it as `python kernelbot_check.py SERVICE_URL TOKEN` with `KERNELBOT_SRC` set to a
kernelbot checkout, against a service whose fake Buildkite plays each build to a passed end.
It prints one JSON line with what the test checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types
from enum import Enum
from pathlib import Path

from samples import result_json, sample_config  # noqa: F401  (sample_config is used below)

SRC = Path(os.environ["KERNELBOT_SRC"]) / "src"
sys.path.insert(0, str(SRC))
try:
    import libkernelbot.launchers  # noqa: F401
except ImportError:
    # Its __init__ imports the GitHub and Modal launchers, whose packages (PyGithub, modal)
    # need not be installed here; launcher.py itself needs only the standard library.
    pkg = types.ModuleType("libkernelbot.launchers")
    pkg.__path__ = [str(SRC / "libkernelbot" / "launchers")]
    sys.modules["libkernelbot.launchers"] = pkg

try:
    from libkernelbot.consts import GPU
    from libkernelbot.launchers.launcher import Launcher, RunnerQueueStatus
    from libkernelbot.report import RunProgressReporter, make_short_report
    from libkernelbot.run_eval import EvalResult, FullResult, RunResult
except SyntaxError as e:
    # kernelbot targets Python 3.13 (report.py uses PEP 701 f-strings, 3.12+).
    v = ".".join(map(str, sys.version_info[:3]))
    print(
        json.dumps(
            {
                "skip": f"kernelbot's source does not load on Python {v} ({e.msg}); "
                "set KERNELBOT_PYTHON to a Python >= 3.12 with httpx"
            }
        )
    )
    sys.exit(0)

from kernelkite.kernelbot_launcher import KernelkiteLauncher  # noqa: E402


class KernelkiteGPU(Enum):
    H100_KK = "H100_KK"


class Reporter(RunProgressReporter):
    async def _update_message(self) -> None:
        pass


async def main(url: str, token: str) -> dict:
    launcher = KernelkiteLauncher(
        url, token, KernelkiteGPU, {KernelkiteGPU.H100_KK: "h100"}, deadline_s=60
    )
    gpu = GPU(name="H100_KK", value="H100_KK", runner="Kernelkite")
    reporter = Reporter("H100_KK on Kernelkite")
    result = await launcher.run_submission(sample_config(), gpu, reporter)
    status = await launcher.get_queue_status(gpu)
    run = result.runs["test"]
    return {
        "is_launcher": isinstance(launcher, Launcher),
        "types": [
            type(result) is FullResult,
            type(run) is EvalResult,
            type(run.run) is RunResult,
            type(status) is RunnerQueueStatus,
        ],
        "success": result.success,
        "aware": run.start.tzinfo is not None,
        "short_report": make_short_report(result.runs, full=False),
        "message": reporter.get_message(),
        "status": status.to_dict(),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
