#!/bin/bash
# Finds the kernelkite-isolate binary for the plugin's hooks, in this order:
#   1. $KERNELKITE_ISOLATE_BIN (must be executable),
#   2. ${KERNELKITE_PREFIX:-/opt/kernelkite}/bin/kernelkite-isolate, where
#      `kernelkite-isolate setup` installs it,
#   3. kernelkite-isolate on PATH.
# A GPU node has no Rust toolchain: without the binary the hook fails with the `setup`
# command that installs it. Developers can opt in to building it from this plugin checkout
# with KERNELKITE_BUILD_FROM_SOURCE=1: `cargo build --release --locked`, once per plugin
# version, cached under $KERNELKITE_CACHE_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/kernelkite).
# `kernelkite_find_binary PLUGIN_DIR VAR` stores the path in the caller's variable VAR (no
# command substitution, so no subshell per hook); on failure prints why on stderr and returns 1.

kernelkite_find_binary() {
  local plugin_dir="$1" into="$2"
  if [[ -n "${KERNELKITE_ISOLATE_BIN:-}" ]]; then
    if [[ -x "$KERNELKITE_ISOLATE_BIN" && ! -d "$KERNELKITE_ISOLATE_BIN" ]]; then
      printf -v "$into" '%s' "$KERNELKITE_ISOLATE_BIN"
      return 0
    fi
    echo "kernelkite: KERNELKITE_ISOLATE_BIN=$KERNELKITE_ISOLATE_BIN is not an executable file" >&2
    return 1
  fi
  local installed="${KERNELKITE_PREFIX:-/opt/kernelkite}/bin/kernelkite-isolate"
  if [[ -x "$installed" && ! -d "$installed" ]]; then
    printf -v "$into" '%s' "$installed"
    return 0
  fi
  local on_path
  if on_path="$(type -P kernelkite-isolate)" && [[ -n "$on_path" ]]; then
    printf -v "$into" '%s' "$on_path"
    return 0
  fi
  if [[ "${KERNELKITE_BUILD_FROM_SOURCE:-}" != 1 ]]; then
    {
      echo "kernelkite: kernelkite-isolate is not installed on this agent (not at $installed, not on PATH, KERNELKITE_ISOLATE_BIN unset)."
      echo "kernelkite: set the node up once, as root, in a directory holding the kernelkite-isolate and kernelkite-runner binaries (a release; deployment/README.md, \"Vendor path\"):"
      echo "kernelkite:   sudo ./kernelkite-isolate setup --from . --queue ${BUILDKITE_AGENT_META_DATA_QUEUE:-QUEUE} --agent-token-file /path/to/agent-token"
      echo "kernelkite: developers: KERNELKITE_BUILD_FROM_SOURCE=1 builds it from this plugin checkout with cargo instead."
    } >&2
    return 1
  fi
  local built
  built="$(kernelkite_build_binary "$plugin_dir")" || return 1
  printf -v "$into" '%s' "$built"
}

# The developers' opt-in: builds this plugin checkout once per version and prints the path.
kernelkite_build_binary() {
  local plugin_dir
  # The developers' path only: a subshell here costs nothing that matters next to cargo.
  plugin_dir="$(cd "$1" && pwd)" || return 1
  local cache="${KERNELKITE_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/kernelkite}"
  local key
  key="$(git -C "$plugin_dir" rev-parse HEAD 2>/dev/null || true)"
  if [[ -z "$key" ]]; then
    # Not a git checkout: key on the sources' content instead.
    key="src-$(cd "$plugin_dir/.." && find plugin/src plugin/Cargo.toml Cargo.lock -type f 2>/dev/null |
      LC_ALL=C sort | xargs cat 2>/dev/null | cksum | cut -d' ' -f1)"
  fi
  local bin="$cache/$key/kernelkite-isolate"
  if [[ -x "$bin" ]]; then
    printf '%s\n' "$bin"
    return 0
  fi
  if ! command -v cargo >/dev/null 2>&1; then
    echo "kernelkite: KERNELKITE_BUILD_FROM_SOURCE=1, but cargo is not installed to build kernelkite-isolate; install Rust (https://rustup.rs) or install the binary with \`kernelkite-isolate setup\`" >&2
    return 1
  fi
  mkdir -p "$cache/$key" || return 1
  echo "kernelkite: building kernelkite-isolate from the plugin checkout (KERNELKITE_BUILD_FROM_SOURCE=1; once per plugin version) into $cache/$key" >&2
  (
    # Agents on one node share the cache: one builds, the others wait for it.
    if command -v flock >/dev/null 2>&1; then
      exec 9>"$cache/$key/.build.lock"
      flock 9
    fi
    if [[ -x "$bin" ]]; then exit 0; fi
    cargo build --release --locked --quiet \
      --manifest-path "$plugin_dir/Cargo.toml" \
      --bin kernelkite-isolate \
      --target-dir "$cache/target" >&2 || exit 1
    cp "$cache/target/release/kernelkite-isolate" "$bin.tmp.$$" && mv -f "$bin.tmp.$$" "$bin"
  ) || {
    echo "kernelkite: building kernelkite-isolate failed (see above)" >&2
    return 1
  }
  printf '%s\n' "$bin"
}
