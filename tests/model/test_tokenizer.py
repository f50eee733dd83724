"""Tokenizer: shipped assets, both file formats, K2 pat_str, chat templates, streaming decode."""

from __future__ import annotations

import base64
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Regex, pre_tokenizers

from model.chat_template import K2_DEFAULT_SYSTEM_PROMPT
from model.tokenizer import (MINI_RANKS, MINI_VOCAB_SIZE, SHIPPED_DIR, SHIPPED_KINDS, SHIPPED_RANKS, SHIPPED_VOCAB_SIZE, IncrementalDecoder, Tokenizer,
                             copy_tokenizer_files, shipped_special_ids)
from model.tokenizer_backends import K2_PAT_STR, split_long_runs

REPO = Path(__file__).resolve().parents[2]
R = SHIPPED_RANKS

KIMI_SPECIALS = {  # K2 offsets from 163584, rebased to R (MODEL_SPEC §1.11)
    "[BOS]": R + 0, "[EOS]": R + 1, "<|im_end|>": R + 2, "<|im_user|>": R + 3, "<|im_assistant|>": R + 4,
    "<|start_header_id|>": R + 6, "<|end_header_id|>": R + 7, "[EOT]": R + 9, "<|im_system|>": R + 10,
    "<|tool_calls_section_begin|>": R + 11, "<|tool_calls_section_end|>": R + 12, "<|tool_call_begin|>": R + 13,
    "<|tool_call_argument_begin|>": R + 14, "<|tool_call_end|>": R + 15, "<|im_middle|>": R + 17,
    "<think>": R + 22, "</think>": R + 23,  # K2-Thinking's 163606 / 163607
    "[UNK]": R + 254, "[PAD]": R + 255,
}
DEEPSEEK_SPECIALS = {"<｜begin▁of▁sentence｜>": 768, "<｜end▁of▁sentence｜>": 769, "<｜User｜>": 770, "<｜Assistant｜>": 771}

TEXTS = {
    "english": "The keeper's lamp didn't fail; she'd checked it twice. WE'LL see at 10:45!",
    "code": "def f(x: int) -> int:\n    return {\"a\": x ** 2}[\"a\"]  # square\n\n\tif x != 0:\r\n        pass\n",
    "chinese": "今天天气很好，我们去公园散步吧。混合 mixed 文本123",
    "emoji": "rare bytes: 🦜🧬 ∮ ℵ ⁂ — ok",
    "spaces": "   leading\n\n\n   trailing   \t",
}


@pytest.fixture(scope="module")
def kimi() -> Tokenizer:
    return Tokenizer.from_dir(SHIPPED_DIR / "kimi")


@pytest.fixture(scope="module")
def deepseek() -> Tokenizer:
    return Tokenizer.from_dir(SHIPPED_DIR / "deepseek")


def tiktoken_pieces(text: str) -> list[str]:
    """How tiktoken splits ``text`` with K2's pat_str: every substring is a rank, so each
    regex piece comes back as exactly one token."""
    data = text.encode()
    subs = {data[i:j] for i in range(len(data)) for j in range(i + 1, len(data) + 1)}
    subs |= {bytes([b]) for b in range(256)}
    enc = tiktoken.Encoding("probe", pat_str=K2_PAT_STR, mergeable_ranks={s: k for k, s in enumerate(sorted(subs))},
                            special_tokens={})
    return [enc.decode_single_token_bytes(i).decode() for i in enc.encode(text)]


# ---------------------------------------------------------------- shipped assets and formats

def test_shipped_layout(kimi: Tokenizer, deepseek: Tokenizer):
    assert SHIPPED_VOCAB_SIZE == 1024 and SHIPPED_RANKS == 768
    lines = (SHIPPED_DIR / "kimi" / "tiktoken.model").read_text().splitlines()
    assert len(lines) == R and [int(line.split()[1]) for line in lines] == list(range(R))
    assert [base64.b64decode(line.split()[0]) for line in lines[:256]] == [bytes([b]) for b in range(256)]
    merges = json.loads((SHIPPED_DIR / "deepseek" / "tokenizer.json").read_text())["model"]["merges"]
    assert len(merges) == R - 256
    assert kimi.vocab_size == deepseek.vocab_size == SHIPPED_VOCAB_SIZE
    for tok in (kimi, deepseek):  # every id decodes
        assert all(isinstance(tok.id_to_token(i), str) for i in range(SHIPPED_VOCAB_SIZE))
        tok.decode(list(range(SHIPPED_VOCAB_SIZE)))


