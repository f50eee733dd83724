"""How wrong is `moeray simulate`? (issues 27, 34)

    python bench/bench_simulate.py [--part machine|paper|answer|all] [--quick]

machine — on this machine: profile it (the real engine and actors, `moeray simulate --profile`),
then run the real cluster (a local Ray cluster of 3 nodes, kimi-k2-tiny) for several cases — shapes
1×1, 1×2, 2×2 and 2×3, 2 colocated workers, 1 and 16 streams, and after `rebalance` with redundant
slots — and predict each with the simulator (the profile's costs, the run's own measured routing
counts). Reports the measured and predicted output tokens/s and ITL p50 and the error of each.

paper — the published figures at steady state (cluster.capacity.search.shape_capacity), with the one set
of GPU factors (cluster/costmodel.py), each in the anchor's own layout (data-parallel attention and
expert parallelism on every device: colocated), with the anchor systems' decode exchange (`fp8-ll`,
DeepEP's low-latency kernels), with `fp8-dedup` and with moeray's: SGLang's DeepSeek-V3 decode on 9 × 8 H100 (22.3k output tokens/s per node, 2k input,
ITL about 100 ms; lmsys blog 2025-05-05), DeepSeek-V3 on Hopper at 50 ms TPOT and 4k context (2,324
tokens/s per GPU, the Step-3 paper's comparison, arXiv 2507.19427; Step-3's own 4,039 needs its MFA
attention, which moeray does not serve), DeepSeek's own 14.8k output tokens/s per H800 decode node
(its inference system overview, 2025-03-01; with MTP, which the simulator leaves out).

answer — K2 FP8 on 16, 64 and 256 H200s at 50 ms per output token: the capacity search per exchange
model (the best colocated and the best disaggregated shape, the batch decoded and the room), the
gain of redundant slots at a routing skew, and the throughput one node failure per day costs with
0 and 1 standbys (docs/simulate.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cluster.config import EngineConfig
from cluster.costmodel import load_gpu
from cluster.capacity.search import capacity_search, shape_capacity
from cluster.capacity.simulator import Recovery, Routing, Simulator
from cluster.capacity.stepcost import CpuCost, GpuCost, Shape
from cluster.capacity.workload import SimRequest
from model.config import load_config

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


def plan_for(cfg, gpu: str, context: int):
    from deploy.simulate import plan_for as plan

    return lambda shape: plan(cfg, gpu, shape, context)


def capacity(cfg, gpu_name: str, shape: Shape, context: int, output: int, tpot_ms: float | None, *,
             exchange: str, routing: Routing | None = None) -> dict:
    """One shape at steady state (cluster.capacity.search.shape_capacity): the largest batch per attention
    replica within its layout's room whose decode step meets ``tpot_ms`` (None: the room), its
    tokens/s per GPU, the batch actually decoded and the ITL."""
    plan = plan_for(cfg, gpu_name, context + output)(shape)
    if not plan.fits:
        return {"fits": False, "problems": plan.problems}
    s = shape_capacity(cfg, shape, GpuCost(cfg, load_gpu(gpu_name), shape, exchange=exchange),
                       room=plan.concurrent_sequences, tpot_s=None if tpot_ms is None else tpot_ms / 1e3,
                       context=context, output_tokens=output, routing=routing)
    return row(s)


def row(s: dict) -> dict:
    return {"attention": s["attention"], "experts": s["experts"], "layout": s["layout"],
            "micro_batches": s["micro_batches"], "redundant_slots": s["redundant_slots"],
            "per_gpu": round(s["tokens_per_s_per_gpu"], 1), "at_slo": round(s["tokens_per_s_per_gpu_at_slo"], 1),
            "batch_mean": round(s["batch_mean"], 1), "batch_p50": s["batch_p50"], "kv_sequences": s["kv_sequences"],
            "itl_p50_ms": round(s["itl_p50_s"] * 1e3, 2), "itl_p99_ms": round(s["itl_p99_s"] * 1e3, 2),
            "meets": s["meets"], "imbalance": round(s["imbalance"], 3)}


def paper(quick: bool) -> list[dict]:
    """Each anchor in its own layout (every device data-parallel attention and its share of the
    experts: colocated), at steady state at its published latency (SGLang publishes none for the
    figure; its blog gives ITL about 100 ms), the best of 1 and 2 micro-batches; with the anchor
    systems' decode exchange (fp8-ll: DeepEP's low-latency kernels), with fp8-dedup and with moeray's."""
    dsv3 = load_config(CONFIGS / "deepseek-v3.json")
    anchors = [
        ("SGLang: DeepSeek-V3 decode on 9 nodes of 8 H100, 2k input, ITL ~100 ms; output tokens/s per node",
         "h100", 72, 2000, 22_282, 8, 100.0),
        ("Step-3 paper: DeepSeek-V3 on Hopper, 4k context, 50 ms TPOT; output tokens/s per GPU (32 H800 assumed)",
         "h800", 32, 4096, 2_324, 1, 50.0),
        ("DeepSeek: V3 decode on 18 nodes of 8 H800 (with MTP), 50 ms assumed; output tokens/s per node",
         "h800", 144, 4096, 14_800, 8, 50.0),
    ]
    out = []
    for name, gpu, devices, ctx, published, per_unit, tpot_ms in anchors[:2] if quick else anchors:
        entry = {"anchor": name, "published": published}
        for exchange in ("fp8-ll", "fp8-dedup", "moeray"):
            runs = [capacity(dsv3, gpu, Shape(devices, devices, colocated=True, micro_batches=m), ctx, 64, tpot_ms,
                             exchange=exchange) for m in (1, 2)]
            best = max(runs, key=lambda r: r["at_slo"])
            figure = best["at_slo"] * per_unit
            entry[exchange] = best | {"figure": round(figure), "error": round(figure / published - 1, 3)}
        out.append(entry)
        print(json.dumps(entry), flush=True)
    return out


