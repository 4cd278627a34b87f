#!/usr/bin/env bats
# The plugin's hook files (hooks/*) as the agent runs them: executed, so the kernel reads their
# first line and runs the binary it names with `plugin-hook` and the file's path.
# Run with: bats plugin/tests/bats

bats_require_minimum_version 1.5.0

INSTALLED=/opt/kernelkite/bin/kernelkite-isolate

setup() {
  PLUGIN_SRC="$(cd "$BATS_TEST_DIRNAME/../.." && pwd)"
  STUBS="$BATS_TEST_TMPDIR/stubs"
  mkdir -p "$STUBS"
  CALLS="$BATS_TEST_TMPDIR/calls"
  export CALLS
}

# A fake kernelkite-isolate that records its arguments and exits with $2.
make_binary() {
  local path="$1" exit_code="${2:-0}"
  # The stub's own text: its variables expand when it runs, not here.
  # shellcheck disable=SC2016
  printf '#!/bin/bash\necho "$*" >> "$CALLS"\nexit %s\n' "$exit_code" > "$path"
  chmod +x "$path"
}

# The plugin's hooks as a node with the binary at $1 runs them: the first line names $1.
plugin_with_binary() {
  local bin="$1" hook
  PLUGIN="$BATS_TEST_TMPDIR/plugin"
  mkdir -p "$PLUGIN/hooks"
  for hook in environment command pre-exit; do
    { printf '#!%s plugin-hook\n' "$bin"; tail -n +2 "$PLUGIN_SRC/hooks/$hook"; } > "$PLUGIN/hooks/$hook"
    chmod +x "$PLUGIN/hooks/$hook"
  done
}

@test "every hook's first line names the installed binary and plugin-hook, and nothing else" {
  for hook in environment command pre-exit; do
    [ -x "$PLUGIN_SRC/hooks/$hook" ]
    [ "$(head -n 1 "$PLUGIN_SRC/hooks/$hook")" = "#!$INSTALLED plugin-hook" ]
    # Only comments follow: nothing else could run, whoever reads the file.
    run grep -cv '^#' "$PLUGIN_SRC/hooks/$hook"
    [ "$output" = "0" ]
  done
}

@test "executed, a hook runs the binary with plugin-hook and its own path" {
  make_binary "$STUBS/kernelkite-isolate"
  plugin_with_binary "$STUBS/kernelkite-isolate"
  for hook in environment command pre-exit; do
    run "$PLUGIN/hooks/$hook"
    [ "$status" -eq 0 ]
  done
  [ "$(cat "$CALLS")" = "plugin-hook $PLUGIN/hooks/environment
plugin-hook $PLUGIN/hooks/command
plugin-hook $PLUGIN/hooks/pre-exit" ]
}

@test "the hook's exit status is the binary's (command: the step's)" {
  make_binary "$STUBS/kernelkite-isolate" 42
  plugin_with_binary "$STUBS/kernelkite-isolate"
  run "$PLUGIN/hooks/command"
  [ "$status" -eq 42 ]
}

@test "without the installed binary the hook fails instead of doing nothing" {
  if [[ -e "$INSTALLED" ]]; then
    skip "$INSTALLED exists on this machine"
  fi
  # bash reports exec's ENOENT as 127; the agent fails the job on any status but 0.
  run -127 "$PLUGIN_SRC/hooks/environment"
  # bash says why: the interpreter the first line names is missing.
  [[ "$output" == *"required file not found"* || "$output" == *"No such file or directory"* ]]
}
