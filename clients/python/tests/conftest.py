"""Fixtures: a real kernelkite-service against the fake Buildkite, per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from kernelbot_standins import TYPES, KiteGPU
from stack import Stack

from kernelkite import KernelkiteClient
from kernelkite.kernelbot_launcher import KernelkiteLauncher


@pytest_asyncio.fixture
async def stack(tmp_path) -> AsyncIterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        await s.aclose()


@pytest_asyncio.fixture
async def client(stack: Stack) -> AsyncIterator[KernelkiteClient]:
    async with KernelkiteClient(stack.url, stack.token, request_timeout_s=5.0) as c:
        yield c


def make_launcher(url: str, token: str | None, **kwargs) -> KernelkiteLauncher:
    """A launcher for the test GPU enum, fast to report and to fall back."""
    kwargs.setdefault("request_timeout_s", 5.0)
    kwargs.setdefault("progress_interval_s", 0.2)
    kwargs.setdefault("deadline_s", 60.0)
    kwargs.setdefault("types", TYPES)
    return KernelkiteLauncher(
        url, token, KiteGPU, {KiteGPU.H100_KK: "h100", "B200_KK": "b200"}, **kwargs
    )
