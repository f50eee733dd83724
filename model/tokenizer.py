"""Tokenizer: text ↔ ids, chat rendering and streaming detokenization for a checkpoint dir.

Owns one loaded vocabulary (Kimi's ``tiktoken.model`` or a Hugging Face ``tokenizer.json``,
see :mod:`model.tokenizer_backends`) and the checkpoint's chat template. It never adds BOS by
itself (the chat template decides) and never reads anything outside the directory it is given.
Also ships the tiny 1024-id tokenizers that ``moeray make-checkpoint`` copies next to tiny
random-weight checkpoints (built by ``scripts/build_tokenizer.py``).
"""

from __future__ import annotations

import codecs
import shutil
from pathlib import Path
from typing import Any

import jinja2

from model.chat_template import K2_CHAT_TEMPLATE, compile_template, render
from model.tokenizer_backends import HFBackend, TiktokenBackend, read_json_if_exists

SHIPPED_RANKS = 768  # 256 single bytes + 512 merges
SHIPPED_VOCAB_SIZE = 1024  # ranks + 256 special/reserved ids, like K2's 163,584 + 256
SHIPPED_DIR = Path(__file__).parent / "assets" / "tokenizer"
MINI_RANKS = 1536  # kimi-mini/: the trained preset's (scripts/build_tokenizer.py build_mini)
MINI_VOCAB_SIZE = MINI_RANKS + 256  # its ranks + K2's 256 special/reserved ids
SHIPPED_KINDS = ("kimi", "deepseek", "kimi-mini")

# Tokens that end an assistant turn, whichever family the checkpoint belongs to: K2 ends a
# turn with <|im_end|> then sometimes [EOS] (MODEL_SPEC §1.11); K3 renames im_end (§3.12).
END_OF_TURN_TOKENS = ("<|im_end|>", "[EOS]", "[EOT]", "<|end_of_msg|>", "<｜end▁of▁sentence｜>")
THINK_BEGIN, THINK_END = "<think>", "</think>"  # K2-Thinking / K2.5: 163606, 163607


def _token_content(value: object) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_source(path: Path, tok_cfg: dict, is_kimi: bool) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    source = tok_cfg.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return K2_CHAT_TEMPLATE if is_kimi else None
    if not isinstance(source, str):
        raise ValueError(f"{path / 'tokenizer_config.json'}: chat_template must be a string, got {type(source).__name__}")
    return source


