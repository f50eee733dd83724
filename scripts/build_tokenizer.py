#!/usr/bin/env python
"""Build the tiny shipped tokenizers in model/assets/tokenizer/{kimi,deepseek}/.

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
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections import Counter
from pathlib import Path

from tokenizers import Regex, pre_tokenizers

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model.chat_template import DEEPSEEK_CHAT_TEMPLATE, K2_CHAT_TEMPLATE  # noqa: E402
from model.tokenizer import SHIPPED_RANKS, SHIPPED_VOCAB_SIZE, Tokenizer  # noqa: E402
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


def train_bpe(counts: Counter[bytes], n_merges: int) -> list[tuple[bytes, bytes]]:
    """Classic BPE over pre-split words. A pair whose concatenation is already a token (reached
    by another split) is never chosen, so every rank has distinct bytes."""
    words = [[bytes([c]) for c in w] for w in sorted(counts)]
    freqs = [counts[w] for w in sorted(counts)]
    known = {bytes([c]) for c in range(256)}
    merges: list[tuple[bytes, bytes]] = []
    pairs: Counter[tuple[bytes, bytes]] = Counter()
    for w, f in zip(words, freqs):
        for p in zip(w, w[1:]):
            pairs[p] += f
    while len(merges) < n_merges:
        candidates = [(-n, p) for p, n in pairs.items() if n > 0 and p[0] + p[1] not in known]
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


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8", newline="\n")


def _added_token(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def write_kimi(out: Path, ranked: list[bytes]) -> None:
    out.mkdir(parents=True, exist_ok=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "model" / "assets" / "tokenizer")
    parser.add_argument("--corpus", type=Path, default=REPO / "scripts" / "tokenizer_corpus.txt")
    args = parser.parse_args()
    build(args.out, args.corpus)
    print(f"wrote {args.out}/kimi and {args.out}/deepseek ({R} ranks, vocab {SHIPPED_VOCAB_SIZE})")


if __name__ == "__main__":
    main()