def fit_skew(counts, k: int) -> float:
    """The power-law skew whose expected max/mean tokens per expert equals the measured one (mean
    over layers), by bisection."""
    import torch

    c = torch.as_tensor(counts, dtype=torch.float64)
    target = float((c.max(1).values / c.mean(1)).mean())
    E = c.shape[1]
    lo, hi = 0.0, 4.0
    for _ in range(50):
        mid = (lo + hi) / 2
        w = torch.arange(1, E + 1, dtype=torch.float64) ** -mid
        (lo, hi) = (mid, hi) if float(w.max() / w.mean()) < target else (lo, mid)
    return (lo + hi) / 2


def answer(quick: bool, skew: float) -> dict:
    """K2 FP8 on H200s at 50 ms per output token (4k prompt made elsewhere, 64 output tokens, uniform
    routing): capacity_search per size and exchange model, the best shape of each layout; for the
    best shape with moeray's exchange, redundant slots (one per expert actor) at power-law ``skew``;
    one node failure a day with 0 and 1 standby node."""
    k2 = load_config(CONFIGS / "kimi-k2-instruct.json")
    sizes = (16, 64) if quick else (16, 64, 256)
    ctx, output, tpot_ms = 4096, 64, 50.0
    skewed = Routing.power_law(len(k2.moe_layers), k2.n_routed_experts, k2.num_experts_per_tok, skew, seed=1)
    out = {"skew": skew, "sizes": []}
    rc = Recovery()
    gpu = load_gpu("h200")
    for n in sizes:
        entry = {"gpus": n}
        for exchange in ("moeray", "fp8-ll", "fp8-dedup"):
            t = time.time()
            rows = capacity_search(k2, n, lambda shape: GpuCost(k2, gpu, shape, exchange=exchange),
                                   plan_for=plan_for(k2, "h200", ctx + output), tpot_s=tpot_ms / 1e3, context=ctx,
                                   output_tokens=output)
            per = {}
            for layout in ("colocated", "disaggregated"):
                mine = [r for r in rows if r["layout"] == layout]
                per[layout] = row(max(mine, key=lambda r: r["tokens_per_s_per_gpu_at_slo"])) if mine else None
            per["shapes_tried"], per["search_s"] = len(rows), round(time.time() - t, 1)
            entry[exchange] = per
        best = max((entry["moeray"][k] for k in ("colocated", "disaggregated") if entry["moeray"][k]),
                   key=lambda r: r["at_slo"])
        colocated = best["layout"] == "colocated"
        base = Shape(best["attention"], best["experts"], colocated=colocated, micro_batches=best["micro_batches"])
        at_skew = capacity(k2, "h200", base, ctx, output, tpot_ms, exchange="moeray", routing=skewed)
        with_slots = capacity(k2, "h200", Shape(base.attention, base.experts, base.experts, colocated=colocated,
                                                micro_batches=base.micro_batches),
                              ctx, output, tpot_ms, exchange="moeray", routing=skewed)
        entry["skewed"] = {"best_moeray_shape": at_skew, "with_redundant_slots": with_slots,
                           "redundant_gain": (with_slots["at_slo"] / at_skew["at_slo"] - 1) if at_skew["at_slo"] else None}
        from cluster.planner import weight_bytes

        tps = best["at_slo"] * n
        per_expert_actor = weight_bytes(k2).routed_experts / base.experts
        cold = rc.detect_s + rc.start_s + per_expert_actor / rc.load_bytes_per_s + rc.regroup_s
        warm = rc.detect_s + rc.standby_s + rc.regroup_s
        entry["node_failure_per_day"] = {"pause_s_no_standby": cold, "pause_s_standby_node": warm,
                                         "lost_fraction_no_standby": cold / 86400,
                                         "lost_fraction_standby_node": warm / 86400,
                                         "standby_node_cost_fraction": 8 / (n + 8),
                                         "tokens_lost_no_standby": tps * cold, "tokens_lost_standby_node": tps * warm}
        out["sizes"].append(entry)
        print(json.dumps(entry), flush=True)
    return out


