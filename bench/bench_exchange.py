"""One MoE layer's expert exchange between two processes on this machine, per transport, against its
floors: shared memory (transport auto, actors/shm.py), the direct sockets (socket, actors/wire.py) and
gloo's own sends (group), each beside the time of copying the same bytes once in memory (what a
shared-memory exchange cannot go below) and gloo's all_to_all_single of them. Identity experts, so the
exchange alone is timed (bench/bench_overhead.py's measurement, which this reuses).

    python bench/bench_exchange.py                       # the benchmark preset's width (256), 1 and 16 tokens
    python bench/bench_exchange.py --hidden 1024 --tokens 1,16,256 --transports auto,socket
    python bench/bench_exchange.py --colocated          # two colocated workers: mailboxes (auto) vs sockets

``--colocated`` times a whole colocated MoE layer (actors/colocated.py) between two worker processes,
each holding half of the experts (real GEMMs, one thread each), per step shape (``--shapes``: each
worker's tokens, e.g. 1:0 is one stream, 8:8 sixteen), over the sockets (``transport: socket``) and
the mailboxes (``auto``, actors/board.py): the median of issue + collect on worker 0, and of that its
waits for the peer's messages and its experts' GEMMs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def memcpy_ms(nbytes: int, iters: int = 200) -> float:
    """Median ms to copy ``nbytes`` once (one thread): the floor of moving them through shared memory."""
    import torch

    torch.set_num_threads(1)
    src, dst = torch.empty(max(nbytes, 1), dtype=torch.uint8), torch.empty(max(nbytes, 1), dtype=torch.uint8)
    src.fill_(1)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _colocated_worker(rank: int, port: int, shape: tuple[int, int], transport: str, iters: int, q) -> None:
    import torch

    from actors.colocated import ColocatedExchange
    from actors.framing import TOKEN_BYTES
    from actors.group import join_group, leave_group
    from actors.messages import GroupInfo, PlacementTable
    from model.layers import silu_glu
    from model.moe import RoutedExperts

    torch.set_num_threads(1)
    E, H, K, inter = 32, 256, 8, 128  # issue 54's checkpoint's MoE layer
    join_group(GroupInfo(0, "127.0.0.1", port, b"c" * TOKEN_BYTES, timeout_s=60, transport=transport), rank, 2,
               num_attention=2, colocated=True)
    halves = (tuple(range(E // 2)), tuple(range(E // 2, E)))
    table = PlacementTable(0, E, 2, (1,), (halves,), colocated=True)
    experts = RoutedExperts(H, inter, halves[rank], silu_glu)
    torch.nn.init.normal_(experts.w13, std=0.02), torch.nn.init.normal_(experts.w2, std=0.02)
    d = ColocatedExchange(f"worker[{rank}]", rank, table, {1: experts}, H, torch.float32, K, exchange_format="dense")
    g = torch.Generator().manual_seed(rank)
    T = shape[rank]
    x, w = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.long)
    whole, waited, gemms = [], [], []
    with torch.no_grad():
        for step in range(iters):
            d.begin_step(step, (shape,))
            t0 = time.perf_counter()
            d.collect(d.issue(1, x, idx, w))
            whole.append(time.perf_counter() - t0)
            waited.append(d.exchange_s)
            gemms.append(d.expert_s)
    leave_group()
    q.put((rank, [1000 * statistics.median(v[iters // 5:]) for v in (whole, waited, gemms)],
           d.board is not None and d.board.exchanges == iters))


def colocated_ms(shape: tuple[int, int], transport: str, iters: int) -> dict:
    """Worker 0's median ms per MoE layer: whole, waiting for the peer, in its experts' GEMMs."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_colocated_worker, args=(r, port, shape, transport, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    answers = [q.get(timeout=300) for _ in range(2)]
    for p in procs:
        p.join(30)
    (whole, waited, gemms), boxed = next((a[1], a[2]) for a in answers if a[0] == 0)
    return dict(shape=list(shape), transport=transport, whole_ms=whole, wait_ms=waited, experts_ms=gemms,
                mailboxes=boxed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", default="1,16", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--mode", default="dense", choices=("dense", "sparse"))
    ap.add_argument("--transports", default="auto,socket,group", type=lambda t: t.split(","))
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--colocated", action="store_true", help="time a colocated layer: mailboxes vs sockets")
    ap.add_argument("--shapes", default="1:0,8:8", type=lambda t: [tuple(int(n) for n in s.split(":")) for s in t.split(",")])
    ap.add_argument("--rounds", type=int, default=3, help="--colocated: interleaved rounds (medians over them)")
    args = ap.parse_args(argv)
    if args.colocated:
        results = []
        for shape in args.shapes:
            runs = {t: [colocated_ms(shape, t, args.iters) for _ in range(args.rounds)] for t in ("socket", "auto")}
            med = {t: {k: statistics.median(r[k] for r in rs) for k in ("whole_ms", "wait_ms", "experts_ms")}
                   for t, rs in runs.items()}
            for t in ("socket", "auto"):
                m = med[t]
                print(f"colocated {shape[0]}:{shape[1]} tokens  {t:6}: a MoE layer {m['whole_ms']:.3f} ms (waiting "
                      f"{m['wait_ms']:.3f}, experts {m['experts_ms']:.3f}, the rest {m['whole_ms'] - m['wait_ms'] - m['experts_ms']:.3f})"
                      + ("  [mailboxes]" if all(r["mailboxes"] for r in runs[t]) else ""), flush=True)
            print(f"colocated {shape[0]}:{shape[1]} tokens: mailboxes / sockets = "
                  f"{med['auto']['whole_ms'] / med['socket']['whole_ms']:.2f}", flush=True)
            results.append({"shape": list(shape), **{t: med[t] for t in med}})
        print(json.dumps(results))
        return 0

    from bench_overhead import exchange_vs_floor

    rows = []
    for tokens in args.tokens:
        width = args.hidden + 2 * args.k if args.mode == "dense" else args.hidden
        rows_out = tokens if args.mode == "dense" else tokens * args.k
        nbytes = 4 * rows_out * (width + args.hidden)  # out and back, fp32
        copy = memcpy_ms(nbytes)
        for transport in args.transports:
            e = exchange_vs_floor(tokens, args.hidden, args.k, args.experts, args.mode, iters=args.iters,
                                  transport=transport)
            e.update(bytes=nbytes, memcpy_ms=copy)
            rows.append(e)
            wire = e["wire_floor_ms"]
            bare = f"the bytes alone over its links {wire:.3f} ms = {wire / copy:6.1f}x a memcpy" if wire else \
                f"gloo's send/recv alone {e['p2p_floor_ms']:.3f} ms"
            print(f"{tokens:>5} tokens ({nbytes / 1024:8.1f} KiB out and back) {transport:6}: exchange "
                  f"{e['exchange_ms']:.3f} ms ({e['ratio']:.2f}x gloo's all_to_all_single, {e['floor_ms']:.3f} ms); "
                  f"{bare} ({copy:.4f} ms)", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
