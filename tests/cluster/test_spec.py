"""Speculative decoding through the real engine, scheduler and attention workers (the in-process
executor: real AttentionWorkers holding every expert, no Ray): outputs with drafts equal outputs
without, token for token — greedy, seeded, penalised and grammar-constrained, with chunked prefill,
preemption and prefix caching — the unseeded draw keeps its distribution, and the draft-length
policy shrinks drafts with the batch and with rejections.

A random model rarely repeats itself, so besides the real proposers (ngram, suffix) the tests use
an *oracle drafter*: it proposes the tokens the run without drafts produced, with one of them
corrupted at about a third of the steps, so every step mixes accepted and rejected drafts at known
places."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.inprocess import InProcessExecutor
from cluster.scheduler import Scheduler
from cluster.seq import Seq
from cluster.spec import ClusterSpec
from model.config import load_config
from model.sampling import SamplingParams
from tests.presets import preset

pytestmark = pytest.mark.ray_queue



def prompts(n, lo=3, hi=30, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 760, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


@pytest.fixture(scope="module")
def models():
    return {name: preset(name, seed=2, dtype="float32")
            for name in ("kimi-k2-tiny", "kimi-k3-tiny", "deepseek-v3-tiny")}


class OracleDrafter:
    """Proposes the next tokens of ``truth[seq_id]`` (a run without drafts), one of them corrupted
    at about a third of the calls (by a hash of the sequence and its length: reproducible)."""

    def __init__(self, truth: list[list[int]], vocab: int):
        self.truth, self.vocab = truth, vocab
        self.calls = 0

    def propose(self, seq_id, token_ids, k, salt=None):
        full = self.truth[seq_id]
        L = len(token_ids)
        if full[:L] != token_ids:
            return []  # already diverged: the equality check reports it
        out = list(full[L : L + k])
        self.calls += 1
        if out and (seq_id * 31 + L) % 3 == 0:
            j = (seq_id + L) % len(out)
            out[j] = (out[j] + 1) % self.vocab
        return out

    def finished(self, seq_id, token_ids, num_prompt_tokens, salt=None):
        pass


def engine(path, speculative=None, attention=2, **knobs) -> Engine:
    cfg = EngineConfig.of(path, speculative=speculative, **knobs)
    spec = ClusterSpec(attention=attention, experts=1)
    return Engine(cfg, spec, executor=InProcessExecutor(cfg, spec, load_config(path))).start()


def run(path, ps, params, speculative=None, drafter=None, **knobs):
    """(full token lists, engine stats, prefix tokens hit) of one engine's generate."""
    eng = engine(path, speculative, **knobs)
    try:
        if drafter is not None:
            eng.scheduler.drafts.drafter = drafter
        seqs = eng.generate(ps, params)
        return [s.token_ids for s in seqs], eng.stats, sum(eng.scheduler.cache.hits.values())
    finally:
        eng.shutdown()


SPEC = {"method": "ngram", "num_speculative_tokens": 4}
# chunked prefill (a 64-token budget: the hybrid snapshot grid), preemption (one replica of 12 blocks of 16, 3 sequences of ~110 tokens)
# and prefix caching (a 70-token shared prefix: past the hybrid snapshot grid of 64)
KNOBS = dict(max_tokens_per_step=64, num_blocks=12, block_size=16, prefix_caching=True, attention=1)


def shared_prefix_prompts(n=6, seed=0):
    head = prompts(1, 70, 71, seed=seed + 100)[0]
    return [head + p for p in prompts(n, 4, 20, seed=seed)]


@pytest.mark.parametrize("name", ["kimi-k2-tiny", "kimi-k3-tiny", "deepseek-v3-tiny"])
def test_drafts_change_no_token(models, name):
    path = models[name]
    ps = shared_prefix_prompts()
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=11),
              SamplingParams(max_tokens=30, repetition_penalty=1.4, frequency_penalty=0.6),
              SamplingParams(max_tokens=30, temperature=1.0, seed=5, presence_penalty=1.0, min_tokens=3),
              SamplingParams(max_tokens=25, temperature=0.7, top_k=5, seed=3), SamplingParams(max_tokens=30)]
    # the prompts run in two waves, so the second finds the first's prefix cached
    first, _, _ = run(path, ps, params, **KNOBS)
    want, off_stats, off_hits = run(path, ps, params, max_num_seqs=3, **KNOBS)
    assert want == first  # (the waves change nothing either)
    drafter = OracleDrafter(want, load_config(path).vocab_size)
    got, st, hits = run(path, ps, params, SPEC, drafter, max_num_seqs=3, **KNOBS)
    assert got == want
    assert st.spec_accepted_tokens > 0 and st.spec_draft_tokens > st.spec_accepted_tokens  # both kinds happened
    assert st.preemptions > 0 and hits > 0 and off_stats.preemptions > 0


