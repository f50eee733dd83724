"""How wrong is `moeray simulate`? (issue 27)

    python bench/bench_simulate.py [--part machine|paper|answer|all] [--quick]

machine — on this machine: profile it (the real engine and actors, `moeray simulate --profile`),
then run the real cluster (a local Ray cluster of 3 nodes, kimi-k2-tiny) for several cases — shapes
1×1, 1×2, 2×2 and 2×3, 1 and 16 streams, and after `rebalance` with redundant slots — and predict
each with the simulator (the profile's costs, the run's own measured routing counts). Reports the
measured and predicted output tokens/s and ITL p50 and the error of each.

paper — the published figures, simulated with the one set of GPU factors (cluster/costmodel.py):
SGLang's DeepSeek-V3 decode on 9 × 8 H100 (22.3k output tokens/s per node, 2k input; lmsys blog
2025-05-05), DeepSeek-V3 on Hopper at 50 ms TPOT and 4k context (2,324 tokens/s per GPU, the
Step-3 paper's comparison, arXiv 2507.19427; Step-3's own 4,039 needs its MFA attention, which
moeray does not serve), DeepSeek's own 14.8k output tokens/s per H800 decode node (its inference
system overview, 2025-03-01). Each anchor is simulated as moeray would run it, and with the
anchor system's exchange (FP8 dispatch, two micro-batches overlapping the exchange).

answer — K2 FP8 on 16, 64 and 256 H200s at 50 ms per output token: the best split, the gain of
redundant slots at a measured skew, and the throughput one node failure per day costs with 0 and
1 standbys (docs/simulate.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cluster.config import EngineConfig
from cluster.costmodel import load_gpu
from cluster.planner import DEVICES, plan_shape
from cluster.simulator import Failure, Recovery, Routing, Shape, Simulator, SimRequest, poisson_workload
from cluster.stepcost import CpuCost, GpuCost
from model.config import load_config
from model.params import cache_bytes_per_token

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


def _decode_config(cfg, gpu_name: str, attention: int, per_replica: int, block_size: int = 64) -> EngineConfig:
    """Each attention replica's cache: what one device holds after its weights (the planner's
    arithmetic), so a batch that does not fit is preempted as the engine would."""
    plan = plan_shape(cfg, model="simulated", device=DEVICES[gpu_name], nodes=1, gpus_per_node=8, attention=1,
                      experts=7, context=4096)
    blocks = plan.cache_bytes // (cache_bytes_per_token(cfg)["latent"] * block_size)
    return EngineConfig.of(model="simulated", block_size=block_size, num_blocks=int(blocks),
                        max_num_seqs=per_replica * attention, max_tokens_per_step=32_768 * attention)


def decode_node(cfg, gpu_name: str, devices: int, context: int, per_replica: int, *, anchor_exchange: bool,
                output: int = 16) -> dict:
    """A decode deployment (prefill elsewhere) in the anchors' layout — every device runs attention
    (data parallel) and its share of the experts (expert parallel): ``per_replica`` sequences per
    device at ``context`` tokens. The figure is output tokens/s over the decode-only steps, and its
    time per output token (``itl_p50_ms``) their mean duration.
    ``anchor_exchange``: the anchor systems' exchange (FP8 dispatch, two micro-batches overlapping
    it) instead of moeray's (bf16, no overlap)."""
    gpu = load_gpu(gpu_name)
    shape = Shape(devices, devices, ping_pong=anchor_exchange, colocated=True)
    cost = GpuCost(cfg, gpu, shape, exchange_dtype_bytes=1 if anchor_exchange else 2)
    work = [SimRequest(0.0, context, output) for _ in range(per_replica * devices)]
    res = Simulator(cfg, shape, cost, config=_decode_config(cfg, gpu_name, devices, per_replica)).run(work).summary()
    return {"per_replica": per_replica, "decode_tokens_per_s": res["decode_tokens_per_s"],
            "per_gpu": res["decode_tokens_per_s"] / devices, "itl_p50_ms": res["decode_step_s"] * 1e3}


