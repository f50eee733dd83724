"""model/grammar.py on the shipped tiny tokenizers (the kimi one is kimi-k2-tiny's, 1024 ids): the
llguidance adapter of both backends (special tokens by name, every end-of-turn id as EOS, a padded
logits width), masks against llguidance's own per-matcher mask as the oracle, the error-state policy,
compile errors, and the compile cache.

Measured (``python tests/model/test_grammar.py``; a synthetic 163,840-id tiktoken vocabulary of
random words, CJK and punctuation, on a 2-core CPU host shared with other jobs, so indicative only):
building the LLTokenizer ~0.5 s; a typical JSON schema (6 properties, a nested object, an array with
min/maxItems, an enum, a pattern) compiles in ~3-5 ms at first use and ~0.01 ms cached (a deep copy);
a 3-tool, 16-call tool grammar ~4-6 ms and ~0.01 ms. The mask per row and step, through
:meth:`Grammars.fill` along random-logit generations: ~10-20 µs alone, ~60-100 µs per row in a
16-row batch on these 2 cores; unpacking and applying it to CPU logits costs ~150-300 µs per row
(memory-bound; on a GPU it is one small kernel).
"""

import random
import threading
import time

import llguidance
import pytest
import torch

from model.grammar import Grammars, apply_bitmask, check, lltokenizer
from model.tokenizer import SHIPPED_DIR, SHIPPED_VOCAB_SIZE, Tokenizer
from model.tokenizer_backends import K2_PAT_STR

V = SHIPPED_VOCAB_SIZE
TOOL_MARKERS = {"<|tool_calls_section_begin|>": 779, "<|tool_calls_section_end|>": 780, "<|tool_call_begin|>": 781,
                "<|tool_call_argument_begin|>": 782, "<|tool_call_end|>": 783}


@pytest.fixture(scope="module")
def kimi() -> Tokenizer:
    """The tokenizer that kimi-k2-tiny (and every kimi preset) copies into its checkpoint."""
    return Tokenizer.from_dir(SHIPPED_DIR / "kimi")


@pytest.fixture(scope="module")
def grammars(kimi) -> Grammars:
    g = Grammars(lltokenizer(kimi, V))
    yield g
    g.close()


def allowed_ids(matcher: llguidance.LLMatcher) -> set[int]:
    """The oracle: llguidance's own one-byte-per-id mask of a single matcher (no bitmask, no torch)."""
    return {i for i, b in enumerate(matcher.compute_logit_bias()) if b}


