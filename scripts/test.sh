#!/usr/bin/env bash
# The project's one test command (README "Run the tests"; `.ci/run` calls exactly this).
# It installs what it needs, then runs, in order: formatting, lints, every crate's tests,
# the plugin's bats tests, and each benchmark in its short mode.
#
# Environment:
#   KERNELKITE_SKIP_INSTALL=1  don't touch apt (you installed bats/hwloc/python3 yourself)
#   KERNELKITE_SKIP_BENCH=1    skip the short benchmark runs
set -euo pipefail
cd "$(dirname "$0")/.."

section() { printf '\n--- %s\n' "$*"; }

install_deps() {
  local want=(bats hwloc python3 iproute2 util-linux procps)
  local missing=()
  for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    section "installing ${missing[*]} (apt)"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  if ! command -v cargo >/dev/null; then
    echo "error: cargo is not installed. Install Rust with rustup (https://rustup.rs), then re-run." >&2
    exit 1
  fi
  for comp in clippy rustfmt; do
    if ! cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
      section "installing rustup component $comp"
      rustup component add "$comp"
    fi
  done
}

[ "${KERNELKITE_SKIP_INSTALL:-}" = 1 ] || install_deps

section "cargo fmt --check"
cargo fmt --all --check

section "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

section "cargo test"
cargo test --workspace --locked

section "bats (plugin hook shims)"
bats plugin/tests/bats

if [ "${KERNELKITE_SKIP_BENCH:-}" != 1 ]; then
  section "benchmarks (short mode)"
  KERNELKITE_BENCH_SHORT=1 cargo bench --workspace --locked
fi

section "all checks passed"
