"""The real processes the tests talk to: `kernelkite-service` and the `fake-buildkite`
binary (the testkit crate's fake Buildkite, with a control API), on loopback.

Binaries come from `$KERNELKITE_SERVICE_BIN` / `$KERNELKITE_FAKE_BUILDKITE_BIN`, else from
cargo's target dir (`$CARGO_TARGET_DIR`, else `<repo>/target`) `debug/`; build them with
`cargo build -p kernelkite-service -p kernelkite-testkit --bins`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import httpx

REPO = Path(__file__).resolve().parents[3]
API_TOKEN = "kk-test-token"
WEBHOOK_TOKEN = "whsec-python-tests"


def binary(env_var: str, name: str) -> Path:
    if os.environ.get(env_var):
        path = Path(os.environ[env_var])
    else:
        target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
        path = target / "debug" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: build it with `cargo build -p kernelkite-service "
            f"-p kernelkite-testkit --bins` (or set {env_var})"
        )
    return path


def service_bin() -> Path:
    return binary("KERNELKITE_SERVICE_BIN", "kernelkite-service")


def fake_bin() -> Path:
    return binary("KERNELKITE_FAKE_BUILDKITE_BIN", "fake-buildkite")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_line(proc: subprocess.Popen, within: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], within)
    if not ready:
        raise TimeoutError("no line within the time")
    return proc.stdout.readline().decode()


async def wait_until(check: Callable[[], Any], within: float = 10.0, what: str = "it") -> Any:
    """Polls `check` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {within} s")
        await asyncio.sleep(0.02)


