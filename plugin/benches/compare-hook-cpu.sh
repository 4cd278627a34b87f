#!/usr/bin/env bash
# Compares the CPU time (perf stat task-clock, the hook and its children) of the three hooks of
# two kernelkite-isolate builds, run as agent-level binary hooks on this machine's real cgroups,
# back to back, in alternating rounds, with the same plan (the DGX H100 fixture's, folded onto
# CPU 0) and the same plugin configuration. Prints the median per hook, per build, per round.
#
#   plugin/benches/compare-hook-cpu.sh OLD_BIN NEW_BIN [JOBS] [ROUNDS]
#
# Needs root (real cgroups), perf and python3. KERNELKITE_SANDBOX (default off) and
# KERNELKITE_CONFIG (default {}) are passed to both builds: a build older than the sandbox
# knows neither `user` nor the sandbox, so compare with the sandbox off.
set -euo pipefail

old=$(realpath "${1:?usage: compare-hook-cpu.sh OLD_BIN NEW_BIN [JOBS] [ROUNDS]}")
new=$(realpath "${2:?usage: compare-hook-cpu.sh OLD_BIN NEW_BIN [JOBS] [ROUNDS]}")
jobs=${3:-20}
rounds=${4:-2}
command -v perf >/dev/null || { echo "perf is not installed (Debian: linux-perf)" >&2; exit 2; }

work=$(mktemp -d /dev/shm/kk-hookcpu.XXXXXX)
# The checkouts live on disk beside the repository, as an agent's builds do.
builds=$(mktemp -d "${TMPDIR:-/var/tmp}/kk-hookcpu-builds.XXXXXX")
trap 'rm -rf "$work" "$builds"' EXIT

"$new" fixture dgx-h100 --out "$work/sys" >/dev/null
"$new" plan --json --sysfs-root "$work/sys" | python3 -c '
import json, sys
plan = json.load(sys.stdin)
for s in plan["slices"]:
    s["cpus"], s["mems"], s["memory_bytes"] = [0], [0], 1 << 30
json.dump(plan, open(sys.argv[1], "w"))' "$work/plan.json"

export BUILDKITE_AGENT_NAME=bench BUILDKITE_COMMAND=true BUILDKITE_SHELL='/bin/bash -e -c'
export BUILDKITE_AGENT_META_DATA_GPU_INDEX=0 KERNELKITE_JOB_PID=$$
export KERNELKITE_RUN_DIR="$work/run" KERNELKITE_CGROUP_ROOT=/ KERNELKITE_PLAN_FILE="$work/plan.json"
export KERNELKITE_SANDBOX="${KERNELKITE_SANDBOX:-off}" KERNELKITE_CONFIG="${KERNELKITE_CONFIG:-{\}}"

# run TAG BIN: JOBS jobs through the three hooks, a perf stat file per hook and job.
run() {
  local tag=$1 bin=$2 i exports
  for ((i = 1; i <= jobs; i++)); do
    export BUILDKITE_JOB_ID="cpu-$tag-$i" BUILDKITE_BUILD_CHECKOUT_PATH="$builds/$tag-$i"
    mkdir -p "$BUILDKITE_BUILD_CHECKOUT_PATH"
    exports=$(cd "$BUILDKITE_BUILD_CHECKOUT_PATH" &&
      perf stat -x, -o "$work/$tag.environment.$i" "$bin" environment --export shell 2>/dev/null) ||
      { echo "$tag: environment failed:" >&2; (cd "$BUILDKITE_BUILD_CHECKOUT_PATH" && "$bin" environment --export shell >/dev/null); exit 1; }
    (
      eval "$exports"
      cd "$BUILDKITE_BUILD_CHECKOUT_PATH"
      perf stat -x, -o "$work/$tag.command.$i" "$bin" command >/dev/null 2>&1
      perf stat -x, -o "$work/$tag.pre-exit.$i" "$bin" pre-exit >/dev/null 2>&1
    )
  done
}

median() { grep -h task-clock "$@" | cut -d, -f1 | sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

echo "hook CPU time (task-clock, ms; median of $jobs jobs), sandbox $KERNELKITE_SANDBOX, config $KERNELKITE_CONFIG"
for ((r = 1; r <= rounds; r++)); do
  for which in old new; do
    bin=$old
    [[ $which == new ]] && bin=$new
    run "$which$r" "$bin"
    printf '%-4s round %d:' "$which" "$r"
    for hook in environment command pre-exit; do
      printf '  %s %s' "$hook" "$(median "$work/$which$r.$hook".*)"
    done
    echo
  done
done
