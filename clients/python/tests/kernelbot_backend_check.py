"""kernelbot's own backend driving the launcher: `test_kernelbot_backend.py` runs this as
`python kernelbot_backend_check.py SETTINGS_JSON` under a Python that loads a kernelbot checkout
(`KERNELBOT_SRC`) and its requirements, against `kernelkite-service local` and a PostgreSQL
migrated with kernelbot's own migrations. It prints one JSON object with what each scenario
ended as; the test asserts on it.

Nothing of kernelbot is changed: the launcher is registered by running the Python block of
`clients/python/README.md` marked `kernelbot-registration`, the lines a maintainer adds to
kernelbot's `main.py` (its per-user wiring of `submit_full` included), as they are written
there.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SETTINGS = json.loads(sys.argv[1])
sys.path.insert(0, str(Path(os.environ["KERNELBOT_SRC"]) / "src"))

from libkernelbot import consts  # noqa: E402
from libkernelbot.backend import KernelBackend  # noqa: E402
from libkernelbot.background_submission_manager import (  # noqa: E402
    BackgroundSubmissionManager,
    BackgroundSubmissionManagerReporter,
)
from libkernelbot.consts import SubmissionMode  # noqa: E402
from libkernelbot.report import generate_report, make_short_report  # noqa: E402
from libkernelbot.submission import SubmissionRequest, prepare_submission  # noqa: E402
from libkernelbot.task import make_task_definition  # noqa: E402
from readme import readme_block  # noqa: E402  (tests/, on PYTHONPATH)

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "prefixsum_py"
CUDA_EXAMPLE = REPO / "examples" / "vectoradd_cuda"


def make_backend(service_url: str) -> KernelBackend:
    """kernelbot's backend as its main.py makes it, plus the README's lines."""
    env = SimpleNamespace(DATABASE_URL=SETTINGS["database_url"], DISABLE_SSL="1")
    backend = KernelBackend(env, False)
    os.environ["KERNELKITE_URL"] = service_url
    os.environ["KERNELKITE_TOKEN"] = SETTINGS["token"]
    exec(readme_block("kernelbot-registration"), {"backend": backend, "os": os})
    # Which user each run was sent for (the block's user_of, watched, not changed).
    launcher = backend.launcher_map["H100_KK"]
    user_of = launcher.user_of

    def watched(config: dict) -> str | None:
        user = user_of(config)
        USERS.append((config.get("mode"), user))
        return user

    launcher.user_of = watched
    return backend


USERS: list[tuple[str | None, str | None]] = []


def add_leaderboard(backend: KernelBackend, name: str, example: Path, **task_changes) -> None:
    definition = make_task_definition(example)
    for k, v in task_changes.items():
        setattr(definition.task, k, v)
    with backend.db as db:
        db.create_leaderboard(
            name=name,
            deadline=dt.datetime.now(dt.UTC) + dt.timedelta(days=1),
            definition=definition,
            creator_id=1,
            forum_id=1,
            gpu_types=["H100_KK"],
        )


def without_directives(code: str) -> str:
    """The examples name their leaderboard in a `#!POPCORN` header; these leaderboards are
    named by the scenarios."""
    return "".join(line for line in code.splitlines(True) if not line.startswith("#!POPCORN"))


def request(backend, leaderboard: str, code: str, mode: SubmissionMode, name="submission.py"):
    code = without_directives(code)
    req = SubmissionRequest(
        code=code,
        file_name=name,
        user_id=7,
        user_name="competitor",
        gpus=["H100_KK"],
        leaderboard=leaderboard,
    )
    return prepare_submission(req, backend, mode)


def summary(result: Any, mode: SubmissionMode) -> dict[str, Any]:
    full = mode in (SubmissionMode.LEADERBOARD, SubmissionMode.PRIVATE)
    runs = result.runs
    return {
        "success": result.success,
        "error": result.error,
        "short_report": make_short_report(runs, full=full),
        "runs": {
            k: {
                "passed": None if v.run is None else v.run.passed,
                "exit_code": None if v.run is None else v.run.exit_code,
                "duration": None if v.run is None else v.run.duration,
            }
            for k, v in runs.items()
        },
    }


async def run_full(backend, leaderboard: str, code: str, mode: SubmissionMode) -> dict:
    req = request(backend, leaderboard, code, mode)
    sub_id, results = await backend.submit_full(req, mode, BackgroundSubmissionManagerReporter())
    with backend.db as db:
        db.cursor.execute(
            "SELECT mode, secret, passed, score FROM leaderboard.runs WHERE submission_id = %s "
            "ORDER BY secret, mode",
            (sub_id,),
        )
        stored = [list(r) for r in db.cursor.fetchall()]
    return {"results": [summary(r, mode) for r in results], "stored": stored}


async def run_background(backend, leaderboard: str, code: str, mode: SubmissionMode) -> dict:
    """The API's background path: the job's status and error as kernelbot stores them."""
    manager = BackgroundSubmissionManager(backend, min_workers=1, max_workers=1)
    await manager.start()
    try:
        req = request(backend, leaderboard, code, mode)
        with backend.db as db:
            sub_id = db.create_submission(
                leaderboard=leaderboard,
                file_name=req.file_name,
                code=req.code,
                user_id=req.user_id,
                time=dt.datetime.now(dt.UTC),
                user_name=req.user_name,
                mode_category=req.mode_category,
            )
        await manager.enqueue(req, mode, sub_id)
        for _ in range(1200):
            with backend.db as db:
                db.cursor.execute(
                    "SELECT status, error FROM leaderboard.submission_job_status "
                    "WHERE submission_id = %s",
                    (sub_id,),
                )
                status, error = db.cursor.fetchone()
            if status not in ("pending", "running"):
                return {"status": status, "error": error}
            await asyncio.sleep(0.1)
        return {"status": "still running after 120 s", "error": None}
    finally:
        await manager.stop()


async def cuda_without_nvcc(backend) -> dict:
    """A CUDA task on a machine without nvcc, as kernelbot's backend reports it (submission id
    -1: no database write, where kernelbot itself fails on a run that did not start)."""
    definition = make_task_definition(CUDA_EXAMPLE)
    gpu = consts.get_gpu_by_name("H100_KK")
    reporter = BackgroundSubmissionManagerReporter().add_run("H100_KK on Kernelkite")
    result = await backend.handle_submission(
        gpu,
        reporter,
        code=without_directives((CUDA_EXAMPLE / "submission.cu").read_text()),
        name="submission.cu",
        task=definition.task,
        mode=SubmissionMode.TEST,
    )
    report = generate_report(result)
    texts = [str(getattr(d, "text", d)) for d in getattr(report, "data", [])]
    return {**summary(result, SubmissionMode.TEST), "report": texts}


def step(name: str) -> None:
    """Progress on stderr: where a run that hangs got to."""
    print(f"scenario: {name}", file=sys.stderr, flush=True)


async def main() -> None:
    backend = make_backend(SETTINGS["service_url"])
    gpu = consts.get_gpu_by_name("H100_KK")
    out: dict[str, Any] = {
        "registered": {
            "gpu": None if gpu is None else [gpu.name, gpu.value, gpu.runner],
            "arch": backend._get_arch(gpu) if gpu else None,
            "launcher": type(backend.launcher_map.get("H100_KK")).__name__,
        }
    }
    good = (EXAMPLE / "submission.py").read_text()
    wrong = (EXAMPLE / "wrong_submission.py").read_text()
    syntax = "def custom_kernel(data:\n    return data\n"
    sleepy = "import time\n\ndef custom_kernel(data):\n    time.sleep(60)\n    return data\n"
    add_leaderboard(backend, "prefixsum", EXAMPLE)
    add_leaderboard(backend, "prefixsum-fast", EXAMPLE, test_timeout=3)
    add_leaderboard(
        backend,
        "prefixsum-multi",
        EXAMPLE,
        multi_gpu=True,
        tests=[{**t, "world_size": 2} for t in make_task_definition(EXAMPLE).task.tests],
        benchmarks=[{**b, "world_size": 2} for b in make_task_definition(EXAMPLE).task.benchmarks],
    )
    for mode in (SubmissionMode.TEST, SubmissionMode.BENCHMARK, SubmissionMode.LEADERBOARD):
        step(mode.value)
        out[mode.value] = await run_full(backend, "prefixsum", good, mode)
    step("wrong")
    out["wrong"] = await run_full(backend, "prefixsum", wrong, SubmissionMode.TEST)
    step("syntax")
    out["syntax"] = await run_full(backend, "prefixsum", syntax, SubmissionMode.TEST)
    step("timeout")
    out["timeout"] = await run_full(backend, "prefixsum-fast", sleepy, SubmissionMode.TEST)
    step("background_test")
    out["background_test"] = await run_background(backend, "prefixsum", good, SubmissionMode.TEST)
    step("multi_gpu_without_gpu")
    out["multi_gpu_without_gpu"] = await run_background(
        backend, "prefixsum-multi", good, SubmissionMode.TEST
    )
    # Ranked: the public and the secret run both fail on the node; kernelbot's background
    # manager ends the job failed with the reason.
    step("multi_gpu_ranked")
    out["multi_gpu_ranked"] = await run_background(
        backend, "prefixsum-multi", good, SubmissionMode.LEADERBOARD
    )
    if SETTINGS.get("cuda_without_nvcc"):
        step("cuda_without_nvcc")
        out["cuda_without_nvcc"] = await cuda_without_nvcc(backend)
    # The same registration against a service nobody answers on.
    dead = make_backend(SETTINGS["dead_url"])
    step("unreachable")
    out["unreachable"] = await run_background(dead, "prefixsum", good, SubmissionMode.TEST)
    out["users"] = sorted({f"{mode}:{user}" for mode, user in USERS})
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    asyncio.run(main())
