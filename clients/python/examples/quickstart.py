"""Quickstart: the Python client against a kernelkite service on this machine.

Starts `kernelkite-service local` (the production HTTP API; jobs run on this machine, no
Buildkite account), gets run configs for the bundled example task from `kernelkite-service
submit --print-config`, submits a test and a benchmark run with `KernelkiteClient`, prints
each one's place in the service's queue while it waits and its state changes, then its
result, and stops the service. Exit status 0 when every run passed.

    python3 clients/python/examples/quickstart.py [PATH/TO/kernelkite-service]

The service: the argument, else $KERNELKITE_SERVICE_BIN, else `kernelkite-service` on PATH,
else this checkout's target/release or target/debug (`cargo build --release --workspace
--bins` puts the runner and the job hooks beside it, where local mode finds them).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kernelkite import KernelkiteClient, QueueEvent

REPO = Path(__file__).resolve().parents[3]
TASK = REPO / "examples" / "prefixsum_py"  # a kernelbot task that runs on any CPU
QUEUE = "local"  # local mode runs every queue on this machine; a real service: e.g. "h100"


def service_binary() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    found = os.environ.get("KERNELKITE_SERVICE_BIN") or shutil.which("kernelkite-service")
    built = [REPO / "target" / profile / "kernelkite-service" for profile in ("release", "debug")]
    found = found or next((str(p) for p in built if p.is_file()), None)
    if found is None:
        sys.exit("no kernelkite-service: run `cargo build --release --workspace --bins`")
    return found


def run_config(service: str, mode: str) -> dict:
    """The run config kernelbot's `build_task_config` makes for the task and a submission:
    what a backend sends. The service's CLI builds it the same way."""
    submit = [service, "submit", "--task", TASK, "--submission", TASK / "submission.py"]
    out = subprocess.run(
        [*submit, "--mode", mode, "--print-config"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def start_service(service: str, token: str) -> tuple[subprocess.Popen, str]:
    """`kernelkite-service local` on a free loopback port; its process and URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "KERNELKITE_API_TOKEN": token}  # the bearer token /v1/* asks for
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (the service's stderr, as long as it runs)
    proc = subprocess.Popen(
        [service, "local", "--listen", f"127.0.0.1:{port}"], env=env, stderr=log, text=True
    )
    for _ in range(300):
        if proc.poll() is not None:
            log.seek(0)
            sys.exit(f"kernelkite-service local did not start:\n{log.read()}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    sys.exit("kernelkite-service local did not answer /healthz within 30 s")


async def follow(kite: KernelkiteClient, name: str, sub_id: str) -> bool:
    """Prints the submission's place and state changes as they come, then its result; whether
    every run of it passed."""
    async for event in kite.follow(sub_id):
        if isinstance(event, QueueEvent):  # waiting in the service's queue
            wait = event.estimated_wait_s
            print(f"{name}: number {event.position} in line, about {wait or 0:.0f} s to wait")
        else:
            print(f"{name}: {event.state}")
    submission = event.submission or await kite.get(sub_id)  # the last event carries it
    if submission["state"] != "succeeded":
        print(f"{name}: no result: {submission['error']}")
        return False
    result = submission["result"]  # kernelbot's FullResult, as result.json
    runs = [(key, run.get("run") or {}) for key, run in result["runs"].items()]
    for key, run in runs:
        verdict = "passed" if run.get("passed") else "failed"
        print(f"{name}: result: {key} {verdict} in {run.get('duration', 0):.2f} s")
    return result["success"] and bool(runs) and all(run.get("passed") for _, run in runs)


async def main() -> int:
    service = service_binary()
    configs = {mode: run_config(service, mode) for mode in ("test", "benchmark")}
    token = secrets.token_hex(16)
    proc, url = start_service(service, token)
    try:
        async with KernelkiteClient(url, token) as kite:
            # Both at once: with one slot free, the second waits in the service's queue.
            # cache=False: run it even if the service has the result of an identical run.
            subs = {mode: await kite.submit(c, QUEUE, cache=False) for mode, c in configs.items()}
            passed = await asyncio.gather(
                *(follow(kite, mode, sub["id"]) for mode, sub in subs.items())
            )
    finally:
        proc.terminate()  # SIGTERM: the service stops its jobs and exits
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print("every run passed" if all(passed) else "a run did not pass")
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
