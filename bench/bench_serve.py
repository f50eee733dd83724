"""An OpenAI-API load generator: the same code and flags as `moeray bench serve` (deploy/loadgen.py).

    python bench/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1,8,16,32 \
        --prompt-len 128 --max-tokens 128 [--requests N] [--api-key KEY] [--model NAME] [--json]

Works against any OpenAI-compatible server (ours, vLLM, llama.cpp's `llama-server`): streaming
/v1/completions, one run per concurrency level; prints requests/s, output tokens/s, and TTFT, ITL,
TPOT and end-to-end latency at p50/p90/p99. `--help` lists every flag."""

from __future__ import annotations

import typer

from deploy.cli_ops import bench_serve

if __name__ == "__main__":
    typer.run(bench_serve)
