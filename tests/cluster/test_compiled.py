"""The compiled decode step (issue 54, Must show 1; model/compiled.py): with ``compile: decode`` the
decode steps run compiled and every token equals eager's — greedy and seeded — on K2, K3 (hybrid:
KDA and gated NoPE MLA, attention residuals, latent MoE) and DeepSeek-V3; in the engine over the
in-process executor, and on the session's Ray cluster in both layouts through a scale change and a
killed worker (the replacement compiles at its start). The logits of a compiled step equal eager's
within floating-point tolerance; a decode batch the graphs do not cover runs eager and is counted.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch

import single
from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.spec import ClusterSpec
from model.cache import build_attn_meta
from model.config import load_config
from model.compiled import FALLBACK_REASONS, DecodeBatch, decode_batch
from model.loader import load_model
from model.moe import run_stages
from model.runner import ModelRunner, Sequence, generate
from model.sampling import SamplingParams
from tests.presets import preset

PRESETS = ("kimi-k2-tiny", "kimi-k3-tiny", "deepseek-v3-tiny")
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
# two layers (a dense one, a MoE one): each compiling actor compiles two segments
K2_2L = (("num_hidden_layers", 2), ("first_k_dense_replace", 1))
# K3 at four layers, every feature still there: KDA (dense, then MoE) and gated NoPE MLA layers, latent MoE,
# two attention-residual blocks (the block starts at layer 0 and 3)
K3_4L = (("num_hidden_layers", 4),
         ("linear_attn_config", (("head_dim", 16), ("num_heads", 4), ("short_conv_kernel_size", 4),
                                 ("gate_lower_bound", -5.0), ("use_full_rank_gate", True), ("kda_layers", (1, 3)),
                                 ("full_attn_layers", (2, 4)))))
SEEDED = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7)


SMALL = dict(num_blocks=64, max_num_seqs=8, collective_timeout_s=5, step_timeout_s=60, hang_floor_s=3.0,
             heartbeat_timeout_s=2.0)


class Drafts:
    """The scheduler's drafter in these tests: none while ``truth`` is empty (plain decode steps); then
    the next tokens of the eager run (``truth``: a sequence id's whole token list), at every other
    context length, with the last draft made wrong at every third proposal — so steps verify drafts
    (some accepted, some rejected) beside sequences that decode one token."""

    def __init__(self, vocab: int):
        self.vocab, self.truth, self.made = vocab, {}, 0

    def propose(self, seq_id, token_ids, k, salt=None):
        full, n = self.truth.get(seq_id), len(token_ids)
        if full is None or full[:n] != token_ids or n % 2:
            return []
        out = list(full[n: n + k])
        self.made += 1
        if out and self.made % 3 == 0:
            out[-1] = (out[-1] + 1) % self.vocab
        return out

    def finished(self, seq_id, token_ids, num_prompt_tokens, salt=None):
        pass


@functools.cache
def _eager_runs(name: str):
    """``name``'s checkpoint (a few layers: what a deeper model repeats), five prompts, their greedy and
    seeded params (lengths 20, 16, 12, 8, 4: a batch of them shrinks from 5 to 1), and each prompt's
    tokens from the eager single process alone."""
    path = str(preset(name, seed=5, overrides=K3_4L if name == "kimi-k3-tiny" else K2_2L))
    prompts = single.prompts(5, lo=3, hi=40, seed=1)
    runs = [[dataclasses.replace(params, max_tokens=params.max_tokens - 4 * i) for i in range(len(prompts))]
            for params in (GREEDY, SEEDED)]
    expected = [[single.alone(path, [p], sp)[0] for p, sp in zip(prompts, plist)] for plist in runs]
    return path, prompts, runs, expected


@pytest.mark.parametrize("name", PRESETS)
def test_the_single_process_whole_step_graph_gives_the_eager_tokens(name):
    """The single process compiled (model.compile_decode: the routed experts in the graph, one graph a
    step) generating the five prompts at once, greedy then seeded: the eager tokens. Its decode batches
    of up to 4 sequences (16 pairs for 16 experts) ran as the whole-step graph; with max_batch 4 (so
    the warm-up compiles no segments: the other tests cover them) the batch of 5 ran eager, counted."""
    path, prompts, runs, expected = _eager_runs(name)
    net = load_model(path, progress=False)
    runner = ModelRunner(net, num_blocks=64, block_size=16, num_slots=8)
    compiled = net.compile_decode(runner.cache, max_batch=4)
    assert compiled.whole
    for plist, want in zip(runs, expected):
        assert [s.output_ids for s in generate(runner, prompts, plist)] == want, plist[0]
    tally = compiled.tally()
    # a run's decode steps: 19 (the longest sequence's); the first 3 at batch 5 (eager), then batches 4..1
    assert tally["compiled"] == tally["whole"] == 2 * (GREEDY.max_tokens - 4), tally
    assert tally["batch"] == 2 * 3 and sum(tally[r] for r in FALLBACK_REASONS) == 2 * 3, tally


@pytest.mark.parametrize("name", PRESETS)
def test_compiled_decode_gives_the_single_process_tokens(name):
    """The engine (in-process executor) with compile: decode against the eager single process, greedy
    then seeded, in one engine: every decode step ran compiled (batches of 5 down to 1 as the
    sequences end: both batch buckets), nothing fell back. Then the same runs verifying drafts
    (speculative decoding): K2 and DeepSeek-V3 verify them on the compiled step (each query token a
    row; DeepSeek-V3's drafts from its MTP layer), K3 (hybrid) verifies them eager, counted — the same
    tokens every time."""  # (prefill steps run eager, uncounted)
    from cluster.inprocess import InProcessExecutor

    path, prompts, runs, expected = _eager_runs(name)
    mtp = name == "deepseek-v3-tiny"
    cfg = EngineConfig.of(model=path, compile="decode", speculative={"method": "mtp" if mtp else "ngram"}, **SMALL)
    spec = ClusterSpec(attention=1, experts=1)
    with Engine(cfg, spec, executor=InProcessExecutor(cfg, spec, load_config(path))) as eng:
        drafts = Drafts(load_config(path).vocab_size)
        if not mtp:
            eng.scheduler.drafts.drafter = drafts
            truth = {}
            for plist, want in zip(runs, expected):
                seqs = eng.generate(prompts, plist)
                assert [s.output_ids for s in seqs] == want, plist[0]
                truth.update((s.seq_id, s.token_ids) for s in seqs)
            plain = dict(eng.stats.compiled)
            # every decode step compiled: 19 a run (the longest sequence's), the last 4 of them at batch 1
            assert plain.get("compiled", 0) >= 2 * (GREEDY.max_tokens - 1) and set(plain) == {"compiled"}, plain
            drafts.truth = {i + len(truth): t for i, t in truth.items()}  # the same runs again, under new ids
        else:
            plain = {}
        for plist, want in zip(runs, expected):
            assert [s.output_ids for s in eng.generate(prompts, plist)] == want, plist[0]
        counts = {k: n - plain.get(k, 0) for k, n in eng.stats.compiled.items()}
        stats = eng.stats
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens >= (0 if mtp else 1)  # rejected drafts, and accepted
    if name == "kimi-k3-tiny":  # KDA verifies drafts one at a time: those steps run eager, counted
        assert counts.get("drafts", 0) > 0 and counts.get("verify", 0) == 0 and set(counts) <= {"compiled", "drafts"}
    else:
        assert counts.get("verify", 0) > 0 and set(counts) == {"compiled", "verify"}, counts


@pytest.mark.parametrize("layout", ["disaggregated", "colocated"])
def test_compiled_on_the_cluster_through_a_scale_change_and_a_killed_actor(ray_cluster, layout):
    """Both layouts with compile: decode, streams (greedy and seeded at once, verifying drafts) through
    a scale change (colocated: a third worker, which compiles at its start; disaggregated: a third
    expert actor — the attention replica's graphs do not depend on where the experts are) and then a
    killed attention replica / worker (its replacement compiles at its start): the single process's
    tokens. The drafts (the oracle drafter: accepted and rejected ones beside plain decodes) are
    verified on the compiled step; the streams end at different lengths, so the last one decodes
    alone (a batch of one row, or of one row and its drafts)."""
    path = str(preset("kimi-k2-tiny", seed=6, dtype="float32", overrides=K2_2L))
    prompts = single.prompts(4, lo=5, hi=40, seed=2)
    params = [dataclasses.replace(sp, max_tokens=40 - 4 * i) for i, sp in enumerate([GREEDY, SEEDED] * 2)]
    expected = [single.alone(path, [p], sp)[0] for p, sp in zip(prompts, params)]
    colocated = layout == "colocated"
    spec = ClusterSpec.of_workers(2) if colocated else ClusterSpec(attention=1, experts=2)
    eng = Engine(EngineConfig.of(path, compile="decode", speculative={"method": "ngram"}, **SMALL), spec).start()
    drafts = Drafts(load_config(path).vocab_size)
    eng.scheduler.drafts.drafter = drafts
    events = []

    def at(turn: int) -> None:
        if turn == 3:  # begin the change and wait (not stepping) until its new actor is up: then it commits
            change = eng.begin_scale_workers(3) if colocated else eng.begin_scale_experts(3)
            t0 = time.monotonic()
            while not eng.executor.ready(change.prepared):
                assert time.monotonic() - t0 < 120, "the new actor never became ready"
                time.sleep(0.05)
            events.append(change)
        elif len(events) == 1 and eng.epochs.transition is None and eng.table.epoch == 1:
            assert not any(eng.requests[i].seq.finish_reason for i in ids), "a stream ended before the kill"
            events.append(eng.executor.kill("worker" if colocated else "attention", 0))  # mid-stream

    try:
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        drafts.truth = {i: p + want for i, p, want in zip(ids, prompts, expected)}
        turn, deadline = 0, time.monotonic() + 300
        while eng.busy:
            assert time.monotonic() < deadline, "no end"
            turn += 1
            at(turn)
            eng.pipelined()
        got = [eng.release(i).seq.output_ids for i in ids]
        assert len(events) == 2, "the kill never came: the scale change did not commit mid-stream"
        assert got == expected
        assert [c.kind for c in eng.epochs.changes][-2:] == ["workers" if colocated else "experts", "recovery"]
        counts = eng.stats.compiled
        assert counts.get("verify", 0) > 0 and set(counts) == {"compiled", "verify"}, counts
        assert eng.stats.spec_draft_tokens > eng.stats.spec_accepted_tokens >= 1
    finally:
        eng.shutdown()


def _runner(name: str, max_batch: int, whole: bool):
    net = load_model(str(preset(name, seed=5, dtype="float32", overrides=K3_4L)), progress=False)
    runner = ModelRunner(net, num_blocks=32, block_size=16, num_slots=8)
    return net, runner, net.compile_decode(runner.cache, max_batch=max_batch, whole=whole)


def _decode_inputs(runner: ModelRunner, seqs: list[Sequence]):
    for s in seqs:
        runner.reserve(s, s.num_cached + 1)
    meta = build_attn_meta([1] * len(seqs), [s.num_cached + 1 for s in seqs], [s.block_table for s in seqs], 16,
                           state_slots=[s.state_slot for s in seqs] if runner.cache.kda is not None else None)
    return torch.tensor([s.token_ids[-1] for s in seqs]), meta


@pytest.mark.parametrize("whole", [False, True], ids=["segments", "whole"])
@pytest.mark.parametrize("name", ["kimi-k3-tiny"])  # (MLA and KDA layers, attention residuals, latent MoE)
def test_a_compiled_step_equals_eager_within_tolerance_and_uncovered_batches_fall_back_counted(name, whole):
    """One decode step run compiled (as segments, the routed experts outside, as the actors run it; or
    as the single process's whole-step graph, the routed experts in it) and, on a copy of the cache,
    eager: the logits agree within fp32 tolerance (not bit for bit: inductor fuses and may reorder a
    reduction). A batch above ``max_batch`` and inputs the warm-up never compiled (int32 slots) run
    eager, counted by reason."""
    net, runner, compiled = _runner(name, max_batch=2, whole=whole)
    seqs = [Sequence(i, list(range(3 + i, 20 + 2 * i)), 17 + i, SamplingParams()) for i in range(3)]
    runner.forward(seqs, [s.num_uncached for s in seqs])  # prefill: eager (not a decode step)
    assert compiled.tally() == dict.fromkeys(("compiled", "verify", "whole", *FALLBACK_REASONS), 0)
    for s in seqs:
        s.token_ids.append(7)
    ids, meta = _decode_inputs(runner, seqs[:2])
    saved = (runner.cache.latent.data.clone(),
             None if runner.cache.kda is None else (runner.cache.kda.conv.clone(), runner.cache.kda.recurrent.clone()))
    with torch.no_grad():
        got = net.logits(net(ids, meta, runner.cache))
        assert compiled.tally()["compiled"] == 1 and compiled.tally()["whole"] == whole
        runner.cache.latent.data.copy_(saved[0])
        if saved[1] is not None:
            runner.cache.kda.conv.copy_(saved[1][0])
            runner.cache.kda.recurrent.copy_(saved[1][1])
        net.compiled = None  # the same step eager
        want = net.logits(net(ids, meta, runner.cache))
        net.compiled = compiled
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    # three sequences: above max_batch 2 → eager, counted
    ids3, meta3 = _decode_inputs(runner, seqs)
    with torch.no_grad():
        net(ids3, meta3, runner.cache)
    assert compiled.tally()["batch"] == 1 and compiled.tally()["compiled"] == 1
    d = decode_batch(meta)
    odd = DecodeBatch(d.positions, d.slot_mapping.to(torch.int32), d.kv_slots, d.mask, d.state_slots)
    if whole:  # inputs the warm-up did not compile the whole step for: eager, counted, the same values
        with torch.no_grad():
            h = compiled.forward(ids, odd, runner.cache)
        assert compiled.tally()["recompile"] == 1 and compiled.tally()["compiled"] == 1
        assert h.shape == (2, net.cfg.hidden_size) and torch.isfinite(h).all()
        return
    # combined rows with other strides (the colocated combine's copy of slot 0 of [T, k, H] rows): still compiled
    def strided(req):
        rows = torch.zeros(req.x.shape[0], 4, req.x.shape[1])
        rows[:, 0] = req.local()
        return rows[:, 0].clone()  # (clone keeps the strides: [T, H] at stride k·H)

    one = decode_batch(_decode_inputs(runner, seqs[:1])[1])
    with torch.no_grad():
        run_stages(compiled.stages(ids[:1], one, runner.cache), lambda req: req, strided)
    assert compiled.tally()["compiled"] == 2 and compiled.tally()["recompile"] == 0
    # a decode batch whose inputs need a graph the warm-up did not compile: eager, counted, the same values
    with torch.no_grad():
        h = run_stages(compiled.stages(ids, odd, runner.cache))  # each block's routed rows by its own experts
    assert compiled.tally()["recompile"] >= 1 and compiled.tally()["compiled"] == 2
    assert h.shape == (2, net.cfg.hidden_size) and torch.isfinite(h).all()


def test_the_compiled_steps_rows_make_room_for_drafts():
    """A replica's compiled step covers max_num_seqs sequences each carrying its drafts (a verifying
    step's rows), not max_num_seqs rows."""
    from cluster.config import compiled

    assert compiled(EngineConfig.of("m", max_num_seqs=8))["max_batch"] == 8
    assert compiled(EngineConfig.of("m", max_num_seqs=8, speculative={"method": "ngram", "num_speculative_tokens": 3}))[
        "max_batch"] == 32
