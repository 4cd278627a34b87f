"""Switching kernelbot to kernelkite without editing kernelbot: the README's registration
block, `register`, `gpu_types` and `submitting_user` against stand-ins of kernelbot's
`consts` and `KernelBackend` (the checkout mode, `test_kernelbot_source.py` and
`test_kernelbot_backend.py`, runs them against kernelbot's own); CUDA include directories as
kernelbot's Modal launcher adds them; the launcher refusing to be a stand-in where kernelbot is
installed without its launchers' requirements."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import subprocess
import sys
import types
import zlib
from enum import Enum
from pathlib import Path

import kernelbot_results
import kernelbot_standins
import pytest
from conftest import make_launcher
from fake_service import FakeService
from kernelbot_standins import TYPES, KiteGPU, RecordingReporter, gpu
from readme import readme_block
from samples import result_json, sample_config
from stack import Stack

from kernelkite.kernelbot_launcher import (
    KernelkiteLauncher,
    gpu_types,
    register,
    submitting_user,
)

SRC = Path(__file__).resolve().parents[1] / "src"


@dataclasses.dataclass
class GPU:
    name: str
    value: str
    runner: str


def fake_consts() -> types.SimpleNamespace:
    """kernelbot's consts.py as far as registration touches it (gpu-mode/kernelbot 4bdd839:
    `_GPU_LOOKUP` keyed by lower-case name, `GPU_TO_SM` by name)."""
    return types.SimpleNamespace(
        GPU=GPU,
        _GPU_LOOKUP={
            "h100": GPU("H100", "H100", "Modal"),
            "mi300": GPU("MI300", "MI300", "GitHub"),
        },
        GPU_TO_SM={"H100": "90a", "MI300": None},
    )


class FakeBackend:
    """`KernelBackend.register_launcher`: every member's value maps to the launcher."""

    def __init__(self) -> None:
        self.launcher_map: dict[str, object] = {}

    def register_launcher(self, launcher) -> None:
        for member in launcher.gpus:
            self.launcher_map[member.value] = launcher


def kk_launcher(gpus) -> KernelkiteLauncher:
    return KernelkiteLauncher(
        "http://127.0.0.1:1", None, gpus, {m: m.name.lower() for m in gpus}, types=TYPES
    )


def test_register_adds_the_gpu_types_and_their_architectures():
    consts, backend = fake_consts(), FakeBackend()
    gpus = gpu_types("KernelkiteGPU", ["H100_KK", "MI300X_KK"])
    assert [(m.name, m.value) for m in gpus] == [("H100_KK", "H100_KK"), ("MI300X_KK", "MI300X_KK")]
    launcher = kk_launcher(gpus)
    register(backend, launcher, arch={"H100_KK": "90a"}, consts=consts)
    assert consts._GPU_LOOKUP["h100_kk"] == GPU("H100_KK", "H100_KK", "Kernelkite")
    assert consts._GPU_LOOKUP["mi300x_kk"].runner == "Kernelkite"
    # -arch=native for a GPU given no architecture (nvcc runs on the GPU machine).
    assert consts.GPU_TO_SM == {"H100": "90a", "MI300": None, "H100_KK": "90a", "MI300X_KK": None}
    assert backend.launcher_map == {"H100_KK": launcher, "MI300X_KK": launcher}
    # Modal's own entries are untouched.
    assert consts._GPU_LOOKUP["h100"].runner == "Modal"


def test_register_refuses_another_launchers_gpu_unless_told_to_replace_it():
    consts, backend = fake_consts(), FakeBackend()
    launcher = kk_launcher(gpu_types("G", ["H100"]))
    with pytest.raises(ValueError, match=r"Modal launcher \(GPU H100\) already serves"):
        register(backend, launcher, consts=consts)
    assert backend.launcher_map == {} and consts._GPU_LOOKUP["h100"].runner == "Modal"
    register(backend, launcher, replace=True, consts=consts)
    assert consts._GPU_LOOKUP["h100"].runner == "Kernelkite"
    assert consts.GPU_TO_SM["H100"] == "90a", "a replaced GPU keeps its architecture"
    with pytest.raises(ValueError, match="does not serve"):
        register(backend, launcher, arch={"B200": "100"}, consts=consts)


