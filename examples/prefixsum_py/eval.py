"""POPCORN harness of the prefix-sum task: `python3 eval.py <mode> <cases-file>`.

Results go to the file descriptor in $POPCORN_FD as `key: value` lines; the exit code is 0
when every check passed, 112 when one failed (leaderboard runs report a failure in `check`
only), 113 for a cases file it cannot read, 111 without $POPCORN_FD, 2 for a bad command
line. Pure Python: no NumPy, no torch, no GPU.
"""
import base64
import math
import os
import re
import statistics
import sys
import time

from reference import check_implementation, generate_input, ref_kernel

EXIT_PIPE_FAILED = 111
EXIT_VALIDATE_FAIL = 112
EXIT_TEST_SPEC = 113

CASE_PART = re.compile(r"\s*([a-zA-Z_]+):\s*([a-zA-Z]+|[+-]?[0-9]+)\s*")

# Timing: at least MIN_RUNS calls, at most MAX_RUNS, and no more once BUDGET_NS is spent.
MIN_RUNS, MAX_RUNS, BUDGET_NS = 3, 25, 250_000_000


class Output:
    def __init__(self, fd):
        self.f = os.fdopen(fd, "w")

    def put(self, key, value):
        self.f.write(f"{key}: {value}\n")
        self.f.flush()


def read_cases(path):
    """One case per line, `key: value; key: value`; the line itself is the case's spec."""
    cases = []
    with open(path) as f:
        for line in f.read().splitlines():
            args = {}
            for part in line.split(";"):
                m = CASE_PART.fullmatch(part)
                if m is None:
                    print(f"invalid test case: {line!r}: {part!r}", file=sys.stderr)
                    sys.exit(EXIT_TEST_SPEC)
                key, value = m.groups()
                try:
                    value = int(value)
                except ValueError:
                    pass
                args[key] = value
            cases.append((line, args))
    return cases


def ranked_seed(seed, secret):
    """Mixes the run's secret seed into a case's seed (Cantor pairing), so ranked inputs
    cannot be known in advance but stay reproducible for one seed."""
    return secret + (seed + secret) * (seed + secret + 1) // 2


def run_case(custom_kernel, args):
    data = generate_input(**args)
    expected = ref_kernel(data)
    output = custom_kernel(list(data))
    return data, expected, output


def test(out, custom_kernel, cases):
    out.put("test-count", len(cases))
    ok = True
    for i, (spec, args) in enumerate(cases):
        out.put(f"test.{i}.spec", spec)
        try:
            data, expected, output = run_case(custom_kernel, args)
            good, message = check_implementation(data, expected, output)
        except Exception as e:  # the submission's own error is the test's result
            good, message = False, f"{type(e).__name__}: {e}"
        out.put(f"test.{i}.status", "pass" if good else "fail")
        if not good:
            out.put(f"test.{i}.error", message)
            ok = False
    out.put("check", "pass" if ok else "fail")
    return ok


def time_case(custom_kernel, data, expected, recheck):
    times = []
    spent = 0
    while len(times) < MAX_RUNS and (len(times) < MIN_RUNS or spent < BUDGET_NS):
        copy = list(data)
        start = time.perf_counter_ns()
        output = custom_kernel(copy)
        elapsed = time.perf_counter_ns() - start
        if recheck and output != expected:
            return None, "the output changed between runs"
        times.append(elapsed)
        spent += elapsed
    return times, None


def benchmark(out, custom_kernel, cases, ranked):
    secret = int(os.environ.get("POPCORN_SEED", "0")) if ranked else 0
    out.put("benchmark-count", len(cases))
    for i, (spec, args) in enumerate(cases):
        out.put(f"benchmark.{i}.spec", spec)
        if ranked and "seed" in args:
            args = dict(args, seed=ranked_seed(args["seed"], secret))
        try:
            data, expected, output = run_case(custom_kernel, args)
            good, message = check_implementation(data, expected, output)
            times, error = (None, message) if not good else time_case(custom_kernel, data, expected, ranked)
        except Exception as e:
            times, error = None, f"{type(e).__name__}: {e}"
        if times is None:
            out.put(f"benchmark.{i}.status", "fail")
            out.put(f"benchmark.{i}.error", error)
            out.put("check", "fail")
            return False
        mean = statistics.fmean(times)
        std = statistics.stdev(times) if len(times) > 1 else 0.0
        out.put(f"benchmark.{i}.runs", len(times))
        out.put(f"benchmark.{i}.mean", mean)
        out.put(f"benchmark.{i}.std", std)
        out.put(f"benchmark.{i}.err", std / math.sqrt(len(times)))
        out.put(f"benchmark.{i}.best", float(min(times)))
        out.put(f"benchmark.{i}.worst", float(max(times)))
    out.put("check", "pass")
    return True


def profile(out, custom_kernel, cases):
    import cProfile
    import io
    import pstats

    out.put("benchmark-count", len(cases))
    for i, (spec, args) in enumerate(cases):
        out.put(f"benchmark.{i}.spec", spec)
        data = generate_input(**args)
        prof = cProfile.Profile()
        prof.runcall(custom_kernel, list(data))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(10)
        out.put(f"benchmark.{i}.report", base64.b64encode(text.getvalue().encode(), b"+*").decode())
    out.put("check", "pass")
    return True


def main():
    fd = os.environ.get("POPCORN_FD")
    if not fd:
        return EXIT_PIPE_FAILED
    if len(sys.argv) < 3:
        print("usage: eval.py test|benchmark|leaderboard|profile CASES_FILE", file=sys.stderr)
        return 2
    mode, cases_file = sys.argv[1], sys.argv[2]
    cases = read_cases(cases_file)
    out = Output(int(fd))
    from submission import custom_kernel

    if mode == "test":
        return 0 if test(out, custom_kernel, cases) else EXIT_VALIDATE_FAIL
    if mode == "benchmark":
        return 0 if benchmark(out, custom_kernel, cases, ranked=False) else EXIT_VALIDATE_FAIL
    if mode == "leaderboard":
        # As kernelbot's harnesses do: a ranked run reports a failed check, not an exit code.
        benchmark(out, custom_kernel, cases, ranked=True)
        return 0
    if mode == "profile":
        return 0 if profile(out, custom_kernel, cases) else EXIT_VALIDATE_FAIL
    print(f"unknown mode {mode!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
