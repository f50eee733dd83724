"""The KV tier (issue 56): an agent trace whose working set is several times the device pool, with the tier off,
the node tier, and the node tier over a disk tier; and the recovery of a killed attention actor at long contexts
with the tier off and on.

    python bench/bench_kv_tier.py [--preset kimi-k2-tiny] [--sessions 40] [--clients 3] [--turns 6]
                                  [--system 512] [--turn-tokens 64] [--pool-ratio 5] [--rounds 3] [--systems off,node,disk,control]
                                  [--contexts 4096,16384] [--skip-trace] [--skip-recovery] [--cross-context 4096]
                                  [--cross-on process|ray]

**Trace** (in this process: the in-process executor, the async engine on its own thread): ``--sessions`` agent
sessions share one ``--system``-token tool/system prompt; each turn resends the session's whole history plus
``--turn-tokens`` new tokens and asks for 16 tokens. ``--clients`` clients each own a share of the sessions and
serve them turn by turn, round-robin, so a session's next turn comes after its client's other sessions' turns:
their histories push each other out of the device pool, sized so that the working set (the shared prompt once,
every session's final history) is ``--pool-ratio`` times it (and never less than the clients' requests at once
need). The same trace runs with the tier off, on (node tier
in /dev/shm), and on with a node tier holding a quarter of the working set over a disk tier (the rest on disk),
and as a control with the tier off and a device pool that holds the whole working set (the best a tier could
do), rounds interleaved. Reported (medians over rounds): prompt tokens found cached (device pool and tier) over those
looked up, TTFT p50 and p99, output tokens/s and requests/s over the trace; every answer is checked equal across
the systems (greedy).

**Recovery** (a local Ray cluster, a 1 attention × 1 expert engine): one stream whose prompt is ``--contexts``
tokens decodes; after 8 tokens its attention actor is killed. Reported per context, tier off and on: the stream's
stall (the longest gap between two of its tokens), the engine's recovery (the replacement started and regrouped),
and the rest of the stall — the redone step: re-prefilling the whole context without the tier, loading it with
the tier. Tokens are checked equal to the fault-free run.

**Across nodes** (in this process: two replicas as two logical nodes, each node's tier its own directory): a
``--cross-context``-token history on node 1's tier alone; its next turn's TTFT when loaded on node 1, loaded on
node 0 from node 1's tier, and prefilled on node 0. Timings are printed, never asserted."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from cluster.aengine import AsyncEngine  # noqa: E402
from cluster.config import EngineConfig  # noqa: E402
from cluster.engine import Engine  # noqa: E402
from cluster.inprocess import InProcessExecutor  # noqa: E402
from cluster.spec import ClusterSpec  # noqa: E402
from cluster.stream import EngineRequest  # noqa: E402
from model.config import load_config  # noqa: E402
from model.presets import build_preset  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

BS = 16
ANSWER = 16


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def trace(args, rng_seed: int) -> list[list[list[int]]]:
    """sessions × turns prompts: one shared system prompt, each session's history growing by a turn's tokens."""
    import random

    rng = random.Random(rng_seed)
    system = [rng.randrange(10, 900) for _ in range(args.system)]
    out = []
    for _ in range(args.sessions):
        history = [rng.randrange(10, 900) for _ in range(args.turn_tokens * args.turns)]
        out.append([system + history[:args.turn_tokens * (t + 1)] for t in range(args.turns)])
    return out


async def run_trace(front: AsyncEngine, prompts, clients: int) -> dict:
    ttft, answers, out_tokens = [], {}, 0

    async def client(c: int):
        nonlocal out_tokens
        mine = [s for s in range(len(prompts)) if s % clients == c]
        for t in range(len(prompts[0])):
            for s in mine:
                t0, first = time.perf_counter(), None
                got = []
                async for chunk in front.generate(EngineRequest(tuple(prompts[s][t]),
                                                                SamplingParams(max_tokens=ANSWER, ignore_eos=True))):
                    if chunk.token_ids and first is None:
                        first = time.perf_counter()
                    got += chunk.token_ids
                ttft.append(first - t0)
                answers[(s, t)] = got
                out_tokens += len(got)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    return {"ttft": ttft, "answers": answers, "wall": wall, "out_tokens": out_tokens, "requests": len(answers)}


def trace_part(args, path: str) -> None:
    prompts = trace(args, 56)
    working = (args.system // BS + args.sessions * args.turn_tokens * args.turns // BS)  # blocks
    pool = max(int(working / args.pool_ratio), args.clients * ((args.system + args.turn_tokens * args.turns) // BS + 2))
    per_block = None
    # the control: a device pool that holds the whole working set (the best any tier could do)
    systems = {"tier off": None, "node tier": "node", "node + disk": "disk", "pool holds all": "control"}
    pick = {"off": "tier off", "node": "node tier", "disk": "node + disk", "control": "pool holds all"}
    systems = {pick[k]: systems[pick[k]] for k in args.systems.split(",")}
    rows: dict = {n: [] for n in systems}
    same = True
    for r in range(args.rounds):
        ref = None
        for name, kind in systems.items():
            dirs = []
            knobs = dict(num_blocks=pool, block_size=BS, prefix_caching=True, max_tokens_per_step=512,
                         max_num_seqs=args.clients)
            if kind == "control":
                knobs["num_blocks"] = working + pool
            elif kind is not None:
                node = tempfile.mkdtemp(prefix="bench-kv-", dir="/dev/shm")
                dirs.append(node)
                gib = 1.0
                if kind == "disk":
                    per_block = per_block or _block_bytes(path)
                    gib = working * per_block / 4 / 2**30  # a quarter of the working set in host memory
                    disk = tempfile.mkdtemp(prefix="bench-kv-disk-")
                    dirs.append(disk)
                    knobs |= dict(kv_offloading_disk=disk, kv_offloading_disk_size=1.0)
                knobs |= dict(kv_offloading_size=gib, kv_offloading_path=node)
            cfg = EngineConfig.of(path, **knobs)
            spec = ClusterSpec(attention=1, experts=1)
            eng = Engine(cfg, spec, executor=InProcessExecutor(cfg, spec, load_config(path))).start()
            front = AsyncEngine(eng).start()
            try:
                res = asyncio.run(run_trace(front, prompts, args.clients))
            finally:
                front.stop()
                status = eng.status()
                eng.shutdown()
                for d in dirs:
                    shutil.rmtree(d, ignore_errors=True)
            pc = status["prefix_cache"][0]
            tier = status["kv_tier"] or {}
            actor = (tier.get("actors") or {}).get("0", {})
            row = {"hit": pc["hit_tokens"] / pc["queries_tokens"], "ttft_p50_ms": 1e3 * pct(res["ttft"], 0.5),
                   "ttft_p99_ms": 1e3 * pct(res["ttft"], 0.99), "tok_s": res["out_tokens"] / res["wall"],
                   "req_s": res["requests"] / res["wall"], "loaded_tokens": tier.get("loaded_tokens", 0),
                   "tiers": [(t["tier"], t["hits"], t["evictions"]) for t in actor.get("tiers", [])]}
            rows[name].append(row)
            if ref is None:
                ref = res["answers"]
            elif res["answers"] != ref:
                same = False
            print(json.dumps({"round": r, "system": name, **row}), flush=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"\n{args.preset}: {args.sessions} sessions × {args.turns} turns, {args.clients} clients; a {args.system}-token "
          f"shared prompt, +{args.turn_tokens} tokens a turn; working set {working} blocks, device pool {pool} "
          f"({working / pool:.1f}×); medians of {args.rounds} rounds")
    base = rows.get("tier off") or next(iter(rows.values()))  # (the ratios' reference: the tier off, when it ran)
    for name, v in rows.items():
        p50, p99, tok, req, hit = (med([x[k] for x in v]) for k in ("ttft_p50_ms", "ttft_p99_ms", "tok_s", "req_s",
                                                                     "hit"))
        b50, btok = med([x["ttft_p50_ms"] for x in base]), med([x["tok_s"] for x in base])
        print(f"{name:<12} hit {hit:6.1%}  TTFT p50 {p50:7.1f} ms ({b50 / p50:4.1f}× lower)  p99 {p99:7.1f} ms  "
              f"{tok:7.1f} tok/s ({tok / btok:4.2f}×)  {req:5.2f} req/s  tiers {v[-1]['tiers']}")
    if not same:
        print("!!! THE SYSTEMS' ANSWERS DIFFER !!!")
        sys.exit(1)
    print("every system's answers equal (greedy)")


def _block_bytes(path: str) -> int:
    cfg = load_config(path)
    return (len(cfg.mla_layers)) * BS * cfg.latent_dim * 4 + 256  # fp32 rows and the entry's header


def recovery_part(args, tmp: Path) -> None:
    import ray

    from cluster.local import LocalCluster

    contexts = [int(c) for c in args.contexts.split(",")]
    path = str(build_preset(args.preset, tmp / "ckpt-long", seed=0, dtype="float32", progress=False,
                            overrides={"max_position_embeddings": max(contexts) + 512}))
    rows = []
    with LocalCluster(nodes=1, num_cpus=4, first_ip=72) as lc:
        ray.init(address=lc.address, logging_level="WARNING")
        for ctx in contexts:
            import random

            rng = random.Random(ctx)
            prompt = [rng.randrange(10, 900) for _ in range(ctx)]
            params = SamplingParams(max_tokens=24, ignore_eos=True)
            want = None
            for tiered in (False, True):
                for _ in range(args.rounds):
                    node = tempfile.mkdtemp(prefix="bench-kv-rec-", dir="/dev/shm")
                    knobs = dict(num_blocks=ctx // BS + 64, block_size=BS, prefix_caching=True, max_tokens_per_step=2048)
                    if tiered:
                        knobs |= dict(kv_offloading_size=1.0, kv_offloading_path=node)
                    eng = Engine(EngineConfig.of(path, **knobs), ClusterSpec(attention=1, experts=1)).start()
                    try:
                        got, stall, rec = _kill_mid_stream(eng, prompt, params)
                    finally:
                        eng.shutdown()
                        shutil.rmtree(node, ignore_errors=True)
                    want = want or got
                    rows.append({"context": ctx, "tier": tiered, "stall_s": stall, "recovery_s": rec,
                                 "redo_s": stall - rec, "same": got == want})
                    print(json.dumps(rows[-1]), flush=True)
        ray.shutdown()
    print("\nrecovery of a killed attention actor mid-stream (medians):")
    for ctx in contexts:
        for tiered in (False, True):
            v = [r for r in rows if r["context"] == ctx and r["tier"] == tiered]
            stall, rec, redo = (statistics.median(r[k] for r in v) for k in ("stall_s", "recovery_s", "redo_s"))
            print(f"  {ctx:>6} tokens, tier {'on ' if tiered else 'off'}: stall {stall:6.2f} s = recovery {rec:5.2f} s "
                  f"+ the redone step {redo:6.2f} s" + ("" if all(r["same"] for r in v) else "  !!! TOKENS DIFFER"))
        off = statistics.median(r["redo_s"] for r in rows if r["context"] == ctx and not r["tier"])
        on = statistics.median(r["redo_s"] for r in rows if r["context"] == ctx and r["tier"])
        print(f"  {ctx:>6} tokens: the redone step {off / on:.1f}× faster with the tier")


def _kill_mid_stream(eng: Engine, prompt, params) -> tuple[list[int], float, float]:
    """Run one request; after its 8th token kill its attention actor (once the tier has filed its blocks).
    Returns (tokens, the stream's longest gap, the engine's recovery seconds)."""
    rid = eng.add_request(prompt, params)
    times, killed = [], False
    while eng.busy:
        events = eng.pipelined()
        if any(ev.token_ids for ev in events):
            times.append(time.perf_counter())
        req = eng.requests.get(rid)
        if not killed and req is not None and len(req.seq.output_ids) >= 8:
            if eng.tier is not None:
                eng.executor.tier(0, "tier_flush")
            eng.executor.kill("attention", 0)
            killed = True
    seq = eng.release(rid).seq
    gaps = [b - a for a, b in zip(times, times[1:])]
    return seq.output_ids, max(gaps), sum(eng.stats.recoveries)


def cross_part(args, path: str, tmp: Path) -> None:
    """One ``--cross-context``-token history written through on node 1 of two nodes, each node's tier its own
    directory, then gone from the device pools; its next turn (one token) served three ways, rounds interleaved:
    on replica 1 (its node's tier holds it: a local load), on replica 0 (replica 0's actor reads the entries from
    replica 1's: a cross-node load), on replica 0 with the tier's cross-node loads off (prefilled). The two nodes
    are logical ones in this process, or with ``--cross-on ray`` two Ray nodes of this machine (the actors' own
    processes; ``{node}`` directories), where the entries cross between the actors through Ray."""
    if args.cross_on != "ray":
        return _cross(args, path, tmp, None)
    import ray

    from cluster.local import LocalCluster

    with LocalCluster(nodes=2, num_cpus=4, first_ip=74) as lc:
        ray.init(address=lc.address, logging_level="WARNING")
        try:
            _cross(args, path, tmp, lc.node_ips)
        finally:
            ray.shutdown()


def _cross(args, path: str, tmp: Path, ips: list[str] | None) -> None:
    import random

    from actors.tier import ActorTier
    from cluster.kv_transfer import tier_spec

    ctx = args.cross_context
    rng = random.Random(5)
    history = [rng.randrange(10, 900) for _ in range(ctx + 64)]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    knobs = dict(num_blocks=2 * (ctx + 64) // BS + 16, block_size=BS, prefix_caching=True, max_tokens_per_step=2048,
                 kv_offloading_size=1.0, kv_offloading_path=str(tmp / ("{node}" if ips else "node0")))
    cfg = EngineConfig.of(path, **knobs)
    if ips:  # two Ray nodes: the actors open their own node's directory
        eng = Engine(cfg, ClusterSpec(attention=2, experts=1, attention_nodes=(ips[0], ips[1]))).start()
        node0 = tmp / ips[0]
    else:
        spec = ClusterSpec(attention=2, experts=1)
        eng = Engine(cfg, spec, executor=InProcessExecutor(cfg, spec, load_config(path))).start()
        eng.executor.node_of = lambda replica: f"node{replica}"
        worker = eng.executor.workers[1]
        worker.tier.close()
        worker.tier = ActorTier({**tier_spec(cfg, load_config(path)), "path": str(tmp / "node1")}, worker.cache)
        node0 = tmp / "node0"
    times: dict[str, list[float]] = {"local load (replica 1)": [], "cross-node load (replica 0)": [],
                                     "prefill (replica 0, cross-node off)": []}
    want = None

    def serve(prompt, replica: int) -> list[int]:
        rid = eng.add_request(prompt, one, replica=replica)
        while eng.busy:
            eng.pipelined()
        return eng.release(rid).seq.output_ids

    try:
        serve(history[:ctx], 1)
        eng.executor.tier(1, "tier_flush")
        for _ in range(args.rounds):
            for what, replica, remote in (("local load (replica 1)", 1, True), ("cross-node load (replica 0)", 0, True),
                                          ("prefill (replica 0, cross-node off)", 0, False)):
                eng.scheduler.cache.forget([0, 1])
                eng.executor.tier(0, "tier_flush")
                for f in node0.rglob("*.kv"):  # (node 0's copy from the last cross-node load)
                    f.unlink()
                eng.tier.remote, eng.tier.load_cost = remote, None
                t0 = time.perf_counter()
                got = serve(history[:ctx + 64], replica)
                times[what].append(time.perf_counter() - t0)
                want = want or got
                assert got == want, f"{what}: tokens differ"
        st = eng.tier.status()
    finally:
        eng.shutdown()
    print(f"\na {ctx}-token history's next turn ({'two Ray nodes' if ips else 'in process'}; TTFT, medians of "
          f"{args.rounds}; {st['remote_blocks']:,} blocks came from the other node):")
    base = statistics.median(times["prefill (replica 0, cross-node off)"])
    for what, v in times.items():
        print(f"  {what:<38} {1e3 * statistics.median(v):8.1f} ms  (the prefill / {base / statistics.median(v):.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k2-tiny")
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--pool-ratio", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default="off,node,disk,control",
                    help="the trace's systems, any of off, node, disk, control (ratios: against off, else the first)")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--skip-recovery", action="store_true")
    ap.add_argument("--cross-context", type=int, default=4096, help="the cross-node load's history (0: skip it)")
    ap.add_argument("--cross-on", choices=("process", "ray"), default="process",
                    help="the cross-node load's two nodes: logical ones in this process, or two Ray nodes")
    args = ap.parse_args()
    if not args.systems or not set(args.systems.split(",")) <= {"off", "node", "disk", "control"}:
        ap.error(f"--systems takes off, node, disk and control, comma-separated; got {args.systems!r}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-kv-tier-"))
    try:
        if not args.skip_trace:
            longest = args.system + args.turn_tokens * args.turns + ANSWER
            path = str(build_preset(args.preset, tmp / "ckpt", seed=0, dtype="float32", progress=False,
                                    overrides={"max_position_embeddings": max(4096, longest + 64)}))
            trace_part(args, path)
        if args.cross_context:
            path = str(build_preset(args.preset, tmp / "ckpt-cross", seed=0, dtype="float32", progress=False,
                                    overrides={"max_position_embeddings": args.cross_context + 512}))
            cross_part(args, path, tmp)
        if not args.skip_recovery:
            recovery_part(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