def paper(quick: bool) -> list[dict]:
    """Each anchor at its published operating point: the largest batch per device (of those tried)
    whose ITL meets its latency (50 ms where published; SGLang's run gives none: the largest that
    fits), with the anchor's exchange; and the same layout with moeray's exchange."""
    dsv3 = load_config(CONFIGS / "deepseek-v3.json")
    batches = (32, 64, 128) if quick else (32, 64, 96, 128, 192, 256)
    anchors = [
        ("SGLang: DeepSeek-V3 decode on 9 nodes of 8 H100, 2k input; output tokens/s per node", "h100", 72, 2048,
         22_282, 8, None),
        ("Step-3 paper: DeepSeek-V3 on Hopper, 4k context, 50 ms TPOT; output tokens/s per GPU (32 H800 assumed)",
         "h800", 32, 4096, 2_324, 1, 50.0),
        ("DeepSeek: V3 decode on 18 nodes of 8 H800 (with MTP); output tokens/s per node", "h800", 144, 4096,
         14_800, 8, 50.0),
    ]
    out = []
    for name, gpu, devices, ctx, published, per_unit, tpot_ms in anchors:
        row = {"anchor": name, "published": published}
        for label, anchor_exchange in (("anchor exchange", True), ("moeray exchange", False)):
            best = None
            for per in batches:
                r = decode_node(dsv3, gpu, devices, ctx, per, anchor_exchange=anchor_exchange)
                if tpot_ms is not None and r["itl_p50_ms"] > tpot_ms:
                    break
                best = r
            if best is None:
                row[label] = None
                continue
            figure = best["per_gpu"] * per_unit
            row[label] = {"figure": round(figure), "error": round(figure / published - 1, 3),
                          "batch_per_device": best["per_replica"], "itl_p50_ms": round(best["itl_p50_ms"], 1)}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def decode_shape(cfg, gpu_name: str, shape: Shape, context: int, per_replica: int, routing: Routing | None = None,
                 output: int = 16) -> dict:
    """moeray's own exchange (bf16) with ping-pong on, decode-only figure (as decode_node)."""
    gpu = load_gpu(gpu_name)
    cost = GpuCost(cfg, gpu, shape)
    work = [SimRequest(0.0, context, output) for _ in range(per_replica * shape.attention)]
    res = Simulator(cfg, shape, cost, config=_decode_config(cfg, gpu_name, shape.attention, per_replica),
                    routing=routing).run(work).summary()
    return {"attention": shape.attention, "experts": shape.experts, "colocated": shape.colocated,
            "redundant_slots": shape.redundant_slots, "per_replica": per_replica,
            "decode_tokens_per_s": res["decode_tokens_per_s"], "per_gpu": res["decode_tokens_per_s"] / shape.devices,
            "itl_p50_ms": res["decode_step_s"] * 1e3, "imbalance": res["imbalance"]}


