"""Parameter counts and KV-cache sizes computed from a :class:`ModelConfig` alone (MODEL_SPEC §4, §2.4).

The count is built layer by layer. Each decoder layer has an *attention kind* (``"mla"`` today) and an
*FFN kind* (``"dense"`` or ``"moe"``). The kinds are chosen by :func:`attention_kind` and
:func:`ffn_kind`, and each kind has a counting function in :data:`ATTENTION_PARAMS` /
:data:`FFN_PARAMS`. New architectures (Kimi Linear / K3: KDA layers, gated MLA, latent MoE, attention
residuals) add a kind, a counting function, and a branch in the kind selectors; the totals need no
change.

Not counted: MTP (``num_nextn_predict_layers``) layers, quantization scale tensors and stray buffers
such as ``rotary_emb.inv_freq`` (MODEL_SPEC §4 lists these separately).
"""

from __future__ import annotations

import io
import json as _json
from dataclasses import dataclass, fields
from typing import Callable

from model.config import ModelConfig

# ---- per-module formulas (MODEL_SPEC §4) -------------------------------------


def mla_params(cfg: ModelConfig) -> int:
    """One MLA block, with or without q-LoRA (``q_lora_rank`` null). Norms inside MLA
    (q_a_layernorm, kv_a_layernorm) are included; the layer's input norm is not."""
    H, n_h = cfg.hidden_size, cfg.num_attention_heads
    r_q, r_kv = cfg.q_lora_rank, cfg.kv_lora_rank
    d_n, d_r, d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if r_q:
        q = H * r_q + r_q + r_q * n_h * (d_n + d_r)  # q_a_proj, q_a_layernorm, q_b_proj
    else:
        q = H * n_h * (d_n + d_r)  # q_proj
    kv = H * (r_kv + d_r) + r_kv + r_kv * n_h * (d_n + d_v)  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
    o = n_h * d_v * H  # o_proj
    return q + kv + o


def swiglu_params(hidden: int, inter: int) -> int:
    """gate, up and down projections of a SwiGLU MLP."""
    return 3 * hidden * inter


@dataclass(frozen=True)
class FfnParams:
    """Parameters of one FFN block. ``activated`` is what one token touches."""

    total: int
    activated: int
    routed_experts: int = 0
    shared_experts: int = 0
    router: int = 0  # weight + e_score_correction_bias


def dense_ffn_params(cfg: ModelConfig) -> FfnParams:
    n = swiglu_params(cfg.hidden_size, cfg.intermediate_size)
    return FfnParams(total=n, activated=n)


def moe_expert_hidden(cfg: ModelConfig) -> int:
    """H_e of MODEL_SPEC §4: the width experts read and write (H; the latent width for latent MoE)."""
    return cfg.hidden_size


def moe_ffn_params(cfg: ModelConfig) -> FfnParams:
    H, H_e, E, k = cfg.hidden_size, moe_expert_hidden(cfg), cfg.n_routed_experts, cfg.num_experts_per_tok
    per_expert = swiglu_params(H_e, cfg.moe_intermediate_size)
    routed = E * per_expert
    shared = swiglu_params(H, cfg.n_shared_experts * cfg.moe_intermediate_size)
    router = E * H + E
    return FfnParams(
        total=routed + shared + router,
        activated=k * per_expert + shared + router,
        routed_experts=routed,
        shared_experts=shared,
        router=router,
    )


ATTENTION_PARAMS: dict[str, Callable[[ModelConfig], int]] = {"mla": mla_params}
FFN_PARAMS: dict[str, Callable[[ModelConfig], FfnParams]] = {"dense": dense_ffn_params, "moe": moe_ffn_params}


def attention_kind(cfg: ModelConfig, layer: int) -> str:
    """The token mixer of ``layer``. Every DeepSeek-V3 / Kimi K2 layer is MLA."""
    return "mla"


def ffn_kind(cfg: ModelConfig, layer: int) -> str:
    return "moe" if cfg.is_moe_layer(layer) else "dense"


def layer_norm_params(cfg: ModelConfig, layer: int) -> int:
    """input_layernorm + post_attention_layernorm."""
    return 2 * cfg.hidden_size


# ---- report --------------------------------------------------------------------


@dataclass(frozen=True)
class LayerParams:
    index: int
    attention_kind: str
    ffn_kind: str
    attention: int
    ffn: int
    norms: int
    total: int
    activated: int


def layer_params(cfg: ModelConfig, layer: int) -> LayerParams:
    a_kind, f_kind = attention_kind(cfg, layer), ffn_kind(cfg, layer)
    attn = ATTENTION_PARAMS[a_kind](cfg)
    ffn = FFN_PARAMS[f_kind](cfg)
    norms = layer_norm_params(cfg, layer)
    return LayerParams(
        index=layer,
        attention_kind=a_kind,
        ffn_kind=f_kind,
        attention=attn,
        ffn=ffn.total,
        norms=norms,
        total=attn + ffn.total + norms,
        activated=attn + ffn.activated + norms,
    )


