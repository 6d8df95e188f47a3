#!/usr/bin/env bash
# One command for the day a GPU is lent: throughput and MFU of the training step (compiled and not), peak memory, a
# 100-step compiled training smoke, and a single-GPU NCCL torchrun. JSON lines on stdout and in $OUT/gpu_check.jsonl
# when OUT is set. Needs torch and this repository only. `--dry-run`: tiny shapes on the CPU (what CI runs).
#   benchmarks/gpu_check.sh              # on a CUDA machine, under 5 minutes on one H200
#   benchmarks/gpu_check.sh --dry-run    # anywhere
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m benchmarks.gpu_check "$@"
