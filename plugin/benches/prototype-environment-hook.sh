#!/usr/bin/env bash
# Reconstruction of the Python prototype's agent `environment` hook, kept as the baseline that
# `kernelkite-isolate plan` is measured against (benches/plan.rs) and as the behaviour its tests
# show to be wrong: CPUs split as contiguous ranges gpu*N..gpu*N+N-1 (on a 2-socket SMT machine
# that hands a job another job's hyper-thread siblings and the far socket's cores) and memory as
# MemTotal/GPUs with nothing kept for the host. Nothing here was ever enforced: the variables are
# only exported.
#
# The GPU index comes from the agent name's trailing number (`--spawn N` names agents `...-%spawn`).
# Sourced by the agent; run directly it prints the exports. KERNELKITE_PROTO_ROOT prefixes
# /proc/meminfo so tests can point it at a fake tree.
set -euo pipefail

name="${BUILDKITE_AGENT_NAME:-agent-0}"
gpu_index="${name##*[!0-9]}"
gpu_index="${gpu_index:-0}"

num_gpus="$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)"
if [ "$num_gpus" -eq 0 ]; then
  echo "no GPUs found by nvidia-smi" >&2
  exit 1
fi
cpus_total="$(nproc)"
cpus_per_gpu=$((cpus_total / num_gpus))
cpu_start=$((gpu_index * cpus_per_gpu))
cpu_end=$((cpu_start + cpus_per_gpu - 1))
mem_kb="$(awk '/^MemTotal:/ {print $2}' "${KERNELKITE_PROTO_ROOT:-}/proc/meminfo")"
mem_per_gpu_gb=$((mem_kb / num_gpus / 1024 / 1024))

export KERNELBOT_GPU_INDEX="$gpu_index"
export CUDA_VISIBLE_DEVICES="$gpu_index"
export KERNELBOT_CPUSET="${cpu_start}-${cpu_end}"
export KERNELBOT_MEMORY="${mem_per_gpu_gb}g"

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  for v in KERNELBOT_GPU_INDEX CUDA_VISIBLE_DEVICES KERNELBOT_CPUSET KERNELBOT_MEMORY; do
    printf 'export %s=%s\n' "$v" "${!v}"
  done
fi
