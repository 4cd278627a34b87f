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

log=$(mktemp)
trap 'rm -f "$log"' EXIT

section "cargo test"
cargo test --workspace --locked 2>&1 | tee "$log"

section "bats (plugin hook shims)"
bats plugin/tests/bats 2>&1 | tee -a "$log"

if [ "${KERNELKITE_SKIP_BENCH:-}" != 1 ]; then
  section "benchmarks (short mode)"
  # Only the bench targets (each prints its figures beside the baseline it names); the
  # unit tests already ran above.
  KERNELKITE_BENCH_SHORT=1 cargo bench --workspace --locked --bench '*'
fi

# One closing line over every runner above (cargo's per-binary lines, then bats' ok/not ok).
passed=$(grep -hoE '^test result: .* ([0-9]+) passed' "$log" | grep -oE '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
failed=$(grep -hoE '[0-9]+ failed;' "$log" | awk '{s+=$1} END {print s+0}')
bats_ok=$(grep -cE '^ok [0-9]+' "$log" || true)
bats_bad=$(grep -cE '^not ok [0-9]+' "$log" || true)
section "all checks passed"
echo "tests: $((passed + bats_ok)) passed, $((failed + bats_bad)) failed"
