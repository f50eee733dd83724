"""Model architecture: a Hugging Face ``config.json`` → a frozen :class:`ModelConfig`.

Owns the parsing and validation of architecture fields only. Runtime knobs
(dtype, cache size, batch limits) never live here. Every problem with a config
is a ``ValueError`` that names the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2")
KIMI_LINEAR_TYPES = ("kimi_linear",)
SUPPORTED_MODEL_TYPES = DEEPSEEK_TYPES + KIMI_LINEAR_TYPES
ACTIVATIONS = ("silu", "situ")

# Kimi Linear / K3 spell the MoE fields differently (MODEL_SPEC §3.7); DeepSeek names are canonical.
FIELD_ALIASES = {
    "n_routed_experts": ("num_experts",),
    "num_experts_per_tok": ("num_experts_per_token",),
    "n_group": ("num_expert_group",),
    "scoring_func": ("moe_router_activation_func",),
    "norm_topk_prob": ("moe_renormalize",),
    "n_shared_experts": ("num_shared_experts",),
    "max_position_embeddings": ("model_max_length",),
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding. ``kind`` is "default", "yarn" or "none" (NoPE: the rope dims are never
    rotated, Kimi Linear / K3 MLA)."""

    kind: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention (MODEL_SPEC §3.3, §3.10): ``gate_lower_bound`` None → Kimi Linear's
    softplus forget gate, else K3's lower-bounded sigmoid; ``full_rank_gate`` → K3's g_proj."""

    num_heads: int
    head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None = None
    full_rank_gate: bool = False

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class QuantConfig:
    """Checkpoint weight format: "fp8" (128x128 block scales), "int4" (compressed-tensors
    pack-quantized, routed experts only) or "mxfp4" (compressed-tensors, routed experts only)."""

    method: str
    block_size: tuple[int, int] = (128, 128)
    group_size: int = 32
    raw: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    # MLA
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    # the rest
    rope: RopeConfig
    rope_interleave: bool
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    num_nextn_predict_layers: int
    torch_dtype: str
    quant: QuantConfig | None
    # hybrid (Kimi Linear / K3); DeepSeek-V3 models have every layer "mla" and the defaults below
    layer_types: tuple[str, ...] = ()  # per layer: "mla" or "kda"
    kda: KDAConfig | None = None
    mla_output_gate: bool = False  # K3: o ← o ⊙ sigmoid(g_proj x) before o_proj
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_expert_hidden_size: int | None = None  # latent MoE width (K3)
    latent_moe_use_norm: bool = False
    attn_res_block_size: int | None = None  # K3 block attention residuals
    gate_bias_in_weights: bool = False  # reproduce the original Kimi Linear HF gate (§3.7)
    mlp_layer_kinds: tuple[str, ...] = ()  # per layer: "dense" or "moe"
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    # ---- derived -----------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per MLA layer: the normed latent + the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def family(self) -> str:
        """Checkpoint naming family: "deepseek_v3" (mlp.*, gate/up/down experts) or "kimi_linear"."""
        return "kimi_linear" if self.model_type in KIMI_LINEAR_TYPES else "deepseek_v3"

    def is_moe_layer(self, layer: int) -> bool:
        if self.mlp_layer_kinds:
            return self.mlp_layer_kinds[layer] == "moe"
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def is_kda_layer(self, layer: int) -> bool:
        return layer < len(self.layer_types) and self.layer_types[layer] == "kda"  # the MTP layer is MLA

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i)]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda_layer(i)]

    @property
    def expert_hidden_size(self) -> int:
        """Width the routed experts work in: the hidden size, or the latent width (K3)."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def softmax_scale(self) -> float:
        """σ of MLA: qk_head_dim^-1/2, times mscale² under YaRN (MODEL_SPEC §1.5)."""
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.kind == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# ---- parsing ---------------------------------------------------------------

_MISSING = object()


class _Fields:
    """Typed access to a raw config dict; every error names the field."""

    def __init__(self, raw: dict, where: str, spelled: dict[str, str] | None = None):
        self.raw, self.where, self.spelled = raw, where, spelled or {}

    def label(self, name: str) -> str:
        return repr(self.spelled.get(name, name))

    def get(self, name: str, kind: type | tuple, default: Any = _MISSING, *, nullable=False):
        if name not in self.raw or (self.raw[name] is None and not nullable):
            if default is _MISSING:
                raise ValueError(f"{self.where}: missing required field {self.label(name)}")
            return default
        value = self.raw[name]
        if value is None and nullable:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise ValueError(f"{self.where}: field {self.label(name)} must be {_names(kinds)}, got {value!r}")
        return value

    def positive(self, name: str, default: Any = _MISSING, *, zero_ok=False) -> int:
        value = self.get(name, int, default)
        if value < 0 or (value == 0 and not zero_ok):
            raise ValueError(f"{self.where}: field {self.label(name)} must be {'>= 0' if zero_ok else '> 0'}, got {value}")
        return value


