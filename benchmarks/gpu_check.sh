#!/usr/bin/env bash
# For the day a GPU is lent: throughput, MFU and memory of the training step and its variants, a profile by part, a
# 100-step compiled training smoke, and a single-GPU NCCL torchrun, in phases of under 4 minutes each. JSON lines on
# stdout and in $OUT/gpu_check.jsonl when OUT is set. Needs torch and this repository only.
#   benchmarks/gpu_check.sh --list                       # the phases and their expected time
#   benchmarks/gpu_check.sh --phase throughput profile  # on a CUDA machine, some phases (default: all, ~22 min)
#   for p in profile heads regularisers attention; do timeout -k 20 240 benchmarks/gpu_check.sh --phase $p; done
#                                                        # each phase under its own limit, SIGKILL 20 s after SIGTERM
#   benchmarks/gpu_check.sh --dry-run                    # every phase on the CPU with tiny shapes (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m benchmarks.gpu_check "$@"
