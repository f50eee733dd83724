"""Built-in presets: real-format configs of the supported architectures, shrunk to CPU size.

A preset is a ``config.json`` dict, a shipped tokenizer and optionally its own chat template;
:func:`build_preset` turns it into a complete Hugging Face directory with seeded random weights,
exactly as a real checkpoint is laid out. A preset name is accepted wherever a model path is
(:func:`resolve_model`, which builds it once into a cache directory keyed by its files' contents).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .chat_template import K2_THINKING_CHAT_TEMPLATE
from .tokenizer import MINI_VOCAB_SIZE, SHIPPED_DIR, SHIPPED_VOCAB_SIZE, copy_tokenizer_files, shipped_special_ids

TRAINED_DIR = Path(__file__).parent / "assets" / "presets"  # trained presets' committed weights


def _k2_like(**over) -> dict:
    ids = shipped_special_ids("kimi")
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": SHIPPED_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 160,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 128,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "num_nextn_predict_layers": 0,
        "torch_dtype": "bfloat16",
    }
    cfg.update(over)
    return cfg


def kimi_k2_mini() -> dict:
    """The trained preset's shape (scripts/train_preset.py): K2's architecture at hidden 256, 6 layers
    (the first dense), 32 routed experts (4 per token) and one MTP layer in DeepSeek's layout, over
    its own K2-format tokenizer (kimi-mini: 1,536 ranks + K2's 256 special and reserved ids)."""
    return _k2_like(
        vocab_size=MINI_VOCAB_SIZE, **shipped_special_ids("kimi-mini"),
        hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=4,
        num_nextn_predict_layers=1,
    )


# the same architecture much smaller, every feature on: the training script's smoke runs and the tests
KIMI_K2_MINI_SMOKE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                          q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                          n_routed_experts=8, num_experts_per_tok=2)


def _deepseek_v3_tiny() -> dict:
    ids = shipped_special_ids("deepseek")
    return _k2_like(
        model_type="deepseek_v3",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=2,
        num_hidden_layers=5,
        num_nextn_predict_layers=1,  # DeepSeek-V3 ships one MTP layer (speculative decoding's method: mtp)
        rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
    )


def _kimi_k2_small() -> dict:
    """~0.75 B parameters: the benchmark's "larger" preset, still CPU-sized."""
    return _k2_like(
        hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64, num_experts_per_tok=8,
    )


def _kimi_linear_tiny() -> dict:
    """Kimi-Linear-48B-A3B's config (§3.1) shrunk: 3:1 KDA:MLA ending on MLA, NoPE MLA without
    q-LoRA, the renamed MoE fields, Moonshot's spelling throughout."""
    ids = shipped_special_ids("kimi")
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": SHIPPED_VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "intermediate_size": 160,
        "moe_intermediate_size": 32,
        "num_experts": 16,
        "num_experts_per_token": 4,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "num_expert_group": 1,
        "topk_group": 1,
        "use_grouped_topk": True,
        "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6]},
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"] + 1,  # <|im_end|>, as Kimi Linear's config says
        "tie_word_embeddings": False,
        "model_max_length": 4096,
        "torch_dtype": "bfloat16",
    }


def _kimi_k3_tiny() -> dict:
    """K3's text config (§3.9) shrunk with every K3 feature on: gated NoPE MLA with q-LoRA,
    full-rank and lower-bounded KDA gates, SiTU-GLU, latent MoE with its norm, two shared
    experts, block attention residuals."""
    cfg = _kimi_linear_tiny()
    cfg.update({
        "num_hidden_layers": 7,
        "q_lora_rank": 48,
        "mla_use_output_gate": True,
        "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4, 7]},
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "num_shared_experts": 2,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "attn_res_block_size": 3,
        "max_position_embeddings": 4096,
    })
    cfg.pop("model_max_length")
    return cfg


@dataclass(frozen=True)
class Preset:
    """How to build one preset: its config.json, the shipped tokenizer it copies ("kimi",
    "deepseek" or "kimi-mini"), and a ``chat_template.jinja`` to write beside it (which wins over the
    tokenizer_config.json template, as in a real checkpoint), if any."""

    config: Callable[[], dict]
    tokenizer: str
    chat_template: str | None = None
    weights: str | None = None  # a trained preset's directory under TRAINED_DIR (its model.safetensors)


PRESETS: dict[str, Preset] = {
    "kimi-k2-tiny": Preset(_k2_like, "kimi"),
    # trained (scripts/train_preset.py, docs/trained_preset.md): calls tools, routes unevenly, has an MTP layer
    "kimi-k2-mini": Preset(kimi_k2_mini, "kimi-mini", weights="kimi-k2-mini"),
    # K2-Thinking: K2's architecture (same tiny weights), with the thinking chat template.
    "kimi-k2-thinking-tiny": Preset(_k2_like, "kimi", chat_template=K2_THINKING_CHAT_TEMPLATE),
    "deepseek-v3-tiny": Preset(_deepseek_v3_tiny, "deepseek"),
    "kimi-k2-small": Preset(_kimi_k2_small, "kimi"),
    "kimi-linear-tiny": Preset(_kimi_linear_tiny, "kimi"),
    "kimi-k3-tiny": Preset(_kimi_k3_tiny, "kimi"),
}


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_config(name: str) -> dict:
    return _preset(name).config()


