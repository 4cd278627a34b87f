#!/usr/bin/env bats
# The plugin's shell shims (hooks/*): how they find kernelkite-isolate and what they hand it.
# Run with: bats plugin/tests/bats

setup() {
  PLUGIN_SRC="$(cd "$BATS_TEST_DIRNAME/../.." && pwd)"
  # A copy of the plugin outside any git checkout, so the build cache key is the sources'.
  PLUGIN="$BATS_TEST_TMPDIR/plugin"
  mkdir -p "$PLUGIN"
  cp -r "$PLUGIN_SRC/hooks" "$PLUGIN_SRC/lib" "$PLUGIN_SRC/plugin.yml" "$PLUGIN/"
  mkdir -p "$PLUGIN/src" && echo 'fn main() {}' > "$PLUGIN/src/main.rs"
  echo '[package]' > "$PLUGIN/Cargo.toml"
  STUBS="$BATS_TEST_TMPDIR/stubs"
  mkdir -p "$STUBS"
  CALLS="$BATS_TEST_TMPDIR/calls"
  export CALLS
  export KERNELKITE_CACHE_DIR="$BATS_TEST_TMPDIR/cache"
  # Where `setup` installs the binary; empty unless a test puts one there.
  export KERNELKITE_PREFIX="$BATS_TEST_TMPDIR/opt/kernelkite"
  unset KERNELKITE_ISOLATE_BIN KERNELKITE_BUILD_FROM_SOURCE BUILDKITE_AGENT_META_DATA_QUEUE
  BASE_PATH="/usr/local/bin:/usr/bin:/bin"
}

# A fake kernelkite-isolate: records its arguments, prints exports for `environment`.
make_binary() {
  local path="$1" exit_code="${2:-0}"
  cat > "$path" <<STUB
#!/bin/bash
echo "\$*" >> "\$CALLS"
if [[ "\$1" == environment ]]; then
  [[ $exit_code == 0 ]] || { echo "plugin configuration is invalid: gpu: unknown key" >&2; exit $exit_code; }
  echo "export KERNELBOT_GPU_INDEX='3'"
  echo "export KERNELKITE_SLICE='{\"index\":3,\"note\":\"it'\\''s quoted\"}'"
  exit 0
fi
exit $exit_code
STUB
  chmod +x "$path"
}

@test "environment: exports from KERNELKITE_ISOLATE_BIN reach the sourcing shell" {
  make_binary "$STUBS/kk"
  run env PATH="$BASE_PATH" KERNELKITE_ISOLATE_BIN="$STUBS/kk" bash -c \
    "source '$PLUGIN/hooks/environment' && echo \"gpu=\$KERNELBOT_GPU_INDEX slice=\$KERNELKITE_SLICE\""
  [ "$status" -eq 0 ]
  [[ "$output" == *"gpu=3 slice={\"index\":3,\"note\":\"it's quoted\"}"* ]]
  [ "$(cat "$CALLS")" = "environment --export shell" ]
}

@test "environment: the shim leaves no helper variables behind" {
  make_binary "$STUBS/kk"
  run env PATH="$BASE_PATH" KERNELKITE_ISOLATE_BIN="$STUBS/kk" bash -c \
    "source '$PLUGIN/hooks/environment' && compgen -v | grep '^_kk_' || echo clean"
  [ "$status" -eq 0 ]
  [ "$output" = "clean" ]
}

@test "environment: a failing binary fails the hook with its message and exports nothing" {
  make_binary "$STUBS/kk" 1
  # The agent's wrapper sources the hook and reads its status from `$?`.
  run env PATH="$BASE_PATH" KERNELKITE_ISOLATE_BIN="$STUBS/kk" bash -c \
    "source '$PLUGIN/hooks/environment'; s=\$?; echo \"after gpu=\${KERNELBOT_GPU_INDEX:-none}\"; exit \$s"
  [ "$status" -eq 1 ]
  [[ "$output" == *"unknown key"* ]]
  [[ "$output" == *"after gpu=none"* ]]
}