def test_mtp_drafts_change_no_token(models):
    """The MTP layer drafts (DeepSeek-V3 tiny's random one, so nearly all rejected) with chunked prefill,
    preemption and prefix caching: outputs equal; the trained preset's MTP layer gets most accepted."""
    path = models["deepseek-v3-tiny"]
    ps = shared_prefix_prompts(seed=5)
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=30, temperature=0.8, seed=2),
              SamplingParams(max_tokens=30, repetition_penalty=1.3)]
    mtp = {"method": "mtp", "full_draft_batch": 8}
    want, _, _ = run(path, ps, params * 2, max_num_seqs=3, **KNOBS)
    got, st, hits = run(path, ps, params * 2, mtp, max_num_seqs=3, **KNOBS)
    assert got == want and st.spec_draft_tokens > 0 and st.preemptions > 0 and hits > 0
    from model.tokenizer import Tokenizer

    mini = preset("kimi-k2-mini", dtype="float32")
    tok = Tokenizer.from_dir(mini)
    ps = [tok.encode(t) for t in ("The weather in Paris is", "def add(a, b):\n    return", "Once upon a time")]
    want, _, _ = run(mini, ps, SamplingParams(max_tokens=40))
    got, st, _ = run(mini, ps, SamplingParams(max_tokens=40), mtp)
    assert got == want and st.spec_accepted_tokens > st.spec_draft_tokens / 2


