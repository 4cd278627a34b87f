#!/usr/bin/env bash
# The project's one test command (README "Run the tests"; `.ci/run` calls exactly this).
# It installs what it needs, then runs, in order: formatting, lints, the API docs, every
# crate's tests, the plugin's bats tests, the unit and integration tests again in a fresh
# clone with nothing beside it, and each benchmark in its short mode. The closing line counts
# passed, failed and skipped tests; a test that could not run here (no root, no GPU, no
# cgroups) is listed with its reason and never counted as passed.
#
# Environment:
#   KERNELKITE_SKIP_INSTALL=1  don't touch apt (you installed bats/hwloc/python3 yourself)
#   KERNELKITE_SKIP_BENCH=1    skip the short benchmark runs
#   KERNELKITE_SKIP_CLONE=1    skip the fresh-clone run (it tests the last commit, not your
#                              uncommitted changes)
set -euo pipefail
cd "$(dirname "$0")/.."

section() { printf '\n--- %s\n' "$*"; }

install_deps() {
  local want=(bats hwloc python3 python3-yaml iproute2 util-linux procps)
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

section "cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet

log=$(mktemp)
# Tests that skip themselves append "<test>\t<reason>" here (kernelkite_testkit::skip).
export KERNELKITE_SKIP_LOG
KERNELKITE_SKIP_LOG=$(mktemp)
clone_dir=""
trap 'rm -rf "$log" "$KERNELKITE_SKIP_LOG" ${clone_dir:+"$clone_dir"}' EXIT

section "cargo test"
cargo test --workspace --locked 2>&1 | tee "$log"

section "bats (plugin hook shims)"
bats plugin/tests/bats 2>&1 | tee -a "$log"

if [ "${KERNELKITE_SKIP_CLONE:-}" != 1 ] && git rev-parse --git-dir >/dev/null 2>&1; then
  # The repository must stand alone: clone it into an empty directory, with nothing beside it,
  # and run the tests there.
  clone_dir=$(mktemp -d)
  section "cargo test in a fresh clone ($(git rev-parse --short HEAD), in $clone_dir/kernelkite)"
  [ -z "$(git status --porcelain)" ] ||
    echo "note: the working tree has uncommitted changes; the clone tests the last commit"
  git clone --quiet --no-hardlinks "$PWD" "$clone_dir/kernelkite"
  # Its own target directory: sharing ours would swap the binaries our tests run. Its counts
  # are not added to the closing line (the same tests ran above); a failure fails the script.
  root=$PWD
  if ! (cd "$clone_dir/kernelkite" &&
    KERNELKITE_SKIP_LOG=/dev/null CARGO_TARGET_DIR="$root/target/fresh-clone" \
      cargo test --workspace --locked >"$clone_dir/log" 2>&1); then
    cat "$clone_dir/log"
    echo "error: the tests fail in a fresh clone but not here: something they need lives outside the repository (or is not committed)" >&2
    exit 1
  fi
  grep -hoE '^test result: .* ([0-9]+) passed' "$clone_dir/log" | grep -oE '[0-9]+ passed' |
    awk '{s+=$1} END {print "fresh clone: " s+0 " passed, 0 failed"}'
elif [ "${KERNELKITE_SKIP_CLONE:-}" != 1 ]; then
  echo "note: not a git checkout; the fresh-clone run is skipped"
fi

if [ "${KERNELKITE_SKIP_BENCH:-}" != 1 ]; then
  section "benchmarks (short mode)"
  # Only the bench targets (each prints its figures beside the baseline it names); the
  # unit tests already ran above.
  KERNELKITE_BENCH_SHORT=1 cargo bench --workspace --locked --bench '*'
fi

# One closing line over every runner above (cargo's per-binary lines, then bats' ok/not ok,
# `# skip` lines being bats' skips). A Rust test that skipped itself reported `ok` to cargo, so
# it is moved from passed to skipped.
passed=$(grep -hoE '^test result: .* ([0-9]+) passed' "$log" | grep -oE '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
failed=$(grep -hoE '[0-9]+ failed;' "$log" | awk '{s+=$1} END {print s+0}')
bats_ok=$(grep -E '^ok [0-9]+' "$log" | grep -cv ' # skip' || true)
bats_skip=$(grep -E '^ok [0-9]+' "$log" | grep -c ' # skip' || true)
bats_bad=$(grep -cE '^not ok [0-9]+' "$log" || true)
rust_skip=$(cut -f1 "$KERNELKITE_SKIP_LOG" | sort -u | wc -l)
skipped=$((rust_skip + bats_skip))
section "all checks passed"
if ((skipped)); then
  echo "skipped (not counted as passed):"
  sort -u -t$'\t' -k1,1 "$KERNELKITE_SKIP_LOG" | awk -F'\t' '{printf "  %s: %s\n", $1, $2}'
  { grep -E '^ok [0-9]+.* # skip' "$log" || true; } | sed -E 's/^ok [0-9]+ /  bats: /'
fi
echo "tests: $((passed - rust_skip + bats_ok)) passed, $((failed + bats_bad)) failed, $skipped skipped"