def finite(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_the_tiny_tokenizer_has_the_k2_markers(kimi):
    assert {name: kimi.token_to_id(name) for name in TOOL_MARKERS} == TOOL_MARKERS
    assert set(TOOL_MARKERS.values()) <= kimi.special_token_ids
    assert kimi.stop_token_ids == {769, 770, 777}  # [EOS], <|im_end|>, [EOT]


def test_special_tokens_are_addressable_by_name(kimi, grammars):
    m = grammars.matcher('start: <|tool_call_begin|> "get" <|tool_call_end|>')
    assert allowed_ids(m) == {781}
    assert m.consume_token(781) and m.consume_tokens(kimi.encode("get"))
    assert allowed_ids(m) == {783}
    assert m.consume_token(783) and m.is_accepting()
    with pytest.raises(ValueError, match="unknown special token"):
        grammars.check("start: <|no_such_token|>")


def test_hf_backend_tokenizes_like_the_tokenizer_and_names_its_specials():
    tok = Tokenizer.from_dir(SHIPPED_DIR / "deepseek")
    llt = lltokenizer(tok, V)
    text = "Hello, world! 12345 — ünïcödé"
    assert llt.tokenize_str(text) == tok.encode(text)
    g = Grammars(llt)
    begin = tok.token_to_id("<｜tool▁calls▁begin｜>")
    assert allowed_ids(g.matcher('start: <｜tool▁calls▁begin｜> "x"')) == {begin}
    g.close()


def test_tiktoken_backend_tokenizes_like_the_tokenizer(kimi):
    llt = lltokenizer(kimi, V)
    text = "Hello, world! 12345 — ünïcödé 你好 <|tool_call_begin|>"
    assert llt.tokenize_str(text, parse_special=True) == kimi.encode(text)
    assert set(llt.eos_tokens) == kimi.stop_token_ids


def test_a_finished_grammar_allows_exactly_the_end_of_turn_ids(kimi, grammars):
    m = grammars.matcher('start: "ok"')
    assert m.consume_tokens(kimi.encode("ok"))
    assert allowed_ids(m) == set(kimi.stop_token_ids)
    logits = torch.randn(1, V)
    assert grammars.mask_logits([m], logits) == []
    assert finite(logits[0]) == set(kimi.stop_token_ids)
    assert grammars.consume([m], [770]) == [] and m.is_stopped()


def test_padded_vocabulary_ids_are_never_allowed(kimi):
    wide = V + 100  # a model whose logits are wider than its tokenizer
    g = Grammars(lltokenizer(kimi, wide))
    m = g.matcher("start: /(?s:.)*/")
    logits = torch.randn(1, wide)
    g.mask_logits([m], logits)
    allowed = finite(logits[0])
    assert allowed and max(allowed) < V
    g.close()
    with pytest.raises(ValueError, match="n_vocab"):
        lltokenizer(kimi, V - 1)


def test_mask_logits_matches_each_matchers_own_mask(kimi, grammars):
    """A mixed batch: JSON at different points, free text, and an unconstrained row (None)."""
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}}}'
    prefixes = ['', '{"a"', '{"a": 12', '{"b": "', 'text']
    grammar_texts = [f"start: %json {schema}"] * 4 + ["start: /[a-z ]+/"]
    matchers = []
    for text, prefix in zip(grammar_texts, prefixes):
        m = grammars.matcher(text)
        assert m.consume_tokens(kimi.encode(prefix)), m.get_error()
        matchers.append(m)
    rows = [matchers[0], matchers[1], None, matchers[2], matchers[3], matchers[4]]
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    assert grammars.mask_logits(rows, logits) == []
    for r, m in enumerate(rows):
        if m is None:
            assert torch.equal(logits[r], before[r])
            continue
        expected = allowed_ids(m)
        assert finite(logits[r]) == expected and expected
        assert torch.equal(logits[r, sorted(expected)], before[r, sorted(expected)])


def test_apply_bitmask_sets_exactly_the_cleared_bits():
    rng = random.Random(0)
    for vocab in (1, 31, 32, 33, 1000, 1024):
        ids = [i for i in range(vocab) if rng.random() < 0.3]
        words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
        for i in ids:
            words[i // 32] |= 1 << (i % 32)
        bitmask = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).unsqueeze(0)
        logits = torch.zeros(1, vocab)
        apply_bitmask(logits, bitmask)
        assert finite(logits[0]) == set(ids)


def test_a_matcher_in_error_state_allows_only_the_stop_ids(kimi, grammars):
    good, bad = grammars.matcher('start: "yes" | "no"'), grammars.matcher('start: "yes" | "no"')
    forbidden = kimi.encode("maybe")[0]
    assert forbidden not in allowed_ids(bad)
    assert grammars.consume([good, None, bad], [kimi.encode("yes")[0], 5, forbidden]) == [2]
    assert bad.is_error() and not good.is_error()
    logits = torch.randn(3, V)
    assert grammars.mask_logits([good, None, bad], logits) == [2]  # reported, not raised
    assert finite(logits[2]) == set(kimi.stop_token_ids)
    assert torch.isfinite(logits[1]).all()
    assert grammars.consume([bad], [769]) == [] and bad.is_error()  # the stop id ends it; the error stays


def test_compile_errors_are_value_errors_with_llguidances_message(grammars):
    with pytest.raises(ValueError, match="unknown name"):
        grammars.matcher("start: nothing_defined")
    with pytest.raises(ValueError, match="unknown name"):
        check("start: nothing_defined")
    with pytest.raises(ValueError, match="Invalid type"):
        grammars.matcher('start: %json {"type": "strin"}')
    check('start: "a" <[781]>')  # ids need no tokenizer
    grammars.check('start: <|tool_call_begin|>')


