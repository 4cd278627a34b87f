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
  unset KERNELKITE_ISOLATE_BIN
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
        leftovers=\"\$(compgen -v | grep -E '^_kk|^plugin_dir\$|^bin\$|^exports\$'; declare -F | grep -E '_kk_hook|kernelkite_find_binary')\"
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

@test "without a binary, the plugin checkout is built once with cargo --release --locked and cached" {
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
  run env PATH="$STUBS:$BASE_PATH" bash -c "source '$PLUGIN/hooks/pre-exit'"
  [ "$status" -eq 0 ]
  grep -q -- "cargo build --release --locked --quiet --manifest-path $PLUGIN/Cargo.toml --bin kernelkite-isolate" "$CALLS"
  grep -qx "built pre-exit" "$CALLS"
  # Second job: cached, no build.
  : > "$CALLS"
  run env PATH="$STUBS:$BASE_PATH" bash -c "source '$PLUGIN/hooks/command'"
  [ "$status" -eq 0 ]
  [ "$(cat "$CALLS")" = "built command" ]
  # A changed plugin version builds afresh.
  echo '// v2' >> "$PLUGIN/src/main.rs"
  : > "$CALLS"
  run env PATH="$STUBS:$BASE_PATH" bash -c "source '$PLUGIN/hooks/command'"
  grep -q "^cargo build" "$CALLS"
}

@test "a failed build fails the hook and caches nothing" {
  printf '#!/bin/bash\necho "error: could not compile" >&2\nexit 101\n' > "$STUBS/cargo"
  chmod +x "$STUBS/cargo"
  run env PATH="$STUBS:$BASE_PATH" bash -c "source '$PLUGIN/hooks/pre-exit'"
  [ "$status" -ne 0 ]
  [[ "$output" == *"building kernelkite-isolate failed"* ]]
  [ -z "$(find "$KERNELKITE_CACHE_DIR" -name kernelkite-isolate -type f)" ]
}

@test "no binary and no cargo: a clear error" {
  if PATH="$BASE_PATH" command -v cargo >/dev/null; then
    skip "cargo is installed system-wide"
  fi
  run env PATH="$BASE_PATH" bash -c "source '$PLUGIN/hooks/environment'"
  [ "$status" -ne 0 ]
  [[ "$output" == *"install the binary on the agent"* ]]
}
