"""Structured output's cost (issue 24): decode with a JSON-schema grammar against without, in one run.

    python bench/bench_structured.py [--preset kimi-k2-tiny] [--streams 1,16] [--tokens 48] [--runs 3]

On a local Ray cluster (1 attention × 1 expert actor, async scheduling on), for each stream count:
``--runs`` alternating rounds of unconstrained and constrained requests (seeded, temperature 1, the
same prompts). The grammar is a JSON schema that cannot close within ``--tokens`` tokens (an array
of at least 64 objects), so every stream decodes exactly ``--tokens`` tokens either way and the
batches match. Reports the median decode time per step (the engine's steps over the round's wall
time after the first token) and tokens/s, and their ratio constrained / unconstrained (goal: at
most 1.15).

Then the grammar's costs on the attention actor's side, in this process: compile of the schema
(first use, then cached: a deep copy), and the mask per row (fill and apply, 16 rows, one torch
thread as on the actor) at the preset's vocabulary and at K2's 163,840 ids (a synthetic byte-level
vocabulary of that size)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import ray

from cluster.engine import Engine, EngineConfig
from cluster.local import LocalCluster
from cluster.spec import ClusterSpec
from deploy.structured import response_format_grammar
from model.grammar import Grammars, lltokenizer
from model.presets import build_preset
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "kind": {"enum": ["tool", "text", "image"]},
                                     "score": {"type": "number"}},
    "required": ["name", "kind", "score"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}
GRAMMAR = response_format_grammar({"type": "json_schema", "json_schema": {"name": "rows", "schema": SCHEMA}})


def one_round(eng: Engine, streams: int, tokens: int, grammar: str | None, seed: int) -> dict:
    prompts = [[(i * 37 + j * 11) % 700 + 5 for j in range(12)] for i in range(streams)]
    params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed + i, grammar=grammar, ignore_eos=True)
              for i in range(streams)]
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    first = None
    steps0 = eng.step_no
    t0 = time.perf_counter()
    while eng.has_work:
        events = eng.step()
        if first is None and events:
            first, steps_first = time.perf_counter(), eng.step_no
    t1 = time.perf_counter()
    out = [eng.release(i).seq.output_ids for i in ids]
    assert all(len(o) == tokens for o in out), [len(o) for o in out]
    steps = eng.step_no - steps_first
    return {"step_ms": 1000 * (t1 - first) / max(steps, 1), "tok_s": streams * (tokens - 1) / (t1 - first),
            "wall_s": t1 - t0, "steps": eng.step_no - steps0}


def grammar_costs(path: str, vocab: int) -> dict:
    import torch

    torch.set_num_threads(1)  # as the attention actor runs (actors/attention.py: threads=1)
    tok = Tokenizer.from_dir(path)
    out = {}
    g = Grammars(lltokenizer(tok, vocab))
    t0 = time.perf_counter()
    g.matcher(GRAMMAR)
    out["compile_first_ms"] = 1000 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(100):
        g.matcher(GRAMMAR)
    out["compile_cached_ms"] = 1000 * (time.perf_counter() - t0) / 100
    out["mask_us_per_row_tiny"] = _mask_us(g, vocab)
    out["mask_us_per_row_163840"] = _mask_us(Grammars(_big_tokenizer()), 163840)
    g.close()
    return out


def _mask_us(g: Grammars, vocab: int, rows: int = 16, reps: int = 50) -> float:
    import torch

    matchers = [g.matcher(GRAMMAR) for _ in range(rows)]
    for m in matchers:  # into the array: the mask the decode steps compute
        m.consume_tokens(g.tokenizer.tokenize_str('{"rows": [{"name": "ab'))
    logits = torch.randn(rows, vocab)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        g.mask_logits(matchers, logits.clone())
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times) / rows


def _big_tokenizer():
    """A byte-level vocabulary of K2's size (every byte, then multi-byte pieces of ASCII text)."""
    import itertools

    import llguidance
    import tiktoken

    ranks = {bytes([b]): b for b in range(256)}
    letters = b"abcdefghijklmnopqrstuvwxyz ,.:{}\"0123456789"
    for n in (2, 3, 4):
        for combo in itertools.product(letters, repeat=n):
            if len(ranks) >= 163584:
                break
            ranks.setdefault(bytes(combo), len(ranks))
    specials = {f"<|reserved_{i}|>": 163584 + i for i in range(256)}
    enc = tiktoken.Encoding("big", pat_str=r"[^\s]+|\s+", mergeable_ranks=ranks, special_tokens=specials)
    return llguidance.LLTokenizer.from_tiktoken(encoder=enc._mergeable_ranks, special_tokens=enc._special_tokens,
                                                pattern=enc._pat_str, eos_token=163584, n_vocab=163840)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k2-tiny")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    path = str(build_preset(args.preset, tempfile.mkdtemp() + "/m", dtype="float32", progress=False))
    rows = []
    with LocalCluster(nodes=2, num_cpus=4) as lc:
        ray.init(address=lc.address, logging_level="WARNING")
        with Engine(EngineConfig.of(model=path, num_blocks=512, max_tokens_per_step=512),
                    ClusterSpec(attention=1, experts=1)) as eng:
            one_round(eng, 2, 8, GRAMMAR, 0)  # warm: compiles, first steps
            for streams in (int(s) for s in args.streams.split(",")):
                got = {"free": [], "json": []}
                for r in range(args.runs):
                    for kind, grammar in (("free", None), ("json", GRAMMAR)):
                        got[kind].append(one_round(eng, streams, args.tokens, grammar, 100 * r))
                med = {k: {m: statistics.median(x[m] for x in v) for m in ("step_ms", "tok_s")} for k, v in got.items()}
                rows.append({"streams": streams, "step_ms_free": round(med["free"]["step_ms"], 2),
                             "step_ms_json": round(med["json"]["step_ms"], 2),
                             "tok_s_free": round(med["free"]["tok_s"], 1), "tok_s_json": round(med["json"]["tok_s"], 1),
                             "step_ratio": round(med["json"]["step_ms"] / med["free"]["step_ms"], 3)})
                print(json.dumps(rows[-1]), flush=True)
            vocab = eng.model_cfg.vocab_size
        ray.shutdown()
    print(json.dumps({"grammar": {k: round(v, 3) for k, v in grammar_costs(path, vocab).items()}}), flush=True)


if __name__ == "__main__":
    main()