class Tokenizer:
    """One checkpoint's tokenizer. Build it with :meth:`from_dir`."""

    def __init__(self, backend: TiktokenBackend | HFBackend, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, extra_stop_ids: tuple[int, ...] = ()):
        self._backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        stop = {backend.token_to_id(t) for t in END_OF_TURN_TOKENS} | {self.eos_token_id, *extra_stop_ids}
        self.stop_token_ids = frozenset(i for i in stop if i is not None and 0 <= i < backend.vocab_size)
        self.special_token_ids = backend.special_ids
        self.chat_template_source = chat_template
        self._template: jinja2.Template | None = compile_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Kimi format if ``tiktoken.model`` is present, else ``tokenizer.json``. Optional:
        ``tokenizer_config.json`` (specials, bos/eos, chat_template), ``chat_template.jinja``
        (wins over the config's template), ``config.json`` (``vocab_size`` caps the specials),
        ``generation_config.json`` (``eos_token_id`` ids are added to the stop set)."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"tokenizer directory {path} does not exist")
        tok_cfg = read_json_if_exists(path / "tokenizer_config.json")
        is_kimi = (path / "tiktoken.model").is_file()
        if is_kimi:
            backend: TiktokenBackend | HFBackend = TiktokenBackend.from_dir(path)
        elif (path / "tokenizer.json").is_file():
            backend = HFBackend(path)
        else:
            raise ValueError(f"{path} has no tokenizer: expected 'tiktoken.model' (+ tokenizer_config.json, "
                             "Kimi format) or 'tokenizer.json' (Hugging Face format)")
        gen_eos = read_json_if_exists(path / "generation_config.json").get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else gen_eos or []
        return cls(backend,
                   bos_token=_token_content(tok_cfg.get("bos_token")),
                   eos_token=_token_content(tok_cfg.get("eos_token")),
                   chat_template=_chat_template_source(path, tok_cfg, is_kimi),
                   extra_stop_ids=tuple(i for i in gen_eos if isinstance(i, int)))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer defines (may be below config.json's padded vocab_size)."""
        return self._backend.vocab_size

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def thinking(self) -> bool:
        """The chat template writes think blocks (K2-Thinking style), so a reply may open with
        reasoning: ``<think>…</think>`` before the content, unless the request renders with the
        template kwarg ``thinking=False``."""
        return self.chat_template_source is not None and THINK_BEGIN in self.chat_template_source

    @property
    def think_ids(self) -> tuple[int, int] | None:
        """Ids of ``<think>`` and ``</think>`` when both are special tokens of this vocabulary."""
        ids = (self._backend.token_to_id(THINK_BEGIN), self._backend.token_to_id(THINK_END))
        if any(i is None or i not in self.special_token_ids for i in ids):
            return None
        return ids  # type: ignore[return-value]

    def id_to_token(self, token_id: int) -> str:
        """Byte-level token string ("Ġthe") or a special token's content."""
        self._check_id(token_id)
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one id stands for (a special's UTF-8 content)."""
        self._check_id(token_id)
        return self._backend.token_bytes(token_id)

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """No BOS is added. With ``allow_special`` (the default, like K2's tokenizer), special
        token strings in ``text`` map to their ids; otherwise they are encoded as plain text."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, allow_special)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Invalid UTF-8 becomes U+FFFD; an id outside [0, vocab_size) is a ValueError."""
        ids = list(ids)
        for i in ids:
            self._check_id(i)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_token_ids]
        return self._backend.decode(ids)

    def apply_chat_template(self, messages: list[dict], /, *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        """Render the checkpoint's template to a prompt string (encode it with allow_special).
        ``template_kwargs`` (a request's ``chat_template_kwargs``, e.g. ``thinking=False``) become
        template variables; setting one the renderer owns (messages, tools, add_generation_prompt,
        bos_token, eos_token) is a ValueError. Pass a request's dict through
        :func:`model.chat_template.check_template_kwargs` before splatting it here."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template: add 'chat_template' to tokenizer_config.json "
                             "or a chat_template.jinja file")
        return render(self._template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                      bos_token=self.bos_token, eos_token=self.eos_token, template_kwargs=template_kwargs)

    def _check_id(self, token_id: int) -> None:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})")


class IncrementalDecoder:
    """Per-request streaming detokenizer. ``push`` returns only completed text and holds back a
    UTF-8 sequence split across tokens; the concatenation of every ``push`` plus ``flush``
    equals ``tokenizer.decode(all_ids)`` exactly (for byte-level tokenizers)."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: a dangling partial sequence becomes U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def _kind_dir(kind: str) -> Path:
    if kind not in SHIPPED_KINDS:
        raise ValueError(f"tokenizer kind must be one of {SHIPPED_KINDS}, got {kind!r}")
    return SHIPPED_DIR / kind


def copy_tokenizer_files(kind: str, out_dir: str | Path) -> list[Path]:
    """Copy a shipped tiny tokenizer (one of :data:`SHIPPED_KINDS`) into a checkpoint directory."""
    src, out = _kind_dir(kind), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for f in sorted(src.iterdir()):
        if f.is_file():
            written.append(Path(shutil.copyfile(f, out / f.name)))
    if not written:
        raise ValueError(f"no shipped tokenizer files in {src}; run scripts/build_tokenizer.py")
    return written


def shipped_special_ids(kind: str) -> dict[str, int]:
    """{"bos_token_id", "eos_token_id"} of a shipped tokenizer, for a preset's config.json."""
    tok_cfg = read_json_if_exists(_kind_dir(kind) / "tokenizer_config.json")
    by_content = {v["content"]: int(k) for k, v in tok_cfg.get("added_tokens_decoder", {}).items()}
    return {"bos_token_id": by_content[_token_content(tok_cfg["bos_token"])],
            "eos_token_id": by_content[_token_content(tok_cfg["eos_token"])]}
