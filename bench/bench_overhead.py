"""Where the served cluster's time goes (issue 10), in one run on one checkpoint.

    python bench/bench_overhead.py [--streams 1,16] [--new-tokens 64] [--prompt-len 32] [--repeats 3]

The checkpoint is the issue's: a DeepSeek-V3 of 6 layers, 32 routed experts, hidden 256, fp32,
written in the real format. Greedy decoding of ``--new-tokens`` tokens from ``--prompt-len``-token
prompts, ignoring EOS, at each stream count, by:

* transformers ``generate`` (a test dependency; skipped with a note when it is not installed),
* our single-process runner (``model.runner.generate``, 2 threads),
* the cluster engine without Serve (``--engine``, default on): the same 1 attention × 1 expert
  actors on one local Ray node, driven in this process (``Engine.generate``, all streams submitted at
  once) — the data plane's cost apart from Serve/HTTP's,
* the served cluster: ``moeray up --detach`` (1 attention × 1 expert actor), driven over HTTP with
  streaming completions, with ping-pong micro-batches off and on (``--ping-pong``); with
  ``--before-tree DIR`` also a checkout of an earlier commit, served from DIR in the same run (the
  "before" row; its /status needs the breakdown for the per-step table); with ``--expert-threads 1,2``
  also with the expert actor's GEMMs over 2 threads, and the single-process runner given the same
  threads (a like-for-like row); with ``--ingress haproxy,proxy`` behind HAProxy (Serve's direct
  ingress, the default) and behind Serve's proxy actor.

Each figure is the median of ``--repeats`` runs; the table gives tokens/s and the served cluster's
ratio to the single-process runner at the same stream count. Then the engine's per-step breakdown
(from ``GET /status``): scheduler, Ray call round trip, attention compute, each collective's wait,
expert compute, sampling, statistics, stop checks, delivery to the streams — and the Serve/HTTP
share, the client's time per step minus the engine's. Last, one MoE layer's exchange against the
bare ``all_to_all_single`` floor of the same bytes (gloo, two processes)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import yaml

from deploy.loadgen import LoadSpec, run_bench
from model.loader import load_model
from model.presets import build_preset
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 6,
         "n_routed_experts": 32, "num_experts_per_tok": 8, "n_group": 4, "topk_group": 2,
         "first_k_dense_replace": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 128,
         "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}


def prompts(n: int, length: int, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + n)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def have_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def transformers_rate(path: Path, streams: int, prompt_len: int, new: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor(prompts(streams, prompt_len))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm up
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        dt = time.perf_counter() - t0
    assert out.shape[1] == prompt_len + new
    return streams * new / dt


def single_rate(path: Path, streams: int, prompt_len: int, new: int, expert_threads: int = 1) -> float:
    """The single-process runner's tokens/s; ``expert_threads`` > 1 gives its routed experts the
    expert actors' GEMM threads (:class:`model.moe.ExpertThreads`) and, as in the actors, one torch
    thread (a torch pool under each of them would oversubscribe the cores), for a like-for-like row."""
    from model.moe import ExpertThreads, attach_threads

    model = load_model(path, dtype=torch.float32, progress=False)
    threads = ExpertThreads(expert_threads) if expert_threads > 1 else None
    attach_threads(model.modules(), threads)
    runner = ModelRunner(model, num_blocks=streams * (-(-(prompt_len + new) // 16) + 1) + 4, block_size=16)
    torch_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(1)
    try:
        generate(runner, prompts(streams, prompt_len), SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
        t0 = time.perf_counter()
        seqs = generate(runner, prompts(streams, prompt_len), SamplingParams(max_tokens=new, ignore_eos=True))
        dt = time.perf_counter() - t0
    finally:
        torch.set_num_threads(torch_threads)
        if threads is not None:
            threads.close()
    assert all(len(s.output_ids) == new for s in seqs)
    return streams * new / dt


def engine_rates(path: Path, streams: list[int], prompt_len: int, new: int, reps: int) -> tuple[dict, dict]:
    """The cluster engine (1 attention × 1 expert actor on one local node) without Serve: tokens/s
    (median of ``reps``) and the per-step breakdown over the measured runs, per stream count."""
    import ray

    from cluster.config import EngineConfig
    from cluster.engine import Engine
    from cluster.local import LocalCluster
    from cluster.spec import ClusterSpec

    rates, parts = {}, {}
    with LocalCluster(nodes=1, num_cpus=4, first_ip=60) as cluster:
        ray.init(address=cluster.address, logging_level="WARNING")
        try:
            with Engine(EngineConfig.of(model=str(path), dtype="float32", max_num_seqs=64),
                        ClusterSpec(attention=1, experts=1)) as eng:
                eng.generate(prompts(2, prompt_len), SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
                for n in streams:
                    runs = []
                    for _ in range(reps):
                        b0, t0 = dict(eng.stats.breakdown), time.perf_counter()
                        seqs = eng.generate(prompts(n, prompt_len), SamplingParams(max_tokens=new, ignore_eos=True))
                        dt = time.perf_counter() - t0
                        assert all(len(s.output_ids) == new for s in seqs)
                        runs.append((b0, dict(eng.stats.breakdown), dt))
                    rates[n] = statistics.median(n * new / dt for *_, dt in runs)
                    parts[n] = level_ms(runs)
        finally:
            ray.shutdown()
    return rates, parts


def served_rate(app: "Served", streams: int, prompt_len: int, new: int, parts: list) -> float:
    """Output tokens/s of ``streams`` concurrent streamed requests (``moeray bench serve``'s load
    generator). The engine's breakdown over the level alone (not the load generator's probe
    request before it) is appended to ``parts`` as (before, after)."""
    spec = LoadSpec(app.url, concurrency=(streams,), prompt_len=prompt_len, max_tokens=new, requests=streams)
    start: list[dict] = []
    (level,) = run_bench(spec, lambda msg: start.append(app.breakdown()) if msg.startswith("concurrency") else None).levels
    parts.append((start[0], app.breakdown(), level.duration_s))
    assert level.errors == 0 and level.tokens_received == level.tokens_requested, level.error_samples
    return level.output_tokens_per_s


class Served:
    """``moeray up --detach`` on the checkpoint (1 attention × 1 expert, or ``shape``), stopped on exit."""

    def __init__(self, path: Path, port: int, ping_pong: bool, env: dict, tree: str | None = None, threads: int = 1,
                 expert_threads: int = 1, ingress: str | None = None, shape: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        # another checkout's code: first on the path, and the working directory (Ray's workers import from it)
        self.env, self.cwd = (env | {"PYTHONPATH": tree}, tree) if tree else (env, None)
        self.cfg = Path(env["MOERAY_CACHE_DIR"]) / f"serve-{port}.yaml"
        # shape: the layout's keys (default 1 attention × 1 expert actor; e.g. {"layout": "colocated", "workers": 2})
        cfg = {"model": str(path), "port": port, "max_num_seqs": 64} | (shape or {"attention": 1, "experts": 1})
        cfg |= ({"ping_pong": True} if ping_pong else {}) | ({"actor_threads": threads} if threads > 1 else {})
        cfg |= {"expert_threads": expert_threads} if expert_threads > 1 else {}
        cfg |= {"ingress": ingress} if ingress else {}  # None: the checkout's default (a "before" tree has none)
        self.cfg.write_text(yaml.safe_dump(cfg))
        self.moeray = str(Path(sys.executable).parent / "moeray")

    def __enter__(self) -> "Served":
        subprocess.run([self.moeray, "up", "--detach", "--config", str(self.cfg)], env=self.env, cwd=self.cwd,
                       check=True)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([self.moeray, "down"], env=self.env, cwd=self.cwd, check=False)

    def breakdown(self) -> dict:
        st = httpx.get(f"{self.url}/status", timeout=30).json()
        return st.get("breakdown", {})


def _exchange_worker(rank: int, port: int, tokens: int, hidden: int, k: int, experts: int, mode: str, iters: int,
                     transport: str, q):
    """Rank 0 is an attention rank, rank 1 an expert actor holding every expert. Times one MoE
    layer's exchange over ``transport`` twice: with the expert's GEMMs run and their time taken out
    (which still leaves what they do to the caches: 12.6 MB of weights stream through them between
    the dispatch and the combine), and with identity experts (each row its own result: the exchange
    alone, as the floors run). Then the bare floors of the same bytes out and back: gloo's
    all_to_all_single, one gloo send and receive each way, and (transport auto) one send and
    receive each way over the direct sockets alone."""
    import torch.distributed as dist

    from actors.dispatch import DistDispatcher, ExpertExchange
    from actors.framing import TOKEN_BYTES
    from actors.group import current_mesh, join_group, leave_group
    from actors.messages import GroupInfo, PlacementTable
    from model.layers import silu_glu
    from model.moe import RoutedExperts

    torch.set_num_threads(1)
    token = b"b" * TOKEN_BYTES  # the epoch's token: the same in both processes
    join_group(GroupInfo(0, "127.0.0.1", port, token, transport=transport), rank, 2, num_attention=1)
    table = PlacementTable(0, experts, 1, (1,), ((tuple(range(experts)),),))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    times, floor = [], []
    if rank == 0:
        d = DistDispatcher("attention[0]", table, hidden, torch.float32, k, mode)
        d.begin_step(0)
    else:
        ex = ExpertExchange("expert[0]", 0, table, k, mode)
        shard = RoutedExperts(hidden, hidden // 2, range(experts), silu_glu)
        torch.nn.init.normal_(shard.w13, std=0.02), torch.nn.init.normal_(shard.w2, std=0.02)
        inner = shard.grouped
        spent = []

        def timed(xs, local):
            t0 = time.perf_counter()
            y = inner(xs, local)
            spent.append(time.perf_counter() - t0)
            return y

        shard.grouped = timed

    def run() -> None:
        if rank == 0:
            d.exchange(1, x, idx, w)
        else:
            ex.serve(1, shard, hidden, torch.float32, (tokens,))
            ex.drain()

    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    alone = []  # identity experts: no GEMM, no weights through the caches
    if rank == 1:
        shard.grouped = lambda xs, local: xs
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        alone.append(time.perf_counter() - t0)
    if mode == "dense":
        out_rows, back_rows, width = tokens, tokens, hidden + 2 * k
    else:
        out_rows, back_rows, width = tokens * k, tokens * k, hidden
    for _ in range(iters):
        a = torch.randn(out_rows if rank == 0 else 0, width)
        b = torch.empty(out_rows if rank == 1 else 0, width)
        c = torch.randn(back_rows if rank == 1 else 0, hidden)
        e = torch.empty(back_rows if rank == 0 else 0, hidden)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(b, a, [out_rows, 0] if rank == 1 else [0, 0], [0, out_rows] if rank == 0 else [0, 0])
        dist.all_to_all_single(e, c, [0, back_rows] if rank == 0 else [0, 0], [back_rows, 0] if rank == 1 else [0, 0])
        floor.append(time.perf_counter() - t0)
    p2p = []  # the same bytes as one send and one receive each way (what the exchange uses on gloo)
    for _ in range(iters):
        a, c = torch.randn(out_rows, width), torch.randn(back_rows, hidden)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(a, 1)
            dist.recv(c, 1)
        else:
            dist.recv(a, 0)
            dist.send(c, 0)
        p2p.append(time.perf_counter() - t0)
    wire, mesh = [], current_mesh()  # the same bytes over the exchange's sockets, nothing else
    for i in range(iters if mesh is not None else 0):
        a, c = torch.randn(out_rows, width), torch.randn(back_rows, hidden)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            mesh.send(a, 1, tag=i).wait()
            mesh.recv(c, 1, tag=i).wait()
        else:
            mesh.recv(a, 0, tag=i).wait()
            mesh.send(c, 0, tag=i).wait()
        wire.append(time.perf_counter() - t0)
    if rank == 1:
        q.put(("expert", spent))
    else:
        q.put(("attention", times, floor, p2p, wire, alone))
    leave_group()


def exchange_vs_floor(tokens: int, hidden: int, k: int, experts: int, mode: str, iters: int = 200,
                      transport: str = "auto") -> dict:
    """Median ms of one MoE layer's exchange (identity experts; and with the GEMMs run and their time
    taken out) and of the floors."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_exchange_worker, args=(r, port, tokens, hidden, k, experts, mode, iters, transport, q))
             for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict((m[0], m[1:]) for m in (q.get(timeout=600), q.get(timeout=600)))
    for p in procs:
        p.join(60)
    times, floor, p2p, wire, alone = got["attention"]
    (spent,) = got["expert"]
    net = [t - c for t, c in zip(times, spent)]
    return {"mode": mode, "transport": transport, "tokens": tokens, "exchange_ms": 1000 * statistics.median(alone),
            "with_gemms_ms": 1000 * statistics.median(net),
            "floor_ms": 1000 * statistics.median(floor), "p2p_floor_ms": 1000 * statistics.median(p2p),
            "wire_floor_ms": 1000 * statistics.median(wire) if wire else None,
            "ratio": statistics.median(alone) / statistics.median(floor),
            "with_gemms_ratio": statistics.median(net) / statistics.median(floor)}


