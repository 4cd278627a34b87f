"""Sample kernelbot documents: a run config and the result.json a runner writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]


def sample_config(**overrides: Any) -> dict[str, Any]:
    """A valid kernelbot run config (Python, test mode)."""
    config = {
        "lang": "py",
        "mode": "test",
        "main": "eval.py",
        "sources": {"eval.py": "print('hi')\n", "submission.py": "def kernel(x):\n    return x\n"},
        "tests": [{"size": 128, "seed": 1}],
        "benchmarks": [{"size": 4096, "seed": 2}],
        "seed": 42,
        "test_timeout": 60,
    }
    config.update(overrides)
    return config


def example_config(mode: str = "test") -> dict[str, Any]:
    """The repository's bundled CPU-only example task (examples/prefixsum_py), which a local
    executor can run on any machine with python3."""
    example = REPO / "examples" / "prefixsum_py"
    return {
        "lang": "py",
        "mode": mode,
        "sources": {
            name: (example / name).read_text()
            for name in ("eval.py", "reference.py", "submission.py")
        },
        "main": "eval.py",
        "tests": [{"size": 16, "seed": 1}, {"size": 1000, "seed": 2}],
        "benchmarks": [{"size": 1000, "seed": 3}],
        "seed": 4242,
        "ranking_by": "geom",
        "test_timeout": 60,
        "benchmark_timeout": 60,
        "ranked_timeout": 60,
    }


def result_json(*, success: bool = True, error: str = "", naive_times: bool = False) -> str:
    """A result.json as the runner writes it (kernelbot's FullResult, every field)."""
    offset = "" if naive_times else "+00:00"
    return json.dumps(
        {
            "success": success,
            "error": error,
            "system": {
                "gpu": "NVIDIA H100 80GB HBM3",
                "device_count": 1,
                "cpu": "AMD EPYC 9654",
                "runtime": "CUDA",
                "platform": "Linux-6.8.0-x86_64-with-glibc2.39",
                "torch": "2.6.0",
                "hostname": "gpu-node-1",
            },
            "runs": {
                "test": {
                    "start": f"2026-11-22T10:40:00.123456{offset}",
                    "end": f"2026-11-22T10:40:03.654321{offset}",
                    "compilation": None,
                    "run": {
                        "success": success,
                        "passed": success,
                        "command": "python3 eval.py test cases.txt",
                        "stdout": "",
                        "stderr": "" if success else "Traceback: boom",
                        "exit_code": 0 if success else 1,
                        "duration": 3.53,
                        "result": {"check": "pass" if success else "fail", "test-count": "1"},
                    },
                    "profile": None,
                }
            },
        }
    )
