"""Prototype-style baseline for the overhead benchmark: what a Python runner pays per job.

It does what kernelbot's Python runner does around the harness: start an interpreter, import
its modules, decode the payload (base64 → zlib → JSON), gather system info, write the
sources, run the harness with a POPCORN pipe, read it, and write result.json as dataclasses.
Usage: KERNELBOT_PAYLOAD=... python3 prototype_runner.py RESULT_PATH
"""
import base64
import copy  # noqa: F401  (imported by the prototype)
import dataclasses
import datetime
import functools  # noqa: F401
import json
import os
import platform
import shlex
import shutil  # noqa: F401
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path


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


def system_info():
    info = {"gpu": "", "device_count": 1, "cpu": "", "runtime": "", "platform": "", "torch": "", "hostname": ""}
    try:
        import torch  # noqa: F401  (the prototype asks torch first)
        info["torch"] = torch.__version__
    except ImportError:
        pass
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            info["cpu"] = value.strip()
    info["platform"] = platform.platform()
    info["hostname"] = socket.gethostname()
    return info


def run(call, timeout):
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, POPCORN_FD=str(write_fd))
    start = time.perf_counter()
    proc = subprocess.run(call, capture_output=True, text=True, env=env, pass_fds=[write_fd], timeout=timeout)
    duration = time.perf_counter() - start
    os.close(write_fd)
    result = {}
    for line in os.fdopen(read_fd).read().splitlines():
        key, _, value = line.partition(":")
        result[key.strip()] = value.strip()
    return RunResult(proc.returncode in (0, 112), result.get("check") == "pass", shlex.join(call),
                     proc.stdout, proc.stderr, proc.returncode, duration, result)


def main():
    config = json.loads(zlib.decompress(base64.b64decode(os.environ["KERNELBOT_PAYLOAD"])))
    system = system_info()
    workdir = tempfile.mkdtemp()
    os.chdir(workdir)
    for name, text in config["sources"].items():
        Path(name).write_text(text)
    start = datetime.datetime.now()
    with tempfile.NamedTemporaryFile("w") as cases:
        for case in config["tests"]:
            cases.write("; ".join(f"{k}: {v}" for k, v in case.items()) + "\n")
        cases.flush()
        r = run([sys.executable, config["main"], "test", cases.name], config.get("test_timeout", 180))
    runs = {"test": {"start": start.isoformat(), "end": datetime.datetime.now().isoformat(),
                     "compilation": None, "run": dataclasses.asdict(r), "profile": None}}
    with open(sys.argv[1], "w") as f:
        json.dump({"success": True, "error": "", "system": system, "runs": runs}, f)


if __name__ == "__main__":
    main()
