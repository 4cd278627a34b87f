#!/usr/bin/env bash
# Makes target/kernelbot-venv: a Python >= 3.12 (kernelbot's source needs it) with kernelbot's
# own requirements and httpx, for the client suite's checkout mode
# (clients/python/tests/test_kernelbot_source.py and test_kernelbot_backend.py).
#
#   KERNELBOT_SRC=~/src/kernelbot ./scripts/kernelbot-venv.sh
#   KERNELBOT_SRC=~/src/kernelbot KERNELBOT_PYTHON=target/kernelbot-venv/bin/python ./scripts/test.sh
#
# KERNELBOT_SRC: a gpu-mode/kernelbot checkout (its code is read there, never copied here).
# PYTHON: the interpreter to make the venv with (default: the first python3.13 or python3.12
# on PATH, then pyenv's). Prints the venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."

src=${KERNELBOT_SRC:?set KERNELBOT_SRC to a gpu-mode/kernelbot checkout}
if [ ! -f "$src/pyproject.toml" ] || [ ! -d "$src/src/libkernelbot" ]; then
  echo "KERNELBOT_SRC=$src is not a kernelbot checkout (no pyproject.toml, src/libkernelbot)" >&2
  exit 2
fi

python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python3.13 python3.12 \
    "$HOME"/.pyenv/versions/3.13*/bin/python "$HOME"/.pyenv/versions/3.12*/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 &&
      "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      python=$candidate
      break
    fi
  done
fi
[ -n "$python" ] ||
  { echo "no Python >= 3.12 found (kernelbot's source needs it); set PYTHON=/path/to/python3.12" >&2; exit 2; }

venv=target/kernelbot-venv
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
echo "installing kernelbot's requirements into $venv (from $src/pyproject.toml)..." >&2
# kernelbot itself, with its dependencies as its pyproject.toml lists them; httpx for ours.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$src" httpx
echo "$venv/bin/python"