def test_register_refuses_a_value_another_launcher_routes_and_names_twice():
    # kernelbot routes runs by the GPU's value: a new name with Modal's value would take
    # Modal's H100 runs while the lookup still says Modal.
    consts, backend = fake_consts(), FakeBackend()
    sneaky = Enum("G", {"H100_KK": "H100"})
    with pytest.raises(ValueError, match=r"Modal launcher \(GPU H100\)"):
        register(backend, kk_launcher(sneaky), consts=consts)
    # A value routed to another launcher the lookup does not know of.
    other = types.SimpleNamespace(name="Other")
    backend.launcher_map["B200_KK"] = other
    with pytest.raises(ValueError, match="Other launcher"):
        register(backend, kk_launcher(gpu_types("G", ["B200_KK"])), consts=consts)
    with pytest.raises(ValueError, match="x1 twice"):
        register(FakeBackend(), kk_launcher(gpu_types("G", ["X1", "x1"])), consts=consts)
    assert backend.launcher_map == {"B200_KK": other}
    assert "h100_kk" not in consts._GPU_LOOKUP and "b200_kk" not in consts._GPU_LOOKUP


@dataclasses.dataclass
class Request:
    """kernelbot's `ProcessedSubmissionRequest`, as far as the launcher's wiring reads it."""

    user_id: int
    gpus: list[str]


class KernelBackend(FakeBackend):
    """kernelbot's `KernelBackend` as far as a submission goes: `submit_full` gathers one run
    per GPU (and for a leaderboard submission its secret run too), each given the run config
    `build_task_config` makes, which names no user."""

    def __init__(self, consts: types.SimpleNamespace) -> None:
        super().__init__()
        self.consts = consts

    async def submit_full(self, req, mode, reporter, pre_sub_id=None, skip_precheck=False):
        runs = []
        for name in req.gpus:
            found = self.consts._GPU_LOOKUP[name.lower()]
            launcher = self.launcher_map[found.value]
            modes = [mode, "private"] if mode == "leaderboard" else [mode]
            runs += [
                launcher.run_submission(sample_config(mode=m), found, RecordingReporter())
                for m in modes
            ]
        return pre_sub_id, await asyncio.gather(*runs)


def kernelbot_modules(consts: types.SimpleNamespace) -> dict[str, types.ModuleType]:
    """Stand-ins of the kernelbot modules the launcher imports inside kernelbot (its consts,
    result dataclasses and `RunnerQueueStatus`), by module name."""
    modules = {
        name: types.ModuleType(name)
        for name in (
            "libkernelbot",
            "libkernelbot.consts",
            "libkernelbot.launchers",
            "libkernelbot.launchers.launcher",
            "libkernelbot.run_eval",
        )
    }
    modules["libkernelbot.consts"].__dict__.update(vars(consts))
    modules["libkernelbot"].consts = modules["libkernelbot.consts"]
    launcher_module = modules["libkernelbot.launchers.launcher"]
    launcher_module.RunnerQueueStatus = kernelbot_standins.RunnerQueueStatus
    results = ("FullResult", "SystemInfo", "EvalResult", "CompileResult", "RunResult")
    for cls in (*results, "ProfileResult"):
        setattr(modules["libkernelbot.run_eval"], cls, getattr(kernelbot_results, cls))
    return modules


async def test_the_readmes_registration_block_registers_and_sends_each_submissions_user(
    monkeypatch: pytest.MonkeyPatch,
):
    """The block as it is in the README, in the namespace kernelbot's `create_backend` gives
    it (`backend`, `os`): the GPU type is kernelbot's, runs go to the service, and each run of
    concurrent submissions (a leaderboard submission: its public and secret run) is sent with
    its submission's user, while runs outside `submit_full` are sent with none."""
    fake = await FakeService().start()
    try:
        fake.on_submit = lambda sub: sub.move("succeeded", result=json.loads(result_json()))
        consts = fake_consts()
        for name, module in kernelbot_modules(consts).items():
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setenv("KERNELKITE_URL", fake.url)
        monkeypatch.setenv("KERNELKITE_TOKEN", fake.token)
        backend = KernelBackend(consts)
        exec(readme_block("kernelbot-registration"), {"backend": backend, "os": os})

        assert consts._GPU_LOOKUP["h100_kk"] == GPU("H100_KK", "H100_KK", "Kernelkite")
        assert consts.GPU_TO_SM["H100_KK"] == "90a"
        launcher = backend.launcher_map["H100_KK"]
        assert isinstance(launcher, KernelkiteLauncher)
        submissions = [Request(user_id=u, gpus=["H100_KK"]) for u in (7, 8)]
        done = await asyncio.wait_for(
            asyncio.gather(*(backend.submit_full(r, "leaderboard", None, 1) for r in submissions)),
            30,
        )
        assert all(result.success for _, results in done for result in results)
        sent = sorted((p["user"], p["config"]["mode"], p["priority"]) for p in fake.posts)
        assert sent == [
            ("7", "leaderboard", "ranked"),
            ("7", "private", "ranked"),
            ("8", "leaderboard", "ranked"),
            ("8", "private", "ranked"),
        ]
        # kernelbot's admin verification runs do not go through submit_full: no user.
        fake.posts.clear()
        await launcher.run_submission(sample_config(), gpu(KiteGPU.H100_KK), RecordingReporter())
        assert "user" not in fake.posts[0]
    finally:
        await fake.aclose()