def test_special_ids(kimi: Tokenizer, deepseek: Tokenizer):
    for name, i in KIMI_SPECIALS.items():
        assert kimi.token_to_id(name) == i and kimi.id_to_token(i) == name
    assert kimi.id_to_token(R + 5) == f"<|reserved_token_{R + 5}|>"
    assert kimi.id_to_token(R + 253) == f"<|reserved_token_{R + 253}|>"
    assert kimi.id_to_token(R + 21) == f"<|reserved_token_{R + 21}|>"  # K2.5's media ids stay unnamed
    for name, i in DEEPSEEK_SPECIALS.items():
        assert deepseek.token_to_id(name) == i and deepseek.id_to_token(i) == name
    assert (kimi.bos_token_id, kimi.eos_token_id) == (R, R + 1)
    assert (deepseek.bos_token_id, deepseek.eos_token_id) == (768, 769)
    assert shipped_special_ids("kimi") == {"bos_token_id": 768, "eos_token_id": 769}
    assert shipped_special_ids("deepseek") == {"bos_token_id": 768, "eos_token_id": 769}


def test_stop_ids(kimi: Tokenizer, deepseek: Tokenizer):
    assert kimi.stop_token_ids == frozenset({R + 2, R + 1, R + 9})  # <|im_end|>, [EOS], [EOT]
    assert deepseek.stop_token_ids == frozenset({769})


@pytest.mark.parametrize("name", list(TEXTS))
def test_round_trip_and_formats_agree(kimi: Tokenizer, deepseek: Tokenizer, name: str):
    text = TEXTS[name]
    ids = kimi.encode(text)
    assert kimi.decode(ids) == text
    assert deepseek.encode(text) == ids  # same 768 ranks and merges, same pre-split
    assert deepseek.decode(ids) == text
    assert all(0 <= i < R for i in ids)


def test_formats_agree_on_corpus(kimi: Tokenizer, deepseek: Tokenizer):
    text = (REPO / "scripts" / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    ids = kimi.encode(text)
    assert ids == deepseek.encode(text) and kimi.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # the merges actually compress


def test_emoji_falls_back_to_bytes(kimi: Tokenizer):
    ids = kimi.encode("🦜")
    assert [kimi.token_bytes(i) for i in ids] == [bytes([b]) for b in "🦜".encode()]


def test_specials_in_text(kimi: Tokenizer, deepseek: Tokenizer):
    assert kimi.encode("<|im_user|>hi<|im_end|>") == [R + 3, *kimi.encode("hi"), R + 2]
    assert kimi.encode(f"<|reserved_token_{R + 100}|>") == [R + 100]
    plain = kimi.encode("<|im_end|>", allow_special=False)
    assert all(i < R for i in plain) and kimi.decode(plain) == "<|im_end|>"
    assert deepseek.encode("<｜User｜>hi<｜Assistant｜>") == [770, *deepseek.encode("hi"), 771]
    plain = deepseek.encode("<｜User｜>", allow_special=False)
    assert all(i < R for i in plain) and deepseek.decode(plain) == "<｜User｜>"
    ids = kimi.encode("<|im_user|>hi<|im_end|>")
    assert kimi.decode(ids, skip_special_tokens=True) == "hi"


# ---------------------------------------------------------------- K2 pat_str

@pytest.mark.parametrize("text, pieces", [
    ("1234567 89", ["123", "456", "7", " ", "89"]),
    ("don't I'm WE'LL they're", ["don't", " I'm", " WE'LL", " they're"]),
    ("abc你好def", ["abc", "你好", "def"]),
    ("HelloWorld ABCdef", ["Hello", "World", " ABCdef"]),
    ("a   b", ["a", "  ", " b"]),
    ("x!!\n\ny", ["x", "!!\n\n", "y"]),
    ("  \n\n  z", ["  \n\n", " ", " z"]),
    ("é naïve", ["é", " naïve"]),
])
def test_k2_pat_str_splits(text: str, pieces: list[str]):
    assert tiktoken_pieces(text) == pieces  # tiktoken (fancy-regex) accepts the && classes
    onig = pre_tokenizers.Split(Regex(K2_PAT_STR), behavior="isolated").pre_tokenize_str(text)
    assert [p for p, _ in onig] == pieces  # and tokenizer.json's Oniguruma splits the same


def test_long_input_chunking(kimi: Tokenizer):
    assert [len(p) for p in split_long_runs(" " * 60_000 + "ab")] == [25_000, 25_000, 10_002]
    assert [len(p) for p in split_long_runs("ab " * 140_000)] == [400_000, 20_000]
    assert split_long_runs("") == []
    text = "x" * 30_000 + " y"
    assert kimi.decode(kimi.encode(text)) == text


# ---------------------------------------------------------------- chat templates

K2_SYS = f"<|im_system|>system<|im_middle|>{K2_DEFAULT_SYSTEM_PROMPT}<|im_end|>"


def test_k2_template_default_system(kimi: Tokenizer):
    out = kimi.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out == K2_SYS + "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    enc = kimi.encode
    assert enc(out) == [R + 10, *enc("system"), R + 17, *enc(K2_DEFAULT_SYSTEM_PROMPT), R + 2,
                        R + 3, *enc("user"), R + 17, *enc("Hi"), R + 2, R + 4, *enc("assistant"), R + 17]


def test_k2_template_explicit_system_and_parts(kimi: Tokenizer):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
            {"role": "assistant", "content": "ok"}]
    assert kimi.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>AB<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>ok<|im_end|>")


