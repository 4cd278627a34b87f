"""The README's runnable code: `examples/quickstart.py` run as written against the real
`kernelkite-service local` (and the README's copy of it equal to the file), and the README's
client example run against local mode. Skipped where the service binary has no local
executor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from readme import readme_block
from stack import API_TOKEN, local_mode_supported, local_service, service_bin

CLIENT = Path(__file__).resolve().parents[1]
QUICKSTART = CLIENT / "examples" / "quickstart.py"


def local_mode() -> None:
    supported, reason = local_mode_supported()
    if not supported:
        pytest.skip(reason)


def script_env(tmp_path: Path) -> dict[str, str]:
    """This environment, with the package importable and local mode kept to the test's own
    directories (as `stack.local_service`: not the node's run dir and cgroups, no sandbox)."""
    no_cgroups = tmp_path / "no-cgroups"
    no_cgroups.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELKITE_")}
    return env | {
        "PYTHONPATH": os.pathsep.join([str(CLIENT / "src"), os.environ.get("PYTHONPATH", "")]),
        "KERNELKITE_RUN_DIR": str(tmp_path / "run"),
        "KERNELKITE_CGROUP_ROOT": str(no_cgroups),
        "KERNELKITE_LOCAL_SANDBOX": "off",
    }


def test_the_readme_shows_the_quickstart_as_it_is():
    assert readme_block("quickstart") == QUICKSTART.read_text()


def test_the_quickstart_runs_as_written(tmp_path: Path):
    local_mode()
    # One slot, whatever this machine's GPUs: the second run waits, so its place is shown.
    env = script_env(tmp_path) | {"KERNELKITE_QUEUE_SLOTS": "local=1"}
    out = subprocess.run(
        [sys.executable, str(QUICKSTART), str(service_bin())],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    lines = out.stdout.splitlines()
    for mode in ("test", "benchmark"):
        mine = [line.removeprefix(f"{mode}: ") for line in lines if line.startswith(f"{mode}: ")]
        states = [line for line in mine if " " not in line]
        assert states == ["queued", "scheduled", "running", "fetching", "succeeded"], mine
        assert any(line.startswith(f"result: {mode} passed in ") for line in mine), mine
    places = [line for line in lines if " in line, about " in line]
    assert places and places[0].startswith("benchmark: number 1 in line, about "), lines
    assert lines[-1] == "every run passed"


def test_the_readmes_client_example_runs(tmp_path: Path):
    local_mode()
    task = CLIENT.parents[1] / "examples" / "prefixsum_py"
    submission = task / "submission.py"
    config = subprocess.run(
        [service_bin(), "submit", "--task", task, "--submission", submission, "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    (tmp_path / "config.json").write_text(config)
    (tmp_path / "example.py").write_text(readme_block("client-example"))
    service = local_service(tmp_path)
    service.start()
    try:
        env = script_env(tmp_path) | {"KERNELKITE_URL": service.url, "KERNELKITE_TOKEN": API_TOKEN}
        out = subprocess.run(
            [sys.executable, "example.py"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        service.stop(signal.SIGKILL)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    lines = out.stdout.splitlines()
    assert lines[-2] == "succeeded True", lines
    assert "'queue': 'h100'" in lines[-1], lines