async def test_submitting_user_wraps_submit_full_once_and_keeps_what_it_returns_and_raises():
    calls = []

    class Backend:
        async def submit_full(self, req, mode, reporter, pre_sub_id=None):
            """kernelbot's docstring."""
            calls.append((req.user_id, mode, pre_sub_id, user_of({})))
            if mode == "boom":
                raise RuntimeError("kernelbot failed")
            return "sub", ["results"]

    backend = Backend()
    user_of = submitting_user(backend)
    assert submitting_user(backend) is user_of, "a second call wraps nothing twice"
    assert backend.submit_full.__doc__ == "kernelbot's docstring."
    assert await backend.submit_full(Request(42, []), "test", None, pre_sub_id=5) == (
        "sub",
        ["results"],
    )
    with pytest.raises(RuntimeError, match="kernelbot failed"):
        await backend.submit_full(Request(43, []), "boom", None)
    assert calls == [(42, "test", 5, "42"), (43, "boom", None, "43")]
    assert user_of({}) is None, "reset after each submission"
    await backend.submit_full(types.SimpleNamespace(user_id=None), "test", None)
    assert calls[-1][-1] is None, "a request without a user sends none"


def payload(build: dict) -> dict:
    env = build["env"]
    if "KERNELBOT_PAYLOAD_CHUNKS" in env:
        n = int(env["KERNELBOT_PAYLOAD_CHUNKS"])
        text = "".join(env[f"KERNELBOT_PAYLOAD_{i}"] for i in range(n))
    else:
        text = env["KERNELBOT_PAYLOAD"]
    return json.loads(zlib.decompress(base64.b64decode(text)))


async def test_cuda_runs_get_the_include_directories_and_the_callers_config_is_left_alone(
    stack: Stack,
):
    await stack.fake.autoplay({"state": "passed", "result": result_json()})
    launcher = make_launcher(
        stack.url, stack.token, cuda_include_dirs=["/opt/ThunderKittens/include"]
    )
    cu = sample_config(lang="cu", sources={"submission.cu": "int main() {}\n"})
    cu["include_dirs"] = ["/opt/task"]
    given = json.loads(json.dumps(cu))
    h100 = gpu(KiteGPU.H100_KK)
    await asyncio.wait_for(launcher.run_submission(cu, h100, RecordingReporter()), 20)
    await asyncio.wait_for(launcher.run_submission(sample_config(), h100, RecordingReporter()), 20)
    builds = await stack.fake.wait_builds(2)
    assert payload(builds[0])["include_dirs"] == ["/opt/task", "/opt/ThunderKittens/include"]
    assert "include_dirs" not in payload(builds[1]), "Python runs get none (as on Modal)"
    assert cu == given, "kernelbot's config dict is not changed"
    with pytest.raises(TypeError):
        make_launcher(stack.url, stack.token, cuda_include_dirs="/opt/x")


def import_launcher(pythonpath: list[Path]) -> subprocess.CompletedProcess:
    """`import kernelkite.kernelbot_launcher` in a fresh interpreter with `pythonpath`."""
    return subprocess.run(
        [sys.executable, "-c", "import kernelkite.kernelbot_launcher"],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, pythonpath))),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_kernelbot_without_its_launchers_requirements_is_an_error_not_a_stand_in(tmp_path):
    # A libkernelbot whose launchers package imports modal, which is not installed.
    pkg = tmp_path / "libkernelbot"
    (pkg / "launchers").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launchers" / "__init__.py").write_text("import modal  # noqa\n")
    out = import_launcher([tmp_path, SRC])
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "modal and PyGithub" in out.stderr, out.stderr
    # Without kernelbot at all, the module loads (stand-in base, injected types).
    out = import_launcher([SRC])
    assert out.returncode == 0, out.stderr
