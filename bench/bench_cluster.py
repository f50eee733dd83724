"""Cluster benchmark (issue: the disaggregated cluster).

    python bench/bench_cluster.py [--preset kimi-k2-tiny] [--concurrency 1,8,32] [--tokens 16]

For each shape (1x2, 2x4 on 3 local Ray nodes) and the single-process model: decode tokens/s at
each concurrency; the median time of one MoE-layer exchange (counts + dispatch + combine, from the
attention actors) vs a bare gloo all_to_all_single of the same payload between the same number of
processes (the floor); each expert actor's resident memory vs its shard's parameter bytes."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import ray
import torch

from cluster.engine import Engine, EngineConfig
from cluster.local import LocalCluster
from cluster.spec import ClusterSpec
from model.config import load_config
from model.loader import load_model
from model.presets import build_preset
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams


def prompts(n: int, length: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, 700, (length,), generator=g).tolist() for _ in range(n)]


def single_process(path, conc: int, tokens: int) -> float:
    net = load_model(path, progress=False)
    runner = ModelRunner(net, num_blocks=conc * 4 + 4, block_size=16, num_slots=conc + 1)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    generate(runner, prompts(conc), SamplingParams(max_tokens=1, ignore_eos=True))  # warm up
    t0 = time.perf_counter()
    generate(runner, prompts(conc), sp)
    return conc * tokens / (time.perf_counter() - t0)


def cluster_run(eng: Engine, conc: int, tokens: int) -> tuple[float, list[float]]:
    eng.generate(prompts(conc), SamplingParams(max_tokens=1, ignore_eos=True))  # warm up
    steps0 = eng.stats.steps
    t0 = time.perf_counter()
    eng.generate(prompts(conc), SamplingParams(max_tokens=tokens, ignore_eos=True))
    dt = time.perf_counter() - t0
    n_moe = len(eng.model_cfg.moe_layers)
    recent = list(eng.stats.recent)[-(eng.stats.steps - steps0):]
    per_layer = [x / n_moe for t in recent[1:] for x in t.attention_exchange_s]  # decode steps
    return conc * tokens / dt, per_layer


def _a2a_worker(rank, world, port, A, rows, hidden, iters, q):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    E = world - A
    out_rows = [0] * world
    in_rows = [0] * world
    if rank < A:
        in_rows = [0] * A + [rows // E + (1 if j < rows % E else 0) for j in range(E)]
    times = []
    for _ in range(iters):
        x = torch.randn(sum(in_rows), hidden)
        y = torch.empty(0, hidden)
        if rank >= A:  # experts receive from every attention rank
            per = rows // E + (1 if rank - A < rows % E else 0)
            out_rows = [per] * A + [0] * E
            y = torch.empty(sum(out_rows), hidden)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x, out_rows, in_rows)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        q.put(statistics.median(times))
    dist.destroy_process_group()


def bare_a2a(A: int, E: int, rows: int, hidden: int, iters: int = 100) -> float:
    """Median seconds of one all_to_all_single moving ``rows`` rows of ``hidden`` fp32 from each
    attention rank to the expert ranks (one direction of one exchange)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_a2a_worker, args=(r, A + E, port, A, rows, hidden, iters, q)) for r in range(A + E)]
    for p in procs:
        p.start()
    med = q.get(timeout=300)
    for p in procs:
        p.join(60)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k2-tiny")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    concs = [int(c) for c in args.concurrency.split(",")]
    path = build_preset(args.preset, tempfile.mkdtemp() + "/m", dtype="float32", progress=False)
    cfg = load_config(path)
    rows = []
    for c in concs:
        rows.append({"shape": "single-process", "concurrency": c, "decode_tok_s": round(single_process(path, c, args.tokens), 1)})
        print(json.dumps(rows[-1]), flush=True)
    with LocalCluster(nodes=3, num_cpus=4) as lc:
        ray.init(address=lc.address, logging_level="WARNING")
        for A, E in ((1, 2), (2, 4)):
            with Engine(EngineConfig.of(model=str(path), num_blocks=256, max_tokens_per_step=1024),
                        ClusterSpec(attention=A, experts=E)) as eng:
                for c in concs:
                    tps, per_layer = cluster_run(eng, c, args.tokens)
                    # decode: each attention rank sends c/A tokens × top_k rows per layer
                    floor = bare_a2a(A, E, max(1, c // A) * cfg.num_experts_per_tok, cfg.expert_hidden_size)
                    rows.append({"shape": f"{A}x{E}", "concurrency": c, "decode_tok_s": round(tps, 1),
                                 "moe_exchange_median_ms": round(1000 * statistics.median(per_layer), 3),
                                 "bare_a2a_one_way_median_ms": round(1000 * floor, 3)})
                    print(json.dumps(rows[-1]), flush=True)
                mem = [(ray.get(e.resident_bytes.remote()), ray.get(e.param_bytes.remote())) for e in (m.actor for m in eng.executor.fleet.experts)]
                for j, (rss, shard) in enumerate(mem):
                    print(json.dumps({"shape": f"{A}x{E}", "expert_actor": j, "rss_MiB": round(rss / 2**20, 1),
                                      "shard_MiB": round(shard / 2**20, 3)}), flush=True)
        ray.shutdown()


if __name__ == "__main__":
    main()
