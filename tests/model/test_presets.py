"""Presets: the K2-Thinking preset is K2's tiny model with the thinking chat template, whose
chat_template.jinja wins over the tokenizer_config.json template; cached builds are keyed by content."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.chat_template import K2_CHAT_TEMPLATE, K2_THINKING_CHAT_TEMPLATE
from model.presets import PRESETS, build_preset, preset_config, preset_fingerprint, resolve_model
from model.tokenizer import SHIPPED_DIR, SHIPPED_KINDS, Tokenizer

MSGS = [{"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo", "reasoning_content": "r"},
        {"role": "user", "content": "Q"}]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("presets")
    return {name: build_preset(name, root / name, seed=1, dtype="float32", progress=False)
            for name in ("kimi-k2-tiny", "kimi-k2-thinking-tiny")}


def test_thinking_preset_is_k2_tiny_with_the_thinking_template(built: dict[str, Path]):
    plain, thinking = built["kimi-k2-tiny"], built["kimi-k2-thinking-tiny"]
    assert preset_config("kimi-k2-thinking-tiny") == preset_config("kimi-k2-tiny")
    assert (thinking / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()
    assert (thinking / "chat_template.jinja").read_text(encoding="utf-8") == K2_THINKING_CHAT_TEMPLATE
    assert not (plain / "chat_template.jinja").exists()
    assert json.loads((thinking / "generation_config.json").read_text())["moeray_preset"] == "kimi-k2-thinking-tiny"


def test_checkpoint_jinja_wins_over_the_built_in(built: dict[str, Path]):
    plain, thinking = (Tokenizer.from_dir(built[n]) for n in ("kimi-k2-tiny", "kimi-k2-thinking-tiny"))
    cfg = json.loads((built["kimi-k2-thinking-tiny"] / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == K2_CHAT_TEMPLATE  # the shipped tokenizer's, overridden by the .jinja
    assert thinking.thinking and not plain.thinking
    assert thinking.think_ids == plain.think_ids == (790, 791)
    out = thinking.apply_chat_template(MSGS)
    assert "<|im_assistant|>assistant<|im_middle|><think></think>Yo<|im_end|>" in out
    assert "<think>" not in plain.apply_chat_template(MSGS)
    assert thinking.apply_chat_template(MSGS, thinking=False).endswith("<think></think>")


def test_resolve_model_caches_by_content(tmp_path: Path):
    assert preset_fingerprint("kimi-k2-thinking-tiny") != preset_fingerprint("kimi-k2-tiny")  # template counts
    assert preset_fingerprint("kimi-k2-tiny") == preset_fingerprint("kimi-k2-tiny")
    path = resolve_model("kimi-k2-thinking-tiny", tmp_path)
    assert path.name == f"kimi-k2-thinking-tiny-seed0-{preset_fingerprint('kimi-k2-thinking-tiny')}"
    assert Tokenizer.from_dir(path).thinking
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("kimi-k2-thinking-tiny", tmp_path) == path  # built once
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="kimi-k2-thinking-tiny"):  # the error lists the presets
        resolve_model("no-such-preset", tmp_path)


def test_every_preset_names_a_shipped_tokenizer():
    for name, preset in PRESETS.items():
        assert preset.tokenizer in SHIPPED_KINDS, name
        cfg = preset_config(name)
        tok = Tokenizer.from_dir(SHIPPED_DIR / preset.tokenizer)
        assert cfg["vocab_size"] == tok.vocab_size, name  # the config and its tokenizer agree
        assert cfg["bos_token_id"] == tok.token_to_id("[BOS]") or preset.tokenizer == "deepseek", name
