"""Tokenizer backends: Kimi's tiktoken format and Hugging Face ``tokenizer.json``.

Each backend owns one loaded vocabulary and answers the same few questions
(encode, token bytes, names, specials). :class:`model.tokenizer.Tokenizer` is
the public face; nothing here renders chat or streams. Loaders raise
``ValueError`` naming the file and the problem; they never download anything.
"""

from __future__ import annotations

import base64
import json
import re
from functools import lru_cache
from pathlib import Path

import tiktoken
import tokenizers

# Kimi K2's pre-tokenizer (tokenization_kimi.py `pat_str`, MODEL_SPEC §1.11). tiktoken's
# fancy-regex and the Oniguruma engine inside `tokenizers` both accept the `&&` class
# intersections as written, so no lookahead rewrite is needed.
K2_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

NUM_RESERVED_SPECIAL_TOKENS = 256  # K2: ids [163584, 163840)
MAX_CHUNK_CHARS = 400_000  # tiktoken's Rust core is handed at most this many chars at once
MAX_RUN_CHARS = 25_000  # longest run of only-whitespace / only-non-whitespace per piece
_LONG_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS + 1}}}|\S{{{MAX_RUN_CHARS + 1}}}")


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the other 68 bytes
    to code points 256.. in byte order. Token strings in ``tokenizer.json`` use it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def bytes_to_token_str(data: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in data)


def split_long_runs(text: str) -> list[str]:
    """Cut ``text`` as Kimi does before tiktoken sees it: ≤400,000-char chunks, then a new
    piece whenever a run of whitespace (or of non-whitespace) would pass 25,000 chars."""
    pieces: list[str] = []
    for start in range(0, len(text), MAX_CHUNK_CHARS):
        chunk = text[start:start + MAX_CHUNK_CHARS]
        if not _LONG_RUN.search(chunk):  # the common case, scanned at C speed
            pieces.append(chunk)
            continue
        piece_start, run_len, run_is_space = 0, 0, None
        for i, ch in enumerate(chunk):
            is_space = ch.isspace()
            if is_space == run_is_space:
                run_len += 1
                if run_len > MAX_RUN_CHARS:
                    pieces.append(chunk[piece_start:i])
                    piece_start, run_len = i, 1
            else:
                run_is_space, run_len = is_space, 1
        pieces.append(chunk[piece_start:])
    return pieces


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model``: one ``base64(bytes) rank`` line per token; ranks must be 0..n-1."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
                if len(parts) != 2:
                    raise ValueError
            except (ValueError, IndexError):
                raise ValueError(f"{path}:{lineno}: expected 'base64(bytes) rank', got {line[:80]!r}") from None
            if token in ranks:
                raise ValueError(f"{path}:{lineno}: token {token!r} appears twice")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1} with no gaps or repeats")
    return ranks


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_json_if_exists(path: Path) -> dict:
    return _read_json(path) if path.is_file() else {}


class TiktokenBackend:
    """Kimi's format: ``tiktoken.model`` ranks + specials from ``added_tokens_decoder``.

    Unnamed ids in [n_ranks, n_ranks + 256) become ``<|reserved_token_{id}|>``; every id at or
    above ``vocab_cap`` (config.json ``vocab_size``, the embedding rows) is dropped, so a
    file version that names 256 + 2 reserved ids never yields an id past the embedding.
    """

    byte_level = True

    def __init__(self, ranks: dict[bytes, int], named_specials: dict[int, str], vocab_cap: int | None):
        n_ranks = len(ranks)
        if vocab_cap is not None and vocab_cap < n_ranks:
            raise ValueError(f"config.json vocab_size={vocab_cap} is smaller than the {n_ranks} BPE ranks")
        for i in named_specials:
            if i < n_ranks:
                raise ValueError(f"special token id {i} ({named_specials[i]!r}) collides with a BPE rank (< {n_ranks})")
        by_id = {i: f"<|reserved_token_{i}|>" for i in range(n_ranks, n_ranks + NUM_RESERVED_SPECIAL_TOKENS)}
        by_id.update(named_specials)
        if vocab_cap is not None:
            by_id = {i: s for i, s in by_id.items() if i < vocab_cap}
        specials = {s: i for i, s in sorted(by_id.items())}
        if len(specials) != len(by_id):
            raise ValueError("two special token ids share the same content")
        self.special_ids = frozenset(by_id)
        self.vocab_size = max(by_id, default=n_ranks - 1) + 1
        self._specials = specials
        self._special_by_id = by_id
        self._ranks = ranks
        self._names = [bytes_to_token_str(t) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
        self._enc = tiktoken.Encoding("moeray-kimi", pat_str=K2_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)

    @classmethod
    def from_dir(cls, path: Path) -> TiktokenBackend:
        ranks = load_tiktoken_ranks(path / "tiktoken.model")
        tok_cfg = read_json_if_exists(path / "tokenizer_config.json")
        named: dict[int, str] = {}
        for key, entry in (tok_cfg.get("added_tokens_decoder") or {}).items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not str(key).isdigit() or not isinstance(content, str):
                raise ValueError(f"{path / 'tokenizer_config.json'}: bad added_tokens_decoder entry {key!r}: {entry!r}")
            named[int(key)] = content
        cap = read_json_if_exists(path / "config.json").get("vocab_size")
        if cap is not None and (not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"{path / 'config.json'}: vocab_size must be a positive int, got {cap!r}")
        return cls(ranks, named, cap)

    def encode(self, text: str, allow_special: bool) -> list[int]:
        allowed = "all" if allow_special else set()
        ids: list[int] = []
        for piece in split_long_runs(text):
            ids.extend(self._enc.encode(piece, allowed_special=allowed, disallowed_special=()))
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(token_id)

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._special_by_id:
            return self._special_by_id[token_id]
        return self._names[token_id]

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        try:
            data = bytes(unicode_to_byte()[c] for c in token)
        except KeyError:
            return None
        return self._ranks.get(data)

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


class HFBackend:
    """A Hugging Face ``tokenizer.json`` (DeepSeek-V3 style: byte-level BPE + added specials)."""

    def __init__(self, path: Path):
        file = path / "tokenizer.json"
        spec = _read_json(file)
        try:
            self._tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
        except Exception as e:  # the Rust loader raises a bare Exception
            raise ValueError(f"{file}: tokenizers could not load it ({e})") from None
        self._plain_tok: tokenizers.Tokenizer | None = None  # specials-as-text twin, made on demand
        self.byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added = {i: t.content for i, t in added.items()}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._spec_json = json.dumps(spec)

    def encode(self, text: str, allow_special: bool) -> list[int]:
        tok = self._tok
        if not allow_special:
            if self._plain_tok is None:
                self._plain_tok = tokenizers.Tokenizer.from_str(self._spec_json)
                self._plain_tok.encode_special_tokens = True
            tok = self._plain_tok
        return tok.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if self.byte_level:
            table = unicode_to_byte()
            return bytes(table[c] for c in self._tok.id_to_token(token_id))
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def id_to_token(self, token_id: int) -> str:
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} has no entry in tokenizer.json")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode(self, ids: list[int]) -> str:
        if self.byte_level:
            return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
        return self._tok.decode(ids, skip_special_tokens=False)