def best_at(cfg, gpu_name, shape, context, tpot_ms, batches, routing=None) -> dict | None:
    best = None
    for per in batches:
        r = decode_shape(cfg, gpu_name, shape, context, per, routing)
        if r["itl_p50_ms"] > tpot_ms:
            break
        best = r
    return best


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
    """K2 FP8 on H200s at 50 ms per output token (4k context, decode): the best split per size, the
    gain of redundant slots at ``skew``, and one node failure a day with 0 and 1 standby node."""
    k2 = load_config(CONFIGS / "kimi-k2-instruct.json")
    batches = (32, 64, 128) if quick else (16, 32, 64, 96, 128, 192, 256)
    sizes = (16, 64) if quick else (16, 64, 256)
    routing = Routing.power_law(len(k2.moe_layers), k2.n_routed_experts, k2.num_experts_per_tok, skew, seed=1)
    out = {"skew": skew, "sizes": []}
    rc = Recovery()
    for n in sizes:
        tried = []
        big = n >= 128  # fewer candidates at 256 GPUs (each simulates ~3·10^4 sequences)
        grid = (32, 64, 128) if big else batches
        for frac in ((0.25, 0.5) if big else (0.125, 0.25, 0.375, 0.5, 0.625)):
            a = max(1, round(n * frac))
            shape = Shape(a, n - a, ping_pong=True)
            if not fits_shape(k2, "h200", shape):
                continue
            r = best_at(k2, "h200", shape, 4096, 50.0, grid, routing)
            if r:
                tried.append(r)
        r = best_at(k2, "h200", Shape(n, n, ping_pong=True, colocated=True), 4096, 50.0, grid, routing)
        if r:
            tried.append(r)
        best = max(tried, key=lambda r: r["per_gpu"])
        base = Shape(best["attention"], best["experts"], ping_pong=True, colocated=best["colocated"])
        redundant = Shape(base.attention, base.experts, base.experts, ping_pong=True, colocated=base.colocated)
        with_r = best_at(k2, "h200", redundant, 4096, 50.0, grid, routing)
        rebalanced = best_at(k2, "h200", Shape(base.attention, base.experts, ping_pong=True, colocated=base.colocated,
                                               rebalanced=True), 4096, 50.0, grid, routing)
        tps = best["decode_tokens_per_s"]
        from cluster.planner import weight_bytes

        w = weight_bytes(k2)
        per_expert_actor = w.routed_experts / base.experts
        cold = rc.detect_s + rc.start_s + per_expert_actor / rc.load_bytes_per_s + rc.regroup_s
        warm = rc.detect_s + rc.standby_s + rc.regroup_s
        entry = {"gpus": n, "best": best, "tried": tried, "rebalanced": rebalanced, "with_redundant_slots": with_r,
                 "rebalance_gain": (rebalanced["per_gpu"] / best["per_gpu"] - 1) if rebalanced else None,
                 "redundant_gain": (with_r["per_gpu"] / best["per_gpu"] - 1) if with_r else None,
                 "node_failure_per_day": {"pause_s_no_standby": cold, "pause_s_standby_node": warm,
                                          "lost_fraction_no_standby": cold / 86400,
                                          "lost_fraction_standby_node": warm / 86400,
                                          "standby_node_cost_fraction": 8 / (n + 8),
                                          "tokens_lost_no_standby": tps * cold, "tokens_lost_standby_node": tps * warm}}
        out["sizes"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "tried"}), flush=True)
    return out


def fits_shape(cfg, gpu: str, shape: Shape) -> bool:
    from deploy.simulate import fits

    return fits(cfg, gpu, shape)


MACHINE_CASES = [  # (attention, experts, streams, redundant slots after a rebalance or None)
    (1, 1, 1, None), (1, 1, 16, None), (1, 2, 16, None), (2, 2, 16, None), (2, 3, 1, None), (2, 3, 16, None),
    (2, 3, 16, 3),
]


def machine(quick: bool, runs: int) -> list[dict]:
    """Profile this machine, then each case on the real cluster against its prediction."""
    import ray

    from cluster.engine import Engine
    from cluster.local import LocalCluster
    from cluster.profile import profile
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
    cases = MACHINE_CASES[:3] if quick else MACHINE_CASES
    out = []
    with LocalCluster(nodes=3, num_cpus=4, object_store_mb=80, memory_mb=2048) as cluster:
        ray.init(address=cluster.address, logging_level="ERROR")
        try:
            engines: dict = {}
            for attention, experts, streams, redundant in cases:
                key = (attention, experts)
                if key not in engines:
                    for eng in engines.values():
                        eng.shutdown()
                    engines = {key: Engine(EngineConfig.of(model=str(path), max_tokens_per_step=512, num_blocks=512),
                                           ClusterSpec(attention=attention, experts=experts)).start()}
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
                shape = Shape(attention, experts, redundant or 0, rebalanced=redundant is not None)
                sim = Simulator(eng.model_cfg, shape, cost, config=eng.config, routing=routing).run(
                    [SimRequest(0.0, prompt, output) for _ in range(streams)]).summary()
                row = {"case": f"{attention}x{experts}, {streams} stream(s)"
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
