"""One MoE layer's expert exchange between two processes on this machine, per transport, against its
floors: shared memory (transport auto, actors/shm.py), the direct sockets (socket, actors/wire.py) and
gloo's own sends (group), each beside the time of copying the same bytes once in memory (what a
shared-memory exchange cannot go below) and gloo's all_to_all_single of them. Identity experts, so the
exchange alone is timed (bench/bench_overhead.py's measurement, which this reuses).

    python bench/bench_exchange.py                       # the benchmark preset's width (256), 1 and 16 tokens
    python bench/bench_exchange.py --hidden 1024 --tokens 1,16,256 --transports auto,socket
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", default="1,16", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--mode", default="dense", choices=("dense", "sparse"))
    ap.add_argument("--transports", default="auto,socket,group", type=lambda t: t.split(","))
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args(argv)

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
