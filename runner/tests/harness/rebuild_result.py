"""Rebuilds result.json the way kernelbot's launcher does: `Dataclass(**dict)` on every level.

The dataclasses follow DESIGN.md (kernelbot's run_eval.py, SystemInfo with hostname,
ProfileResult with trace); they are tests/python/kernelbot_results.py. A missing or extra field raises TypeError; this script then
exits 1 with the message. Usage: python3 rebuild_result.py result.json [...]
"""
import dataclasses
import datetime
import json
import os
import sys

# The dataclasses live once, in the repository's tests/python.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "python"))
from kernelbot_results import (  # noqa: E402
    CompileResult,
    EvalResult,
    FullResult,
    ProfileResult,
    RunResult,
    SystemInfo,
)


def check_types(obj):
    """Types kernelbot's code relies on, beyond the field names."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        want = {bool: bool, int: int, float: (int, float), str: str, dict: dict}.get(f.type)
        if want is not None and not isinstance(v, want):
            raise TypeError(f"{type(obj).__name__}.{f.name} is {type(v).__name__}, expected {f.type}")
        if want is int and isinstance(v, bool):
            raise TypeError(f"{type(obj).__name__}.{f.name} is bool, expected int")


def exact(cls, d):
    """kernelbot's Dataclass(**d) tolerates missing fields that have defaults; the contract
    does not, so the key sets must match exactly."""
    names = {f.name for f in dataclasses.fields(cls)}
    if set(d) != names:
        raise TypeError(f"{cls.__name__}: missing {sorted(names - set(d))}, extra {sorted(set(d) - names)}")


def rebuild(data):
    exact(FullResult, data)
    exact(SystemInfo, data["system"])
    runs = {}
    for name, r in data["runs"].items():
        r = dict(r)
        exact(EvalResult, r)
        for key, cls in (("compilation", CompileResult), ("run", RunResult), ("profile", ProfileResult)):
            if r[key] is not None:
                exact(cls, r[key])
        r["start"] = datetime.datetime.fromisoformat(r["start"])
        r["end"] = datetime.datetime.fromisoformat(r["end"])
        if r["compilation"] is not None:
            r["compilation"] = CompileResult(**r["compilation"])
            check_types(r["compilation"])
        if r["run"] is not None:
            r["run"] = RunResult(**r["run"])
            check_types(r["run"])
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in r["run"].result.items())
        if r["profile"] is not None:
            r["profile"] = ProfileResult(**r["profile"])
        runs[name] = EvalResult(**r)
        assert runs[name].start <= runs[name].end, f"{name}: start after end"
    system = SystemInfo(**data["system"])
    check_types(system)
    full = FullResult(**{**data, "system": system, "runs": runs})
    check_types(full)
    return full


def main():
    for path in sys.argv[1:]:
        with open(path) as f:
            data = json.load(f)
        try:
            full = rebuild(data)
        except (TypeError, AssertionError, ValueError, KeyError) as e:
            print(f"{path}: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
        print(f"{path}: ok, success={full.success}, runs={list(full.runs)}")


if __name__ == "__main__":
    main()