def _names(kinds) -> str:
    return " or ".join(k.__name__ for k in kinds)


def _parse_rope(f: _Fields) -> RopeConfig:
    theta = f.get("rope_theta", float, None)
    params = f.raw.get("rope_parameters") or f.raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{f.where}: field 'rope_scaling' must be an object or null, got {params!r}")
    params = dict(params or {})
    theta = params.get("rope_theta", theta)
    if theta is None:
        theta = 10000.0
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"{f.where}: field 'rope_scaling.type' must be 'yarn' or 'default', got {kind!r}")
    if kind == "default":
        return RopeConfig(kind="default", theta=float(theta))
    p = _Fields(params, f"{f.where}: rope_scaling")
    max_pos = f.raw.get("max_position_embeddings")
    orig = p.positive("original_max_position_embeddings")
    factor = p.get("factor", float, None)
    if factor is None:
        factor = float(max_pos) / orig if max_pos else 1.0
    if factor <= 0:
        raise ValueError(f"{f.where}: field 'rope_scaling.factor' must be > 0, got {factor}")
    return RopeConfig(
        kind="yarn",
        theta=float(theta),
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=p.get("beta_fast", float, 32.0) or 32.0,
        beta_slow=p.get("beta_slow", float, 1.0) or 1.0,
        mscale=p.get("mscale", float, None),
        mscale_all_dim=p.get("mscale_all_dim", float, None),
        attention_factor=p.get("attention_factor", float, None),
        truncate=p.get("truncate", bool, True),
    )


def _parse_quant(f: _Fields) -> QuantConfig | None:
    q = f.raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"{f.where}: field 'quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size", [128, 128])
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{f.where}: field 'quantization_config.weight_block_size' must be [int, int], got {block!r}")
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{f.where}: field 'quantization_config.fmt' must be 'e4m3', got {q.get('fmt')!r}")
        return QuantConfig("fp8", block_size=tuple(block), raw=q)
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ValueError(f"{f.where}: field 'quantization_config.config_groups' must be a non-empty object")
        group = next(iter(groups.values()))
        weights = (group or {}).get("weights") or {}
        fmt = q.get("format") or group.get("format")
        bits, typ = weights.get("num_bits"), weights.get("type")
        gsize = weights.get("group_size", 32)
        if fmt == "pack-quantized" and bits == 4 and typ == "int":
            return QuantConfig("int4", group_size=gsize, raw=q)
        if fmt == "mxfp4-pack-quantized" or (bits == 4 and typ == "float"):
            return QuantConfig("mxfp4", group_size=gsize, raw=q)
        raise ValueError(
            f"{f.where}: unsupported compressed-tensors scheme (format={fmt!r}, num_bits={bits!r}, type={typ!r}); "
            "supported: pack-quantized int4, mxfp4-pack-quantized"
        )
    raise ValueError(
        f"{f.where}: field 'quantization_config.quant_method' must be 'fp8' or 'compressed-tensors', got {method!r}"
    )


def _canonical(raw: dict) -> tuple[dict, dict[str, str]]:
    """Copy of ``raw`` with Kimi Linear's field names mapped to the DeepSeek names, and which
    spelling each mapped field had (so errors name the field as the file spells it)."""
    out, spelled = dict(raw), {}
    for name, aliases in FIELD_ALIASES.items():
        if out.get(name) is None:
            for alias in aliases:
                if out.get(alias) is not None:
                    out[name], spelled[name] = out[alias], alias
                    break
    return out, spelled


