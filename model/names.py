"""Checkpoint tensor names: the one place that knows what a model family calls its weights.

Owns: the logical (dequantised) name → shape table of each family, the parsers that
read a layer / routed expert out of a name, and which weights a quantised checkpoint
stores quantised. Never touches files or tensor data.

A *logical* name is the Hugging Face name of the dequantised tensor
(``model.layers.3.mlp.experts.7.up_proj.weight``). A quantised checkpoint stores it as
*parts*: the logical name plus a suffix (``weight`` + ``weight_scale_inv`` for fp8;
``weight_packed``/``weight_scale``/``weight_shape`` for int4; ``weight_packed``/
``weight_scale`` for mxfp4), see :data:`PART_SUFFIXES`.

Families (``ModelConfig.family``): DeepSeek-V3 / Kimi K2 (MODEL_SPEC §1.9) and Kimi Linear /
K3 (§3.8, §3.11: ``block_sparse_moe.*``, experts ``w1``/``w3``/``w2``, KDA tensors, gated MLA,
latent MoE, attention residuals), each a ``*_specs`` function built from the same helpers.

Stored names are mapped to these names by :func:`canonical_name` before anything else looks
at them (K3's multimodal ``language_model.`` prefix; transformers' spelling of a dense MLP).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from .config import ModelConfig

Specs = dict[str, tuple[int, ...]]
# which routed experts to hold: None = all; ids = the same in every MoE layer; layer → ids = per layer
ExpertSelection = Iterable[int] | Mapping[int, Iterable[int]] | None

# stored suffixes appended to a logical ``...weight`` name, per storage format; "" = the name itself
PART_SUFFIXES: dict[str, tuple[str, ...]] = {
    "plain": ("",),
    "fp8": ("", "_scale_inv"),
    "int4": ("_packed", "_scale", "_shape"),
    "mxfp4": ("_packed", "_scale"),
}
_QUANT_SUFFIXES = ("_scale_inv", "_packed", "_scale", "_shape")

# quant methods whose stored layout each family's names are known for (fp8 only for DeepSeek-V3 / K2)
QUANT_METHODS: dict[str, tuple[str, ...]] = {"deepseek_v3": ("fp8", "int4", "mxfp4"), "kimi_linear": ("int4", "mxfp4")}
_FP32_SUFFIXES = ("e_score_correction_bias", ".A_log", ".dt_bias")
# K3 is a multimodal wrapper: the text model's tensors sit under ``language_model.`` and the
# vision tower's are not ours (MODEL_SPEC §3.9, §3.11)
_WRAPPER_PREFIX = "language_model."
_OTHER_TOWERS = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
# transformers' KimiLinear save_pretrained renames every ``mlp.`` to ``block_sparse_moe.``,
# the dense layer's too; no MoE tensor is called ``block_sparse_moe.{gate,up,down}_proj``
_HF_DENSE_MLP = re.compile(r"(\.layers\.\d+\.)block_sparse_moe\.(gate_proj|up_proj|down_proj)\.")

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


def canonical_name(stored: str) -> str:
    """A stored tensor name → the name :func:`tensor_specs` uses: drops K3's ``language_model.``
    prefix, and maps transformers' ``layers.N.block_sparse_moe.{gate,up,down}_proj`` (a dense MLP
    as its Kimi Linear save_pretrained writes it) to ``layers.N.mlp.…``."""
    name = stored.removeprefix(_WRAPPER_PREFIX)
    return _HF_DENSE_MLP.sub(r"\1mlp.\2.", name)


def split_stored(name: str) -> tuple[str, str]:
    """A stored tensor name → (logical name, part suffix); ``x.weight_scale_inv`` →
    (``x.weight``, ``_scale_inv``); a plain name → (name, "")."""
    for suffix in _QUANT_SUFFIXES:
        if name.endswith(".weight" + suffix):
            return name[: -len(suffix)], suffix
    return name, ""


def is_ignored(name: str, cfg: ModelConfig, *, mtp: bool = False) -> bool:
    """Stored tensors a loader skips: the stray ``rotary_emb.inv_freq`` buffers, a multimodal
    checkpoint's vision tower and projector, and the multi-token-prediction layers that follow
    the decoder (DeepSeek-V3's layer 61, declared by ``num_nextn_predict_layers``) — but the first
    of them when ``mtp`` (a model built with its MTP layer). Any other extra layer is unexpected."""
    if name.endswith("rotary_emb.inv_freq") or name.startswith(_OTHER_TOWERS):
        return True
    layer = layer_index(name)
    n = cfg.num_hidden_layers + (1 if mtp else 0)
    return layer is not None and n <= layer < cfg.num_hidden_layers + cfg.num_nextn_predict_layers


def is_quantized(name: str, method: str | None) -> bool:
    """Whether a checkpoint in format ``method`` stores logical weight ``name`` quantised."""
    if method is None:
        return False
    if method == "fp8":
        return _FP8_LINEAR.search(name) is not None
    if method in ("int4", "mxfp4"):  # compressed-tensors checkpoints quantise routed experts only
        return name.endswith(".weight") and is_routed_expert(name) is not None
    raise ValueError(f"quant method must be 'fp8', 'int4' or 'mxfp4', got {method!r}")


def check_quant_method(cfg: ModelConfig, method: str | None) -> None:
    """ValueError unless family ``cfg.family`` has a known stored layout for ``method``."""
    allowed = QUANT_METHODS[cfg.family]
    if method is not None and method not in allowed:
        raise ValueError(
            f"quant method {method!r} is not supported for {cfg.family} models (model_type {cfg.model_type!r}); "
            f"supported: None, {', '.join(repr(m) for m in allowed)}"
        )


def is_fp32(name: str) -> bool:
    """Tensors read (and written) in fp32 whatever the dtype of the rest: the router bias, and
    KDA's forget-gate A_log and dt_bias (stored fp32 in Kimi Linear, MODEL_SPEC §3.8)."""
    return name.endswith(_FP32_SUFFIXES)


# ---- expected tensors -----------------------------------------------------------------


# Checkpoint module names that differ between the families (MODEL_SPEC §1.9, §3.8).
EXPERT_WEIGHT_NAMES = {"deepseek_v3": ("gate_proj", "up_proj", "down_proj"), "kimi_linear": ("w1", "w3", "w2")}


def ffn_name(cfg: ModelConfig, layer: int) -> str:
    """Module name of a layer's FFN: Kimi Linear / K3 call the MoE ``block_sparse_moe``."""
    return "block_sparse_moe" if cfg.family == "kimi_linear" and cfg.is_moe_layer(layer) else "mlp"


def tensor_specs(cfg: ModelConfig, experts: ExpertSelection = None, *, mtp: bool = False) -> Specs:
    """Logical name → shape of every tensor the model needs. ``experts`` restricts the routed
    experts of each MoE layer to those ids (``range(0)``: none), or per MoE layer when it maps
    layer → ids (a layer it does not name holds none); None means all. With ``mtp``, the first
    multi-token-prediction layer's tensors too (:func:`mtp_specs`, all its experts).

    One layout serves both families (DeepSeek-V3 / K2 §1.9, Kimi Linear / K3 §3.8, §3.11): they
    differ only in the FFN module name, the expert weight names, and the switches only Kimi
    Linear / K3 configs turn on (KDA layers, attention residuals)."""
    if cfg.family not in EXPERT_WEIGHT_NAMES:
        raise ValueError(f"no tensor naming for model_type {cfg.model_type!r}")
    h, v = cfg.hidden_size, cfg.vocab_size
    specs: Specs = {"model.embed_tokens.weight": (v, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        specs[p + "input_layernorm.weight"] = (h,)
        specs[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.attn_res_block_size is not None:
            for which in ("self_attention_res", "mlp_res"):
                specs.update(attn_res_specs(cfg, f"{p}{which}_"))
        attn = kda_specs if cfg.is_kda_layer(layer) else mla_specs
        specs.update(attn(cfg, p + "self_attn."))
        ffn = f"{p}{ffn_name(cfg, layer)}."
        if cfg.is_moe_layer(layer):
            ids = experts.get(layer, ()) if isinstance(experts, Mapping) else experts
            specs.update(moe_specs(cfg, ffn, ids, EXPERT_WEIGHT_NAMES[cfg.family]))
        else:
            specs.update(swiglu_specs(ffn, h, cfg.intermediate_size))
    specs["model.norm.weight"] = (h,)
    if cfg.attn_res_block_size is not None:
        specs.update(attn_res_specs(cfg, "model.output_attn_res_"))
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = (v, h)
    if mtp:
        specs.update(mtp_specs(cfg, experts))
    return specs


def mtp_specs(cfg: ModelConfig, experts: ExpertSelection = None) -> Specs:
    """DeepSeek-V3's first MTP layer (model/mtp.py), ``model.layers.{num_hidden_layers}``: its own
    embedding and head, the two norms and ``eh_proj`` that join them, and one MLA decoder layer
    (its routed experts selected by ``experts`` as :func:`tensor_specs` selects them)."""
    if cfg.num_nextn_predict_layers < 1 or cfg.family != "deepseek_v3":
        raise ValueError(f"this {cfg.model_type} config declares no MTP layer (num_nextn_predict_layers "
                         f"{cfg.num_nextn_predict_layers})")
    n, h, v = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    p = f"model.layers.{n}."
    specs: Specs = {p + "embed_tokens.weight": (v, h), p + "enorm.weight": (h,), p + "hnorm.weight": (h,),
                    p + "eh_proj.weight": (h, 2 * h), p + "shared_head.norm.weight": (h,),
                    p + "shared_head.head.weight": (v, h), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)}
    specs.update(mla_specs(cfg, p + "self_attn."))
    if cfg.is_moe_layer(n):
        ids = experts.get(n, ()) if isinstance(experts, Mapping) else experts
        specs.update(moe_specs(cfg, p + "mlp.", ids, EXPERT_WEIGHT_NAMES[cfg.family]))
    else:
        specs.update(swiglu_specs(p + "mlp.", h, cfg.intermediate_size))
    return specs


def attn_res_specs(cfg: ModelConfig, prefix: str) -> Specs:
    """K3 block attention residuals (§3.10.6): an RMSNorm weight and a [1, H] query projection."""
    return {prefix + "norm.weight": (cfg.hidden_size,), prefix + "proj.weight": (1, cfg.hidden_size)}


def kda_specs(cfg: ModelConfig, prefix: str) -> Specs:
    """Kimi Delta Attention (§3.3, §3.10): P = n_h·d, W = conv kernel."""
    kda = cfg.kda
    assert kda is not None, "a KDA layer needs cfg.kda"
    h, n_h, d, w = cfg.hidden_size, kda.num_heads, kda.head_dim, kda.conv_kernel
    p = kda.proj_dim
    specs: Specs = {}
    for s in "qkv":
        specs[f"{prefix}{s}_proj.weight"] = (p, h)
    for s in "qkv":
        specs[f"{prefix}{s}_conv1d.weight"] = (p, 1, w)
    # Kimi Linear stores the per-head A_log broadcast-ready; K3's module holds a plain [n_h]
    specs[prefix + "A_log"] = (1, 1, n_h, 1) if kda.gate_lower_bound is None else (n_h,)
    specs[prefix + "dt_bias"] = (p,)
    specs[prefix + "f_a_proj.weight"] = (d, h)
    specs[prefix + "f_b_proj.weight"] = (p, d)
    specs[prefix + "b_proj.weight"] = (n_h, h)
    if kda.full_rank_gate:
        specs[prefix + "g_proj.weight"] = (p, h)
    else:
        specs[prefix + "g_a_proj.weight"] = (d, h)
        specs[prefix + "g_b_proj.weight"] = (p, d)
    specs[prefix + "o_norm.weight"] = (d,)
    specs[prefix + "o_proj.weight"] = (h, p)
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
    if cfg.mla_output_gate:  # K3: o ⊙ sigmoid(g_proj x) on the concatenated heads, before o_proj
        specs[prefix + "g_proj.weight"] = (n * cfg.v_head_dim, h)
    return specs


def moe_specs(
    cfg: ModelConfig,
    prefix: str,
    experts: Iterable[int] | None,
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> Specs:
    """Router, routed experts (``expert_names`` = gate, up, down) and shared experts; with a latent
    MoE (K3) the routed experts work in ``cfg.expert_hidden_size`` between a down and an up
    projection (and a norm), while router and shared experts stay at the full width."""
    h, h_e, n_routed = cfg.hidden_size, cfg.expert_hidden_size, cfg.n_routed_experts
    specs: Specs = {prefix + "gate.weight": (n_routed, h), prefix + "gate.e_score_correction_bias": (n_routed,)}
    ids = range(n_routed) if experts is None else experts
    for e in ids:
        if not 0 <= e < n_routed:
            raise ValueError(f"expert id {e} is outside 0..{n_routed - 1} (n_routed_experts = {n_routed})")
        specs.update(swiglu_specs(f"{prefix}experts.{e}.", h_e, cfg.moe_intermediate_size, expert_names))
    if cfg.n_shared_experts:
        specs.update(swiglu_specs(prefix + "shared_experts.", h, cfg.n_shared_experts * cfg.moe_intermediate_size))
    if cfg.routed_expert_hidden_size is not None:
        specs[prefix + "routed_expert_down_proj.weight"] = (h_e, h)
        specs[prefix + "routed_expert_up_proj.weight"] = (h, h_e)
        if cfg.latent_moe_use_norm:
            specs[prefix + "routed_expert_norm.weight"] = (h_e,)
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
