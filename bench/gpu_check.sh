#!/usr/bin/env bash
# The GPU check (issue 10): bf16 parity with CPU fp32, the cluster on this machine's GPUs (NCCL with
# 3+ GPUs, else gloo on a shared GPU 0), tokens/s and the per-step breakdown. Under 5 minutes on one GPU.
# Needs a CUDA build of torch: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 300 python bench/gpu_check.py "$@"
