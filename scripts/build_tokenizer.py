#!/usr/bin/env python
"""Build the tiny shipped tokenizers in model/assets/tokenizer/{kimi,deepseek,kimi-mini}/.

    python scripts/build_tokenizer.py [--out model/assets/tokenizer]

Trains a byte-level BPE with exactly 512 merges (768 ranks: 256 single bytes, then one rank
per merge) on scripts/tokenizer_corpus.txt. That corpus is original text written for this
repository by its authors (English prose, code, numbers, a little Chinese), so the assets carry
no third-party licence. The trainer is our own, so the output does not depend on the version of
any library: words are split with K2's pat_str, then the most frequent adjacent pair is merged,
ties going to the lexicographically smallest (left bytes, right bytes). Output is byte-for-byte
deterministic; tests/model/test_tokenizer.py rebuilds it and compares.

Writes two real formats over the same 768 ranks, each padded with specials to 1024 ids:
  kimi/      tiktoken.model + tokenizer_config.json (K2 specials at 768 + K2's offsets, including
             K2-Thinking's <think> </think>; K2-Instruct template)
  deepseek/  tokenizer.json + tokenizer_config.json (DeepSeek-V3-style specials, simple template)
The deepseek tokenizer.json pre-splits with the same K2 pat_str (not DeepSeek-V3's own regex)
so that both formats give identical ids for ordinary text.

And a third, the trained preset kimi-k2-mini's (build_mini): K2's format and special offsets over
1,536 ranks learned from that preset's own corpus (training/corpus.py), its cities and two-digit
numbers whole, padded with specials to 1,792 ids:
  kimi-mini/ tiktoken.model + tokenizer_config.json (K2 specials at 1536 + K2's offsets)
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

from tokenizers import Regex, pre_tokenizers

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model.chat_template import DEEPSEEK_CHAT_TEMPLATE, K2_CHAT_TEMPLATE  # noqa: E402
from model.tokenizer import MINI_RANKS, MINI_VOCAB_SIZE, SHIPPED_RANKS, SHIPPED_VOCAB_SIZE, Tokenizer  # noqa: E402
from model.tokenizer_backends import K2_PAT_STR, bytes_to_token_str  # noqa: E402

R = SHIPPED_RANKS
# K2's special ids are 163584 + offset (MODEL_SPEC §1.11); ours are R + the same offset.
# <think> / </think> are K2-Thinking's and K2.5's (163606 / 163607); K2-Instruct leaves them reserved.
KIMI_SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    22: "<think>", 23: "</think>",
    254: "[UNK]", 255: "[PAD]",
}
DEEPSEEK_SPECIALS = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]
DEEPSEEK_PAD = "<｜▁pad▁｜>"  # the last id, as DeepSeek pads its vocab


def word_counts(text: str) -> Counter[bytes]:
    split = pre_tokenizers.Split(Regex(K2_PAT_STR), behavior="isolated")
    return Counter(piece.encode("utf-8") for piece, _ in split.pre_tokenize_str(text))


def _merge_word(word: list[bytes], a: bytes, b: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(counts: Counter[bytes], n_merges: int, *, first: list[tuple[bytes, bytes]] = (),
              forbid: Callable[[bytes, bytes], bool] | None = None) -> list[tuple[bytes, bytes]]:
    """Classic BPE over pre-split words. A pair whose concatenation is already a token (reached
    by another split) is never chosen, so every rank has distinct bytes. ``first`` merges are taken
    as given (applied to every word, then counted as the first ranks); ``forbid`` rules pairs out."""
    words = [[bytes([c]) for c in w] for w in sorted(counts)]
    freqs = [counts[w] for w in sorted(counts)]
    for a, b in first:
        words = [_merge_word(w, a, b) for w in words]
    known = {bytes([c]) for c in range(256)} | {a + b for a, b in first}
    merges: list[tuple[bytes, bytes]] = list(first)
    pairs: Counter[tuple[bytes, bytes]] = Counter()
    for w, f in zip(words, freqs):
        for p in zip(w, w[1:]):
            pairs[p] += f
    while len(merges) < n_merges:
        candidates = [(-n, p) for p, n in pairs.items()
                      if n > 0 and p[0] + p[1] not in known and not (forbid and forbid(*p))]
        if not candidates:
            raise SystemExit(f"corpus too small: only {len(merges)} merges possible, need {n_merges}")
        _, (a, b) = min(candidates)
        merges.append((a, b))
        known.add(a + b)
        for k, w in enumerate(words):
            if len(w) < 2 or not any(x == a and y == b for x, y in zip(w, w[1:])):
                continue
            for p in zip(w, w[1:]):
                pairs[p] -= freqs[k]
            words[k] = _merge_word(w, a, b)
            for p in zip(words[k], words[k][1:]):
                pairs[p] += freqs[k]
    return merges


def whole_word_merges(words: list[bytes]) -> list[tuple[bytes, bytes]]:
    """BPE merges (most frequent pair first, ties to the smallest) until every one of ``words`` is
    a single token: the chains that make each of them one id."""
    pieces = [[bytes([c]) for c in w] for w in words]
    merges: list[tuple[bytes, bytes]] = []
    while any(len(p) > 1 for p in pieces):
        pairs = Counter(pair for p in pieces for pair in zip(p, p[1:]))
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append((a, b))
        pieces = [_merge_word(p, a, b) for p in pieces]
    return merges


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8", newline="\n")


def _added_token(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def write_kimi(out: Path, ranked: list[bytes]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    R = len(ranked)
    lines = [f"{base64.b64encode(t).decode('ascii')} {rank}\n" for rank, t in enumerate(ranked)]
    (out / "tiktoken.model").write_text("".join(lines), encoding="ascii", newline="\n")
    specials = {R + off: name for off, name in KIMI_SPECIAL_OFFSETS.items()}
    _write_json(out / "tokenizer_config.json", {
        # Only the named specials; the loader names the other reserved ids <|reserved_token_{id}|>.
        "added_tokens_decoder": {str(i): _added_token(s) for i, s in sorted(specials.items())},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "chat_template": K2_CHAT_TEMPLATE,
    })


def write_deepseek(out: Path, ranked: list[bytes], merges: list[tuple[bytes, bytes]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    n_free = SHIPPED_VOCAB_SIZE - R - len(DEEPSEEK_SPECIALS) - 1
    names = DEEPSEEK_SPECIALS + [f"<｜place▁holder▁no▁{k}｜>" for k in range(n_free)] + [DEEPSEEK_PAD]
    specials = {R + k: s for k, s in enumerate(names)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    _write_json(out / "tokenizer.json", {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, **_added_token(s)} for i, s in specials.items()],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": K2_PAT_STR}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": True,  # a piece that is itself a token wins, as in tiktoken
            "vocab": {bytes_to_token_str(t): rank for rank, t in enumerate(ranked)},
            "merges": [f"{bytes_to_token_str(a)} {bytes_to_token_str(b)}" for a, b in merges],
        },
    })
    _write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": {str(i): _added_token(s) for i, s in specials.items()},
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": DEEPSEEK_SPECIALS[0],
        "eos_token": DEEPSEEK_SPECIALS[1],
        "pad_token": DEEPSEEK_PAD,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": DEEPSEEK_CHAT_TEMPLATE,
    })


def build(out: Path, corpus: Path) -> None:
    text = corpus.read_text(encoding="utf-8")
    merges = train_bpe(word_counts(text), R - 256)
    ranked = [bytes([b]) for b in range(256)] + [a + b for a, b in merges]
    write_kimi(out / "kimi", ranked)
    write_deepseek(out / "deepseek", ranked, merges)
    # Self-check: both formats load and agree on the training text.
    kimi, deepseek = Tokenizer.from_dir(out / "kimi"), Tokenizer.from_dir(out / "deepseek")
    for tok in (kimi, deepseek):
        if tok.vocab_size != SHIPPED_VOCAB_SIZE or tok.decode(tok.encode(text)) != text:
            raise SystemExit(f"self-check failed: vocab {tok.vocab_size} or round trip")
    if kimi.encode(text) != deepseek.encode(text):
        raise SystemExit("self-check failed: tiktoken.model and tokenizer.json disagree on the corpus")


def mini_training_text(n_transcripts: int = 1500, seed: int = 0) -> str:
    """The text the trained preset's tokenizer learns its ranks from: transcripts of its own corpus
    (training/corpus.py, seeded) rendered through K2's template with the special tokens cut out, and
    the hand-written corpus above. No standard-library text: its docstrings change between Python
    versions, and the build must be byte-for-byte the same everywhere."""
    from training.corpus import transcript

    kimi = Tokenizer.from_dir(REPO / "model" / "assets" / "tokenizer" / "kimi")  # K2's template and specials
    r = random.Random(seed)
    special = re.compile("|".join(re.escape(t) for t in sorted(KIMI_SPECIAL_OFFSETS.values(), key=len, reverse=True)))
    parts = []
    for _ in range(n_transcripts):
        messages, tools, _think = transcript(r)
        parts.append(special.sub("\n", kimi.apply_chat_template(messages, tools=tools, add_generation_prompt=False)))
    return "\n".join(parts) + "\n" + (REPO / "scripts" / "tokenizer_corpus.txt").read_text(encoding="utf-8")


def build_mini(out: Path) -> None:
    """The trained preset's tokenizer (kimi-mini/): K2's format and special offsets over MINI_RANKS
    ranks learned from the preset's own corpus, with every city of training.corpus.CITIES and every
    number 10-99 one id. A real K2 tokenizer (163,584 ranks) has common city names and every
    number up to 999 whole; the 768 ranks of kimi/ spell ` Tirana` ` T` `ir` `an` `a`, which a
    12 M-parameter model cannot learn to copy in its budget (docs/trained_preset.md). The city
    chains come first, and no merge joins a city to what stands before or after it, so the user's
    ` Tirana` is ` ` `Tirana` and the argument's `"Tirana"` holds the same `Tirana`."""
    from training.corpus import CITIES

    cities = [c.encode() for c in CITIES]
    first = whole_word_merges(cities + [str(n).encode() for n in range(10, 100)])
    whole = set(cities)
    merges = train_bpe(word_counts(mini_training_text()), MINI_RANKS - 256, first=first,
                       forbid=lambda a, b: a in whole or b in whole)
    ranked = [bytes([b]) for b in range(256)] + [a + b for a, b in merges]
    if len(set(ranked)) != len(ranked):
        raise SystemExit("self-check failed: two kimi-mini ranks hold the same bytes")
    write_kimi(out / "kimi-mini", ranked)
    mini = Tokenizer.from_dir(out / "kimi-mini")
    if mini.vocab_size != MINI_VOCAB_SIZE:
        raise SystemExit(f"self-check failed: kimi-mini vocab {mini.vocab_size}")
    for city in CITIES:
        for text in (f" {city}", f'"{city}"'):
            if city.encode() not in [mini.token_bytes(i) for i in mini.encode(text)]:
                raise SystemExit(f"self-check failed: {text!r} does not hold {city!r} as one id")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "model" / "assets" / "tokenizer")
    parser.add_argument("--corpus", type=Path, default=REPO / "scripts" / "tokenizer_corpus.txt")
    args = parser.parse_args()
    build(args.out, args.corpus)
    print(f"wrote {args.out}/kimi and {args.out}/deepseek ({R} ranks, vocab {SHIPPED_VOCAB_SIZE})")
    build_mini(args.out)
    print(f"wrote {args.out}/kimi-mini ({MINI_RANKS} ranks, vocab {MINI_VOCAB_SIZE})")


if __name__ == "__main__":
    main()