def test_k2_template_tools(kimi: Tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "functions.get_weather:0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    assert kimi.apply_chat_template(msgs, tools=tools) == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
        '"parameters":{"type":"object"}}}]<|im_end|>' + K2_SYS +
        "<|im_user|>user<|im_middle|>weather?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")


def test_think_tokens_are_single_specials(kimi: Tokenizer, deepseek: Tokenizer):
    think, end = R + 22, R + 23  # the offsets of K2-Thinking's 163606 / 163607 from 163584
    assert kimi.think_ids == (think, end)
    assert {think, end} <= kimi.special_token_ids
    assert kimi.encode("<think>") == [think] and kimi.encode("</think>") == [end]
    assert kimi.encode("<think>why</think>so", allow_special=True) == [think, *kimi.encode("why"), end, *kimi.encode("so")]
    plain = kimi.encode("<think>", allow_special=False)
    assert think not in plain and kimi.decode(plain) == "<think>"
    assert kimi.decode([think, end], skip_special_tokens=True) == ""
    assert think not in kimi.stop_token_ids and end not in kimi.stop_token_ids
    assert deepseek.think_ids is None


def test_deepseek_template(deepseek: Tokenizer):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Q"}]
    assert deepseek.apply_chat_template(msgs) == (
        "<｜begin▁of▁sentence｜>S<｜User｜>Hi<｜Assistant｜>Yo<｜end▁of▁sentence｜><｜User｜>Q<｜Assistant｜>")
    assert deepseek.apply_chat_template(msgs[1:2], add_generation_prompt=False) == "<｜begin▁of▁sentence｜><｜User｜>Hi"
    with pytest.raises(ValueError, match="unsupported role tool"):
        deepseek.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_sources(tmp_path: Path):
    kimi_dir = tmp_path / "kimi"
    copy_tokenizer_files("kimi", kimi_dir)
    cfg = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (kimi_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "Hi"}]
    assert Tokenizer.from_dir(kimi_dir).apply_chat_template(msgs).startswith(K2_SYS)  # built-in K2 fallback
    (kimi_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}|{{ m.content | tojson }}]{% endfor %}")
    assert Tokenizer.from_dir(kimi_dir).apply_chat_template(msgs) == '[user|"Hi"]'  # .jinja file wins
    ds_dir = tmp_path / "ds"
    copy_tokenizer_files("deepseek", ds_dir)
    cfg = json.loads((ds_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (ds_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(ds_dir).apply_chat_template(msgs)


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], r"messages\[0\]\.role must be one of"),
    ([{"role": "wizard", "content": "x"}], "'wizard'"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
    ([{"role": "user"}], r"messages\[0\]\.content is missing"),
    ([{"role": "user", "content": ["x"]}], r"content\[0\] must be a dict"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only allowed on assistant"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}], r"tool_calls\[0\]"),
    ([{"role": "user", "content": "x", "name": 7}], r"messages\[0\]\.name must be a string"),
    ([{"role": "tool", "content": "x", "tool_call_id": ["a"]}], r"tool_call_id must be a string"),
    ([{"role": "user", "content": "x", "reasoning_content": "r"}], "reasoning_content is only allowed on assistant"),
    ([{"role": "assistant", "content": "x", "reasoning": 1}], r"reasoning must be a string"),
    ([{"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"}], "differ"),
])
def test_bad_messages(kimi: Tokenizer, messages, match: str):
    with pytest.raises(ValueError, match=match):
        kimi.apply_chat_template(messages)


# ---------------------------------------------------------------- streaming decode

def stream(tok: Tokenizer, ids: list[int], **kw) -> list[str]:
    dec = IncrementalDecoder(tok, **kw)
    return [dec.push(i) for i in ids] + [dec.flush()]


def test_incremental_multibyte_split(kimi: Tokenizer):
    ids = kimi.encode("a🦜b")
    parts = stream(kimi, ids)
    assert "".join(parts) == "a🦜b"
    assert "🦜" in parts and all(p in ("", "a", "🦜", "b") for p in parts)  # never half a character
    first_byte = ids.index(kimi.encode("🦜")[0])
    assert parts[first_byte] == "" and parts[first_byte + 3] == "🦜"  # 4 byte tokens, text on the 4th


@pytest.mark.parametrize("fixture", ["kimi", "deepseek"])
def test_incremental_matches_decode(request, fixture: str):
    tok: Tokenizer = request.getfixturevalue(fixture)
    text = "".join(TEXTS.values())
    prompt = tok.apply_chat_template([{"role": "user", "content": text}])
    for ids in (tok.encode(prompt), random.Random(0).choices(range(tok.vocab_size), k=2000)):
        assert "".join(stream(tok, ids)) == tok.decode(ids)  # random ids: invalid UTF-8 included
        assert "".join(stream(tok, ids, skip_special_tokens=True)) == tok.decode(ids, skip_special_tokens=True)


def test_incremental_dangling_bytes(kimi: Tokenizer):
    ids = kimi.encode("ok🦜")[:-1]  # cut inside the emoji
    assert stream(kimi, ids)[-1] == "\ufffd" and "".join(stream(kimi, ids)) == kimi.decode(ids)


# ---------------------------------------------------------------- K2-scale layout, simulated

def write_kimi_dir(path: Path, n_ranks: int, named: dict[int, str], vocab_size: int | None) -> Path:
    path.mkdir()
    ranks = [bytes([b]) for b in range(256)] + [b"ab" + bytes([65 + k % 26]) * (1 + k // 26) for k in range(n_ranks - 256)]
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(i): {"content": s, "special": True} for i, s in named.items()},
        "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}}))
    if vocab_size is not None:
        (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return path


def test_reserved_names_and_cap(tmp_path: Path):
    n = 300  # stands in for 163,584
    named = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 255: "[PAD]",
             n + 256: "<|extra_a|>", n + 257: "<|extra_b|>"}  # the "256 + 2" file variant
    tok = Tokenizer.from_dir(write_kimi_dir(tmp_path / "capped", n, named, vocab_size=n + 256))
    assert tok.vocab_size == n + 256
    assert tok.id_to_token(n + 3) == f"<|reserved_token_{n + 3}|>" and tok.id_to_token(n + 255) == "[PAD]"
    assert tok.token_to_id("<|extra_a|>") is None
    assert tok.stop_token_ids == frozenset({n + 1, n + 2}) and tok.bos_token_id == n
    assert tok.decode(tok.encode("abAab<|im_end|>")) == "abAab<|im_end|>"
    with pytest.raises(ValueError, match=f"token id {n + 256} is outside"):
        tok.decode([n + 256])
    uncapped = Tokenizer.from_dir(write_kimi_dir(tmp_path / "uncapped", n, named, vocab_size=None))
    assert uncapped.vocab_size == n + 258
    small = Tokenizer.from_dir(write_kimi_dir(tmp_path / "small", n, named, vocab_size=n + 10))
    assert small.vocab_size == n + 10


# ---------------------------------------------------------------- bad inputs

def test_bad_dirs(tmp_path: Path):
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="expected 'tiktoken.model'.*'tokenizer.json'"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("AA== 0\nnot-base64 1\n")
    with pytest.raises(ValueError, match="tiktoken.model:2"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("AA== 0\nAQ== 5\n")
    with pytest.raises(ValueError, match="no gaps"):
        Tokenizer.from_dir(tmp_path)
    bad = write_kimi_dir(tmp_path / "collide", 260, {5: "[BOS]"}, None)
    with pytest.raises(ValueError, match="collides with a BPE rank"):
        Tokenizer.from_dir(bad)
    small = write_kimi_dir(tmp_path / "small", 260, {}, vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size=100"):
        Tokenizer.from_dir(small)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Tokenizer.from_dir(hf)


def test_bad_ids(kimi: Tokenizer, deepseek: Tokenizer):
    for tok in (kimi, deepseek):
        with pytest.raises(ValueError, match="token id 1024 is outside the vocabulary"):
            tok.decode([1, 1024])
        with pytest.raises(ValueError, match="token id -1"):
            tok.decode([-1])
        with pytest.raises(ValueError, match="outside"):
            IncrementalDecoder(tok).push(5000)
        with pytest.raises(ValueError, match="expects a str"):
            tok.encode(b"bytes")  # type: ignore[arg-type]


def test_copy_tokenizer_files(tmp_path: Path):
    with pytest.raises(ValueError, match="'kimi', 'deepseek'"):
        copy_tokenizer_files("llama", tmp_path)
    for kind in SHIPPED_KINDS:
        written = copy_tokenizer_files(kind, tmp_path / kind)
        assert sorted(p.name for p in written) == sorted(p.name for p in (SHIPPED_DIR / kind).iterdir())
        assert Tokenizer.from_dir(tmp_path / kind).encode("hello") == Tokenizer.from_dir(SHIPPED_DIR / kind).encode("hello")


def test_build_script_is_deterministic(tmp_path: Path):
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_tokenizer.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=180)
    for kind in ("kimi", "deepseek", "kimi-mini"):
        shipped = sorted(p.name for p in (SHIPPED_DIR / kind).iterdir())
        assert sorted(p.name for p in (tmp_path / kind).iterdir()) == shipped
        for name in shipped:
            assert (tmp_path / kind / name).read_bytes() == (SHIPPED_DIR / kind / name).read_bytes(), f"{kind}/{name}"


def test_the_trained_presets_tokenizer_holds_each_city_and_two_digit_number_whole():
    """kimi-mini (the trained preset's): K2's format and special offsets over MINI_RANKS ranks; the
    user's ` Tirana` and the argument's `"Tirana"` hold the same single id (a real K2 tokenizer has
    common city names whole too), and so does a two-digit temperature."""
    from training.corpus import CITIES

    mini = Tokenizer.from_dir(SHIPPED_DIR / "kimi-mini")
    assert mini.vocab_size == MINI_VOCAB_SIZE
    assert mini.token_to_id("[BOS]") == MINI_RANKS and mini.token_to_id("<|tool_call_begin|>") == MINI_RANKS + 13
    for city in CITIES:
        (cid,) = mini.encode(city)
        assert mini.encode(f" {city}") == [mini.encode(" ")[0], cid], city
        assert cid in mini.encode(f'{{"city": "{city}"}}'), city
    for n in range(10, 100):
        assert mini.encode(f"It is {n}°C")[-2:-1] == mini.encode(str(n)), n
    text = "What's the weather like in Lisbon? It is 17°C."
    assert mini.decode(mini.encode(text)) == text
    assert len(mini.encode(text)) < len(Tokenizer.from_dir(SHIPPED_DIR / "kimi").encode(text))
