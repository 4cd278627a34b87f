#!/usr/bin/env bash
# Builds the real Buildkite agent the tests run (tests/buildkite-agent/go.mod: v3.137.0, from
# the Go module proxy) into target/buildkite-agent/<version>/buildkite-agent, once; prints its
# path. Needs Go 1.26.5 or later. Fails loudly: the real-agent tests must not pass by skipping
# on a machine that was meant to run them.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's|^require github.com/buildkite/agent/v3 \(v[0-9.]*\)$|\1|p' tests/buildkite-agent/go.mod)
out="${CARGO_TARGET_DIR:-$PWD/target}/buildkite-agent/$version/buildkite-agent"
if [ ! -x "$out" ]; then
  if ! command -v go >/dev/null 2>&1; then
    echo "error: go is not installed; the real Buildkite agent ($version) is built with it (https://go.dev/dl, 1.26.5 or later)" >&2
    exit 1
  fi
  echo "building buildkite-agent $version (go build; the first build takes about two minutes)" >&2
  mkdir -p "$(dirname "$out")"
  (cd tests/buildkite-agent && go build -mod=readonly -trimpath -o "$out.tmp" github.com/buildkite/agent/v3) || {
    echo "error: cannot build buildkite-agent $version from tests/buildkite-agent/go.mod (is the Go module proxy reachable?)" >&2
    exit 1
  }
  mv "$out.tmp" "$out"
fi
echo "$out"
