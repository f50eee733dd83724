"""The data plane without Ray or Serve: one attention and one expert worker in two processes over
gloo, against the single-process runner, on the issue-10 checkpoint (bench_overhead's shape).

    python bench/bench_actors.py [--streams 1,16] [--steps 40] [--expert-threads 1,2] [--micro 1]
                                 [--transport auto,group] [--profile]

Each worker is the real class (``AttentionWorker``, ``ExpertWorker``), joined to a two-rank process
group and driven step by step in its own process: the attention rank builds its decode chunks from
the tokens it sampled, the expert rank serves the exchanges of the same token counts. Prints the
wall ms per decode step and each worker thread's CPU ms per step — what the cluster's step costs
before Ray's calls and Serve's processes add theirs — and the single-process runner's ms per step
(1 and 2 torch threads) on the same checkpoint. ``--micro 2`` splits each step into two
micro-batches (ping-pong); ``--transport auto,group`` runs the exchange over the direct sockets
(``actors/wire.py``, the default) and over gloo's own sends and receives; ``--profile`` adds torch
profiler tables of 10 more steps per worker."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import SHAPE, prompts  # noqa: E402

from model.presets import build_preset  # noqa: E402

PROMPT, BLOCKS_PER_SEQ = 32, 8


def _worker(rank: int, path: str, streams: int, steps: int, port: int, expert_threads: int, micro: int,
            transport: str, profile: bool, q) -> None:
    from actors.framing import TOKEN_BYTES
    from actors.messages import ExpertStep, GroupInfo, SeqChunk, StepRequest
    from actors.router import even_table
    from model.config import load_config
    from model.sampling import SamplingParams

    torch.set_num_threads(1)
    cfg = load_config(path)
    table = even_table(cfg.n_routed_experts, cfg.moe_layers, 1, 1)
    if rank == 0:
        from actors.attention import AttentionWorker

        w = AttentionWorker(path, index=0, table=table, num_blocks=streams * BLOCKS_PER_SEQ + 1)
    else:
        from actors.expert import ExpertWorker

        w = ExpertWorker(path, index=0, table=table, expert_threads=expert_threads)
    token = b"b" * TOKEN_BYTES  # the epoch's token: the same in both processes
    w.enter_epoch(GroupInfo(0, "127.0.0.1", port, token, transport=transport), table, 0)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    ids = prompts(streams, PROMPT)
    sizes = [streams // micro + (m < streams % micro) for m in range(micro)]
    last: dict[int, int] = {}

    def step(s: int, cached: int) -> None:
        split = tuple(x for x in sizes if x) if cached else ()
        if rank == 0:
            chunks = tuple(SeqChunk(i, tuple(ids[i]) if cached == 0 else (last[i],), cached,
                                    tuple(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)), params=params)
                           for i in range(streams))
            last.update((t.seq_id, t.token_id) for t in w.step(StepRequest(s, 0, chunks, split)).tokens)
        else:
            tokens = tuple((x,) for x in split) if cached else ((streams * PROMPT,),)
            w.step(ExpertStep(s, 0, tokens))

    step(0, 0)
    pos = PROMPT
    for s in range(1, 6):  # warm up
        step(s, pos)
        pos += 1
    t0, c0 = time.perf_counter(), time.thread_time()
    for s in range(6, 6 + steps):
        step(s, pos)
        pos += 1
    out = {"rank": rank, "wall_ms": 1e3 * (time.perf_counter() - t0) / steps,
           "cpu_ms": 1e3 * (time.thread_time() - c0) / steps}
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CPU]) as p:
            for s in range(6 + steps, 16 + steps):
                step(s, pos)
                pos += 1
        out["profile"] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    w.shutdown()
    q.put(out)


def actors_ms(path: Path, streams: int, steps: int, expert_threads: int, micro: int, transport: str,
              profile: bool) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, str(path), streams, steps, port, expert_threads, micro, transport,
                                                        profile, q))
             for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted((q.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(60)
    return {"wall_ms": got[0]["wall_ms"], "attention_cpu_ms": got[0]["cpu_ms"], "expert_cpu_ms": got[1]["cpu_ms"],
            "profiles": [r.get("profile") for r in got]}


def single_ms(path: Path, streams: int, steps: int, threads: int) -> float:
    from model.loader import load_model
    from model.runner import ModelRunner, Sequence
    from model.sampling import SamplingParams

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = ModelRunner(load_model(path, dtype=torch.float32, progress=False),
                             num_blocks=streams * BLOCKS_PER_SEQ + 1)
        seqs = [Sequence(i, p, PROMPT, SamplingParams()) for i, p in enumerate(prompts(streams, PROMPT))]
        for s in seqs:
            runner.reserve(s, PROMPT + steps + 8)
        with torch.no_grad():
            logits = runner.forward(seqs, [PROMPT] * streams)
            times = []
            for k in range(steps + 5):
                for s, t in zip(seqs, logits.argmax(-1).tolist()):
                    s.token_ids.append(t)
                t0 = time.perf_counter()
                logits = runner.forward(seqs, [1] * streams)
                if k >= 5:
                    times.append(time.perf_counter() - t0)
        return 1e3 * statistics.fmean(times)
    finally:
        torch.set_num_threads(old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--expert-threads", default="1", help="e.g. 1,2")
    ap.add_argument("--micro", type=int, default=1, help="micro-batches per step (2: ping-pong)")
    ap.add_argument("--transport", default="auto", help="the exchange's transport(s): auto (direct sockets), "
                                                         "group (gloo's sends), or auto,group")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.steps + 16 + PROMPT > BLOCKS_PER_SEQ * 16:
        ap.error(f"--steps must be at most {BLOCKS_PER_SEQ * 16 - 16 - PROMPT} (the cache blocks per sequence)")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_preset("deepseek-v3-tiny", Path(tmp) / "ckpt", dtype="float32", progress=False, overrides=SHAPE)
        rows = []
        for n in (int(x) for x in args.streams.split(",")):
            row = {"streams": n, **{f"single_{t}t_ms": single_ms(path, n, args.steps, t) for t in (1, 2)}}
            for et in (int(x) for x in args.expert_threads.split(",")):
                for tr in args.transport.split(","):
                    r = actors_ms(path, n, args.steps, et, max(1, min(args.micro, n)), tr, args.profile)
                    for table in filter(None, r.pop("profiles")):
                        print(table)
                    row |= {f"actors_{et}et-{tr}_{k}": v for k, v in r.items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in rows:
        print(f"{row['streams']:>3} streams: single {row['single_1t_ms']:.2f} ms (1 thread), "
              f"{row['single_2t_ms']:.2f} ms (2 threads); " + "; ".join(
                  f"actors, {k.split('_')[1]}: {row[k]:.2f} ms per step (attention CPU "
                  f"{row[k.replace('wall_ms', 'attention_cpu_ms')]:.2f}, expert CPU {row[k.replace('wall_ms', 'expert_cpu_ms')]:.2f})"
                  for k in row if k.endswith("wall_ms")))


if __name__ == "__main__":
    main()
