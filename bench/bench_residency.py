"""Quantised residency vs load-time dequantisation (issue 11): expert-actor memory and CPU decode speed.

    python bench/bench_residency.py [--preset kimi-k2-small] [--quants fp8,int4] [--experts-of 3]
                                    [--batches 1,8] [--steps 16] [--dir /tmp/moeray-bench]

For each checkpoint format, in a fresh process per measurement:
- an expert actor's load: the routed experts of one of ``--experts-of`` expert actors (every MoE
  layer), through ``load_routed_experts`` — its weight bytes and the process's RSS growth, held in
  checkpoint format vs dequantised to fp32 at load (what the actors did before);
- single-process greedy decode tok/s (fp32 compute) of the whole model, quantised-resident vs
  dequantised: the cost of dequantising the experts that received tokens on every step.
Prints one JSON line per measurement and a table."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))


def expert_load(path: str, shard: int, of: int, dequantize: bool) -> dict:
    import torch

    from model.config import load_config
    from model.loader import load_routed_experts

    torch.set_num_threads(1)
    cfg = load_config(path)
    n = cfg.n_routed_experts
    lo, hi = shard * n // of, (shard + 1) * n // of
    before = rss()
    t0 = time.perf_counter()
    experts = load_routed_experts(path, cfg, {l: list(range(lo, hi)) for l in cfg.moe_layers}, dequantize=dequantize)
    load_s = time.perf_counter() - t0
    return {"experts": [lo, hi], "weight_bytes": sum(e.weight_bytes() for e in experts.values()),
            "rss_growth_bytes": rss() - before, "rss_bytes": rss(), "load_s": round(load_s, 2)}


def decode(path: str, batch: int, steps: int, dequantize: bool) -> dict:
    import torch

    from model.loader import load_model
    from model.runner import ModelRunner, Sequence
    from model.sampling import SamplingParams

    torch.set_num_threads(1)
    model = load_model(path, progress=False, dequantize=dequantize)
    prompt = 16
    runner = ModelRunner(model, num_blocks=batch * (-(-(prompt + steps + 1) // 16)) + 1, block_size=16)
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(i, torch.randint(0, 700, (prompt,), generator=g).tolist(), prompt, SamplingParams())
            for i in range(batch)]
    logits = runner.forward(seqs, [prompt] * batch)
    t0 = time.perf_counter()
    for _ in range(steps):
        for s, tok in zip(seqs, logits.argmax(-1).tolist()):
            s.token_ids.append(tok)
        logits = runner.forward(seqs, [1] * batch)
    dt = time.perf_counter() - t0
    return {"batch": batch, "decode_tok_s": round(batch * steps / dt, 2), "step_ms": round(1000 * dt / steps, 1),
            "tokens": [s.token_ids[prompt:] for s in seqs]}


def child(args) -> None:
    fn = {"experts": lambda: expert_load(args.path, 0, args.experts_of, args.dequantize),
          "decode": lambda: decode(args.path, args.batch, args.steps, args.dequantize)}[args.child]
    print("RESULT " + json.dumps(fn()))


def run_child(*argv: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k2-small")
    ap.add_argument("--quants", default="fp8,int4")
    ap.add_argument("--experts-of", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dir", default="/tmp/moeray-bench")
    ap.add_argument("--child", choices=["experts", "decode"])
    ap.add_argument("--path")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dequantize", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args)
    from model.presets import build_preset

    rows = []
    for quant in args.quants.split(","):
        path = Path(args.dir) / f"{args.preset}-{quant}"
        if not (path / "config.json").exists():
            build_preset(args.preset, path, quant=quant, seed=0, progress=False)
        common = ["--path", str(path), "--experts-of", str(args.experts_of), "--steps", str(args.steps)]
        for deq in (False, True):
            flag = ["--dequantize"] if deq else []
            r = {"quant": quant, "resident": "dequantised fp32" if deq else "checkpoint format",
                 **run_child("--child", "experts", *common, *flag)}
            print(json.dumps(r), flush=True)
            rows.append(r)
        for b in (int(x) for x in args.batches.split(",")):
            pair = [run_child("--child", "decode", "--batch", str(b), *common, *(["--dequantize"] if d else []))
                    for d in (False, True)]
            assert pair[0]["tokens"] == pair[1]["tokens"], "quantised residency changed the greedy tokens"
            r = {"quant": quant, "batch": b, "resident_tok_s": pair[0]["decode_tok_s"],
                 "dequantised_tok_s": pair[1]["decode_tok_s"], "same_tokens": True}
            print(json.dumps(r), flush=True)
            rows.append(r)
    print(f"\n{'quant':6} {'experts held as':20} {'weight MiB':>11} {'RSS growth MiB':>15}")
    for r in rows:
        if "weight_bytes" in r:
            print(f"{r['quant']:6} {r['resident']:20} {r['weight_bytes'] / 2**20:>11,.1f} {r['rss_growth_bytes'] / 2**20:>15,.1f}")
    print(f"\n{'quant':6} {'batch':>5} {'resident tok/s':>15} {'dequantised tok/s':>18}")
    for r in rows:
        if "batch" in r:
            print(f"{r['quant']:6} {r['batch']:>5} {r['resident_tok_s']:>15} {r['dequantised_tok_s']:>18}")


if __name__ == "__main__":
    main()