def test_mtp_needs_the_checkpoints_mtp_layer(models):
    with pytest.raises(ValueError, match="needs the checkpoint's multi-token-prediction layer"):
        engine(models["kimi-k2-tiny"], {"method": "mtp"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be <= 1"):
        engine(models["deepseek-v3-tiny"], {"method": "mtp", "num_speculative_tokens": 2})


def test_real_proposers_verify_exactly(models):
    # ngram on K2: repeated prompts give the prompt lookup something to find
    path = models["kimi-k2-tiny"]
    ps = [p * 3 for p in prompts(6, 4, 12, seed=1)]
    params = SamplingParams(max_tokens=40)
    want, _, _ = run(path, ps, params)
    got, st, _ = run(path, ps, params, SPEC)
    assert got == want and st.spec_accepted_tokens > 0
    # suffix on K3 (hybrid): the second pass of the same prompts drafts from the first pass's outputs
    path = models["kimi-k3-tiny"]
    ps = prompts(4, 4, 20, seed=3)
    want, _, _ = run(path, ps + ps, params)
    got, st, _ = run(path, ps + ps, params, {"method": "suffix", "num_speculative_tokens": 4},
                     max_num_seqs=4)
    assert got == want and st.spec_accepted_tokens > 0


def test_a_constrained_and_a_penalised_stream_keep_their_tokens(models):
    import jsonschema

    from deploy.structured import response_format_grammar
    from model.tokenizer import Tokenizer

    path = models["kimi-k2-tiny"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                   "n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["name", "n"], "additionalProperties": False}
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    ps = prompts(4, 5, 15, seed=7)
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, grammar=grammar) for s in range(3)]
    params.append(SamplingParams(max_tokens=40, temperature=0.8, seed=9, repetition_penalty=1.5,
                                 presence_penalty=1.5, frequency_penalty=1.0))
    want, _, _ = run(path, ps, params)
    got, st, _ = run(path, ps, params, SPEC, OracleDrafter(want, load_config(path).vocab_size))
    assert got == want and st.spec_accepted_tokens > 0 and st.spec_draft_tokens > st.spec_accepted_tokens
    tok = Tokenizer.from_dir(path)
    for p, toks in zip(ps[:3], got[:3]):
        jsonschema.validate(json.loads(tok.decode(toks[len(p):], skip_special_tokens=True)), schema)


def chi2_p(a: list[int], b: list[int]) -> float:
    """The p-value of Pearson's chi-squared test that counts ``a`` and ``b`` (same categories) come
    from one distribution (a 2 × C contingency table; categories empty in both are left out)."""
    t = torch.tensor([a, b], dtype=torch.float64)
    t = t[:, t.sum(0) > 0]
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = ((t - expected) ** 2 / expected).sum()
    df = t.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_rejection_sampling_keeps_the_distribution(models):
    path = models["kimi-k2-tiny"]
    prompt = prompts(1, 8, 9, seed=4)[0]
    # Unseeded rows draw from torch's global generator (the engines run in this process): seeded here,
    # the 2 × 2,400 draws are the same every run, so the test does not fail 1 run in 100 by chance
    # (it did once, p = 0.003) yet still compares two different sets of draws.
    torch.manual_seed(35)
    n = 2400
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3)  # unseeded: a fresh draw each time
    # the drafts: after the first token, the greedy continuation of each possible first token
    firsts, _, _ = run(path, [prompt] * 64, SamplingParams(max_tokens=1, temperature=1.0, top_k=3))
    heads = sorted({f[-1] for f in firsts})
    conts, _, _ = run(path, [prompt + [h] for h in heads], SamplingParams(max_tokens=2))
    table = {h: c[-2:] for h, c in zip(heads, conts)}

    class Greedy:
        def propose(self, seq_id, token_ids, k, salt=None):
            return table.get(token_ids[len(prompt)], [])[:k] if len(token_ids) == len(prompt) + 1 else []

        def finished(self, *a, **kw):
            pass

    def counts(toks):
        pairs = [tuple(t[len(prompt) + 1 :]) for t in toks]
        return pairs

    off, _, _ = run(path, [prompt] * n, params, max_num_seqs=64)
    on, st, _ = run(path, [prompt] * n, params, {**SPEC, "full_draft_batch": 64}, Greedy(), max_num_seqs=64)
    assert st.spec_drafts >= n * 0.9 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    a, b = counts(off), counts(on)
    cats = sorted(set(a) | set(b))
    p = chi2_p([a.count(c) for c in cats], [b.count(c) for c in cats])
    assert p > 0.01, (p, cats)
    # a seeded request: the same stream twice with drafts, and the same as without
    seeded = [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in range(4)]
    want, _, _ = run(path, [prompt] * 4, seeded)
    once, _, _ = run(path, [prompt] * 4, seeded, SPEC, OracleDrafter(want, load_config(path).vocab_size))
    again, _, _ = run(path, [prompt] * 4, seeded, SPEC, OracleDrafter(want, load_config(path).vocab_size))
    assert once == again == want


def test_chi2_p_tells_distributions_apart():
    assert chi2_p([500, 300, 200], [480, 320, 200]) > 0.01
    assert chi2_p([500, 300, 200], [300, 500, 200]) < 1e-6


# ---- the draft-length policy, on the scheduler's plans ------------------------------------------

def scheduler(method: str, k: int, *, num_blocks=64, block_size=4, replicas=1, caching=False, max_num_seqs=8,
              budget=64, **kw) -> Scheduler:
    """A scheduler alone (no engine) drafting with ``method``, up to ``k`` drafts."""
    from cluster.config import CacheConfig, SchedulerConfig, SpeculativeConfig

    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_tokens_per_step=budget),
                     CacheConfig(num_blocks=num_blocks, block_size=block_size, prefix_caching=caching),
                     num_replicas=replicas, speculative=SpeculativeConfig(method=method, num_speculative_tokens=k),
                     **kw)


class Always:
    """Proposes k copies of token 7, whatever the context."""

    def propose(self, seq_id, token_ids, k, salt=None):
        return [7] * k

    def finished(self, *a, **kw):
        pass


def decoding_scheduler(n: int) -> Scheduler:
    s = scheduler("ngram", 4, num_blocks=512, block_size=16, replicas=2, max_num_seqs=64, budget=1024)
    s.drafts.drafter = Always()
    for i in range(n):
        s.add(Seq(i, [1, 2, 3], 3, SamplingParams(max_tokens=100)))
    plan = s.schedule()  # the prefills
    s.update(plan, [_tok(c.seq_id) for r in plan.chunks for c in r])
    return s