def _parse_moe(f: _Fields) -> dict:
    where = f.where
    n_routed = f.positive("n_routed_experts", 0, zero_ok=True)
    top_k = f.positive("num_experts_per_tok", 1)
    n_group = f.positive("n_group", 1)
    topk_group = f.positive("topk_group", 1)
    if n_routed:
        if top_k > n_routed:
            raise ValueError(f"{where}: field 'num_experts_per_tok' ({top_k}) exceeds 'n_routed_experts' ({n_routed})")
        if n_routed % n_group:
            raise ValueError(f"{where}: field 'n_group' ({n_group}) must divide 'n_routed_experts' ({n_routed})")
        if topk_group > n_group:
            raise ValueError(f"{where}: field 'topk_group' ({topk_group}) exceeds 'n_group' ({n_group})")
        if n_group > 1 and n_routed // n_group < 2:
            raise ValueError(f"{where}: field 'n_group' ({n_group}) leaves fewer than 2 experts per group")
        if top_k > topk_group * (n_routed // n_group):
            raise ValueError(f"{where}: field 'num_experts_per_tok' ({top_k}) exceeds the experts in 'topk_group' groups")
    scoring = f.get("scoring_func", str, "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"{where}: field 'scoring_func' must be 'sigmoid', got {scoring!r}")
    topk_method = f.get("topk_method", str, "noaux_tc")
    if topk_method != "noaux_tc":
        raise ValueError(f"{where}: field 'topk_method' must be 'noaux_tc', got {topk_method!r}")
    latent = f.get("routed_expert_hidden_size", int, None, nullable=True)
    if latent is not None and latent <= 0:
        raise ValueError(f"{where}: field 'routed_expert_hidden_size' must be null or > 0, got {latent}")
    return dict(
        n_routed_experts=n_routed, num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
        moe_intermediate_size=f.positive("moe_intermediate_size", 1),
        n_shared_experts=f.positive("n_shared_experts", 0, zero_ok=True),
        first_k_dense_replace=f.positive("first_k_dense_replace", 0, zero_ok=True),
        moe_layer_freq=f.positive("moe_layer_freq", 1),
        norm_topk_prob=f.get("norm_topk_prob", bool, True),
        routed_scaling_factor=f.get("routed_scaling_factor", float, 1.0),
        scoring_func=scoring, topk_method=topk_method,
        routed_expert_hidden_size=latent,
        latent_moe_use_norm=f.get("latent_moe_use_norm", bool, False),
    )


def _parse_hybrid(f: _Fields, n_layers: int) -> dict:
    """Kimi Linear / K3: the KDA/MLA schedule (1-based lists, §3.1) and the K3 switches."""
    where = f.where
    lac = f.raw.get("linear_attn_config")
    if lac is None:
        return dict(layer_types=("mla",) * n_layers, kda=None)
    if not isinstance(lac, dict):
        raise ValueError(f"{where}: field 'linear_attn_config' must be an object, got {lac!r}")
    g = _Fields(lac, f"{where}: linear_attn_config")
    kda_1, full_1 = lac.get("kda_layers"), lac.get("full_attn_layers")
    if kda_1 is None and full_1 is None and isinstance(f.raw.get("layer_types"), list):
        kinds = f.raw["layer_types"]  # transformers' spelling
        kda_1 = [i + 1 for i, t in enumerate(kinds) if t == "linear_attention"]
        full_1 = [i + 1 for i, t in enumerate(kinds) if t == "full_attention"]
    for name, lst in (("kda_layers", kda_1), ("full_attn_layers", full_1)):
        if not isinstance(lst, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in lst):
            raise ValueError(f"{where}: field 'linear_attn_config.{name}' must be a list of 1-based layer numbers")
        bad = [i for i in lst if not 1 <= i <= n_layers]
        if bad:
            raise ValueError(f"{where}: field 'linear_attn_config.{name}' has {bad[0]}, outside 1..{n_layers} (1-based)")
    both = set(kda_1) & set(full_1)
    missing = set(range(1, n_layers + 1)) - set(kda_1) - set(full_1)
    if both or missing:
        what = f"layer {min(both)} is in both" if both else f"layer {min(missing)} is in neither"
        raise ValueError(f"{where}: fields 'linear_attn_config.kda_layers'/'full_attn_layers' must partition "
                         f"1..{n_layers}; {what}")
    kda = KDAConfig(
        num_heads=g.positive("num_heads"), head_dim=g.positive("head_dim"),
        conv_kernel=g.positive("short_conv_kernel_size", 4),
        gate_lower_bound=g.get("gate_lower_bound", float, None, nullable=True),
        full_rank_gate=g.get("use_full_rank_gate", bool, False),
    )
    kset = set(kda_1)
    return dict(layer_types=tuple("kda" if i + 1 in kset else "mla" for i in range(n_layers)), kda=kda)


def _mlp_kinds(f: _Fields, n_layers: int) -> tuple[str, ...]:
    kinds = f.raw.get("mlp_layer_types")  # transformers' Kimi Linear spelling
    if kinds is None:
        return ()
    if not (isinstance(kinds, list) and len(kinds) == n_layers and set(kinds) <= {"dense", "sparse"}):
        raise ValueError(f"{f.where}: field 'mlp_layer_types' must list 'dense'/'sparse' for all {n_layers} layers")
    return tuple("moe" if k == "sparse" else "dense" for k in kinds)


def parse_config(raw: dict, where: str = "config.json", *, gate_bias_in_weights: bool = False) -> ModelConfig:
    """Validate a config dict and build a :class:`ModelConfig`.

    ``gate_bias_in_weights`` reproduces the original Kimi Linear HF code, whose gate takes the
    combine weights from the biased scores (MODEL_SPEC §3.7); off by default."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    if isinstance(raw.get("text_config"), dict):  # K3's multimodal wrapper: read the text model
        raw = {**raw["text_config"], **{k: v for k, v in raw.items() if k == "quantization_config"}}
        where = f"{where}: text_config"
    canonical, spelled = _canonical(raw)
    f = _Fields(canonical, where, spelled)
    model_type = f.get("model_type", str)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where}: field 'model_type' is {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    n_layers = f.positive("num_hidden_layers")
    q_lora = f.get("q_lora_rank", int, None, nullable=True)
    if q_lora is not None and q_lora <= 0:
        raise ValueError(f"{where}: field 'q_lora_rank' must be null or > 0, got {q_lora}")
    act = f.get("hidden_act", str, "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: field 'hidden_act' must be one of {ACTIVATIONS}, got {act!r}")
    eos = f.raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    vocab = f.positive("vocab_size")
    for name, ids in (("eos_token_id", eos_ids), ("bos_token_id", (f.raw.get("bos_token_id"),))):
        for i in ids:
            if i is not None and not (isinstance(i, int) and 0 <= i < vocab):
                raise ValueError(f"{where}: field {name!r} value {i!r} is outside the vocabulary (0..{vocab - 1})")
    # Kimi Linear's MLA is NoPE in every release (transformers' class has no rotary and omits the field)
    nope = f.get("mla_use_nope", bool, model_type in KIMI_LINEAR_TYPES)
    dtype = f.raw.get("torch_dtype") or f.raw.get("dtype") or "bfloat16"
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=f.positive("hidden_size"),
        intermediate_size=f.positive("intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=f.positive("num_attention_heads"),
        q_lora_rank=q_lora,
        kv_lora_rank=f.positive("kv_lora_rank"),
        qk_nope_head_dim=f.positive("qk_nope_head_dim"),
        qk_rope_head_dim=f.positive("qk_rope_head_dim"),
        v_head_dim=f.positive("v_head_dim"),
        **_parse_moe(f),
        rope=RopeConfig(kind="none") if nope else _parse_rope(f),
        rope_interleave=f.get("rope_interleave", bool, True),
        max_position_embeddings=f.positive("max_position_embeddings"),
        rms_norm_eps=f.get("rms_norm_eps", float, 1e-6),
        hidden_act=act,
        tie_word_embeddings=f.get("tie_word_embeddings", bool, False),
        bos_token_id=f.get("bos_token_id", int, None, nullable=True),
        eos_token_ids=eos_ids,
        num_nextn_predict_layers=f.positive("num_nextn_predict_layers", f.raw.get("num_mtp_layers") or 0, zero_ok=True),
        torch_dtype=dtype if isinstance(dtype, str) else "bfloat16",
        quant=_parse_quant(f),
        **_parse_hybrid(f, n_layers),
        mla_output_gate=f.get("mla_use_output_gate", bool, False),
        situ_beta=f.get("activation_situ_beta", float, 4.0),
        situ_linear_beta=f.get("activation_situ_linear_beta", float, 25.0),
        attn_res_block_size=f.get("attn_res_block_size", int, None, nullable=True),
        gate_bias_in_weights=gate_bias_in_weights,
        mlp_layer_kinds=_mlp_kinds(f, n_layers),
        raw=dict(raw),
    )
    if cfg.rope.kind != "none" and cfg.qk_rope_head_dim % 2:
        raise ValueError(f"{where}: field 'qk_rope_head_dim' must be even, got {cfg.qk_rope_head_dim}")
    if cfg.attn_res_block_size is not None and cfg.attn_res_block_size <= 0:
        raise ValueError(f"{where}: field 'attn_res_block_size' must be null or > 0, got {cfg.attn_res_block_size}")
    if model_type in DEEPSEEK_TYPES and cfg.kda is not None:
        raise ValueError(f"{where}: field 'linear_attn_config' is only valid for model_type 'kimi_linear'")
    return cfg


def load_config(path: str | Path, *, gate_bias_in_weights: bool = False) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.exists():
        raise ValueError(f"{p}: no config.json found (expected a Hugging Face model directory)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return parse_config(raw, where=str(file), gate_bias_in_weights=gate_bias_in_weights)
