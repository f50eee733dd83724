"""Prefix caching's gain and cost (issue 26): multi-turn conversations with the cache on against off, in one run.

    python bench/bench_prefix.py [--presets kimi-k2-tiny,kimi-k3-tiny] [--runs 3] [--convs 8] [--turns 6]
                                 [--system 1000] [--answer 32] [--quick]

On a local Ray cluster (2 nodes), per preset: two engines started side by side, prefix caching on
and off, each ``--attention`` × ``--experts`` actors (default 1 × 1), async scheduling on, room in
the cache for every conversation at once (``--num-blocks``, default 1024 blocks of 16 tokens).

Conversations: ``--convs`` conversations share one ``--system``-token system prompt (random ids,
fixed seed), each with its own first user message (~50 tokens); each later turn's prompt is the
previous turn's whole sequence (prompt and answer) plus a new ~40-token user message. All the
conversations' turn-k requests are added at once and drained (``--answer`` greedy tokens each,
ignore_eos), then turn k+1 goes. TTFT of a request is the engine's own record (first token applied
− request added, so it includes its wait behind the other conversations' prefills). ``--runs``
rounds alternate on / off; each round uses its own cache salt, so the cache-on engine starts every
round cold (turn 1 may still share the system prompt between conversations admitted in later
steps). Both engines must give identical answers to every request (greedy); the script says so
loudly if not, and exits 1.

Per mode: TTFT p50 at turn 1 and at turns >= 2 (medians over rounds), the ratio off / on at turns
>= 2 (goal: >= 3), the wall time of a round, the hit rate (prompt tokens found cached / prompt tokens
looked up, the scheduler's counters) overall and at turns >= 2, and on hybrid models (K3) the KDA
snapshots: bytes each, the configured cap (``snapshot_bytes`` and what it allows, at most one per
grid boundary the cache has blocks for) and the snapshots in use (held + cached over replicas) after
the first round and at the end (earlier rounds' stay cached under their salt).

Then a 0 % hit rate: ``--random-requests`` random prompts of ``--random-prompt`` tokens (no shared
prefix; fresh ids each round) with ``--answer`` output tokens on both engines, alternating; median
tokens/s (prompt + output tokens over the drain's wall time) and the ratio on / off (goal: >= 0.97).

Timings are printed, never asserted."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time

import ray

from cluster.config import snapshot_plan
from cluster.engine import Engine, EngineConfig
from cluster.local import LocalCluster
from cluster.spec import ClusterSpec
from model.presets import build_preset
from model.sampling import SamplingParams

MODES = ("on", "off")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1, 700) for _ in range(n)]


def workload(convs: int, turns: int, system: int, seed: int = 26) -> tuple[list[int], list[list[list[int]]]]:
    """(system prompt, messages[turn][conv]): a ~50-token first user message per conversation, ~40
    tokens at each later turn (lengths vary by a few tokens so that conversations don't align)."""
    rng = random.Random(seed)
    sys_prompt = _ids(rng, system)
    msgs = [[_ids(rng, (50 if t == 0 else 40) + rng.randint(-3, 3)) for _ in range(convs)] for t in range(turns)]
    return sys_prompt, msgs


def _drain(eng: Engine) -> None:
    while eng.busy:  # the async engine's loop; refresh jobs (K3) run here too
        eng.pipelined()


def _prefix_counters(eng: Engine) -> tuple[int, int]:
    s = eng.scheduler
    return sum(s.cache.queries.values()), sum(s.cache.hits.values())


def conversation_round(eng: Engine, sys_prompt: list[int], msgs: list[list[list[int]]], answer: int,
                       salt: str) -> dict:
    """One round of all conversations, turn by turn. Returns per-turn TTFTs (s), the answers
    [turn][conv], wall time, and the prefix counters' growth over the round."""
    convs = len(msgs[0])
    params = SamplingParams(max_tokens=answer, ignore_eos=True)
    history: list[list[int]] = [list(sys_prompt) for _ in range(convs)]
    ttft: list[list[float]] = []
    answers: list[list[list[int]]] = []
    hits: list[list[tuple[int, int]]] = []  # [turn][conv]: (num_hit, prompt tokens)
    q0, h0 = _prefix_counters(eng)
    wall = 0.0
    for turn_msgs in msgs:
        prompts = [h + m for h, m in zip(history, turn_msgs)]
        t0 = time.perf_counter()
        ids = [eng.add_request(p, params, cache_salt=salt) for p in prompts]
        _drain(eng)
        wall += time.perf_counter() - t0
        reqs = [eng.release(i) for i in ids]
        ttft.append([r.first_token - r.arrival for r in reqs])
        answers.append([list(r.seq.output_ids) for r in reqs])
        hits.append([(r.seq.num_hit or 0, r.seq.num_prompt_tokens) for r in reqs])
        history = [list(r.seq.token_ids) for r in reqs]
    q1, h1 = _prefix_counters(eng)
    return {"ttft": ttft, "answers": answers, "hits": hits, "wall_s": wall, "queries": q1 - q0, "hit_tokens": h1 - h0}


def random_round(eng: Engine, n: int, prompt_len: int, answer: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [_ids(rng, prompt_len) for _ in range(n)]
    params = SamplingParams(max_tokens=answer, ignore_eos=True)
    q0, h0 = _prefix_counters(eng)
    t0 = time.perf_counter()
    ids = [eng.add_request(p, params) for p in prompts]
    _drain(eng)
    wall = time.perf_counter() - t0
    out = [list(eng.release(i).seq.output_ids) for i in ids]
    q1, h1 = _prefix_counters(eng)
    return {"tok_s": n * (prompt_len + answer) / wall, "wall_s": wall, "answers": out,
            "queries": q1 - q0, "hit_tokens": h1 - h0}


def snapshots_in_use(eng: Engine) -> int:
    snaps = eng.scheduler.cache.snaps
    return sum(p.num_held + p.num_cached for p in snaps) if snaps else 0


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def _ms(x: float) -> float:
    return round(1000 * x, 1)


def bench_preset(preset: str, args, lc_dir: str) -> dict:
    path = str(build_preset(preset, f"{lc_dir}/{preset}", dtype="float32", progress=False))
    spec = ClusterSpec(attention=args.attention, experts=args.experts)
    base = dict(model=path, num_blocks=args.num_blocks, max_tokens_per_step=args.max_tokens_per_step,
                max_num_seqs=args.max_num_seqs)
    configs = {"on": EngineConfig.of(**base, prefix_caching=True), "off": EngineConfig.of(**base, prefix_caching=False)}
    engines = {m: Engine(configs[m], spec).start() for m in MODES}
    mismatches: list[str] = []
    try:
        for m in MODES:  # warm: the first steps of each engine (allocation, first prefill and decode)
            engines[m].generate([[(7 * i) % 700 + 1 for i in range(300)]],
                                SamplingParams(max_tokens=8, ignore_eos=True), cache_salt="warm")
        sys_prompt, msgs = workload(args.convs, args.turns, args.system)
        conv = {m: [] for m in MODES}
        snap_first = None
        for r in range(args.runs):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for m in order:
                conv[m].append(conversation_round(engines[m], sys_prompt, msgs, args.answer, f"bench-prefix-{r}"))
            if r == 0:
                snap_first = snapshots_in_use(engines["on"])
            a, b = conv["on"][-1]["answers"], conv["off"][-1]["answers"]
            for t in range(args.turns):
                for c in range(args.convs):
                    if a[t][c] != b[t][c]:
                        first = next((i for i, (x, y) in enumerate(zip(a[t][c], b[t][c])) if x != y), 0)
                        on_ids, off_ids = a[t][c][first:first + 6], b[t][c][first:first + 6]
                        mismatches.append(f"{preset} round {r} turn {t + 1} conv {c}: answers differ from token "
                                          f"{first} (on {on_ids}… off {off_ids}…)")
            print(json.dumps({"preset": preset, "round": r, "phase": "conversations",
                              **{f"wall_s_{m}": round(conv[m][-1]["wall_s"], 2) for m in MODES}}), flush=True)
        rand = {m: [] for m in MODES}
        for r in range(args.runs):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for m in order:
                rand[m].append(random_round(engines[m], args.random_requests, args.random_prompt, args.answer,
                                            seed=1000 + r))
            if rand["on"][-1]["answers"] != rand["off"][-1]["answers"]:
                mismatches.append(f"{preset} random round {r}: answers differ between cache on and off")
            print(json.dumps({"preset": preset, "round": r, "phase": "random",
                              **{f"tok_s_{m}": round(rand[m][-1]["tok_s"], 1) for m in MODES}}), flush=True)
        on = engines["on"]
        plan = snapshot_plan(on.config, on.model_cfg)
        grid, cap_count, each = plan.grid, plan.count, plan.bytes_each
        snap_end = snapshots_in_use(on)
        evicted = sum(p.num_evicted for p in on.scheduler.cache.snaps) if on.scheduler.cache.snaps else 0
    finally:
        for eng in engines.values():
            eng.shutdown()

    res: dict = {"preset": preset, "runs": args.runs, "convs": args.convs, "turns": args.turns,
                 "system": args.system, "answer": args.answer}
    for m in MODES:
        rounds = conv[m]
        t1 = [_p50(x["ttft"][0]) for x in rounds]
        tn = [_p50([v for turn in x["ttft"][1:] for v in turn]) for x in rounds]
        res[f"ttft_p50_turn1_ms_{m}"] = _ms(_p50(t1))
        res[f"ttft_p50_turn2plus_ms_{m}"] = _ms(_p50(tn)) if args.turns > 1 else None
        res[f"conv_wall_s_{m}"] = round(_p50([x["wall_s"] for x in rounds]), 2)
        res[f"random_tok_s_{m}"] = round(_p50([x["tok_s"] for x in rand[m]]), 1)
    on_rounds = conv["on"]
    res["ttft_ratio_turn2plus"] = (round(res["ttft_p50_turn2plus_ms_off"] / res["ttft_p50_turn2plus_ms_on"], 2)
                                   if args.turns > 1 else None)
    res["conv_wall_ratio"] = round(res["conv_wall_s_off"] / res["conv_wall_s_on"], 2)
    res["hit_rate"] = round(sum(x["hit_tokens"] for x in on_rounds) / max(1, sum(x["queries"] for x in on_rounds)), 4)
    later = [h for x in on_rounds for turn in x["hits"][1:] for h in turn]
    res["hit_rate_turn2plus"] = round(sum(h for h, _ in later) / max(1, sum(n for _, n in later)), 4) if later else None
    first = [h for x in on_rounds for h in x["hits"][0]]
    res["hit_rate_turn1"] = round(sum(h for h, _ in first) / max(1, sum(n for _, n in first)), 4)
    res["random_hit_tokens"] = sum(x["hit_tokens"] for x in rand["on"])
    res["random_tok_s_ratio"] = round(res["random_tok_s_on"] / res["random_tok_s_off"], 3)
    res["kda_snapshot_grid"] = grid
    res["kda_snapshot_bytes_each"] = each
    res["kda_snapshot_cap"] = {"snapshot_bytes": configs["on"].snapshot_bytes, "count": cap_count,
                               "bytes": cap_count * each}
    res["kda_snapshots_used_round1"] = {"count": snap_first, "bytes": snap_first * each}
    res["kda_snapshots_used_end"] = {"count": snap_end, "bytes": snap_end * each, "evicted": evicted}
    res["outputs_identical"] = not mismatches
    res["mismatches"] = mismatches[:10]
    return res


def _table(results: list[dict]) -> str:
    rows = [("preset", "mode", "TTFT p50 t1 ms", "TTFT p50 t>=2 ms", "conv wall s", "hit rate (t>=2)",
             "random tok/s", "KDA snapshots used / cap")]
    for res in results:
        for m in MODES:
            snaps = ""
            if m == "on" and res["kda_snapshot_grid"]:
                u, cap = res["kda_snapshots_used_round1"], res["kda_snapshot_cap"]
                snaps = f"{u['count']} × {res['kda_snapshot_bytes_each']} B = {u['bytes'] / 2**20:.2f} MiB / " \
                        f"{cap['count']} ({cap['bytes'] / 2**20:.1f} MiB)"
            hit = f"{res['hit_rate']:.3f} ({res['hit_rate_turn2plus']:.3f})" if m == "on" else "-"
            rows.append((res["preset"], m, f"{res[f'ttft_p50_turn1_ms_{m}']:.1f}",
                         f"{res[f'ttft_p50_turn2plus_ms_{m}']:.1f}", f"{res[f'conv_wall_s_{m}']:.2f}", hit,
                         f"{res[f'random_tok_s_{m}']:.1f}", snaps))
        rows.append((res["preset"], "off/on", "", f"{res['ttft_ratio_turn2plus']:.2f}× (goal >= 3)",
                     f"{res['conv_wall_ratio']:.2f}×", "", f"on/off {res['random_tok_s_ratio']:.3f} (goal >= 0.97)",
                     "outputs identical" if res["outputs_identical"] else "OUTPUTS DIFFER"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="kimi-k2-tiny,kimi-k3-tiny")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=1000, help="system prompt tokens")
    ap.add_argument("--answer", type=int, default=32, help="tokens per answer")
    ap.add_argument("--random-requests", type=int, default=16)
    ap.add_argument("--random-prompt", type=int, default=600)
    ap.add_argument("--attention", type=int, default=1)
    ap.add_argument("--experts", type=int, default=1)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--max-tokens-per-step", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 4 conversations × 3 turns, "
                    "a 256-token system prompt, 8-token answers, 4 random prompts of 200")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.convs, args.turns, args.system, args.answer = 1, 4, 3, 256, 8
        args.random_requests, args.random_prompt = 4, 200
    t_start = time.perf_counter()
    results = []
    tmp = tempfile.mkdtemp(prefix="bench-prefix-")
    actors = 2 * (args.attention + args.experts)  # both engines' actors, one CPU each
    with LocalCluster(nodes=2, num_cpus=max(4, -(-actors // 2))) as lc:
        ray.init(address=lc.address, logging_level="WARNING")
        try:
            for preset in args.presets.split(","):
                results.append(bench_preset(preset, args, tmp))
                print(json.dumps(results[-1]), flush=True)
        finally:
            ray.shutdown()
    print()
    print(_table(results))
    total = time.perf_counter() - t_start
    print(f"\nwall time {total:.0f} s")
    print(json.dumps({"bench": "prefix", "wall_s": round(total, 1), "results": results}), flush=True)
    bad = [m for r in results for m in r["mismatches"]]
    if bad:
        print("\nFAILURE: cache on and cache off gave different greedy answers; the timings above compare "
              "different work:\n  " + "\n  ".join(bad), file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
