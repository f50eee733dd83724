"""Single-process decode throughput and latent-cache size (issue: foundation).

    python bench/bench_decode.py [--presets kimi-k2-tiny,kimi-k2-small] [--batches 1,8,32] [--steps 16]

Random seeded weights (the numbers do not depend on the values), fp32 on CPU. Prints a table and
one JSON line per (preset, batch)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from model.config import parse_config
from model.model import CausalLM, init_random_weights
from model.params import cache_bytes_per_token, count_params, state_bytes_per_sequence
from model.presets import preset_config
from model.runner import ModelRunner, Sequence
from model.sampling import SamplingParams


def bench(preset: str, batch: int, prompt_len: int, steps: int, dtype: torch.dtype) -> dict:
    cfg = parse_config(preset_config(preset))
    model = CausalLM(cfg)
    init_random_weights(model, seed=0)
    model = model.to(dtype).eval()
    block = 16
    per_seq = -(-(prompt_len + steps + 1) // block)
    runner = ModelRunner(model, num_blocks=per_seq * batch + 1, block_size=block)
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(i, torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist(), prompt_len,
                     SamplingParams()) for i in range(batch)]
    t0 = time.perf_counter()
    logits = runner.forward(seqs, [prompt_len] * batch)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        for s, tok in zip(seqs, logits.argmax(-1).tolist()):
            s.token_ids.append(tok)
        logits = runner.forward(seqs, [1] * batch)
    decode_s = time.perf_counter() - t0
    cache = cache_bytes_per_token(cfg, dtype_bytes=2)
    return {
        "preset": preset, "params": count_params(cfg).total, "batch": batch, "prompt_len": prompt_len,
        "prefill_tok_s": round(batch * prompt_len / prefill_s, 1),
        "decode_tok_s": round(batch * steps / decode_s, 1),
        "decode_step_ms": round(1000 * decode_s / steps, 2),
        "latent_cache_B_per_token_bf16": cache["latent"], "naive_kv_B_per_token_bf16": cache["naive"],
        "runner_cache_B_per_token": runner.cache.latent.bytes_per_token,
        "kda_state_B_per_seq": state_bytes_per_sequence(cfg)["total"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="kimi-k2-tiny,kimi-k2-small,kimi-k3-tiny,kimi-linear-tiny")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for preset in args.presets.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            r = bench(preset, b, args.prompt_len, args.steps, getattr(torch, args.dtype))
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'preset':16} {'params':>14} {'batch':>5} {'decode tok/s':>13} {'step ms':>9} {'latent B/tok':>13} {'naive B/tok':>12}")
    for r in rows:
        print(f"{r['preset']:16} {r['params']:>14,} {r['batch']:>5} {r['decode_tok_s']:>13} {r['decode_step_ms']:>9} "
              f"{r['latent_cache_B_per_token_bf16']:>13,} {r['naive_kv_B_per_token_bf16']:>12,}")


if __name__ == "__main__":
    main()