class FakeBuildkite:
    """The `fake-buildkite` process and its control API."""

    def __init__(self, webhook_url: str, log_dir: Path) -> None:
        self._log = open(log_dir / "fake-buildkite.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(fake_bin()),
                "--exit-on-stdin-eof",
                "--webhook-url",
                webhook_url,
                "--webhook-token",
                WEBHOOK_TOKEN,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        try:
            info = json.loads(_read_line(self.proc, 10.0))
        except Exception:
            self.stop()
            raise
        self.api_url: str = info["api_url"]
        self.agent_api_url: str = info["agent_api_url"]
        self.control_url: str = info["control_url"]
        self.org: str = info["org"]
        self.pipeline: str = info["pipeline"]
        self.api_token: str = info["api_token"]
        self.agent_token: str = info["agent_token"]
        self.http = httpx.AsyncClient(base_url=self.control_url, timeout=30.0)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()

    async def aclose(self) -> None:
        await self.http.aclose()
        self.stop()

    async def _post(self, path: str, body: Any) -> Any:
        r = await self.http.post(path, json=body)
        r.raise_for_status()
        return r.json()

    async def builds(self) -> list[dict[str, Any]]:
        return (await self.http.get("/builds")).json()

    async def wait_builds(self, count: int, within: float = 10.0) -> list[dict[str, Any]]:
        r = await self.http.get(
            "/builds/wait", params={"count": count, "timeout_ms": int(within * 1000)}
        )
        assert r.status_code == 200, r.text
        return r.json()

    async def build_for(self, submission_id: str, within: float = 10.0) -> dict[str, Any]:
        """The build the service created for a submission."""

        async def find() -> dict[str, Any] | None:
            for b in await self.builds():
                if b["meta_data"].get("kernelkite_submission_id") == submission_id:
                    return b
            return None

        return await wait_until(find, within, f"a build for {submission_id}")

    async def start(self, number: int) -> None:
        await self._post(f"/builds/{number}/start", {})

    async def finish(
        self, number: int, state: str = "passed", result: str | None = None, **extra: Any
    ) -> None:
        await self._post(f"/builds/{number}/finish", {"state": state, "result": result, **extra})

    async def webhook_mode(self, mode: str, delay_ms: int = 0) -> None:
        await self._post("/webhook-mode", {"mode": mode, "delay_ms": delay_ms})

    async def fault(self, route: str, **fault: Any) -> None:
        await self._post("/faults", {"route": route, **fault})

    async def set_agents(self, agents: list[dict[str, Any]]) -> None:
        await self._post("/agents", agents)

    async def autoplay(self, plan: dict[str, Any] | None) -> None:
        await self._post("/autoplay", plan)

    async def requests(self, route: str | None = None) -> list[dict[str, Any]]:
        reqs = (await self.http.get("/requests")).json()
        return [r for r in reqs if route is None or r["route"] == route]

    async def state(self, number: int) -> str:
        for b in await self.builds():
            if b["number"] == number:
                return b["state"]
        raise KeyError(number)


class Service:
    """A `kernelkite-service` process (restartable on the same port and data dir)."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        port: int,
        log_dir: Path,
    ) -> None:
        self.args = args
        self.env = env
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / "kernelkite-service.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_path, "ab")  # noqa: SIM115
        log.write(f"--- start {self.starts}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [str(service_bin()), *self.args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kernelkite-service exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"kernelkite-service did not answer /healthz:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class Stack:
    """A service against the fake Buildkite, with the webhook pointed back at the service."""

    def __init__(self, tmp: Path, extra_env: dict[str, str] | None = None) -> None:
        port = free_port()
        self.fake = FakeBuildkite(f"http://127.0.0.1:{port}/webhooks/buildkite", tmp)
        data_dir = tmp / "data"
        data_dir.mkdir(exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "RUST_LOG": os.environ.get("RUST_LOG", "info"),
            "BUILDKITE_API_URL": self.fake.api_url,
            "BUILDKITE_AGENT_API_URL": self.fake.agent_api_url,
            "BUILDKITE_ORG": self.fake.org,
            "BUILDKITE_PIPELINE": self.fake.pipeline,
            "BUILDKITE_API_TOKEN": self.fake.api_token,
            "BUILDKITE_WEBHOOK_TOKEN": WEBHOOK_TOKEN,
            "KERNELKITE_LISTEN": f"127.0.0.1:{port}",
            "KERNELKITE_API_TOKEN": API_TOKEN,
            "KERNELKITE_DATA_DIR": str(data_dir),
            "KERNELKITE_RETRY_BASE_MS": "10",
            # The tests send the same sample run again on purpose, to run it again.
            "KERNELKITE_CACHE": "false",
            # The fake lists no agents unless a test sets them: builds are created at once.
            "KERNELKITE_QUEUE_SLOTS": "*=none",
        }
        env.update(extra_env or {})
        self.service = Service([], env, port, tmp)
        try:
            self.service.start()
        except Exception:
            self.fake.stop()
            raise
        self.url = self.service.url
        self.token = API_TOKEN

    async def aclose(self) -> None:
        self.service.stop(signal.SIGKILL)
        await self.fake.aclose()


def local_service(tmp: Path) -> Service:
    """`kernelkite-service serve --executor local` on a free port (not started): the runner
    really runs each job on this machine, unsandboxed and without cgroups (these tests are
    about the client). The run dir is the test's own and the cgroup root an empty directory:
    the node's own (`/run/kernelkite`, its `kernelkite/` cgroups) are for the node's agents,
    and a job left there when a test kills the service would be taken for another instance's
    by every hook after it."""
    port = free_port()
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    no_cgroups = tmp / "no-cgroups"
    no_cgroups.mkdir(exist_ok=True)
    bin_dir = str(service_bin().parent)
    env = {
        # The runner and the isolation hook are found beside the service binary.
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "/usr/bin:/bin")]),
        "RUST_LOG": os.environ.get("RUST_LOG", "info"),
        "KERNELKITE_LISTEN": f"127.0.0.1:{port}",
        "KERNELKITE_API_TOKEN": API_TOKEN,
        "KERNELKITE_DATA_DIR": str(data),
        "KERNELKITE_RUN_DIR": str(tmp / "run"),
        "KERNELKITE_CGROUP_ROOT": str(no_cgroups),
        # `auto` would depend on this machine's users.
        "KERNELKITE_LOCAL_SANDBOX": "off",
        # The tests send the same sample run again on purpose, to run it again.
        "KERNELKITE_CACHE": "false",
    }
    return Service(["serve", "--executor", "local"], env, port, tmp)


def local_mode_supported() -> tuple[bool, str]:
    """Whether this build's service has the local executor (`serve --executor local`)."""
    try:
        out = subprocess.run(
            [str(service_bin()), "serve", "--help"],
            capture_output=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"kernelkite-service serve --help failed: {e}"
    text = (out.stdout + out.stderr).decode(errors="replace")
    if out.returncode == 0 and "--executor" in text:
        return True, ""
    return False, "local mode not available in this build"


class LoopbackServer:
    """A server on a free loopback port; `_handle` serves each connection."""

    port = 0
    _server: asyncio.Server | None = None

    async def start(self) -> Self:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class TcpProxy(LoopbackServer):
    """A loopback TCP proxy in front of the service: it records each connection's request
    head and can cut every open connection, or refuse those whose request matches a text."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.heads: list[str] = []
        self.refuse_containing: str | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        text = head.decode(errors="replace")
        self.heads.append(text)
        if self.refuse_containing and self.refuse_containing in text:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_writer))
        up_writer.write(head)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._open.discard(writer)
        self._open.discard(up_writer)

    def cut(self) -> int:
        """Aborts every open connection (both sides); returns how many pairs were open."""
        n = len(self._open) // 2
        for w in list(self._open):
            w.transport.abort()
        self._open.clear()
        return n

    async def aclose(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