def build_preset(name: str, out_dir: str | Path, *, seed: int = 0, quant: str | None = None,
                 dtype: str = "bfloat16", progress: bool = True, overrides: dict | None = None) -> Path:
    """Write preset ``name`` as a complete HF checkpoint directory (config, weights, tokenizer);
    ``overrides`` replaces config fields (a benchmark's own shape on a preset's tokenizer)."""
    import torch

    from .config import parse_config
    from .model import CausalLM, init_random_weights, to_hf_tensors
    from .mtp import with_shared_mtp_tensors

    preset = _preset(name)
    raw = preset.config() | (overrides or {})
    raw["torch_dtype"] = dtype
    if preset.weights is not None:  # trained: its committed weights, whatever the seed
        if overrides:
            raise ValueError(f"preset {name} is trained: its shape cannot be overridden")
        from safetensors.torch import load_file

        tensors = load_file(TRAINED_DIR / preset.weights / "model.safetensors")
        # committed once; the checkpoint stores the MTP layer's copies of the shared embedding and head
        tensors = with_shared_mtp_tensors(tensors, raw["num_hidden_layers"])
        generation = {"moeray_preset": name, "trained": True}
    else:
        cfg = parse_config(raw, where=f"preset {name}")
        with torch.device("cpu"):
            model = CausalLM(cfg, mtp=cfg.num_nextn_predict_layers > 0 and cfg.family == "deepseek_v3")
        init_random_weights(model, seed)
        tensors = to_hf_tensors(model)
        generation = {"moeray_preset": name, "seed": seed}
    return write_model_dir(tensors, raw, out_dir, tokenizer=preset.tokenizer, chat_template=preset.chat_template,
                           quant=quant, generation=generation)


def stored_tensors(tensors: dict, dtype: str) -> dict:
    """``tensors`` as a checkpoint of ``dtype`` stores them (the tensors kept in fp32 as they are)."""
    import torch

    from .names import is_fp32

    if dtype == "float32":
        return tensors
    return {k: (v if is_fp32(k) else v.to(getattr(torch, dtype))) for k, v in tensors.items()}


def write_model_dir(tensors: dict, raw: dict, out_dir: str | Path, *, tokenizer: str,
                    chat_template: str | None = None, quant: str | None = None,
                    generation: dict | None = None) -> Path:
    """Checkpoint ``tensors`` (logical names: :func:`~model.model.to_hf_tensors` of a model, its MTP
    layer's too if it has one) as a complete HF checkpoint directory: ``raw`` as config.json (its
    ``torch_dtype`` the stored dtype), the shipped ``tokenizer``'s files, a chat_template.jinja if
    given, and generation_config.json (bos/eos and the ``generation`` fields)."""
    from .checkpoint import write_checkpoint

    tensors = stored_tensors(tensors, raw.get("torch_dtype", "bfloat16"))
    out = Path(out_dir)
    write_checkpoint(out, raw, tensors, quant=quant)
    copy_tokenizer_files(tokenizer, out)
    if chat_template is not None:
        (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"], **(generation or {})}, indent=2))
    return out


def preset_fingerprint(name: str) -> str:
    """12 hex digits over what a preset's files are made of (config, shipped tokenizer files,
    chat template): a cached build whose tokenizer or template has since changed is not reused."""
    preset = _preset(name)
    h = hashlib.sha256(json.dumps(preset.config(), sort_keys=True).encode())
    if preset.weights is not None:
        h.update((TRAINED_DIR / preset.weights / "model.safetensors").read_bytes())
    for f in sorted((SHIPPED_DIR / preset.tokenizer).iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update((preset.chat_template or "").encode())
    return h.hexdigest()[:12]


def resolve_model(name_or_path: str | Path, cache_root: str | Path) -> Path:
    """A checkpoint directory for a path or a preset name (presets are built once into ``cache_root``)."""
    p = Path(name_or_path)
    if str(name_or_path) in PRESETS:
        target = Path(cache_root) / "presets" / f"{name_or_path}-seed0-{preset_fingerprint(str(name_or_path))}"
        if not (target / "config.json").exists():
            # a build of its own, renamed into place: two processes building the same preset at once
            # (two `moeray` commands, two test workers) each finish theirs, and the first rename wins
            tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")
            build_preset(str(name_or_path), tmp)
            try:
                tmp.rename(target)
            except OSError:  # another process's build is there now: the same files
                shutil.rmtree(tmp, ignore_errors=True)
                if not (target / "config.json").exists():
                    raise
        return target
    if p.is_dir():
        return p
    raise ValueError(f"{name_or_path!r} is neither a model directory nor a preset; presets: {', '.join(PRESETS)}")
