"""A CPU-only POPCORN harness for the runner's tests.

Run as `python3 popcorn_harness.py <mode> <cases-file>`; the first case line's `behave` key
picks what it does, so one harness covers passing, failing, crashing, hanging, daemonizing,
garbage on the pipe and floods of output. Every behaviour first reports what it was given
(mode, seed, GPU count, open descriptors, payload variables, the cases file's exact bytes as
`cases-b64`) so tests can check the runner's side of the protocol; `raw` instead writes the
bytes its case gives (base64) to the pipe and nothing else.
"""
import base64
import os
import subprocess
import sys
import time


def read_cases(path):
    cases = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            case = {}
            for part in line.strip().split(";"):
                key, _, value = part.partition(":")
                case[key.strip()] = value.strip()
            cases.append(case)
    return cases


def spawn_sleeper(pidfile):
    """A plain grandchild in our process group that would outlive us."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pidfile, "w") as f:
        f.write(str(p.pid))


def spawn_daemon(pidfile):
    """A grandchild that escapes the process group: double fork and setsid. It keeps the
    harness's stdout and stderr open, so a runner that waited for EOF would hang."""
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.close(r)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            time.sleep(600)
        os._exit(0)
    os.close(w)
    pid = os.read(r, 32).decode()
    os.close(r)
    with open(pidfile, "w") as f:
        f.write(pid)


def main():
    fd = int(os.environ["POPCORN_FD"])
    out = os.fdopen(fd, "w", buffering=1)
    mode, cases_file = sys.argv[1], sys.argv[2]
    cases = read_cases(cases_file)
    behave = cases[0].get("behave", "pass") if cases else "pass"
    if behave == "raw":
        out.flush()
        data = base64.b64decode(cases[0]["raw"])
        while data:
            data = data[os.write(fd, data):]
        sys.exit(0)
    with open(cases_file, "rb") as f:
        out.write(f"cases-b64: {base64.b64encode(f.read()).decode()}\n")
    out.write(f"mode: {mode}\n")
    out.write(f"cases: {len(cases)}\n")
    out.write(f"last-case: {cases[-1].get('n', '') if cases else ''}\n")
    out.write(f"seed: {os.environ.get('POPCORN_SEED', 'none')}\n")
    out.write(f"gpus: {os.environ.get('POPCORN_GPUS', 'none')}\n")
    out.write(f"popcorn-fd: {fd}\n")
    out.write(f"fds: {','.join(sorted(os.listdir('/proc/self/fd'), key=int))}\n")
    payload_vars = [k for k in os.environ if k.startswith("KERNELBOT_PAYLOAD")]
    out.write(f"payload-vars: {','.join(payload_vars) or 'none'}\n")
    secret_vars = [k for k in os.environ if "TOKEN" in k or "SECRET" in k]
    out.write(f"secret-vars: {','.join(sorted(secret_vars)) or 'none'}\n")
    out.write(f"run-id: {os.environ.get('KERNELBOT_RUN_ID', 'none')}\n")
    out.write(f"cwd-files: {','.join(sorted(os.listdir('.')))}\n")
    print(f"harness {mode} {behave}", flush=True)

    if behave == "pass":
        out.write("check: pass\n")
        sys.exit(0)
    if behave == "fail":
        out.write("check: fail\n")
        sys.exit(112)
    if behave == "crash":
        raise RuntimeError("harness crashed on purpose")
    if behave == "hang":
        spawn_sleeper(cases[0]["pidfile"])
        print("partial output before the hang", flush=True)
        time.sleep(600)
    if behave == "daemon":
        spawn_daemon(cases[0]["pidfile"])
        out.write("check: pass\n")
        if cases[0].get("then") == "hang":
            time.sleep(600)
        sys.exit(0)
    if behave == "garbage":
        out.write("no colon here\n\n   \n: \ncheck: fail\nkey: first\nkey: second\n")
        out.write("value: with: colons\n\x00binary\n")
        out.write("check: pass\n")
        sys.exit(0)
    if behave == "flood":
        block = "".join(f"line {i:07d}\n" for i in range(100_000))
        for _ in range(10):
            sys.stdout.write(block)
        sys.stderr.write("e" * 20_000 + "\n")
        out.write("check: pass\n")
        sys.exit(0)
    if behave == "bench-fail":
        out.write(f"check: {'pass' if mode == 'test' else 'fail'}\n")
        sys.exit(0 if mode == "test" else 112)
    out.write(f"error: unknown behaviour {behave}\n")
    sys.exit(113)


if __name__ == "__main__":
    main()
