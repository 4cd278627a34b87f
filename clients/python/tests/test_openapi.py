"""`service/openapi.json` kept honest: Schemathesis (pinned in requirements-test.txt) runs every
operation of the document the service serves, with every check, against the real service on
loopback. A schema-valid request the service refuses, a status or body the document does not
describe, or a schema-invalid request it accepts fails the test.

Run twice, side by side: without `KERNELKITE_CALLBACK_SECRET` (the served document leaves
`callback_url` out) and with it. The hooks (`openapi_hooks.py`) keep the run config's two
cross-field rules in generated positive cases (see there); no check is left out. What the run
cannot reach: Buildkite's webhook needs a signature no generator can make (401 to every
generated call; its own tests sign), and the ids of GET/cancel/events are mostly unknown to the
generator (404): both are warnings of Schemathesis, not failures.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from stack import Stack

TESTS = Path(__file__).resolve().parent
# Examples per operation and phase: about ten seconds a run here.
MAX_EXAMPLES = "100"


def st_binary() -> str | None:
    here = Path(sys.executable).parent / "st"
    return str(here) if here.is_file() else shutil.which("st")


async def test_the_service_does_what_its_openapi_document_says(tmp_path: Path) -> None:
    st = st_binary()
    if st is None:
        pytest.skip("schemathesis is not installed (pip install -r requirements-test.txt)")
    # Both configurations at once, each against its own service: a run mostly waits (on the
    # long-polls and event streams of its stateful phase), so side by side they take about the
    # time of one (76 s one after the other here, 54 s side by side, 2 CPUs; 29 s with the caps
    # below at 1 s and 2 s instead of 2 s and 3 s).
    plain, callbacks = tmp_path / "plain", tmp_path / "callbacks"
    plain.mkdir()
    callbacks.mkdir()
    await asyncio.gather(
        run_schemathesis(st, plain, None),
        run_schemathesis(st, callbacks, "callback-secret"),
    )


async def run_schemathesis(st: str, tmp_path: Path, callback_secret: str | None) -> None:
    """Every operation and check against a service started in `tmp_path`, with
    `callback_secret` (callbacks on) or without; fails, naming the configuration, on any
    finding."""
    label = "callbacks" if callback_secret else "plain"
    # Every check runs, the stateful phase included: it creates submissions and reads them
    # with long-polls and event streams, which hold a request until the submission ends. So
    # the service caps each (a wait at 1 s, a submission at 2 s: then it times out and its
    # stream ends), and Schemathesis waits longer than that for an answer.
    extra = {
        "KERNELKITE_MAX_WAIT_S": "1",
        "KERNELKITE_MAX_TIMEOUT_S": "2",
        "KERNELKITE_DEFAULT_TIMEOUT_S": "2",
    }
    if callback_secret:
        extra["KERNELKITE_CALLBACK_SECRET"] = callback_secret
    stack = Stack(tmp_path, extra)
    try:
        # The served document (this configuration's limits), from a file: loaded from the
        # service's URL, Schemathesis would leave out the operation that serves it.
        async with httpx.AsyncClient(timeout=10) as http:
            doc = (await http.get(f"{stack.url}/openapi.json")).json()
        operations = sum(
            1 for item in doc["paths"].values() for m in item if m in ("get", "post", "delete")
        )
        schema = tmp_path / "openapi.json"
        schema.write_text(json.dumps(doc))
        if callback_secret is None:
            assert "callback_url" not in doc["components"]["schemas"]["SubmitRequest"]["properties"]
        env = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "openapi_hooks",
            "PYTHONPATH": str(TESTS),
        }
        proc = await asyncio.create_subprocess_exec(
            st,
            "run",
            str(schema),
            "--url",
            stack.url,
            "--header",
            f"Authorization: Bearer {stack.token}",
            "--checks",
            "all",
            "--max-examples",
            MAX_EXAMPLES,
            "--request-timeout",
            "15",
            "--no-color",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
        except TimeoutError:
            proc.kill()
            raise
    finally:
        await stack.aclose()
    out = output.decode(errors="replace")
    assert proc.returncode == 0, f"{label}:\n{out[-12000:]}"
    assert re.search(rf"Operations:\s+{operations} selected / {operations} total", out), (
        f"{label}:\n{out[-4000:]}"
    )
    for phase in ("Examples", "Coverage", "Fuzzing", "Stateful"):
        assert re.search(rf"✅\s+{phase}", out), (
            f"{label}: phase {phase} did not pass:\n{out[-4000:]}"
        )
