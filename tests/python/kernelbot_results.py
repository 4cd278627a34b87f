"""kernelbot's result dataclasses, as libkernelbot/run_eval.py defines them (gpu-mode/kernelbot
4bdd839): the same fields in the same order with the same defaults.

One copy for every Python test that rebuilds a result.json the way kernelbot does
(`Dataclass(**dict)` on every level): the runner's `rebuild_result.py` and the Python client's
kernelbot stand-ins. The annotations are real types, not strings (no `from __future__ import
annotations`), so a test can check a value against its field's type.
"""
import dataclasses
import datetime
from typing import Optional


@dataclasses.dataclass
class ProfileResult:
    profiler: str
    trace: str
    download_url: Optional[str]


@dataclasses.dataclass
class CompileResult:
    nvcc_found: bool
    nvcc_version: str
    success: bool
    command: str
    stdout: str
    stderr: str
    exit_code: int


@dataclasses.dataclass
class RunResult:
    success: bool
    passed: bool
    command: str
    stdout: str
    stderr: str
    exit_code: int
    duration: float
    result: dict


@dataclasses.dataclass
class SystemInfo:
    gpu: str = ""
    device_count: int = 1
    cpu: str = ""
    runtime: str = ""
    platform: str = ""
    torch: str = ""
    hostname: str = ""


@dataclasses.dataclass
class EvalResult:
    start: datetime.datetime
    end: datetime.datetime
    compilation: Optional[CompileResult]
    run: Optional[RunResult]
    profile: Optional[ProfileResult]


@dataclasses.dataclass
class FullResult:
    success: bool
    error: str
    system: SystemInfo
    runs: dict = dataclasses.field(default_factory=dict)
