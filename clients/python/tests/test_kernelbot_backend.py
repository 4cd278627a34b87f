"""kernelbot's own backend code with the launcher (the checkout mode of issue 22): kernelbot's
`KernelBackend.submit_full`, `prepare_submission`, `BackgroundSubmissionManager`, reports and
`LeaderboardDB` on a real PostgreSQL migrated with kernelbot's own migrations, against
`kernelkite-service local` running the bundled CPU task. The launcher is registered with the
README's lines, unchanged (`kernelbot_backend_check.py` runs them).

Needs `KERNELBOT_SRC` (a gpu-mode/kernelbot checkout), `KERNELBOT_PYTHON` (a Python >= 3.12
with kernelbot's requirements and httpx; `scripts/kernelbot-venv.sh` makes one) and PostgreSQL's
`initdb`/`pg_ctl`; skipped with the reason, and counted as skipped, without them.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from stack import API_TOKEN, free_port, local_mode_supported, local_service

HERE = Path(__file__).resolve().parent


def kernelbot() -> tuple[str, str]:
    """(checkout, python), or skip saying what is missing."""
    src = os.environ.get("KERNELBOT_SRC")
    if not src:
        pytest.skip("KERNELBOT_SRC is not set (a gpu-mode/kernelbot checkout runs this test)")
    if not (Path(src) / "src" / "libkernelbot" / "backend.py").is_file():
        pytest.fail(f"KERNELBOT_SRC={src} is not a kernelbot checkout (no src/libkernelbot)")
    python = os.environ.get("KERNELBOT_PYTHON") or sys.executable
    probe = subprocess.run(
        [
            python,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import libkernelbot.backend",
            f"{src}/src",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(
            f"kernelbot's backend does not load with {python} ({last}); set KERNELBOT_PYTHON "
            "to a Python >= 3.12 with kernelbot's requirements (scripts/kernelbot-venv.sh)"
        )
    return src, python


def pg_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


@pytest.fixture
def postgres() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on loopback; its URL."""
    initdb, pg_ctl = pg_tool("initdb"), pg_tool("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL's initdb/pg_ctl are not installed (apt install postgresql)")
    as_user: list[str] = []
    # Not under pytest's temporary directories: they are private to this user, and
    # PostgreSQL runs as its own.
    top = Path(tempfile.mkdtemp(prefix="kernelkite-pg-"))
    data = top / "pg"
    data.mkdir()
    if os.geteuid() == 0:
        # PostgreSQL refuses to run as root: as its own user, where it exists.
        if (
            shutil.which("runuser") is None
            or subprocess.run(["id", "postgres"], capture_output=True, check=False).returncode
        ):
            pytest.skip("running as root without a postgres user to run PostgreSQL as")
        shutil.chown(data, "postgres")
        os.chmod(top, 0o755)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    made = subprocess.run(
        [*as_user, initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    opts = f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(
        [*as_user, pg_ctl, "-D", str(data), "-o", opts, "-w", "-l", str(data / "log"), "start"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(top, ignore_errors=True)


def nvcc_present() -> bool:
    return shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


@pytest.fixture
def kernelbot_db(postgres: str) -> tuple[str, str, str]:
    """(checkout, python, database URL) with kernelbot's own migrations applied."""
    src, python = kernelbot()
    migrate = (
        "import sys\n"
        "from yoyo import get_backend, read_migrations\n"
        "b = get_backend(sys.argv[1]); m = read_migrations(sys.argv[2])\n"
        "with b.lock():\n    b.apply_migrations(b.to_apply(m))\n"
    )
    subprocess.run(
        [python, "-c", migrate, postgres, f"{src}/src/migrations"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return src, python, postgres


async def test_kernelbots_backend_runs_on_kernelkite(
    tmp_path: Path, kernelbot_db: tuple[str, str, str]
):
    src, python, postgres = kernelbot_db
    supported, reason = local_mode_supported()
    if not supported:
        pytest.skip(reason)
    service = local_service(tmp_path)
    service.start()
    # A port bound and never listened on: connections to it are refused, and nothing else can
    # take it meanwhile.
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    try:
        settings = {
            "service_url": service.url,
            "token": API_TOKEN,
            "database_url": postgres,
            "dead_url": f"http://127.0.0.1:{dead.getsockname()[1]}",
            "cuda_without_nvcc": not nvcc_present(),
        }
        env = dict(
            os.environ,
            KERNELBOT_SRC=src,
            PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), str(HERE)]),
        )
        proc = await asyncio.create_subprocess_exec(
            python,
            str(HERE / "kernelbot_backend_check.py"),
            json.dumps(settings),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 300)
        except TimeoutError:
            proc.kill()
            stdout, stderr = await proc.communicate()
            pytest.fail(f"kernelbot's side did not finish in 300 s:\n{stderr.decode()[-6000:]}")
    finally:
        dead.close()
        service.stop(signal.SIGKILL)
    assert proc.returncode == 0, stderr.decode()[-6000:]
    got = json.loads(stdout.decode().strip().splitlines()[-1])

    # Every run through kernelbot's submit_full (its API, background manager) was sent with
    # the submitting user's id (7): the README block's per-user wiring. The CUDA scenario calls
    # handle_submission itself, as kernelbot's verification runs do: no user.
    direct = ["test:None"] if "cuda_without_nvcc" in got else []
    users = got["users"]
    assert users == ["benchmark:7", "leaderboard:7", "private:7", "test:7", *direct], users
    # Registered with the README's lines only.
    assert got["registered"] == {
        "gpu": ["H100_KK", "H100_KK", "Kernelkite"],
        "arch": "90a",
        "launcher": "KernelkiteLauncher",
    }, got["registered"]

    def only(scenario: str) -> dict:
        results = got[scenario]["results"]
        assert len(results) == 1, results
        return results[0]

    # The three modes, scored and stored by kernelbot.
    test = only("test")
    assert test["success"] and test["short_report"] == ["✅ Testing successful"], test
    assert got["test"]["stored"] == [["test", False, True, None]]
    bench = only("benchmark")
    assert bench["success"] and bench["short_report"] == ["✅ Benchmarking successful"], bench
    public, secret = got["leaderboard"]["results"]
    for r in (public, secret):
        assert r["success"] and len(r["short_report"]) == 3, r
        assert all(line.startswith("✅") for line in r["short_report"]), r
    stored = {
        (mode, secret): (passed, score)
        for mode, secret, passed, score in got["leaderboard"]["stored"]
    }
    assert set(stored) == {
        (m, s) for m in ("test", "benchmark", "leaderboard") for s in (False, True)
    }
    assert all(passed for passed, _ in stored.values()), stored
    assert stored[("leaderboard", False)][1] is not None, "the ranked run has a score"

    # The competitor's mistakes are results, reported by kernelbot as its own evaluator's.
    wrong = only("wrong")
    assert wrong["success"] and wrong["short_report"][0].startswith("❌"), wrong
    assert wrong["runs"]["test"]["passed"] is False
    syntax = only("syntax")
    assert syntax["success"] and syntax["short_report"][0].startswith("❌"), syntax
    timeout = only("timeout")
    assert timeout["success"] and "timeout" in " ".join(timeout["short_report"]), timeout
    assert timeout["runs"]["test"]["exit_code"] == 114
    assert timeout["runs"]["test"]["duration"] == 3
    assert isinstance(timeout["runs"]["test"]["duration"], int), "an int, as kernelbot's"

    # The background path: a run is succeeded; failures end failed with the reason.
    assert got["background_test"] == {"status": "succeeded", "error": None}
    multi = got["multi_gpu_without_gpu"]
    assert multi["status"] == "failed" and "not your code" in multi["error"], multi
    assert "multi_gpu" in multi["error"], multi
    ranked = got["multi_gpu_ranked"]
    assert ranked["status"] == "failed" and "not your code" in ranked["error"], ranked
    dead = got["unreachable"]
    assert dead["status"] == "failed" and "could not be reached" in dead["error"], dead
    if "cuda_without_nvcc" in got:
        cuda = got["cuda_without_nvcc"]
        assert cuda["success"], cuda
        assert any("NVCC could not be found" in t for t in cuda["report"]), cuda
