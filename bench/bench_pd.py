"""Prefill/decode disaggregation against one engine (issue 55): running streams' inter-token latency while
long prompts arrive, the long prompts' TTFT, and what a transfer costs against its floor.

    python bench/bench_pd.py [--preset kimi-k2-tiny] [--streams 8] [--arrivals 4] [--long 2000 | 100:2000]
                             [--gap 0.5] [--rounds 3] [--thresholds 64,1024] [--quick]

On a local Ray cluster (one node, 2 CPUs of this machine shared by every actor), the preset's checkpoint
(fp32), async scheduling on, prefix caching on. Three systems, rounds interleaved:

- ``one engine``: a disaggregated 1 attention × 1 expert engine serving everything, prefills chunked
  (``max_tokens_per_step``, default 256) between the running streams' decode steps;
- ``PD``: the same engine as the decode engine, and a second 1 × 1 engine as the prefill engine
  (cluster/apd.py: each engine on its own thread of this process; their actors are separate processes);
  ``--thresholds`` sweeps ``min_uncached_tokens`` (the first is the PD system's; a threshold above the
  long prompts sends nothing across, as a control).

Each round: ``--streams`` short requests (16-token prompts, 160 greedy tokens each) start decoding; once
each has 8 tokens, ``--arrivals`` requests of ``--long`` random tokens (8 output tokens each) arrive
``--gap`` seconds apart; the round ends when every request is done. Reported per system (medians over
rounds): the running streams' ITL p50 and p99 over the window the long requests were in flight (from the
first one's arrival to the last one's first token), the same in a round of the one engine with no
arrivals, the long requests' TTFT p50, and for PD the transfer's time per request against its floor (its
bytes at this machine's copy bandwidth, as bench_step.py measures it) and the bytes. Every stream's tokens
are checked equal across systems (greedy; each system's round under its own cache salt, so none finds
another's prompts cached): the script says so loudly and exits 1 if not.

Timings are printed, never asserted."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))

from cluster.aengine import AsyncEngine  # noqa: E402
from cluster.apd import AsyncDisaggregated  # noqa: E402
from cluster.config import EngineConfig  # noqa: E402
from cluster.engine import Engine  # noqa: E402
from cluster.local import LocalCluster  # noqa: E402
from cluster.spec import ClusterSpec  # noqa: E402
from cluster.stream import EngineRequest  # noqa: E402
from model.presets import build_preset  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402


def copy_bandwidth() -> float:
    src = torch.randn(16 << 20)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.numel() * 4 / (time.perf_counter() - t0))
    return best


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one_round(front, short: list[list[int]], long: list[list[int]], gap: float, answer: int,
                    salt: str) -> dict:
    """Run the round; returns per-stream token times, tokens, and the long requests' arrival/first-token times."""
    times: dict = {}
    tokens: dict = {}

    async def run(kind, i, prompt, max_tokens):
        key = (kind, i)
        times[key], tokens[key] = [time.perf_counter()], []
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for chunk in front.generate(EngineRequest(tuple(prompt), params, salt)):
            if chunk.token_ids:
                times[key].append(time.perf_counter())
                tokens[key] += chunk.token_ids

    tasks = [asyncio.create_task(run("short", i, p, answer)) for i, p in enumerate(short)]
    while any(len(times.get(("short", i), ())) < 9 for i in range(len(short))):
        await asyncio.sleep(0.002)
    for i, p in enumerate(long):
        tasks.append(asyncio.create_task(run("long", i, p, 8)))
        await asyncio.sleep(gap)
    await asyncio.gather(*tasks)
    return {"times": times, "tokens": tokens}


def itl(result: dict, window: tuple[float, float] | None) -> list[float]:
    """The short streams' inter-token gaps (ms) whose later token fell in ``window`` (None: all after the 8th)."""
    out = []
    for (kind, _), ts in result["times"].items():
        if kind != "short":
            continue
        for a, b in zip(ts[9:], ts[10:]):
            if window is None or window[0] <= b <= window[1]:
                out.append(1e3 * (b - a))
    return out


