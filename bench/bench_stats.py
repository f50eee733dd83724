"""The per-step expert statistics at Kimi K2 scale (issue 10): what they cost on the engine's step path.

    python bench/bench_stats.py [--layers 60] [--experts 384] [--actors 48] [--steps 200]

Per step every attention worker reports how many tokens it routed to each (MoE layer, logical expert)
and to each (MoE layer, expert actor, local slot); the engine folds them into its statistics, the
router's window and the Prometheus metrics. This times, per step and per attention worker: the
worker packing its counts into the :class:`StepResult`, its serialisation both ways (pickle
protocol 5, as Ray does), and the engine's :meth:`EngineStats.record_step` plus the metrics listener — the same
code the engine runs, on K2's shape (60 MoE layers, 384 experts, 8 per token) with 1,024 tokens per
step, random routing. Prints the median milliseconds of each part."""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from types import SimpleNamespace

import torch

from actors.attention import step_stats
from actors.dispatch import DistDispatcher
from actors.messages import PlacementTable, StepResult
from actors.router import Router
from cluster.stats import EngineStats, StepRecord
from deploy.metrics import EngineMetrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--actors", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    L, E, A, k = args.layers, args.experts, args.actors, 8
    per = E // A
    table = PlacementTable(0, E, 1, tuple(range(1, L + 1)),
                           tuple(tuple(tuple(range(j * per, (j + 1) * per)) for j in range(A)) for _ in range(L)))
    d = DistDispatcher("attention[0]", table, 64, torch.float32, k, "dense")
    stats, router = EngineStats(L), Router(E, list(table.moe_layers))
    engine = SimpleNamespace(stats=stats, table=table, router=router)
    metrics = EngineMetrics(engine, "k2", expert_metrics="full")
    g = torch.Generator().manual_seed(0)
    parts: dict[str, list[float]] = {"worker packs": [], "ray serialise": [], "ray deserialise": [],
                                     "engine records (stats + metrics)": []}
    for _ in range(args.steps):
        for layer in table.moe_layers:  # what the worker's dispatcher counts during a step
            idx = torch.randint(0, E, (args.tokens, k), generator=g)
            actor, local = d.routing.assign(layer, idx)
            i = d.layer_index[layer]
            d.expert_tokens[i] += torch.bincount(idx.reshape(-1), minlength=E)
            d.slot_tokens[i] += torch.bincount(actor * table.max_local + local, minlength=d.slot_tokens.shape[1])
        t0 = time.perf_counter()
        result = StepResult(step=0, actor="attention[0]", **step_stats(d))
        t1 = time.perf_counter()
        blob = pickle.dumps(result, protocol=5)  # what Ray does to a return value (cloudpickle, protocol 5)
        t2 = time.perf_counter()
        back = pickle.loads(blob)
        t3 = time.perf_counter()
        rec = StepRecord.of(args.tokens, [back], [], 0.01, table)  # what Engine.record does
        router.report(rec.expert_tokens, rec.actor_tokens, epoch=table.epoch)
        stats.record_step(rec)
        t4 = time.perf_counter()
        for part, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[part].append(dt)
    metrics.close()
    print(f"K2-scale statistics: {L} MoE layers × {E} experts, {A} expert actors, {args.tokens} tokens/step; "
          f"median ms per step over {args.steps} steps")
    for part, times in parts.items():
        print(f"  {part:36} {1000 * statistics.median(times):8.3f}")
    print(f"  {'total':36} {1000 * sum(statistics.median(t) for t in parts.values()):8.3f}")


if __name__ == "__main__":
    main()
