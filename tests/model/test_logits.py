"""Logits processing (model/logits.py, model/sampling.py's min_p): each processor against a
per-token loop that states vLLM's meaning directly, the history's rollback and rebuild, and the
single-process runner with min_tokens masking the stop ids rather than declining to stop."""

import pytest
import torch

from model.config import parse_config
from model.logits import LogitsState
from model.model import CausalLM, init_random_weights
from model.presets import preset_config
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams, sample

V = 50


def _logits(rows, seed=0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _reference(logits, prompt, output, p: SamplingParams):
    """vLLM's order on one row, token by token: bias, then repetition over prompt + output, then
    frequency and presence over the output."""
    x = logits.clone()
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def test_penalties_and_bias_equal_the_per_token_reference():
    state = LogitsState(V, torch.device("cpu"))
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.5),
              SamplingParams(),  # untouched
              SamplingParams(frequency_penalty=1.5, logit_bias=((3, 5.0), (7, -100.0))),
              SamplingParams(repetition_penalty=0.7, presence_penalty=2.0)]
    hist = [([1, 2, 3, 4], [5, 5, 2, 9]), ([1], [2]), ([0, 0, 0], [3, 3, 3, 8]), ([10, 11], [])]
    for i, ((prompt, out), p) in enumerate(zip(hist, params)):
        state.feed(i, len(prompt), 0, prompt, p)
        for j, t in enumerate(out):  # decode steps, one token each
            state.feed(i, len(prompt), len(prompt) + j, [t], p)
    raw = _logits(4)
    got = state.apply(raw, [0, 1, 2, 3], params)
    assert got is not raw and torch.equal(raw, _logits(4))  # the raw logits stay for logprobs
    for i, ((prompt, out), p) in enumerate(zip(hist, params)):
        torch.testing.assert_close(got[i], _reference(raw[i], prompt, out, p), rtol=0, atol=1e-6)
    assert not torch.equal(got[0], raw[0]) and torch.equal(got[1], raw[1])


def test_a_vanishing_repetition_penalty_keeps_the_logits_finite_and_samples():
    """5e-324 (the fuzzer's value) is 0 in fp32: taken as the smallest normal, the quotient kept
    finite, so the seen tokens dominate and a draw still picks a valid token (it raised)."""
    state = LogitsState(V, torch.device("cpu"))
    p = SamplingParams(repetition_penalty=5e-324, temperature=1.0)
    state.feed(0, 3, 0, [4, 5, 6], p)
    raw = _logits(1)
    raw[0, 4] = 3.0  # a seen token with a positive logit: divided towards +inf
    raw[0, 7] = float("-inf")  # masked (a bias or a grammar): stays -inf, never NaN
    got = state.apply(raw, [0], [p])
    assert not got.isnan().any() and bool(torch.isfinite(got[0, 4])) and got[0, 4] > 1e38 and got[0, 7] == float("-inf")
    tok = sample(got, [p], [None])
    assert 0 <= int(tok[0]) < V and int(tok[0]) == 4
    cold = SamplingParams(repetition_penalty=5e-324, temperature=0.01, seed=3)  # the quotient over T < 1
    assert int(sample(got, [cold], [3])[0]) in (4, 5)  # both over the max once scaled: a tie, no NaN


def test_no_processing_returns_the_logits_themselves():
    raw = _logits(2)
    assert LogitsState(V, torch.device("cpu")).apply(raw, [0, 1], [SamplingParams()] * 2) is raw


def test_banned_ids_are_never_sampled():
    state = LogitsState(V, torch.device("cpu"))
    raw = _logits(2, 3)
    best = raw.argmax(-1).tolist()
    got = state.apply(raw, [0, 1], [SamplingParams(), SamplingParams()], [(best[0],), ()])
    assert got[0, best[0]] == float("-inf") and sample(got, [SamplingParams()] * 2, [None, None]).tolist()[0] != best[0]
    assert torch.equal(got[1], raw[1])


def _fed(state, seq_id, prompt, out, p):
    state.feed(seq_id, len(prompt), 0, prompt + out[:1], p)  # a prefill that already holds a token
    for j, t in enumerate(out[1:], 1):
        state.feed(seq_id, len(prompt), len(prompt) + j, [t], p)


def test_a_redone_step_rolls_the_history_back():
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)
    prompt = [1, 2, 3]
    a, b = LogitsState(V, torch.device("cpu")), LogitsState(V, torch.device("cpu"))
    _fed(a, 0, prompt, [4, 5, 6, 7], p)
    a.feed(0, 3, 4, [9], p)  # position 4 again (the token 5 is replaced: a step done again)
    _fed(b, 0, prompt, [4, 9], p)
    ha, hb = a.histories[0], b.histories[0]
    assert ha.tokens == hb.tokens == [1, 2, 3, 4, 9]
    assert torch.equal(ha.counts, hb.counts) and torch.equal(ha.seen, hb.seen)
    a.feed(0, 3, 0, prompt + [4], p)  # a re-prefill from the start rebuilds it
    assert a.histories[0].tokens == [1, 2, 3, 4] and int(a.histories[0].counts.sum()) == 1


