#!/usr/bin/env bash
# `moeray plan` for the closing note of issue 11: K2 FP8 on 2 x 8 H200, K2-Thinking INT4 on 1 x 8 H200,
# K3 (MXFP4 experts) on 2 x 8 H200 — from the configs in tests/fixtures/configs (nothing downloaded).
set -euo pipefail
cd "$(dirname "$0")/.."
C=tests/fixtures/configs
echo "== K2-Instruct FP8, 2 x 8 H200 (1 x 8 first: it must not fit)"
moeray plan --model $C/kimi-k2-instruct.json --gpu h200 --nodes 1 --gpus-per-node 8
moeray plan --model $C/kimi-k2-instruct.json --gpu h200 --nodes 2 --gpus-per-node 8
moeray plan --model $C/kimi-k2-instruct.json --gpu h200 --nodes 2 --gpus-per-node 8 --attention 2 --experts 14
echo "== K2-Thinking INT4 (routed experts compressed-tensors group 32), 1 x 8 H200"
moeray plan --model $C/kimi-k2-thinking.json --gpu h200 --nodes 1 --gpus-per-node 8
moeray plan --model $C/kimi-k2-thinking.json --gpu h200 --nodes 1 --gpus-per-node 8 --attention 2 --experts 6
echo "== K3 (MXFP4 routed experts), 2 x 8 H200, 32k and 128k context"
moeray plan --model $C/kimi-k3-text.json --gpu h200 --nodes 2 --gpus-per-node 8 --context 32768
moeray plan --model $C/kimi-k3-text.json --gpu h200 --nodes 2 --gpus-per-node 8 --attention 2 --experts 14 --context 131072
