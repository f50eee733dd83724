"""Sampler cost at a real vocabulary (issue 10): the vectorised sampler against the one it replaced.

    python bench/bench_sampling.py [--vocab 163840] [--batches 1,16,64] [--repeats 7] [--threads 1]
                                   [--no-step] [--device cpu]

Times ``model.sampling.sample`` (new) and the pre-issue-10 sampler (kept below, verbatim, as
``old_sample``) on random logits for: greedy; temperature 0.8 unseeded and seeded; top-p 0.9; top-k 50;
and top-p 0.9 on flat logits, whose nucleus is wider than the top-k window (the full-sort fallback).
Logits are N(0, 4²) — peaked like a language model's — except the flat case, N(0, 1). Medians of
``--repeats`` runs. Prints a table, the ratio of each mode to greedy, and one JSON line per row.

A sampler's cost only matters next to a step's: the table also times the lm_head alone,
[B, 7168] x [7168, V] in fp32 (``--no-step`` skips it; it allocates a 4.7 GB weight), and prints each
mode's extra cost over greedy as a percentage of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from model.sampling import SamplingParams, draw_seed, sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' reference
from tests.model.test_sampling import old_sample  # noqa: E402  (the sampler before issue 10, kept frozen there)

HIDDEN = 7168  # Kimi K2 / DeepSeek-V3




MODES = {  # name: (SamplingParams, seeded, logits std)
    "greedy": (SamplingParams(), False, 4.0),
    "temperature": (SamplingParams(temperature=0.8), False, 4.0),
    "temperature+seed": (SamplingParams(temperature=0.8, seed=7), True, 4.0),
    "top-p 0.9": (SamplingParams(temperature=0.8, top_p=0.9), False, 4.0),
    "top-k 50": (SamplingParams(temperature=0.8, top_k=50), False, 4.0),
    "top-p 0.9 flat": (SamplingParams(temperature=0.8, top_p=0.9), False, 1.0),
}


def median_ms(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def step_ms(batch: int, vocab: int, repeats: int, device: torch.device, sync) -> float:
    """The lm_head alone: [B, 7168] x [7168, V] fp32, the least a decode step does per token."""
    w = torch.empty(vocab, HIDDEN, device=device).uniform_(-0.02, 0.02)
    h = torch.randn(batch, HIDDEN, device=device)
    return median_ms(lambda: h @ w.t(), max(3, repeats // 2), sync)


def run(args) -> list[dict]:
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for batch in args.batches:
        step = None if args.no_step else step_ms(batch, args.vocab, args.repeats, device, sync)
        greedy = {}
        for mode, (params, seeded, std) in MODES.items():
            logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(batch)) * std
            plist = [params] * batch
            seeds = [draw_seed(params, 100 + b) if seeded else None for b in range(batch)]
            new_ms = median_ms(lambda: sample(logits.to(device), plist, seeds), args.repeats, sync)
            cpu = logits.cpu()
            old_ms = median_ms(lambda: old_sample(cpu, plist, seeds), args.repeats, sync)
            greedy = greedy or {"new": new_ms, "old": old_ms}
            rows.append({"vocab": args.vocab, "batch": batch, "mode": mode, "new_ms": round(new_ms, 3),
                         "old_ms": round(old_ms, 3), "new_vs_greedy": round(new_ms / greedy["new"], 2),
                         "old_vs_greedy": round(old_ms / greedy["old"], 2),
                         "speedup": round(old_ms / new_ms, 2),
                         "lm_head_ms": None if step is None else round(step, 1),
                         "extra_pct_of_lm_head": None if step is None else
                         round(100 * (new_ms - greedy["new"]) / step, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (an attention worker uses 1)")
    ap.add_argument("--device", default="cpu", help="where the new sampler runs (the old one ran on CPU)")
    ap.add_argument("--no-step", action="store_true", help="skip timing the lm_head")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = run(args)
    head = f"{'batch':>5} {'mode':<17} {'new ms':>9} {'old ms':>9} {'speedup':>8} {'new/greedy':>10} " \
           f"{'old/greedy':>10} {'lm_head ms':>10} {'extra % of lm_head':>18}"
    print(head)
    for r in rows:
        step = "-" if r["lm_head_ms"] is None else f"{r['lm_head_ms']:.1f}"
        extra = "-" if r["extra_pct_of_lm_head"] is None else f"{r['extra_pct_of_lm_head']:.2f}"
        print(f"{r['batch']:>5} {r['mode']:<17} {r['new_ms']:>9.3f} {r['old_ms']:>9.3f} {r['speedup']:>8.2f} "
              f"{r['new_vs_greedy']:>10.2f} {r['old_vs_greedy']:>10.2f} {step:>10} {extra:>18}")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
