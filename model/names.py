"""Checkpoint tensor names: the one place that knows what a model family calls its weights.

Owns: the logical (dequantised) name → shape table of each family, the parsers that
read a layer / routed expert out of a name, and which weights a quantised checkpoint
stores quantised. Never touches files or tensor data.

A *logical* name is the Hugging Face name of the dequantised tensor
(``model.layers.3.mlp.experts.7.up_proj.weight``). A quantised checkpoint stores it as
*parts*: the logical name plus a suffix (``weight`` + ``weight_scale_inv`` for fp8;
``weight_packed``/``weight_scale``/``weight_shape`` for int4; ``weight_packed``/
``weight_scale`` for mxfp4), see :data:`PART_SUFFIXES`.

Families: DeepSeek-V3 / Kimi K2 (MODEL_SPEC §1.9) today. Kimi Linear / K3
(``block_sparse_moe.*``, experts ``w1``/``w3``/``w2``, KDA tensors) slot in as another
``*_specs`` function built from the same helpers, dispatched in :func:`tensor_specs`.
"""

from __future__ import annotations

import re

from .config import DEEPSEEK_TYPES, ModelConfig

Specs = dict[str, tuple[int, ...]]

# stored suffixes appended to a logical ``...weight`` name, per storage format; "" = the name itself
PART_SUFFIXES: dict[str, tuple[str, ...]] = {
    "plain": ("",),
    "fp8": ("", "_scale_inv"),
    "int4": ("_packed", "_scale", "_shape"),
    "mxfp4": ("_packed", "_scale"),
}
_QUANT_SUFFIXES = ("_scale_inv", "_packed", "_scale", "_shape")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ROUTED = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
# linear projections a DeepSeek-V3 fp8 checkpoint stores as fp8 (MODEL_SPEC §1.9): attention
# projections, dense MLP, routed and shared experts. Not norms, the router gate, embeddings, lm_head.
_FP8_LINEAR = re.compile(
    r"\.(?:self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(?:experts\.\d+\.|shared_experts\.)?(?:gate_proj|up_proj|down_proj))\.weight$"
)


# ---- parsing names --------------------------------------------------------------------


def layer_index(name: str) -> int | None:
    """``model.layers.12.…`` → 12; None for model-level tensors."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def is_routed_expert(name: str) -> tuple[int, int] | None:
    """``model.layers.L.mlp.experts.E.…`` (or ``block_sparse_moe.experts``) → (L, E), else None.
    Shared experts are not routed experts."""
    m = _ROUTED.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def split_stored(name: str) -> tuple[str, str]:
    """A stored tensor name → (logical name, part suffix); ``x.weight_scale_inv`` →
    (``x.weight``, ``_scale_inv``); a plain name → (name, "")."""
    for suffix in _QUANT_SUFFIXES:
        if name.endswith(".weight" + suffix):
            return name[: -len(suffix)], suffix
    return name, ""


def is_ignored(name: str, cfg: ModelConfig) -> bool:
    """Stored tensors a loader skips: the stray ``rotary_emb.inv_freq`` buffers, and the
    multi-token-prediction layers that follow the decoder (DeepSeek-V3's layer 61, declared by
    ``num_nextn_predict_layers``). Any other extra layer is unexpected."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    layer = layer_index(name)
    n = cfg.num_hidden_layers
    return layer is not None and n <= layer < n + cfg.num_nextn_predict_layers


def is_quantized(name: str, method: str | None) -> bool:
    """Whether a checkpoint in format ``method`` stores logical weight ``name`` quantised."""
    if method is None:
        return False
    if method == "fp8":
        return _FP8_LINEAR.search(name) is not None
    if method in ("int4", "mxfp4"):  # compressed-tensors checkpoints quantise routed experts only
        return name.endswith(".weight") and is_routed_expert(name) is not None
    raise ValueError(f"quant method must be 'fp8', 'int4' or 'mxfp4', got {method!r}")


def is_fp32(name: str) -> bool:
    """Tensors checkpoints keep in fp32 whatever the dtype of the rest (router bias)."""
    return name.endswith("e_score_correction_bias")


# ---- expected tensors -----------------------------------------------------------------


def tensor_specs(cfg: ModelConfig, experts: range | None = None) -> Specs:
    """Logical name → shape of every tensor the model needs. ``experts`` restricts the routed
    experts of each MoE layer to those ids (``range(0)``: none); None means all."""
    if cfg.model_type in DEEPSEEK_TYPES:
        return deepseek_v3_specs(cfg, experts)
    raise ValueError(f"no tensor naming for model_type {cfg.model_type!r}")


def deepseek_v3_specs(cfg: ModelConfig, experts: range | None = None) -> Specs:
    """DeepSeek-V3 / Kimi K2 names, MODEL_SPEC §1.9."""
    h, v = cfg.hidden_size, cfg.vocab_size
    specs: Specs = {"model.embed_tokens.weight": (v, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        specs[p + "input_layernorm.weight"] = (h,)
        specs[p + "post_attention_layernorm.weight"] = (h,)
        specs.update(mla_specs(cfg, p + "self_attn."))
        if cfg.is_moe_layer(layer):
            specs.update(moe_specs(cfg, p + "mlp.", experts))
        else:
            specs.update(swiglu_specs(p + "mlp.", h, cfg.intermediate_size))
    specs["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = (v, h)
    return specs


def mla_specs(cfg: ModelConfig, prefix: str) -> Specs:
    h, n = cfg.hidden_size, cfg.num_attention_heads
    specs: Specs = {}
    if cfg.q_lora_rank is None:
        specs[prefix + "q_proj.weight"] = (n * cfg.qk_head_dim, h)
    else:
        specs[prefix + "q_a_proj.weight"] = (cfg.q_lora_rank, h)
        specs[prefix + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        specs[prefix + "q_b_proj.weight"] = (n * cfg.qk_head_dim, cfg.q_lora_rank)
    specs[prefix + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
    specs[prefix + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    specs[prefix + "kv_b_proj.weight"] = (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    specs[prefix + "o_proj.weight"] = (h, n * cfg.v_head_dim)
    return specs


def moe_specs(
    cfg: ModelConfig,
    prefix: str,
    experts: range | None,
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> Specs:
    """Router, routed experts (``expert_names`` = gate, up, down) and shared experts."""
    h, n_routed = cfg.hidden_size, cfg.n_routed_experts
    specs: Specs = {prefix + "gate.weight": (n_routed, h), prefix + "gate.e_score_correction_bias": (n_routed,)}
    ids = range(n_routed) if experts is None else experts
    for e in ids:
        if not 0 <= e < n_routed:
            raise ValueError(f"expert id {e} is outside 0..{n_routed - 1} (n_routed_experts = {n_routed})")
        specs.update(swiglu_specs(f"{prefix}experts.{e}.", h, cfg.moe_intermediate_size, expert_names))
    if cfg.n_shared_experts:
        specs.update(swiglu_specs(prefix + "shared_experts.", h, cfg.n_shared_experts * cfg.moe_intermediate_size))
    return specs


def swiglu_specs(
    prefix: str, hidden: int, inter: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> Specs:
    gate, up, down = names
    return {
        f"{prefix}{gate}.weight": (inter, hidden),
        f"{prefix}{up}.weight": (inter, hidden),
        f"{prefix}{down}.weight": (hidden, inter),
    }
