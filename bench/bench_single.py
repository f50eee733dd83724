"""The single process's decode step, eager and compiled (issue 54): ms per step at several batch sizes.

    python bench/bench_single.py [--streams 1,8,16] [--steps 48] [--threads 1] [--json FILE]

Issue 54's checkpoint (bench_overhead.py's: a DeepSeek-V3 of 6 layers, 32 routed experts, top-4,
hidden 256, fp32), one ``ModelRunner`` per variant in this process, steps interleaved (one step of
each variant in turn, so a drift of the machine's speed hits them alike); the median over ``--steps``
greedy decode steps after a 32-token prefill:

- ``eager``: the model's own step;
- ``segments``: the compiled segments, the routed experts run eagerly between them (what the cluster's
  actors compile: ``compile_decode(whole=False)``);
- ``whole``: the single process's default (``compile_decode()``): one graph a step, the routed experts
  in it, up to as many pairs as experts (here 8 streams), the segments above;
- ``whole*``: the whole-step graph at every batch, past its threshold too (to show the crossover on
  this machine).

Every variant's tokens are checked against eager's (printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import SHAPE  # noqa: E402  (the issue's checkpoint)

from model.loader import load_model  # noqa: E402
from model.presets import build_preset  # noqa: E402
from model.runner import ModelRunner, Sequence  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

VARIANTS = ("eager", "segments", "whole", "whole*")


def run(path: Path, batch: int, steps: int) -> dict:
    runners, seqs, logits = {}, {}, {}
    for v in VARIANTS:
        net = load_model(str(path), progress=False)
        runner = ModelRunner(net, num_blocks=batch * -(-(32 + steps + 2) // 16) + 1, block_size=16)
        if v != "eager":
            c = net.compile_decode(runner.cache, max_batch=max(batch, 2), whole=v != "segments")
            if v == "whole*":
                c.takes_whole = lambda d: True
        runners[v] = runner
        seqs[v] = [Sequence(i, [(7 * i + 3 * j) % 1000 + 3 for j in range(32)], 32, SamplingParams())
                   for i in range(batch)]
        with torch.no_grad():
            logits[v] = runner.forward(seqs[v], [32] * batch)
    times = {v: [] for v in VARIANTS}
    with torch.no_grad():
        for _ in range(steps):
            for v in VARIANTS:
                for s, t in zip(seqs[v], logits[v].argmax(-1).tolist()):
                    s.token_ids.append(t)
                t0 = time.perf_counter()
                logits[v] = runners[v].forward(seqs[v], [1] * batch)
                times[v].append(time.perf_counter() - t0)
    same = {v: all(a.token_ids == b.token_ids for a, b in zip(seqs["eager"], seqs[v])) for v in VARIANTS}
    tallies = {v: runners[v].model.compiled.tally() for v in VARIANTS if v != "eager"}
    return {v: {"ms": 1e3 * statistics.median(times[v]), "tokens_equal_eager": same[v],
                "tally": tallies.get(v)} for v in VARIANTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8,16")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    streams = [int(s) for s in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_preset("deepseek-v3-tiny", Path(tmp) / "ckpt", seed=0, dtype="float32", progress=False,
                            overrides=SHAPE)
        results = {n: run(path, n, args.steps) for n in streams}
    print(f"\nms per decode step, median of {args.steps} interleaved steps, {args.threads} thread(s)")
    print(f"{'streams':<9}" + "".join(f"{v:>12}" for v in VARIANTS) + "   tokens = eager's")
    for n, r in results.items():
        print(f"{n:<9}" + "".join(f"{r[v]['ms']:>12.2f}" for v in VARIANTS)
              + "   " + ", ".join(v for v in VARIANTS if r[v]["tokens_equal_eager"]))
    for n, r in results.items():
        print(f"{n} stream(s): whole's tally {r['whole']['tally']}")
    if args.json:
        Path(args.json).write_text(json.dumps({str(n): r for n, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