def _tok(seq_id, t=5):
    from actors.messages import SampledToken

    return SampledToken(seq_id, t)


def drafts_of(plan) -> list[int]:
    return [c.draft for r in plan.chunks for c in r]


def test_drafts_shrink_with_the_batch():
    one = drafts_of(decoding_scheduler(1).schedule())
    eight = drafts_of(decoding_scheduler(8).schedule())
    thirty_two = drafts_of(decoding_scheduler(32).schedule())
    assert one == [4]
    assert eight == [1] * 8  # 4 × 2 / 8 (full_draft_batch 2)
    assert thirty_two == [0] * 32  # a full batch drafts nothing: its steps cost what they cost without


def test_drafts_shrink_with_rejections_and_come_back():
    s = decoding_scheduler(1)
    seen = []

    def step(accept: bool):
        plan = s.schedule()
        (c,) = [c for r in plan.chunks for c in r]
        seen.append(c.draft)
        a = c.draft if accept else 0
        toks = [_tok(0, 7)] * a + [_tok(0, 9)]
        assert [v.accepted for v in s.update(plan, toks).verified] == ([a] if c.draft else [])
        # the rejected drafts' positions are given back: the next chunk starts right after the accepted
        seq = s.seqs[0]
        assert seq.num_cached == len(seq.token_ids) - 1
        assert len(seq.block_table) == -(-seq.num_cached // 16)

    for _ in range(15):
        step(accept=False)
    assert seen[:3] == [4, 2, 1]  # its share of K falls with its acceptance
    assert 0 in seen[3:] and 1 in seen[3:]  # then none, but a probe now and then
    for _ in range(10):
        step(accept=True)
    assert seen[-1] == 4  # accepted again: back to K


def test_drafts_never_preempt_another_sequences_token():
    """One replica of 5 blocks of 4: sequence 0 decodes its 8th token, sequence 1 its 9th (2 + 3
    blocks). Drafts for sequence 0 would take the block sequence 1's one token needs: every decode
    grows by its token first, drafts take what is left (here, nothing)."""
    s = scheduler("ngram", 4, num_blocks=5)
    s.drafts.drafter = Always()
    s.add(Seq(0, [1] * 7, 7, SamplingParams(max_tokens=50)))
    s.add(Seq(1, [2] * 8, 8, SamplingParams(max_tokens=50)))
    plan = s.schedule()  # the prefills: 2 + 2 blocks
    s.update(plan, [_tok(0), _tok(1)])
    plan = s.schedule()
    assert plan.preempted == []
    assert sorted((c.seq_id, c.draft) for r in plan.chunks for c in r) == [(0, 0), (1, 0)]
    # with room for them, drafts come back: a sixth block, and sequence 0's four drafts fit in it
    s = scheduler("ngram", 4, num_blocks=6)
    s.drafts.drafter = Always()
    s.add(Seq(0, [1] * 7, 7, SamplingParams(max_tokens=50)))
    s.add(Seq(1, [2] * 8, 8, SamplingParams(max_tokens=50)))
    plan = s.schedule()
    s.update(plan, [_tok(0), _tok(1)])
    plan = s.schedule()
    assert plan.preempted == []
    assert sorted((c.seq_id, c.draft) for r in plan.chunks for c in r) == [(0, 4), (1, 0)]


def test_drafts_accepted_past_a_stop_token_are_neither_counted_nor_cached():
    """Drafts [x, EOS, y], all accepted (4 tokens back): the sequence ends at EOS, so two drafts
    count as accepted (x and EOS) and the blocks registered for prefix hits end at EOS's position."""
    EOS = 2
    s = scheduler("ngram", 3, caching=True, stop_ids=frozenset({EOS}))

    class Proposes:
        def propose(self, seq_id, token_ids, k, salt=None):
            return [7, EOS, 9][:k]

        def finished(self, *a, **kw):
            pass

    s.drafts.drafter = Proposes()
    s.add(Seq(0, [1, 3, 4, 5], 4, SamplingParams(max_tokens=20)))
    plan = s.schedule()
    s.update(plan, [_tok(0, 8)])  # [1, 3, 4, 5, 8]: next, the input 8 and drafts 7, EOS, 9 (positions 4-7: one block)
    plan = s.schedule()
    (c,) = [c for r in plan.chunks for c in r]
    assert c.token_ids == (8, 7, EOS, 9)
    toks = [_tok(0, 7), _tok(0, EOS), _tok(0, 9), _tok(0, 11)]
    update = s.update(plan, toks)
    assert [v.accepted for v in update.verified] == [2]
    assert [a.reason for a in update.applied] == [None, "stop"]  # EOS ends it; 9 and 11 dropped
    probe = Seq(1, [1, 3, 4, 5, 8, 7, EOS, 9, 11, 12], 10, SamplingParams())
    assert s.cache.hit(probe, 0).tokens == 4  # [1, 3, 4, 5]; not [8, 7, EOS, 9], which holds a draft past EOS


# ---- the proposers ------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    from cluster.drafts import NgramDrafter

    d = NgramDrafter(2, 3)
    assert d.propose(0, [1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    # the latest occurrence wins, and the longest n-gram before a shorter one
    assert d.propose(1, [5, 6, 9, 7, 5, 6, 8, 0, 5, 6], 2) == [8, 0]
    assert d.propose(2, [8, 1, 2, 9, 7, 1, 2, 3, 4, 7, 1, 2], 2) == [3, 4]
    assert d.propose(3, [1, 2, 3, 4, 5], 4) == []  # nothing repeats
    # incremental: the index follows a growing sequence
    toks = [1, 2, 3]
    assert d.propose(4, toks, 2) == []
    toks += [1, 2]
    assert d.propose(4, toks, 2) == [3, 1]


def test_suffix_drafts_from_the_sequence_and_from_recent_outputs():
    from cluster.drafts import SuffixDrafter

    d = SuffixDrafter(depth=8, window=2, min_prob=0.3)
    assert d.propose(0, [1, 2, 3, 4, 1, 2], 4) == [3, 4, 1]  # (its last token is not indexed yet)
    # the most frequent continuation, cut where its probability falls under min_prob
    assert d.propose(1, [5, 6, 1, 5, 6, 1, 5, 6, 2, 5, 6], 3) == [1, 5, 6]
    d.finished(1, [5, 6, 1, 5, 6, 1, 5, 6, 2, 5, 6], 2)
    # another request's answer: a new sequence whose context ends like it gets its continuation
    d.finished(2, [9, 9, 40, 41, 42, 43, 44], 2)
    assert d.propose(3, [7, 7, 40, 41], 3) == [42, 43, 44]
    # the window keeps two outputs: a third evicts the first one's counts
    d.finished(4, [0, 50, 51, 52], 1)
    assert d.propose(5, [3, 3, 40, 41], 3) == [42, 43, 44]
    d.finished(6, [0, 60, 61], 1)
    assert d.propose(7, [3, 3, 40, 41], 3) == []
    assert d.shared[None].root.total == sum(c.count for c in d.shared[None].root.children.values())


def _suffix_drafts(finished_salt, salt) -> list[int]:
    """The drafts a decode of [7, 7, 40, 41] under ``salt`` carries, in a scheduler whose suffix
    proposer saw [40 … 44] finish under ``finished_salt``."""
    s = scheduler("suffix", 3)
    s.finish(Seq(0, [9, 9, 40, 41, 42, 43, 44], 2, SamplingParams(), cache_salt=finished_salt), "stop")
    s.add(Seq(1, [7, 7, 40], 3, SamplingParams(max_tokens=10), cache_salt=salt))
    plan = s.schedule()  # the prefill
    s.update(plan, [_tok(1, 41)])
    (c,) = [c for r in s.schedule().chunks for c in r]
    return list(c.token_ids[len(c.token_ids) - c.draft:]) if c.draft else []


def test_suffix_drafts_stay_within_a_cache_salt():
    """Acceptance shows in latency, so another tenant's outputs must not be drafted from: the same
    side channel ``cache_salt`` closes for the prefix cache (review 2026-12-06, finding 5)."""
    assert _suffix_drafts("a", "a") == [42, 43, 44]
    assert _suffix_drafts(None, None) == [42, 43, 44]
    assert _suffix_drafts("a", "b") == []
    assert _suffix_drafts("a", None) == []  # unsalted requests never see salted outputs …
    assert _suffix_drafts(None, "a") == []  # … nor salted ones unsalted outputs
    assert _suffix_drafts("", None) == []  # "" is a salt of its own, as in the block hashes


def test_suffix_window_is_per_salt_and_bounded_in_total():
    from cluster.drafts import SuffixDrafter

    d = SuffixDrafter(depth=8, window=3, min_prob=0.3)
    d.finished(0, [9, 9, 40, 41, 42, 43, 44], 2, salt="a")
    assert d.propose(1, [7, 7, 40, 41], 3, salt="b") == []
    assert d.propose(2, [7, 7, 40, 41], 3) == []
    assert d.propose(3, [7, 7, 40, 41], 3, salt="a") == [42, 43, 44]
    d.finished(4, [1, 50, 51, 52], 1)  # unsalted
    assert d.propose(5, [3, 3, 50, 51], 1, salt="a") == []
    assert d.propose(6, [3, 3, 50, 51], 1) == [52]
    # many salts: the window holds 3 outputs in all (oldest out first), and a salt whose outputs
    # all left it leaves no trie behind
    for i in range(10):
        d.finished(10 + i, [0, 60 + i, 61 + i], 1, salt=f"t{i}")
        d.propose(100, [1], 1)  # takes pending outputs into the tries
    assert len(d.recent) == 3 and set(d.shared) == {"t7", "t8", "t9"}
    assert d.propose(101, [5, 69], 1, salt="t9") == [70]
    assert d.propose(102, [5, 69], 1, salt="t8") == []
    for trie in d.shared.values():
        assert trie.root.total == sum(c.count for c in trie.root.children.values())


def test_acceptance_in_status_and_metrics(models):
    from deploy.metrics import EngineMetrics

    path = models["kimi-k2-tiny"]
    ps = [p * 3 for p in prompts(3, 4, 12, seed=1)]
    eng = engine(path, SPEC)
    try:
        eng.generate(ps, SamplingParams(max_tokens=30))
        st = eng.status()["speculative"]
        assert st["method"] == "ngram" and st["draft_tokens"] == eng.stats.spec_draft_tokens > 0
        assert st["accepted_tokens"] == sum(st["accepted_per_position"]) > 0
        assert st["mean_accepted_length"] == 1 + st["accepted_tokens"] / st["drafts"]
        for prefix, label in (("moeray", 'model_name="m"'), ("vllm", 'engine="0",model_name="m"')):
            text = EngineMetrics(eng, "m", prefix=prefix).render().decode()
            assert f'{prefix}:spec_decode_num_draft_tokens_total{{{label}}} {float(st["draft_tokens"])}' in text
            assert f'{prefix}:spec_decode_num_accepted_tokens_total{{{label}}} {float(st["accepted_tokens"])}' in text
            assert f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="0"}}' in text
        assert "moeray:spec_decode_experts_touched_total" in text
    finally:
        eng.shutdown()
    off = engine(path)
    try:
        assert off.status()["speculative"] is None
        assert "spec_decode" not in EngineMetrics(off, "m").render().decode()
    finally:
        off.shutdown()


def test_accepted_drafts_are_registered_for_prefix_hits():
    """A sequence that finishes in the step that accepted its drafts leaves their blocks cached: a
    later request sharing the whole answer finds it (the live K2 app's five-turn test caught a block
    lost there)."""
    s = scheduler("ngram", 4, caching=True)
    s.drafts.drafter = Always()
    s.add(Seq(0, [1, 2, 3, 4, 5, 6], 6, SamplingParams(max_tokens=6)))
    plan = s.schedule()
    toks = [_tok(0, 7)]
    s.update(plan, toks)  # [1..6, 7]: next, drafts 7 7 7 7 (all accepted) and one more: max_tokens reached
    plan = s.schedule()
    (c,) = [c for r in plan.chunks for c in r]
    assert c.draft == 4
    toks = [_tok(0, 7)] * 4 + [_tok(0, 9)]
    s.update(plan, toks)
    assert not s.seqs  # finished: 6 tokens generated
    probe = Seq(1, [1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 7, 9, 1], 13, SamplingParams())
    assert s.cache.hit(probe, 0).tokens == 8  # blocks [1..4], [5, 6, 7, 7] — the second holds two accepted drafts
