#!/usr/bin/env bash
# The README's main command: the whole system on this machine, no Buildkite account. Builds
# every binary with the demo profile (`cargo build --profile demo --workspace --bins`: optimised,
# without the release profile's whole-program build, 3 minutes from nothing on 2 cores; the local
# executor runs the runner and the plugin's hooks as the separate binaries a node runs), then
# runs `kernelkite-service demo`: local mode on a loopback port, the bundled example task in
# test, benchmark and leaderboard mode (and a wrong submission, which must fail), each state
# change as it happens, the result table and the time spent in each phase. Exits 0 when every
# submission ended as expected. Arguments go to `demo` (`./scripts/demo.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is not installed. Install Rust with rustup (https://rustup.rs), then re-run." >&2
  exit 1
fi
if ! command -v python3 >/dev/null 2>&1; then
  echo "error: python3 is not installed; the bundled example task needs it (Debian/Ubuntu: apt-get install python3)." >&2
  exit 1
fi
echo "building the binaries: cargo build --profile demo --workspace --bins (about 3 minutes the first time on 2 cores)" >&2
cargo build --profile demo --locked --workspace --bins --quiet
# The test command builds ahead, in the background, and runs the demo later.
[ "${KERNELKITE_DEMO_BUILD_ONLY:-}" != 1 ] || exit 0
# Where cargo put them: a CARGO_TARGET_DIR set in the environment moves the build directory.
exec "${CARGO_TARGET_DIR:-target}/demo/kernelkite-service" demo "$@"
