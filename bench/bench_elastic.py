"""Elastic-plane benchmark (issue 8: live placement).

    python bench/bench_elastic.py [--preset kimi-k2-tiny] [--runs 3] [--streams 8]

On 3 local Ray nodes, with ``--streams`` greedy requests in flight, each change is begun, its new
actors load while steps go on, and it happens at a step boundary. Per change: the pause (no steps
ran), the part of it spent regrouping (old process group left, new one joined), and the preparation
time that overlapped serving. Then a skewed prompt mix, ``moeray rebalance``-style with redundant
slots: the measured max/mean tokens per expert actor (mean over MoE layers) before and after, on
the same mix. Medians of ``--runs``; a JSON line at the end."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from cluster.engine import Engine, EngineConfig
from cluster.local import LocalCluster
from cluster.spec import ClusterSpec
from model.presets import build_preset
from model.sampling import SamplingParams

import ray

LONG = SamplingParams(max_tokens=4000, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, 700, (12,), generator=g).tolist() for _ in range(n)]


def change_in_flight(eng: Engine, begin) -> dict:
    """Begin a change while requests stream, keep stepping until it happened; its report."""
    t = begin(eng)
    while not t.done.done():
        eng.step()
    c = t.done.result()
    return {"pause_s": c.pause_s, "regroup_s": c.regroup_s, "prepare_s": c.prepare_s,
            "experts_loaded": c.experts_loaded, "moved": c.moved_sequences}


def one_run(path: str, streams: int) -> dict:
    out = {}
    cfg = EngineConfig.of(model=path, num_blocks=1024, max_tokens_per_step=256)
    with Engine(cfg, ClusterSpec(attention=2, experts=2)) as eng:
        ids = [eng.add_request(p, LONG) for p in _prompts(streams)]
        for _ in range(3):
            eng.step()
        out["experts 2→4"] = change_in_flight(eng, lambda e: e.begin_scale_experts(4))
        out["experts 4→2"] = change_in_flight(eng, lambda e: e.begin_scale_experts(2))
        out["attention 2→1"] = change_in_flight(eng, lambda e: e.begin_scale_attention(1))
        for i in ids:
            eng.abort(i)
    with Engine(EngineConfig.of(model=path, max_tokens_per_step=512), ClusterSpec(attention=1, experts=3)) as eng:
        skewed = [[t] * 40 for t in (5, 5, 5, 9, 9, 17)]
        sp = SamplingParams(max_tokens=16, ignore_eos=True)
        eng.generate(skewed, sp)
        before = eng.router.measured_imbalance()
        change = eng.rebalance(redundant_slots=3)
        eng.generate(skewed, sp)
        after = eng.router.measured_imbalance()
        out["rebalance"] = {"pause_s": change.pause_s, "measured_before": sum(before) / len(before),
                            "measured_after": sum(after) / len(after),
                            "predicted_before": sum(change.imbalance_before) / len(change.imbalance_before),
                            "predicted_after": sum(change.imbalance_after) / len(change.imbalance_after)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k2-tiny")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(nodes=3, num_cpus=4) as cluster:
        path = str(build_preset(args.preset, f"{tmp}/m", seed=0, dtype="float32", progress=False))
        ray.init(address=cluster.address, logging_level="WARNING")
        runs = [one_run(path, args.streams) for _ in range(args.runs)]
        ray.shutdown()
    med = {k: {f: statistics.median(r[k][f] for r in runs) for f in runs[0][k]} for k in runs[0]}
    print(f"{args.preset}, {args.streams} streams in flight, median of {args.runs} runs")
    for k, v in med.items():
        print(f"  {k:14s} " + ", ".join(f"{f} {x:.3f}" for f, x in v.items()))
    print(json.dumps({"preset": args.preset, "runs": args.runs, "median": med}))


if __name__ == "__main__":
    main()