@dataclass(frozen=True)
class ParamReport:
    """Parameter counts of a model. Representative per-layer fields (``dense_*``, ``moe_*``) are 0
    when the model has no layer of that kind. ``layers`` holds every decoder layer."""

    # model-level
    embedding: int
    lm_head: int  # 0 if tied
    final_norm: int
    # attention
    mla_per_layer: int
    q_lora: bool
    # FFN blocks
    dense_mlp_per_layer: int
    moe_routed_experts: int
    moe_shared_experts: int
    moe_router: int
    moe_block: int
    moe_block_activated: int
    # decoder layers (attention + FFN + 2 norms)
    layer_norms_per_layer: int
    dense_decoder_layer: int
    moe_decoder_layer: int
    n_dense_layers: int
    n_moe_layers: int
    dense_layers_total: int
    moe_layers_total: int
    # whole model
    total: int
    activated_per_token: int
    activated_per_token_excl_embedding: int
    layers: tuple[LayerParams, ...] = ()

    def to_dict(self) -> dict:
        """Scalar fields with stable keys (``layers`` omitted)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "layers"}

    def rows(self) -> list[tuple[str, int]]:
        """(label, count) rows for printing."""
        mla = "MLA per layer" + (" (q-LoRA)" if self.q_lora else " (no q-LoRA)")
        rows: list[tuple[str, int]] = [
            ("embedding", self.embedding),
            ("lm_head" + (" (tied)" if self.lm_head == 0 else ""), self.lm_head),
            ("final norm", self.final_norm),
            (mla, self.mla_per_layer),
        ]
        if self.n_dense_layers:
            rows += [
                ("dense MLP per layer", self.dense_mlp_per_layer),
                ("dense decoder layer", self.dense_decoder_layer),
                (f"dense layers total (×{self.n_dense_layers})", self.dense_layers_total),
            ]
        if self.n_moe_layers:
            rows += [
                ("MoE routed experts per layer", self.moe_routed_experts),
                ("MoE shared experts per layer", self.moe_shared_experts),
                ("MoE router (weight + bias)", self.moe_router),
                ("MoE block per layer", self.moe_block),
                ("MoE decoder layer", self.moe_decoder_layer),
                (f"MoE layers total (×{self.n_moe_layers})", self.moe_layers_total),
            ]
        rows += [
            ("total", self.total),
            ("activated per token", self.activated_per_token),
            ("activated per token (excl. input embedding)", self.activated_per_token_excl_embedding),
        ]
        return rows


def _first(layers: list[LayerParams], ffn: str) -> LayerParams | None:
    return next((lp for lp in layers if lp.ffn_kind == ffn), None)


def count_params(cfg: ModelConfig) -> ParamReport:
    """Count parameters per MODEL_SPEC §4 from the config alone."""
    H = cfg.hidden_size
    embedding = cfg.vocab_size * H
    lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * H
    final_norm = H
    layers = [layer_params(cfg, i) for i in range(cfg.num_hidden_layers)]
    dense, moe = _first(layers, "dense"), _first(layers, "moe")
    moe_ffn = moe_ffn_params(cfg) if moe else FfnParams(0, 0)
    dense_layers = [lp for lp in layers if lp.ffn_kind == "dense"]
    moe_layers = [lp for lp in layers if lp.ffn_kind == "moe"]
    model_level = embedding + lm_head + final_norm
    # A tied head is the embedding matrix: counted once, in `embedding`.
    activated = model_level + sum(lp.activated for lp in layers)
    return ParamReport(
        embedding=embedding,
        lm_head=lm_head,
        final_norm=final_norm,
        mla_per_layer=mla_params(cfg),
        q_lora=bool(cfg.q_lora_rank),
        dense_mlp_per_layer=dense.ffn if dense else 0,
        moe_routed_experts=moe_ffn.routed_experts,
        moe_shared_experts=moe_ffn.shared_experts,
        moe_router=moe_ffn.router,
        moe_block=moe_ffn.total,
        moe_block_activated=moe_ffn.activated,
        layer_norms_per_layer=layer_norm_params(cfg, 0),
        dense_decoder_layer=dense.total if dense else 0,
        moe_decoder_layer=moe.total if moe else 0,
        n_dense_layers=len(dense_layers),
        n_moe_layers=len(moe_layers),
        dense_layers_total=sum(lp.total for lp in dense_layers),
        moe_layers_total=sum(lp.total for lp in moe_layers),
        total=model_level + sum(lp.total for lp in layers),
        activated_per_token=activated,
        activated_per_token_excl_embedding=activated - embedding if lm_head else activated,
        layers=tuple(layers),
    )


def format_report(report: ParamReport, *, json: bool = False) -> str:
    """A plain-text table with thousands separators, or (``json=True``) a JSON object of
    :meth:`ParamReport.to_dict`."""
    if json:
        return _json.dumps(report.to_dict(), indent=2)
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE, show_header=True)
    table.add_column("module")
    table.add_column("parameters", justify="right")
    for name, count in report.rows():
        table.add_row(name, f"{count:,}")
    buf = io.StringIO()
    Console(file=buf, width=100, color_system=None, force_terminal=False, no_color=True).print(table)
    return buf.getvalue()


# ---- KV cache (MODEL_SPEC §2.4) ------------------------------------------------


def cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> dict:
    """Bytes of KV cache per token: the absorbed latent cache (``kv_lora_rank + qk_rope_head_dim``
    per MLA layer) and the naive per-head K/V cache (``n_h·(d_n + d_r + d_v)`` per layer)."""
    mla_layers = sum(1 for i in range(cfg.num_hidden_layers) if attention_kind(cfg, i) == "mla")
    latent_per_layer = cfg.latent_dim * dtype_bytes
    naive_per_layer = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * dtype_bytes
    return {
        "dtype_bytes": dtype_bytes,
        "mla_layers": mla_layers,
        "latent_per_layer": latent_per_layer,
        "naive_per_layer": naive_per_layer,
        "latent": mla_layers * latent_per_layer,
        "naive": mla_layers * naive_per_layer,
    }