def summarize(result: dict) -> dict:
    longs = [ts for (kind, _), ts in result["times"].items() if kind == "long"]
    window = (min(ts[0] for ts in longs), max(ts[1] for ts in longs)) if longs else None
    gaps = itl(result, window)
    return {"itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99),
            "ttft_p50_ms": 1e3 * statistics.median(ts[1] - ts[0] for ts in longs) if longs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k2-tiny")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--arrivals", type=int, default=4)
    ap.add_argument("--long", default="2000", help="the arriving prompts' tokens: N, or LO:HI drawn uniformly per "
                                                   "prompt (mixed lengths: what a threshold sweep weighs)")
    ap.add_argument("--answer", type=int, default=160)
    ap.add_argument("--gap", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--thresholds", default="64,4096")
    ap.add_argument("--transports", default="channel", help="how the blocks move, comma-separated: channel (each "
                                                            "actor's direct blocks channel), object_store (Ray calls)")
    ap.add_argument("--max-tokens-per-step", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="1 round, 4 streams, 2 arrivals of 600 tokens")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.streams, args.arrivals, args.long, args.answer = 1, 4, 2, "600", 60
    lo, _, hi = args.long.partition(":")
    lo, hi = int(lo), int(hi or lo)
    thresholds = [int(t) for t in args.thresholds.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    path = str(build_preset(args.preset, tmp / "ckpt", seed=0, dtype="float32", progress=False))
    bw = copy_bandwidth()
    rng = random.Random(55)
    import ray

    with LocalCluster(nodes=1, num_cpus=8, first_ip=70) as lc:
        ray.init(address=lc.address, logging_level="WARNING")
        cfg = EngineConfig.of(model=path, dtype="float32", num_blocks=1024, block_size=16, prefix_caching=True,
                              max_tokens_per_step=args.max_tokens_per_step, max_num_seqs=32)
        decode = AsyncEngine(Engine(cfg, ClusterSpec(attention=1, experts=1)).start()).start()
        prefill = AsyncEngine(Engine(cfg, ClusterSpec(attention=1, experts=1)).start()).start()
        fronts = {"one engine": decode}
        for via in args.transports.split(","):
            for t in thresholds:
                fronts[f"PD {via} (min_uncached_tokens {t})"] = AsyncDisaggregated(prefill, decode, min_uncached_tokens=t,
                                                                                  transport=via)
        rows: dict = {name: [] for name in fronts}
        quiet: list[float] = []
        same = True
        try:
            for r in range(args.rounds):
                short = [[rng.randrange(10, 900) for _ in range(16)] for _ in range(args.streams)]
                long = [[rng.randrange(10, 900) for _ in range(rng.randint(lo, hi))] for _ in range(args.arrivals)]
                # no arrivals: the baseline ITL
                q = asyncio.run(one_round(decode, short, [], 0.0, args.answer, f"quiet-{r}"))
                quiet += itl(q, None)
                ref = None
                for name, front in fronts.items():  # the same prompts, each system under its own cache salt
                    res = asyncio.run(one_round(front, short, long, args.gap, args.answer, f"{name}-{r}"))
                    rows[name].append(summarize(res))
                    if ref is None:
                        ref = res["tokens"]
                    elif res["tokens"] != ref:
                        same = False
                print(json.dumps({"round": r, **{n: v[-1] for n, v in rows.items()}}), flush=True)
        finally:
            prefill.stop()
            decode.stop()
            status = {n: f.status() for n, f in fronts.items() if isinstance(f, AsyncDisaggregated)}
            prefill.engine.shutdown()
            decode.engine.shutdown()
    med = lambda xs: statistics.median(x for x in xs if x is not None) if any(x is not None for x in xs) else None  # noqa: E731
    print(f"\n{args.preset}, {args.streams} running streams, {args.arrivals} arrivals of {args.long} tokens "
          f"{args.gap:g} s apart; medians of {args.rounds} rounds; copy bandwidth {bw / 1e9:.1f} GB/s")
    print(f"running streams with no arrivals: ITL p50 {pct(quiet, 0.5):.1f} ms, p99 {pct(quiet, 0.99):.1f} ms")
    for name, v in rows.items():
        p50, p99, ttft = (med([x[k] for x in v]) for k in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms"))
        print(f"{name:<46} ITL p50 {p50:7.1f} ms  p99 {p99:7.1f} ms ({p99 / pct(quiet, 0.99):.2f}x quiet)  "
              f"long TTFT p50 {ttft:8.1f} ms")
    for name, s in status.items():
        n = s["routes"].get("pd", 0)
        if n:
            per_s, per_b = s["transfer_s"] / n, s["bytes_moved"] / n
            read_ms, write_ms = 1e3 * s["read_s"] / n, 1e3 * s["write_s"] / n
            print(f"{name}: of each transfer, the actors' read {read_ms:.1f} ms and write {write_ms:.1f} ms (over "
                  f"{s['transport']}), the rest {1e3 * per_s - read_ms - write_ms:.1f} ms waiting for the "
                  "engines' threads (decode settles its steps in flight first)")
            print(f"{name}: {n} transfers, {per_b / 1e6:.2f} MB each, {1e3 * per_s:.1f} ms each against a floor of "
                  f"{1e3 * per_b / bw:.2f} ms ({per_s * bw / per_b:.0f}x); routes {s['routes']}; failures {s['failures']}")
        else:
            print(f"{name}: no transfers; routes {s['routes']}")
    if not same:
        print("!!! THE SYSTEMS' TOKENS DIFFER !!!")
        sys.exit(1)
    print("every system's tokens equal (greedy)")


if __name__ == "__main__":
    main()