def test_gaps_and_missing_histories_are_errors_and_release_forgets():
    p = SamplingParams(presence_penalty=1.0)
    state = LogitsState(V, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="without the history"):
        state.feed(0, 3, 5, [1], p)
    state.feed(0, 3, 0, [1, 2, 3], p)
    with pytest.raises(RuntimeError, match="history ends at 3"):
        state.feed(0, 3, 4, [1], p)
    state.release([0])
    with pytest.raises(RuntimeError, match="no history"):
        state.apply(_logits(1), [0], [p])


def test_min_p_keeps_only_tokens_within_the_ratio_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]] * 400))
    params = [SamplingParams(temperature=1.0, min_p=0.25, seed=i) for i in range(400)]
    drawn = set(sample(logits, params, [i + 1 for i in range(400)]).tolist())
    assert drawn == {0, 1}  # 0.1 < 0.25 × 0.5: gone; both survivors drawn
    free = set(sample(logits, [SamplingParams(temperature=1.0, seed=i) for i in range(400)],
                      [i + 1 for i in range(400)]).tolist())
    assert free > {0, 1}


@pytest.fixture(scope="module")
def runner():
    m = CausalLM(parse_config(preset_config("kimi-k2-tiny")))
    init_random_weights(m, seed=3, std=0.08)
    return ModelRunner(m.eval(), num_blocks=64, block_size=4)


def test_min_tokens_masks_the_stop_ids(runner):
    prompt = [5, 6, 7, 8]
    (plain,) = generate(runner, [prompt], SamplingParams(max_tokens=4))
    first = plain.output_ids[0]
    # a stop id the model samples first: with min_tokens 3 it may not come before the third token
    (seq,) = generate(runner, [prompt], SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=(first,)))
    assert first not in seq.output_ids[:2]
    (stopped,) = generate(runner, [prompt], SamplingParams(max_tokens=6, stop_token_ids=(first,)))
    assert stopped.output_ids == [first] and stopped.finish_reason == "stop"


def test_penalties_change_greedy_output_and_match_alone_vs_batched(runner):
    prompt = [5, 6, 7, 8]
    plain = generate(runner, [prompt], SamplingParams(max_tokens=12))[0].output_ids
    pen = SamplingParams(max_tokens=12, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0)
    alone = generate(runner, [prompt], pen)[0].output_ids
    batched = generate(runner, [prompt, [9, 10, 11]], [pen, SamplingParams(max_tokens=5)])[0].output_ids
    assert alone == batched
    assert len(set(alone)) > len(set(plain))  # the penalties break the random model's repetition


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    "inner": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}},
    "required": ["name", "tags", "inner"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars(runner):
    from model.grammar import Grammars, lltokenizer
    from model.tokenizer import SHIPPED_DIR, Tokenizer

    g = Grammars(lltokenizer(Tokenizer.from_dir(SHIPPED_DIR / "kimi"), runner.cfg.vocab_size))
    return lambda: g


def test_a_grammar_holds_the_random_model_to_its_schema(runner, grammars):
    import json

    import jsonschema

    from deploy.structured import response_format_grammar
    from model.tokenizer import SHIPPED_DIR, Tokenizer

    tok = Tokenizer.from_dir(SHIPPED_DIR / "kimi")
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=grammar, min_tokens=3) for s in range(6)]
    big = ModelRunner(runner.model, num_blocks=6 * 52, block_size=4)
    seqs = generate(big, [[5, 6, 7, 8]] * 6, params, stop_ids=tok.stop_token_ids, grammars=grammars)
    texts = set()
    for s in seqs:
        assert s.finish_reason == "stop", s.output_ids  # the grammar ended the turn with a stop id
        text = tok.decode(s.output_ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 1
    free = generate(runner, [[5, 6, 7, 8]], SamplingParams(max_tokens=40, temperature=1.0, seed=0))[0]
    with pytest.raises(ValueError):  # the random model alone writes no JSON
        json.loads(tok.decode(free.output_ids, skip_special_tokens=True))


def test_a_redone_step_rolls_the_matcher_back(grammars):
    from deploy.structured import response_format_grammar

    grammar = response_format_grammar({"type": "json_object"})
    p = SamplingParams(grammar=grammar)
    state = LogitsState(1024, torch.device("cpu"), grammars)
    prompt = [1, 2, 3]
    brace = grammars().tokenizer.tokenize_str("{")
    state.feed(0, 3, 0, prompt + brace, p)
    m = state.histories[0].matcher
    before = m.compute_bitmask()
    quote = grammars().tokenizer.tokenize_str('"')
    state.feed(0, 3, 3 + len(brace), quote, p)
    assert m.compute_bitmask() != before
    state.feed(0, 3, 3 + len(brace), quote, p)  # the same step again: rolled back, then fed
    state.feed(0, 3, 3, brace, p)  # back to just "{"
    assert state.histories[0].matcher.compute_bitmask() == before


def test_a_grammar_that_does_not_compile_only_lets_the_sequence_stop(grammars):
    state = LogitsState(1024, torch.device("cpu"), grammars)
    p = SamplingParams(grammar="start: nope_undefined_rule")
    state.feed(0, 2, 0, [1, 2], p)
    out = state.apply(torch.randn(1, 1024), [0], [p])
    allowed = set(torch.isfinite(out[0]).nonzero().flatten().tolist())
    assert allowed == set(grammars().stop_ids) and state.grammar_errors == 1
