"""Stand-ins for the kernelbot classes the launcher meets, for tests run without kernelbot.

They mirror kernelbot's own (libkernelbot/run_eval.py, launchers/launcher.py, report.py,
consts.py at gpu-mode/kernelbot 4bdd839): the same dataclass fields in the same order with the
same defaults, and a `RunProgressReporter` with kernelbot's `push`/`update` semantics (`update`
replaces the last line and fails when nothing was pushed). `RecordingReporter` keeps every call.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

from kernelbot_results import (  # the repository's tests/python, on pytest's pythonpath
    CompileResult,
    EvalResult,
    FullResult,
    ProfileResult,
    RunResult,
    SystemInfo,
)

from kernelkite.kernelbot_launcher import KernelbotTypes


@dataclasses.dataclass
class RunnerQueueStatus:
    runner: str
    gpu: str
    queued_jobs: int | None
    running_jobs: int | None = None
    available_runners: int | None = None
    status: str = "available"
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GPU:
    """kernelbot's `consts.GPU`: what the backend hands a launcher."""

    name: str
    value: str
    runner: str


class KiteGPU(Enum):
    """A GPU enum as kernelbot's README asks a deployment to add."""

    H100_KK = "H100_KK"
    B200_KK = "B200_KK"


def gpu(member: KiteGPU) -> GPU:
    return GPU(name=member.name, value=member.value, runner="Kernelkite")


class RunProgressReporter:
    def __init__(self, title: str) -> None:
        self.title = title
        self.lines: list[str] = []

    async def push(self, content: str | list[str]) -> None:
        if isinstance(content, str):
            self.lines.append(f"> {content}")
        else:
            for line in content:
                self.lines.append(f"> {line}")
        await self._update_message()

    async def update(self, new_content: str) -> None:
        self.lines[-1] = f"> {new_content}"
        await self._update_message()

    async def update_title(self, new_title: str) -> None:
        self.title = new_title
        await self._update_message()

    def get_message(self) -> str:
        return "\n".join([f"**{self.title}**", *self.lines])

    async def display_report(self, title: str, report: Any) -> None:
        raise NotImplementedError()

    async def _update_message(self) -> None:
        raise NotImplementedError()


class RecordingReporter(RunProgressReporter):
    """Keeps every `push`/`update` as `(kind, text)`."""

    def __init__(self, title: str = "H100_KK on Kernelkite") -> None:
        super().__init__(title)
        self.calls: list[tuple[str, str]] = []

    async def push(self, content: str | list[str]) -> None:
        self.calls.append(("push", str(content)))
        await super().push(content)

    async def update(self, new_content: str) -> None:
        self.calls.append(("update", new_content))
        await super().update(new_content)

    async def _update_message(self) -> None:
        pass

    def texts(self) -> list[str]:
        return [text for _, text in self.calls]


TYPES = KernelbotTypes(
    FullResult=FullResult,
    SystemInfo=SystemInfo,
    EvalResult=EvalResult,
    CompileResult=CompileResult,
    RunResult=RunResult,
    ProfileResult=ProfileResult,
    RunnerQueueStatus=RunnerQueueStatus,
)