def test_a_grammar_text_compiles_once(kimi, grammars):
    text, before = 'start: "once" /[0-9]+/', grammars.num_compiles
    grammars.prepare(text)  # in the background
    grammars.prepare(text)
    a, b = grammars.matcher(text), grammars.matcher(text)
    assert grammars.num_compiles == before + 1
    assert a.consume_tokens(kimi.encode("once1"))  # matchers are independent copies
    assert allowed_ids(b) != allowed_ids(a) and not b.is_error()
    bad = "start: undefined_rule"
    for _ in range(2):
        with pytest.raises(ValueError):
            grammars.matcher(bad)
    assert grammars.num_compiles == before + 2  # a failed compile is cached too


def test_the_cache_evicts_the_least_recently_used(kimi):
    g = Grammars(lltokenizer(kimi, V), max_cached=2)
    texts = ['start: "a"', 'start: "b"', 'start: "c"']
    g.matcher(texts[0]), g.matcher(texts[1]), g.matcher(texts[0])  # "b" is now the oldest
    g.matcher(texts[2])
    assert g.num_compiles == 3
    g.matcher(texts[0])
    assert g.num_compiles == 3
    g.matcher(texts[1])
    assert g.num_compiles == 4
    g.close()


def test_prepare_compiles_off_the_calling_thread(kimi):
    g = Grammars(lltokenizer(kimi, V))
    threads = []
    original = g._compile

    def spy(text):
        threads.append(threading.current_thread().name)
        return original(text)

    g._compile = spy
    g.prepare('start: "bg"')
    g.matcher('start: "bg"')
    assert len(threads) == 1 and threads[0].startswith("grammar-compile")
    g.close()


def _measure() -> None:  # pragma: no cover - run by hand: python tests/model/test_grammar.py
    """The numbers in the module docstring, on a synthetic K2-sized vocabulary."""
    from deploy.structured import response_format_grammar
    n_vocab, rng = 163_840, random.Random(0)
    n_ranks = n_vocab - 256
    ranks = {bytes([b]): b for b in range(256)}
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    while len(ranks) < n_ranks:
        r = rng.random()
        if r < 0.7:
            s = " " * rng.randint(0, 1) + "".join(rng.choice(letters) for _ in range(rng.randint(1, 10)))
        elif r < 0.85:
            s = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 3)))
        else:
            s = "".join(rng.choice(' {}[]":,.\n\t-_!?()') for _ in range(rng.randint(2, 4)))
        ranks.setdefault(s.encode(), len(ranks))
    specials = {f"<|reserved_token_{i}|>": i for i in range(n_ranks + 2, n_vocab)}
    specials.update({"[EOS]": n_ranks, "<|im_end|>": n_ranks + 1})
    t0 = time.perf_counter()
    llt = llguidance.LLTokenizer.from_tiktoken(encoder=ranks, special_tokens=specials, pattern=K2_PAT_STR,
                                              eos_token=[n_ranks, n_ranks + 1], n_vocab=n_vocab)
    print(f"LLTokenizer: {time.perf_counter() - t0:.2f} s")
    g = Grammars(llt)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "address", "status"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                             "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
                             "address": {"type": "object", "required": ["city"], "properties": {
                                 "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
                             "status": {"enum": ["active", "inactive"]}}}
    text = response_format_grammar({"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    t0 = time.perf_counter()
    g.matcher(text)
    t1 = time.perf_counter()
    g.matcher(text)
    print(f"JSON schema: first {1e3 * (t1 - t0):.1f} ms, cached {1e3 * (time.perf_counter() - t1):.3f} ms")
    for rows in (1, 16):
        matchers, gen, fill_s, apply_s = [g.matcher(text) for _ in range(rows)], torch.Generator().manual_seed(0), 0, 0
        bitmask = torch.full((rows, (n_vocab + 31) // 32), -1, dtype=torch.int32)
        for _ in range(200):
            t0 = time.perf_counter()
            g.fill(matchers, bitmask)
            t1 = time.perf_counter()
            logits = torch.randn(rows, n_vocab, generator=gen)
            t2 = time.perf_counter()
            apply_bitmask(logits, bitmask)
            fill_s, apply_s = fill_s + t1 - t0, apply_s + time.perf_counter() - t2
            g.consume(matchers, logits.argmax(-1).tolist())
        per_row = 1e6 / 200 / rows
        print(f"R={rows}: fill {fill_s * per_row:.1f} us/row, apply (CPU) {apply_s * per_row:.1f} us/row")
    g.close()


if __name__ == "__main__":
    _measure()