def level_ms(parts: list) -> dict:
    """Mean milliseconds per step of each component over the measured levels (each a (before,
    after, duration) of one level), and the client's wall time per step."""
    steps = sum(a.get("steps", 0) - b.get("steps", 0) for b, a, _ in parts)
    if steps <= 0:
        return {}
    keys = {k for _, a, _ in parts for k in a if k != "steps"}
    out = {k: 1000 * sum(a.get(k, 0.0) - b.get(k, 0.0) for b, a, _ in parts) / steps for k in keys}
    return out | {"steps": steps, "client_per_step": 1000 * sum(d for *_, d in parts) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ping-pong", default="off,on", help="served runs: off, on or off,on")
    ap.add_argument("--port", type=int, default=8793)
    ap.add_argument("--before-tree", help="also serve this checkout (an earlier commit) in the same run, "
                                          "ping-pong off: the 'before' row")
    ap.add_argument("--engine", default="on", choices=("on", "off"),
                    help="also the cluster engine without Serve (the data plane apart from Serve/HTTP)")
    ap.add_argument("--skip-exchange", action="store_true", help="skip the exchange-vs-floor measurement")
    ap.add_argument("--actor-threads", default="1", type=lambda t: [int(x) for x in t.split(",")],
                    help="served runs with these torch threads per actor, e.g. 1,2")
    ap.add_argument("--expert-threads", default="1", type=lambda t: [int(x) for x in t.split(",")],
                    help="served runs (and single-process rows) with these expert GEMM threads, e.g. 1,2")
    ap.add_argument("--ingress", default="haproxy", help="served runs with these HTTP ingresses: haproxy, proxy "
                                                         "or haproxy,proxy (the serving config's `ingress`)")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    new, plen, reps = args.new_tokens, args.prompt_len, args.repeats
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MOERAY_CACHE_DIR": tmp}
        path = build_preset("deepseek-v3-tiny", Path(tmp) / "ckpt", dtype="float32", progress=False, overrides=SHAPE)
        rows: dict[str, dict[int, float]] = {}
        med = lambda f: statistics.median(f() for _ in range(reps))  # noqa: E731
        for n in streams:
            if have_transformers():
                rows.setdefault("transformers generate", {})[n] = med(lambda: transformers_rate(path, n, plen, new))
            rows.setdefault("single-process runner, 2 threads", {})[n] = med(lambda: single_rate(path, n, plen, new))
            for et in (t for t in args.expert_threads if t > 1):
                rows.setdefault(f"single-process runner, 1 thread + {et} expert threads", {})[n] = med(
                    lambda: single_rate(path, n, plen, new, et))
            print(json.dumps({k: v.get(n) for k, v in rows.items()} | {"streams": n}), flush=True)
        breakdowns = {}
        if args.engine == "on":
            rows["cluster engine 1x1, no Serve"], per = engine_rates(path, streams, plen, new, reps)
            breakdowns |= {("engine, no Serve", n): b for n, b in per.items()}
            print(json.dumps({"run": "engine, no Serve", "tok_s": rows["cluster engine 1x1, no Serve"],
                              "breakdown_ms": per}), flush=True)
        ingresses = args.ingress.split(",")
        runs = [("before", "off", args.before_tree, 1, 1, None)] if args.before_tree else []
        runs += [("now", mode, None, t, et, ing) for mode in args.ping_pong.split(",") for t in args.actor_threads
                 for et in args.expert_threads for ing in ingresses]
        # interleaved: each round serves every configuration once, in turn, so that the machine's
        # drift (shared cores) falls on all of them alike; the figure is the median over the rounds
        rates: dict = {}
        parts: dict = {}
        for r in range(reps):
            for label, mode, tree, threads, et, ing in (runs if r % 2 == 0 else runs[::-1]):
                name = f"served 1x1, {label}, ping-pong {mode}" + (f", {threads} threads/actor" if threads > 1 else "")
                shown = ing if len(ingresses) > 1 and ing else None
                name += (f", {et} expert threads" if et > 1 else "") + (f", ingress {shown}" if shown else "")
                key = label + (f"/{threads}t" if threads > 1 else "") + (f"/{et}et" if et > 1 else "") + f"/pp {mode}"
                key += f"/{shown}" if shown else ""
                with Served(path, args.port, mode == "on", env, tree, threads, et, ing) as app:
                    for n in streams:
                        rate = served_rate(app, n, plen, new, parts.setdefault((key, n), []))
                        rates.setdefault((name, n), []).append(rate)
                        print(json.dumps({"run": name, "round": r, "streams": n, "tok_s": rate}), flush=True)
                        if r == reps - 1:
                            rows.setdefault(name, {})[n] = statistics.median(rates[(name, n)])
                            breakdowns[(key, n)] = level_ms(parts[(key, n)])
    exchanges = [] if args.skip_exchange else [
        exchange_vs_floor(n, SHAPE["hidden_size"], SHAPE["num_experts_per_tok"], SHAPE["n_routed_experts"], m,
                          transport=t)
        for n in streams for m in ("dense", "sparse") for t in ("auto", "group")]
    single = rows["single-process runner, 2 threads"]
    print(f"\n{'system':58}" + "".join(f"{f'{n} streams tok/s':>20}{'vs single':>10}" for n in streams))
    for name, r in rows.items():
        print(f"{name:58}" + "".join(f"{r[n]:>20.1f}{r[n] / single[n]:>10.2f}" for n in streams))
    if not args.before_tree:
        print("(no --before-tree: the 'before' row needs a checkout of the earlier commit)")
    keys = sorted({k for b in breakdowns.values() for k in b if k != "steps"})
    if keys:
        print("\nper-step breakdown, ms (served cluster)")
        print(f"{'component':32}" + "".join(f"{f'{m}, {n} str':>22}" for m, n in breakdowns))
        for k in keys:
            print(f"{k:32}" + "".join(f"{b.get(k, float('nan')):>22.3f}" for b in breakdowns.values()))
    print("\none MoE layer's exchange (1 attention, 1 expert actor; identity experts, as the floors run no compute; "
          "then with the experts' GEMMs run and their time taken out, which leaves their effect on the caches) vs "
          "the floor: gloo's all_to_all_single of the same bytes out and back (and, for reference, one gloo send + "
          "one recv each way, and one over the direct sockets alone); transport auto: the direct sockets, group: "
          "gloo's sends")
    for e in exchanges:
        wire = f", sockets floor {e['wire_floor_ms']:.3f} ms" if e["wire_floor_ms"] is not None else ""
        print(f"  {e['mode']:6} {e['tokens']:>3} tokens, {e['transport']:5}: {e['exchange_ms']:.3f} ms vs floor "
              f"{e['floor_ms']:.3f} ms = {e['ratio']:.2f}x; with the GEMMs run {e['with_gemms_ms']:.3f} ms = "
              f"{e['with_gemms_ratio']:.2f}x  (gloo send/recv floor {e['p2p_floor_ms']:.3f} ms{wire})")
    print(json.dumps({"rates": rows, "breakdown_ms": {f"{m}/{n}": b for (m, n), b in breakdowns.items()},
                      "exchange": exchanges}))


if __name__ == "__main__":
    main()
