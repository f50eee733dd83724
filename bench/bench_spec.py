"""Speculative decoding's gain and cost (issue 36): speculation off against each method, in one run.

    python bench/bench_spec.py [--preset kimi-k2-tiny | kimi-k2-mini] [--runs 3] [--tokens 64] [--executor ray|inprocess]

Engines side by side (``--executor ray``: a local Ray cluster of 2 nodes, each engine 1 attention
× 1 expert actor, the step channels and the exchange as served; ``inprocess``: the engine's
in-process executor), one per mode: off, ngram and suffix (K = ``--k``, default 4), and mtp (1
draft) when the checkpoint has an MTP layer (kimi-k2-mini: trained, deepseek-v3-tiny: random), async
scheduling on (it pauses while drafts may come: see docs/architecture.md).

Workloads, every request greedy with ignore_eos and ``--tokens`` output tokens, each mode checked
to give the same tokens as off (the script exits 1 if not):

- *repetitive* (an agent's loop): 4 tool-result contexts (random ids, 48 tokens) asked again and
  again, each prompt the context plus a 6-token question drawn from 3 — so answers repeat earlier
  answers, as agents' arguments and quoted results repeat what they saw (a random model's greedy
  answers also fall into cycles, which prompt lookup finds);
- *random*: fresh random prompts of 32 tokens.

Per workload and mode: tokens/s per stream at 1 stream (requests one after another), aggregate
tokens/s at 16 and 32 concurrent streams, the mean accepted length (tokens a sequence gained per
step with drafts); the ratio to off of each (medians over ``--runs`` rounds, modes alternating
within a round). Then the cost of a verification step: one stream whose every step carries K = 1,
2, 4, 8 drafts (a proposer that always proposes, all rejected past the first mismatch), the
step's median time against a plain decode step's.

Timings are printed, never asserted."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.config import EngineConfig  # noqa: E402
from cluster.engine import Engine  # noqa: E402
from cluster.spec import ClusterSpec  # noqa: E402
from model.config import load_config  # noqa: E402
from model.presets import build_preset  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

MODES = ("off", "ngram", "suffix")  # and mtp, when the checkpoint has an MTP layer


def make_engine(path: str, mode: str, k: int, executor: str) -> Engine:
    spec_cfg = None if mode == "off" else {"method": mode, "num_speculative_tokens": 1 if mode == "mtp" else k}
    cfg = EngineConfig.of(path, speculative=spec_cfg, num_blocks=1024, max_num_seqs=64, max_tokens_per_step=512)
    spec = ClusterSpec(attention=1, experts=1)
    if executor == "inprocess":
        from cluster.inprocess import InProcessExecutor

        return Engine(cfg, spec, executor=InProcessExecutor(cfg, spec, load_config(path))).start()
    return Engine(cfg, spec).start()


def workload(kind: str, n: int, rng: random.Random) -> list[list[int]]:
    if kind == "random":
        return [[rng.randrange(1000) for _ in range(32)] for _ in range(n)]
    ctxs = [[random.Random(100 + c).randrange(1000) for _ in range(48)] for c in range(4)]
    questions = [[random.Random(200 + q).randrange(1000) for _ in range(6)] for q in range(3)]
    return [rng.choice(ctxs) + rng.choice(questions) for _ in range(n)]


def drain(eng: Engine, prompts: list[list[int]], params: SamplingParams, concurrent: int) -> tuple[float, list]:
    """Tokens/s (over the wall time) and the outputs, ``concurrent`` requests at a time."""
    t0, outs = time.perf_counter(), []
    for i in range(0, len(prompts), concurrent):
        outs += [s.output_ids for s in eng.generate(prompts[i : i + concurrent], params)]
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kimi-k2-tiny")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--executor", choices=("ray", "inprocess"), default="ray")
    ap.add_argument("--out", default="/tmp/moeray-bench-spec")
    args = ap.parse_args()
    path = str(build_preset(args.preset, Path(args.out) / args.preset, seed=2, dtype="float32", progress=False))
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    cluster = None
    if args.executor == "ray":
        import ray

        from cluster.local import LocalCluster

        cluster = LocalCluster(nodes=2, num_cpus=4).__enter__()
        ray.init(address=cluster.address)
    modes = MODES + (("mtp",) if load_config(path).num_nextn_predict_layers else ())
    engines = {m: make_engine(path, m, args.k, args.executor) for m in modes}
    ok = True
    try:
        rows = []
        for kind in ("repetitive", "random"):
            for streams, n in ((1, 6), (16, 32), (32, 64)):
                rates = {m: [] for m in modes}
                accepted = {m: [] for m in modes}
                for run in range(args.runs):
                    prompts = workload(kind, n, random.Random(run * 7 + streams))
                    want = None
                    for m in modes:
                        eng = engines[m]
                        d0, a0 = eng.stats.spec_drafts, eng.stats.spec_accepted_tokens
                        rate, outs = drain(eng, prompts, params, streams)
                        if want is None:
                            want = outs
                        elif outs != want:
                            print(f"!! {m} gave other tokens than off ({kind}, {streams} streams)")
                            ok = False
                        rates[m].append(rate / (streams if streams == 1 else 1))
                        d = eng.stats.spec_drafts - d0
                        accepted[m].append(1 + (eng.stats.spec_accepted_tokens - a0) / d if d else 1.0)
                med = {m: statistics.median(v) for m, v in rates.items()}
                what = "tokens/s per stream" if streams == 1 else "aggregate tokens/s"
                for m in modes:
                    rows.append((kind, streams, what, m, med[m], med[m] / med["off"], statistics.median(accepted[m])))
                    print(f"{kind:10s} {streams:2d} streams  {m:6s}  {what}: {med[m]:8.1f}  x{med[m] / med['off']:.2f} "
                          f"vs off; mean accepted length {statistics.median(accepted[m]):.2f}", flush=True)
        # the cost of a verification step
        print("\nverification step cost (1 stream, every step carrying K drafts):")
        eng = engines["ngram"]
        base = step_time(engines["off"], params, None)
        for k in (1, 2, 4, 8):
            t = step_time(eng, params, k)
            print(f"  K={k}: {1000 * t:.2f} ms per step against {1000 * base:.2f} ms plain: x{t / base:.2f}", flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.__exit__(None, None, None)
    return 0 if ok else 1


def step_time(eng: Engine, params: SamplingParams, k: int | None) -> float:
    """The median wall time of one engine step of one decoding stream (drafting ``k``)."""
    policy = eng.scheduler.drafts
    if k is not None:  # every step carries k drafts, past the policies (a proposer that always proposes)
        policy.propose = lambda seq, _k: [7] * min(k, seq.params.max_tokens - len(seq.output_ids) - 1)
        policy.length = lambda n: k
    try:
        times = []
        for _ in range(3):
            eng.add_request([1, 2, 3, 4, 5, 6, 7, 8], params)
            eng.step()  # the prefill
            while eng.has_work:
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        policy.__dict__.pop("propose", None)
        policy.__dict__.pop("length", None)


if __name__ == "__main__":
    sys.exit(main())
