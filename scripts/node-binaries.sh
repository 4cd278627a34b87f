#!/usr/bin/env bash
# Builds what a GPU node runs into DIR, ready for `kernelkite-isolate setup --from DIR`:
#   kernelkite-isolate       statically linked (musl): the hooks a job starts three times, with
#                            no dynamic loader to pay at each start (docs/BENCHMARKS.md, issue 10),
#                            and no glibc version to match on the node;
#   kernelkite-isolate-nvml  the ordinary, dynamically linked build: a hook that needs NVML
#                            (`require-idle-gpu`, `lock-clocks`) is handed to it, since a static
#                            binary cannot load libnvidia-ml.so.1 (crates/hooks/src/delegate.rs);
#   kernelkite-runner        the evaluator.
# Adds the musl target with rustup when it is missing (exit status 3 when that cannot be done).
# --static-only builds the first alone (the test command's: its tests need nothing else, and
# each build takes a minute and a half on 2 cores).
# Usage: scripts/node-binaries.sh [--static-only] DIR
set -euo pipefail
cd "$(dirname "$0")/.."

static_only=false
if [ "${1:-}" = --static-only ]; then
  static_only=true
  shift
fi
out=${1:-}
if [ -z "$out" ] || [ "$out" = -h ] || [ "$out" = --help ]; then
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
  [ -n "$out" ]
  exit
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is not installed. Install Rust with rustup (https://rustup.rs), then re-run." >&2
  exit 1
fi
target="$(uname -m)-unknown-linux-musl"
if ! rustc --print target-libdir --target "$target" 2>/dev/null | xargs -r test -d; then
  if ! command -v rustup >/dev/null 2>&1; then
    echo "error: the Rust standard library for $target is not installed, and rustup is not here to add it; install Rust with rustup (https://rustup.rs)" >&2
    exit 3
  fi
  echo "adding the Rust target $target (rustup target add $target)" >&2
  if ! rustup target add "$target"; then
    echo "error: rustup could not add the target $target (offline?)" >&2
    exit 3
  fi
fi
target_dir=${CARGO_TARGET_DIR:-target}
if $static_only; then
  echo "building kernelkite-isolate, static ($target, release; the first build takes a minute or two)" >&2
  cargo build --release --locked --quiet --target "$target" -p kernelkite-isolate --bin kernelkite-isolate
  mkdir -p "$out"
  install -m 0755 "$target_dir/$target/release/kernelkite-isolate" "$out/kernelkite-isolate"
  # The dynamic builds of an earlier run would no longer match the static one: whatever
  # measures DIR (the benchmarks) must not take them for this tree's.
  rm -f "$out/kernelkite-isolate-nvml" "$out/kernelkite-runner"
  echo "wrote $out/kernelkite-isolate (static; the dynamic builds are left out)" >&2
  exit 0
fi
echo "building kernelkite-isolate, static ($target), and kernelkite-isolate-nvml and kernelkite-runner, dynamic (release; the first build takes a few minutes)" >&2
cargo build --release --locked --quiet --target "$target" -p kernelkite-isolate --bin kernelkite-isolate
cargo build --release --locked --quiet -p kernelkite-isolate -p kernelkite-runner --bins
mkdir -p "$out"
install -m 0755 "$target_dir/$target/release/kernelkite-isolate" "$out/kernelkite-isolate"
install -m 0755 "$target_dir/release/kernelkite-isolate" "$out/kernelkite-isolate-nvml"
install -m 0755 "$target_dir/release/kernelkite-runner" "$out/kernelkite-runner"
echo "wrote $out/kernelkite-isolate (static), $out/kernelkite-isolate-nvml and $out/kernelkite-runner; on the node: sudo ./kernelkite-isolate setup --from . ..." >&2
