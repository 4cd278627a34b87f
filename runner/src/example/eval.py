"""Example harness for kernelkite-runner: a CPU-only vector add checked in pure Python.

It speaks kernelbot's POPCORN protocol: `python3 eval.py <mode> <cases-file>`, results as
`key: value` lines on the file descriptor in $POPCORN_FD, exit 0 (all good) or 112
(validation failed).
"""
import math
import os
import random
import sys
import time

from submission import custom_kernel


def reference(a, b):
    return [x + y for x, y in zip(a, b)]


def read_cases(path):
    cases = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            case = {}
            for part in line.split(";"):
                key, _, value = part.partition(":")
                case[key.strip()] = int(value.strip())
            cases.append(case)
    return cases


def make_input(case, extra_seed):
    rng = random.Random(case.get("seed", 0) + extra_seed)
    n = case["size"]
    return [rng.random() for _ in range(n)], [rng.random() for _ in range(n)]


def main():
    out = os.fdopen(int(os.environ["POPCORN_FD"]), "w")
    mode, cases_file = sys.argv[1], sys.argv[2]
    cases = read_cases(cases_file)
    # A secret seed only perturbs ranked runs, so test results stay reproducible.
    extra = int(os.environ.get("POPCORN_SEED", "0")) if mode == "leaderboard" else 0
    ok = True
    if mode == "test":
        out.write(f"test-count: {len(cases)}\n")
        for i, case in enumerate(cases):
            a, b = make_input(case, 0)
            got = custom_kernel(a, b)
            good = len(got) == len(a) and all(math.isclose(g, r) for g, r in zip(got, reference(a, b)))
            out.write(f"test.{i}.spec: size: {case['size']}\n")
            out.write(f"test.{i}.status: {'pass' if good else 'fail'}\n")
            ok = ok and good
    else:
        out.write(f"benchmark-count: {len(cases)}\n")
        for i, case in enumerate(cases):
            a, b = make_input(case, extra)
            if custom_kernel(a, b) != reference(a, b):
                out.write(f"benchmark.{i}.status: fail\n")
                ok = False
                continue
            times = []
            for _ in range(1 if mode == "profile" else 20):
                t = time.perf_counter_ns()
                custom_kernel(a, b)
                times.append(time.perf_counter_ns() - t)
            mean = sum(times) / len(times)
            out.write(f"benchmark.{i}.spec: size: {case['size']}\n")
            out.write(f"benchmark.{i}.runs: {len(times)}\n")
            out.write(f"benchmark.{i}.mean: {mean}\n")
            out.write(f"benchmark.{i}.best: {min(times)}\n")
            out.write(f"benchmark.{i}.worst: {max(times)}\n")
    out.write(f"check: {'pass' if ok else 'fail'}\n")
    out.flush()
    print(f"{mode}: {len(cases)} case(s), {'pass' if ok else 'fail'}")
    sys.exit(0 if ok else 112)


if __name__ == "__main__":
    main()
