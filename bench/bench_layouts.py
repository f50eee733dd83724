"""The two layouts against the single process (issue 33), in one run on one checkpoint.

    python bench/bench_layouts.py [--streams 1,16] [--new-tokens 64] [--prompt-len 32] [--repeats 3]

The checkpoint is bench_overhead.py's: a DeepSeek-V3 of 6 layers, 32 routed experts, hidden 256,
fp32, written in the real format. Greedy decoding of ``--new-tokens`` tokens from
``--prompt-len``-token prompts, ignoring EOS, at each stream count, by:

* the single-process runner (``model.runner.generate``, 2 threads: both cores);
* the served disaggregated layout: ``moeray up --detach``, 1 attention × 1 expert actor (one core each),
  streamed completions over HTTP (``moeray bench serve``'s load generator);
* the served colocated layout: ``moeray up --detach`` with ``layout: colocated, workers: 2`` (each worker
  an attention replica and half the experts, one core each), the same load.

Served rounds are interleaved (each round serves both layouts once, in turn, so the machine's drift
falls on both alike); each figure is the median over ``--repeats`` rounds, and the table gives each
row's ratio to the single process at the same stream count. Then:

* 3 colocated workers over 3 local Ray nodes (the engine without Serve, driven in this process);
* one MoE layer's colocated exchange (2 worker processes in a gloo group, each with half the experts
  as identity experts, so only the exchange is timed) against its floor: gloo's all_to_all_single of
  the same rows out and back."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import SHAPE, Served, prompts, served_rate, single_rate  # noqa: E402

from model.presets import build_preset  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

LAYOUTS = {"served disaggregated 1 attention x 1 expert": {"attention": 1, "experts": 1},
           "served colocated 2 workers": {"layout": "colocated", "workers": 2}}


def three_workers_rate(path: Path, streams: list[int], prompt_len: int, new: int, reps: int) -> dict[int, float]:
    """Tokens/s (median of ``reps``) of 3 colocated workers on 3 local Ray nodes, no Serve."""
    import ray

    from cluster.config import EngineConfig
    from cluster.engine import Engine
    from cluster.local import LocalCluster
    from cluster.spec import ClusterSpec

    rates = {}
    with LocalCluster(nodes=3, num_cpus=2, first_ip=70) as cluster:
        ray.init(address=cluster.address, logging_level="WARNING")
        try:
            with Engine(EngineConfig.of(model=str(path), dtype="float32", max_num_seqs=64),
                        ClusterSpec.of_workers(3)) as eng:
                assert len({m["node"] for m in eng.status()["actors"]["attention"]}) == 3
                eng.generate(prompts(2, prompt_len), SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
                for n in streams:
                    runs = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        seqs = eng.generate(prompts(n, prompt_len), SamplingParams(max_tokens=new, ignore_eos=True))
                        runs.append(n * new / (time.perf_counter() - t0))
                        assert all(len(s.output_ids) == new for s in seqs)
                    rates[n] = statistics.median(runs)
        finally:
            ray.shutdown()
    return rates


def _exchange_worker(rank: int, port: int, tokens: int, hidden: int, k: int, experts: int, iters: int, q) -> None:
    """One of 2 colocated workers: times one MoE layer's exchange (issue, then collect: this worker's
    rows for the other's experts out, the other's rows for its experts in, results back both ways),
    identity experts; then gloo's all_to_all_single of the same rows out and back."""
    import torch.distributed as dist

    from actors.colocated import ColocatedExchange
    from actors.framing import TOKEN_BYTES
    from actors.group import join_group, leave_group
    from actors.messages import GroupInfo, PlacementTable
    from model.layers import silu_glu
    from model.moe import RoutedExperts

    torch.set_num_threads(1)
    join_group(GroupInfo(0, "127.0.0.1", port, b"l" * TOKEN_BYTES, timeout_s=60), rank, 2, num_attention=2,
               colocated=True)
    half = experts // 2
    slots = ((tuple(range(half)), tuple(range(half, experts))),)
    table = PlacementTable(0, experts, 2, (1,), slots, colocated=True)
    shard = RoutedExperts(hidden, hidden // 2, slots[0][rank], silu_glu)
    shard.grouped = lambda xs, local: xs  # identity experts: the exchange alone
    ex = ColocatedExchange(f"worker[{rank}]", rank, table, {1: shard}, hidden, torch.float32, k)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    # rows that leave this worker: (dense, W <= k) each token with any expert on the other worker, once
    away = int(((idx >= half) if rank == 0 else (idx < half)).any(dim=1).sum())
    times, floor = [], []
    for i in range(iters):
        ex.begin_step(i, ((tokens, tokens),))
        dist.barrier()
        t0 = time.perf_counter()
        ex.collect(ex.issue(1, x, idx, w))
        times.append(time.perf_counter() - t0)
    width = hidden + 2 * k  # a dense row: the hidden state and its k (expert, weight) pairs
    counts = [0, away] if rank == 0 else [away, 0]
    for _ in range(iters):
        a, b = torch.randn(away, width), torch.empty(away, width)
        c, e = torch.randn(away, hidden), torch.empty(away, hidden)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(b, a, counts, counts)
        dist.all_to_all_single(e, c, counts, counts)
        floor.append(time.perf_counter() - t0)
    q.put((rank, ex.mode, times, floor))
    leave_group()


def exchange_vs_floor(tokens: int, hidden: int, k: int, experts: int, iters: int = 200) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_exchange_worker, args=(r, port, tokens, hidden, k, experts, iters, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    times = [max(a, b) for a, b in zip(got[0][2], got[1][2])]  # a layer ends when both workers have their rows
    floor = [max(a, b) for a, b in zip(got[0][3], got[1][3])]
    return {"tokens": tokens, "mode": got[0][1], "exchange_ms": 1000 * statistics.median(times),
            "floor_ms": 1000 * statistics.median(floor), "ratio": statistics.median(times) / statistics.median(floor)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=8794)
    ap.add_argument("--skip-three", action="store_true", help="skip 3 workers over 3 nodes")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    new, plen, reps = args.new_tokens, args.prompt_len, args.repeats
    torch.set_num_threads(2)
    rows: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MOERAY_CACHE_DIR": tmp}
        path = build_preset("deepseek-v3-tiny", Path(tmp) / "ckpt", dtype="float32", progress=False, overrides=SHAPE)
        single = "single-process runner, 2 threads"
        for n in streams:
            rows.setdefault(single, {})[n] = statistics.median(single_rate(path, n, plen, new) for _ in range(reps))
        rates: dict = {}
        names = list(LAYOUTS)
        for r in range(reps):
            for name in (names if r % 2 == 0 else names[::-1]):
                with Served(path, args.port, False, env, shape=LAYOUTS[name]) as app:
                    for n in streams:
                        rate = served_rate(app, n, plen, new, [])
                        rates.setdefault((name, n), []).append(rate)
                        print(json.dumps({"run": name, "round": r, "streams": n, "tok_s": rate}), flush=True)
        for (name, n), v in rates.items():
            rows.setdefault(name, {})[n] = statistics.median(v)
        if not args.skip_three:
            rows["engine colocated 3 workers on 3 nodes (no Serve)"] = three_workers_rate(path, streams, plen, new, reps)
    exchanges = [exchange_vs_floor(n, SHAPE["hidden_size"], SHAPE["num_experts_per_tok"], SHAPE["n_routed_experts"])
                 for n in streams]
    base = rows[single]
    print(f"\n{'system':52}" + "".join(f"{f'{n} streams tok/s':>20}{'vs single':>10}" for n in streams))
    for name, r in rows.items():
        print(f"{name:52}" + "".join(f"{r[n]:>20.1f}{r[n] / base[n]:>10.2f}" for n in streams))
    print("\none MoE layer's colocated exchange (2 workers, half the experts each, identity experts) vs the floor "
          "(gloo all_to_all_single of the same rows out and back)")
    for e in exchanges:
        print(f"  {e['tokens']:>3} tokens per worker, {e['mode']}: {e['exchange_ms']:.3f} ms vs floor "
              f"{e['floor_ms']:.3f} ms = {e['ratio']:.2f}x")
    print(json.dumps({"rates": rows, "exchange": exchanges}))


if __name__ == "__main__":
    main()