MACHINE_CASES = [  # (attention, experts, streams, redundant slots after a rebalance or None, colocated)
    (1, 1, 1, None, False), (1, 1, 16, None, False), (1, 2, 16, None, False), (2, 2, 16, None, False),
    (2, 3, 1, None, False), (2, 3, 16, None, False), (2, 3, 16, 3, False), (2, 2, 1, None, True),
    (2, 2, 16, None, True),
]


def machine(quick: bool, runs: int) -> list[dict]:
    """Profile this machine, then each case on the real cluster against its prediction."""
    import ray

    from cluster.engine import Engine
    from cluster.local import LocalCluster
    from cluster.capacity.profile import profile
    from cluster.spec import ClusterSpec
    from cluster.stats import TokenTiming
    from model.presets import build_preset
    from model.sampling import SamplingParams

    import tempfile

    tmp = Path(tempfile.mkdtemp())
    path = build_preset("kimi-k2-tiny", tmp / "k2", seed=0, progress=False)
    t0 = time.time()
    table = profile(str(path), progress=lambda m: None)
    print(f"profile: {table['steps']} steps in {time.time() - t0:.0f} s: {json.dumps(table)}", flush=True)
    cost = CpuCost(table)
    prompt, output = 24, 16 if quick else 48
    cases = MACHINE_CASES[:2] + MACHINE_CASES[-1:] if quick else MACHINE_CASES
    out = []
    with LocalCluster(nodes=3, num_cpus=4, object_store_mb=80, memory_mb=2048) as cluster:
        ray.init(address=cluster.address, logging_level="ERROR")
        try:
            engines: dict = {}
            for attention, experts, streams, redundant, colocated in cases:
                key = (attention, experts, colocated)
                if key not in engines:
                    for eng in engines.values():
                        eng.shutdown()
                    spec = ClusterSpec.of_workers(attention) if colocated else ClusterSpec(attention=attention,
                                                                                          experts=experts)
                    engines = {key: Engine(EngineConfig.of(model=str(path), max_tokens_per_step=512, num_blocks=512),
                                           spec).start()}
                eng = engines[key]
                itl: list[float] = []
                eng.stats.listeners.append(lambda r: itl.append(r.seconds) if isinstance(r, TokenTiming)
                                           and not r.first else None)
                params = SamplingParams(max_tokens=output, ignore_eos=True)
                vocab = eng.model_cfg.vocab_size
                prompts = [[(i * 7919 + j * 104729) % (vocab - 1) + 1 for j in range(prompt)] for i in range(streams)]
                if redundant is not None:
                    eng.generate(prompts, params)  # the counts the rebalance reads
                    eng.rebalance(redundant)
                eng.generate(prompts[:1], params)  # warm-up
                walls, itls = [], []
                for _ in range(runs):
                    itl.clear()
                    t = time.perf_counter()
                    eng.generate(prompts, params)
                    walls.append(time.perf_counter() - t)
                    itls.append(statistics.median(itl))
                eng.stats.listeners.pop()
                counts = eng.router.totals().clone()  # the routing of the random model, for the answer's skew
                real_tps = streams * output / statistics.median(walls)
                real_itl = statistics.median(itls)
                routing = Routing.measured(eng.router.totals().clone(), eng.model_cfg.num_experts_per_tok)
                shape = Shape(attention, experts, redundant or 0, rebalanced=redundant is not None, colocated=colocated)
                sim = Simulator(eng.model_cfg, shape, cost, config=eng.config, routing=routing).run(
                    [SimRequest(0.0, prompt, output) for _ in range(streams)]).summary()
                row = {"case": (f"{attention} colocated workers" if colocated else f"{attention}x{experts}")
                               + f", {streams} stream(s)"
                               + (f", rebalanced +{redundant}" if redundant is not None else ""),
                       "real_tokens_per_s": round(real_tps, 1), "sim_tokens_per_s": round(sim["tokens_per_s"], 1),
                       "tokens_per_s_error": round(sim["tokens_per_s"] / real_tps - 1, 3),
                       "real_itl_p50_ms": round(real_itl * 1e3, 2), "sim_itl_p50_ms": round(sim["itl_p50_s"] * 1e3, 2),
                       "itl_error": round(sim["itl_p50_s"] / real_itl - 1, 3)}
                out.append(row)
                print(json.dumps(row), flush=True)
            for eng in engines.values():
                eng.shutdown()
        finally:
            ray.shutdown()
    errors = [abs(r[k]) for r in out for k in ("tokens_per_s_error", "itl_error")]
    skew = fit_skew(counts, 8)
    print(json.dumps({"median_abs_error": round(statistics.median(errors), 3), "max_abs_error": round(max(errors), 3),
                      "measured_skew": round(skew, 3)}))
    return out, skew


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="all", choices=("machine", "paper", "answer", "all"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skew", type=float, default=None, help="routing skew for the answer (default: fitted to "
                                                              "the machine part's measured counts, else 1.0)")
    args = ap.parse_args()
    t0 = time.time()
    results = {}
    if args.part in ("machine", "all"):
        results["machine"], results["measured_skew"] = machine(args.quick, args.runs)
    if args.part in ("paper", "all"):
        results["paper"] = paper(args.quick)
    if args.part in ("answer", "all"):
        skew = args.skew if args.skew is not None else results.get("measured_skew", 1.0)
        results["answer"] = answer(args.quick, skew)
    print(json.dumps({"results": results, "wall_s": time.time() - t0}))


if __name__ == "__main__":
    main()
