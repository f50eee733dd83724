"""Recovery benchmark (issue 9: survive dead actors).

    python bench/bench_recovery.py [--preset kimi-k2-tiny] [--runs 3] [--streams 6]

On 3 local Ray nodes, a 2 attention x 3 expert engine with ``--streams`` greedy requests in flight:
an expert actor is killed (``ray.kill``, as `moeray chaos kill-expert 1` does), then an attention
actor. Per kill: the recovery time (failed step → dead actor replaced → cluster serving again in a
recovery epoch), of which the regroup; and whether every request still ended with exactly the
tokens of a fault-free run. Medians of ``--runs``; a JSON line at the end."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import ray
import torch

from cluster.engine import Engine, EngineConfig
from cluster.local import LocalCluster
from cluster.topology import ClusterSpec
from model.presets import build_preset
from model.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=48, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, 700, (10 + 3 * i,), generator=g).tolist() for i in range(n)]


def run_with_kill(eng: Engine, prompts, kind: str, index: int) -> tuple[list[list[int]], dict]:
    ids = [eng.add_request(p, PARAMS) for p in prompts]
    for _ in range(4):
        eng.step()
    members = eng.workers.experts if kind == "expert" else eng.workers.attention
    ray.kill(members[index].actor, no_restart=True)
    n = len(eng.changes)
    while eng.has_work:
        eng.step()
    change = eng.changes[n]
    return [eng.release(i).seq.output_ids for i in ids], {"recovery_s": eng.stats.recoveries[-1],
                                                           "regroup_s": change.regroup_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k2-tiny")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=6)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(nodes=3, num_cpus=4) as cluster:
        path = str(build_preset(args.preset, f"{tmp}/m", seed=0, dtype="float32", progress=False))
        ray.init(address=cluster.address, logging_level="WARNING")
        cfg = EngineConfig(model=path, collective_timeout_s=10, max_tokens_per_step=128)
        prompts = _prompts(args.streams)
        for _ in range(args.runs):
            with Engine(cfg, ClusterSpec(attention=2, experts=3)) as eng:
                reference = [s.output_ids for s in eng.generate(prompts, PARAMS)]
                out_e, expert = run_with_kill(eng, prompts, "expert", 1)
                out_a, attention = run_with_kill(eng, prompts, "attention", 0)
                results.append({"expert": {**expert, "exact": out_e == reference},
                                "attention": {**attention, "exact": out_a == reference}})
        ray.shutdown()
    med = {k: {"recovery_s": statistics.median(r[k]["recovery_s"] for r in results),
               "regroup_s": statistics.median(r[k]["regroup_s"] for r in results),
               "all_exact": all(r[k]["exact"] for r in results)} for k in ("expert", "attention")}
    print(f"{args.preset}, 2 attention x 3 experts, {args.streams} streams in flight, median of {args.runs} runs")
    for k, v in med.items():
        print(f"  kill {k:9s}: recovery {v['recovery_s']:.2f}s (regroup {v['regroup_s']:.2f}s), "
              f"outputs exact: {v['all_exact']}")
    print(json.dumps({"preset": args.preset, "median": med, "runs": results}))


if __name__ == "__main__":
    main()
