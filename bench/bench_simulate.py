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
    return EngineConfig(model="simulated", block_size=block_size, num_blocks=int(blocks),
                        max_num_seqs=per_replica * attention, max_tokens_per_step=32_768 * attention)


def decode_node(cfg, gpu_name: str, devices: int, attention: int, context: int, *, anchor_features: bool,
                per_replica: int = 256, output: int = 24, routing: Routing | None = None) -> dict:
    """A decode deployment (prefill elsewhere): ``per_replica`` sequences per attention replica at
    ``context`` tokens; the figure is output tokens/s over the decode-only steps."""
    gpu = load_gpu(gpu_name)
    shape = Shape(attention, devices - attention, ping_pong=anchor_features)
    cost = GpuCost(cfg, gpu, shape, exchange_dtype_bytes=1 if anchor_features else 2)
    work = [SimRequest(0.0, context, output) for _ in range(per_replica * attention)]
    config = _decode_config(cfg, gpu_name, attention, per_replica)
    res = Simulator(cfg, shape, cost, config=config, routing=routing).run(work).summary()
    return {"attention": attention, "experts": devices - attention, "decode_tokens_per_s": res["decode_tokens_per_s"],
            "per_gpu": res["decode_tokens_per_s"] / devices, "itl_p50_ms": res["itl_p50_s"] * 1e3}


def paper(quick: bool) -> list[dict]:
    dsv3 = load_config(CONFIGS / "deepseek-v3.json")
    splits = (8, 16) if quick else (8, 16, 24, 32)
    anchors = [
        ("SGLang DeepSeek-V3, 9 decode nodes of 8 H100, 2k input: output tokens/s per node", "h100", 72, 2048,
         22_282, lambda r: r["decode_tokens_per_s"] / 9, None),
        ("DeepSeek-V3 on Hopper (H800), 4k context, ITL <= 50 ms: output tokens/s per GPU (Step-3 paper)", "h800",
         32, 4096, 2_324, lambda r: r["per_gpu"], 50.0),
        ("DeepSeek's own decode, 18 nodes of 8 H800: output tokens/s per node (with MTP)", "h800", 144, 4096,
         14_800, lambda r: r["decode_tokens_per_s"] / 18, None),
    ]
    out = []
    for name, gpu, devices, ctx, published, figure, tpot_ms in anchors:
        row = {"anchor": name, "published": published}
        for label, features in (("as moeray", False), ("anchor's exchange", True)):
            best = None
            for a in splits if devices > 40 else tuple(s for s in splits if s < devices):
                for per in ((64, 128, 256) if tpot_ms else (256,)):
                    r = decode_node(dsv3, gpu, devices, a, ctx, anchor_features=features, per_replica=per)
                    if tpot_ms and r["itl_p50_ms"] > tpot_ms:
                        continue
                    if best is None or figure(r) > figure(best):
                        best = r
            row[label] = None if best is None else {"figure": figure(best), "error": figure(best) / published - 1,
                                                    "attention": best["attention"], "experts": best["experts"],
                                                    "itl_p50_ms": best["itl_p50_ms"]}
        out.append(row)
        print(json.dumps(row))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="all", choices=("machine", "paper", "answer", "all"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    results = {}
    if args.part in ("paper", "all"):
        results["paper"] = paper(args.quick)
    print(json.dumps({"results": results, "wall_s": time.time() - t0}))


if __name__ == "__main__":
    main()