@test "sourced hooks leave the shell's options, variables and functions as they were" {
  make_binary "$STUBS/kk"
  make_binary "$STUBS/kk-fails" 7
  for hook in environment command pre-exit; do
    for bin in kk kk-fails; do
      run env PATH="$BASE_PATH" KERNELKITE_ISOLATE_BIN="$STUBS/$bin" bash -c "
        before=\"\$(set +o; shopt -p)\"
        source '$PLUGIN/hooks/$hook'
        s=\$?
        after=\"\$(set +o; shopt -p)\"
        [[ \"\$before\" == \"\$after\" ]] || { echo \"options changed: \$(diff <(echo \"\$before\") <(echo \"\$after\"))\"; exit 99; }
        leftovers=\"\$(compgen -v | grep -E '^_kk|^plugin_dir\$|^bin\$|^exports\$'; declare -F | grep -E '_kk_hook|kernelkite_')\"
        [[ -z \"\$leftovers\" ]] || { echo \"left behind: \$leftovers\"; exit 98; }
        echo \"status=\$s\""
      [ "$status" -eq 0 ]
      if [[ $bin == kk ]]; then
        [[ "$output" == *"status=0"* ]]
      else
        [[ "$output" == *"status=7"* ]]
      fi
    done
  done
}

@test "an executed (not sourced) hook exits with the binary's status" {
  make_binary "$STUBS/kk" 5
  run env PATH="$BASE_PATH" KERNELKITE_ISOLATE_BIN="$STUBS/kk" "$PLUGIN/hooks/pre-exit"
  [ "$status" -eq 5 ]
}

@test "KERNELKITE_ISOLATE_BIN that is not executable is an error, not a fallback" {
  touch "$STUBS/not-exec"
  make_binary "$STUBS/kernelkite-isolate"
  run env PATH="$STUBS:$BASE_PATH" KERNELKITE_ISOLATE_BIN="$STUBS/not-exec" bash -c "source '$PLUGIN/hooks/environment'"
  [ "$status" -ne 0 ]
  [[ "$output" == *"is not an executable file"* ]]
  [ ! -e "$CALLS" ]
}

@test "the binary is found on PATH" {
  make_binary "$STUBS/kernelkite-isolate"
  run env PATH="$STUBS:$BASE_PATH" bash -c "source '$PLUGIN/hooks/pre-exit'"
  [ "$status" -eq 0 ]
  [ "$(cat "$CALLS")" = "pre-exit" ]
}

@test "command: the step's exit code is the hook's" {
  make_binary "$STUBS/kernelkite-isolate" 42
  run env PATH="$STUBS:$BASE_PATH" bash -c "source '$PLUGIN/hooks/command'"
  [ "$status" -eq 42 ]
  [ "$(cat "$CALLS")" = "command" ]
}

# A stub cargo that records its arguments and "builds" a binary recording how it is called.
make_cargo() {
  cat > "$STUBS/cargo" <<'STUB'
#!/bin/bash
echo "cargo $*" >> "$CALLS"
target=""
while [[ $# -gt 0 ]]; do
  if [[ "$1" == --target-dir ]]; then target="$2"; shift; fi
  shift
done
mkdir -p "$target/release"
cat > "$target/release/kernelkite-isolate" <<'BIN'
#!/bin/bash
echo "built $*" >> "$CALLS"
BIN
chmod +x "$target/release/kernelkite-isolate"
STUB
  chmod +x "$STUBS/cargo"
}

@test "the binary setup installs is used before PATH" {
  make_binary "$STUBS/kernelkite-isolate"
  mkdir -p "$KERNELKITE_PREFIX/bin"
  cat > "$KERNELKITE_PREFIX/bin/kernelkite-isolate" <<'STUB'
#!/bin/bash
echo "installed $*" >> "$CALLS"
STUB
  chmod +x "$KERNELKITE_PREFIX/bin/kernelkite-isolate"
  run env PATH="$STUBS:$BASE_PATH" bash -c "source '$PLUGIN/hooks/pre-exit'"
  [ "$status" -eq 0 ]
  [ "$(cat "$CALLS")" = "installed pre-exit" ]
}

@test "without a binary the hook fails with the setup command to run, and builds nothing" {
  make_cargo
  run env PATH="$STUBS:$BASE_PATH" BUILDKITE_AGENT_META_DATA_QUEUE=h100 bash -c "source '$PLUGIN/hooks/environment'"
  [ "$status" -eq 1 ]
  [[ "$output" == *"kernelkite-isolate is not installed on this agent (not at $KERNELKITE_PREFIX/bin/kernelkite-isolate, not on PATH"* ]]
  [[ "$output" == *"sudo ./kernelkite-isolate setup --from . --queue h100 --agent-token-file /path/to/agent-token"* ]]
  [[ "$output" == *"KERNELKITE_BUILD_FROM_SOURCE=1"* ]]
  # cargo is on PATH, yet the node does not build: that is a developer's opt-in.
  [ ! -e "$CALLS" ]
  [ -z "$(find "$KERNELKITE_CACHE_DIR" -type f 2>/dev/null)" ]
  # Executed (agent-level) rather than sourced: the same message and status.
  run env PATH="$STUBS:$BASE_PATH" "$PLUGIN/hooks/pre-exit"
  [ "$status" -eq 1 ]
  [[ "$output" == *"--queue QUEUE"* ]]
}

@test "KERNELKITE_BUILD_FROM_SOURCE=1 builds the plugin checkout once with cargo --release --locked and caches it" {
  make_cargo
  run env PATH="$STUBS:$BASE_PATH" KERNELKITE_BUILD_FROM_SOURCE=1 bash -c "source '$PLUGIN/hooks/pre-exit'"
  [ "$status" -eq 0 ]
  grep -q -- "cargo build --release --locked --quiet --manifest-path $PLUGIN/Cargo.toml --bin kernelkite-isolate" "$CALLS"
  grep -qx "built pre-exit" "$CALLS"
  # Second job: cached, no build.
  : > "$CALLS"
  run env PATH="$STUBS:$BASE_PATH" KERNELKITE_BUILD_FROM_SOURCE=1 bash -c "source '$PLUGIN/hooks/command'"
  [ "$status" -eq 0 ]
  [ "$(cat "$CALLS")" = "built command" ]
  # A changed plugin version builds afresh.
  echo '// v2' >> "$PLUGIN/src/main.rs"
  : > "$CALLS"
  run env PATH="$STUBS:$BASE_PATH" KERNELKITE_BUILD_FROM_SOURCE=1 bash -c "source '$PLUGIN/hooks/command'"
  grep -q "^cargo build" "$CALLS"
}

@test "a failed build fails the hook and caches nothing" {
  printf '#!/bin/bash\necho "error: could not compile" >&2\nexit 101\n' > "$STUBS/cargo"
  chmod +x "$STUBS/cargo"
  run env PATH="$STUBS:$BASE_PATH" KERNELKITE_BUILD_FROM_SOURCE=1 bash -c "source '$PLUGIN/hooks/pre-exit'"
  [ "$status" -ne 0 ]
  [[ "$output" == *"building kernelkite-isolate failed"* ]]
  [ -z "$(find "$KERNELKITE_CACHE_DIR" -name kernelkite-isolate -type f)" ]
}

@test "building from source without cargo: a clear error" {
  # A PATH with bash and the basic tools but certainly no cargo.
  mkdir -p "$BATS_TEST_TMPDIR/nocargo"
  for t in bash git find sort xargs cat cksum cut mkdir dirname; do
    p="$(command -v "$t")" && ln -s "$p" "$BATS_TEST_TMPDIR/nocargo/$t"
  done
  run env PATH="$BATS_TEST_TMPDIR/nocargo" KERNELKITE_BUILD_FROM_SOURCE=1 bash -c "source '$PLUGIN/hooks/environment'"
  [ "$status" -ne 0 ]
  [[ "$output" == *"KERNELKITE_BUILD_FROM_SOURCE=1, but cargo is not installed"* ]]
}
