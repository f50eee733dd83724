"""Parameter counts and KV-cache sizes computed from a :class:`ModelConfig` alone (MODEL_SPEC §4, §2.4).

The count is built layer by layer. Each decoder layer has an *attention kind* (``"mla"`` or ``"kda"``)
and an *FFN kind* (``"dense"`` or ``"moe"``). The kinds are chosen by :func:`attention_kind` and
:func:`ffn_kind`, and each kind has a counting function in :data:`ATTENTION_PARAMS` /
:data:`FFN_PARAMS`. The Kimi Linear / K3 switches live inside those functions: gated MLA
(``mla_output_gate``), the KDA output gate (low-rank or full-rank), latent MoE
(``routed_expert_hidden_size``), and K3's block attention residuals (``attn_res_block_size``: 4H per
layer, 2H at model level).

:func:`cache_bytes_per_token` sizes the per-token MLA cache, :func:`state_bytes_per_sequence` the
per-sequence KDA state (MODEL_SPEC §3.6), :func:`verify_state_bytes` what verifying draft tokens
(speculative decoding) holds of it at once.

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
    gate = H * n_h * d_v if cfg.mla_output_gate else 0  # K3 g_proj
    return q + kv + o + gate


def kda_params(cfg: ModelConfig) -> int:
    """One KDA block (MODEL_SPEC §4), A_log counted as n_h (however it is stored). 0 without a KDA config."""
    if cfg.kda is None:
        return 0
    H, n_k, d_k, W = cfg.hidden_size, cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel
    P = cfg.kda.proj_dim
    gate = H * P if cfg.kda.full_rank_gate else H * d_k + d_k * P  # g_proj, or g_a_proj + g_b_proj
    return (
        3 * H * P + 3 * P * W  # q/k/v projections and their depthwise convs
        + n_k + H * d_k + d_k * P + P  # forget gate: A_log, f_a_proj, f_b_proj, dt_bias
        + H * n_k  # b_proj
        + gate + d_k + P * H  # output gate, o_norm, o_proj
    )


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
    latent_proj: int = 0  # latent MoE: routed_expert_down_proj + up_proj (+ norm)


def dense_ffn_params(cfg: ModelConfig) -> FfnParams:
    n = swiglu_params(cfg.hidden_size, cfg.intermediate_size)
    return FfnParams(total=n, activated=n)


def moe_expert_hidden(cfg: ModelConfig) -> int:
    """H_e of MODEL_SPEC §4: the width experts read and write (H; the latent width for latent MoE)."""
    return cfg.expert_hidden_size


def latent_proj_params(cfg: ModelConfig) -> int:
    """Latent MoE (K3): down H → H_e, up H_e → H, and the norm on H_e when ``latent_moe_use_norm``."""
    if cfg.routed_expert_hidden_size is None:
        return 0
    H, H_e = cfg.hidden_size, cfg.routed_expert_hidden_size
    return 2 * H * H_e + (H_e if cfg.latent_moe_use_norm else 0)


def moe_ffn_params(cfg: ModelConfig) -> FfnParams:
    H, H_e, E, k = cfg.hidden_size, moe_expert_hidden(cfg), cfg.n_routed_experts, cfg.num_experts_per_tok
    per_expert = swiglu_params(H_e, cfg.moe_intermediate_size)
    routed = E * per_expert
    shared = swiglu_params(H, cfg.n_shared_experts * cfg.moe_intermediate_size)
    router = E * H + E
    latent = latent_proj_params(cfg)  # every token passes through it
    return FfnParams(
        total=routed + shared + router + latent,
        activated=k * per_expert + shared + router + latent,
        routed_experts=routed,
        shared_experts=shared,
        router=router,
        latent_proj=latent,
    )


ATTENTION_PARAMS: dict[str, Callable[[ModelConfig], int]] = {"mla": mla_params, "kda": kda_params}
FFN_PARAMS: dict[str, Callable[[ModelConfig], FfnParams]] = {"dense": dense_ffn_params, "moe": moe_ffn_params}


def attention_kind(cfg: ModelConfig, layer: int) -> str:
    """The token mixer of ``layer``: "kda" per Kimi Linear's schedule, else "mla" (every
    DeepSeek-V3 / Kimi K2 layer)."""
    return "kda" if cfg.is_kda_layer(layer) else "mla"


def ffn_kind(cfg: ModelConfig, layer: int) -> str:
    return "moe" if cfg.is_moe_layer(layer) else "dense"


def layer_norm_params(cfg: ModelConfig, layer: int) -> int:
    """input_layernorm + post_attention_layernorm."""
    return 2 * cfg.hidden_size


def attn_res_params(cfg: ModelConfig) -> int:
    """K3 block attention residuals of one layer: two RMSNorm weights [H] + two query projections
    [1, H] (self_attention_res_*, mlp_res_*); the model-level output_attn_res_* pair is the same
    size, 2H. 0 without ``attn_res_block_size``."""
    return 0 if cfg.attn_res_block_size is None else 4 * cfg.hidden_size


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
    attn_res: int = 0  # K3 attention-residual norms + projections


def layer_params(cfg: ModelConfig, layer: int) -> LayerParams:
    a_kind, f_kind = attention_kind(cfg, layer), ffn_kind(cfg, layer)
    attn = ATTENTION_PARAMS[a_kind](cfg)
    ffn = FFN_PARAMS[f_kind](cfg)
    norms = layer_norm_params(cfg, layer)
    res = attn_res_params(cfg)
    return LayerParams(
        index=layer,
        attention_kind=a_kind,
        ffn_kind=f_kind,
        attention=attn,
        ffn=ffn.total,
        norms=norms,
        total=attn + ffn.total + norms + res,
        activated=attn + ffn.activated + norms + res,
        attn_res=res,
    )


@dataclass(frozen=True)
class ParamReport:
    """Parameter counts of a model. Representative per-layer fields (``dense_*``, ``moe_*``,
    ``mla_*``, ``kda_*``) are 0 when the model has no layer of that kind; ``dense_decoder_layer`` /
    ``moe_decoder_layer`` are the first layer of that FFN kind (in a hybrid model its attention kind
    is whatever that layer has). ``layers`` holds every decoder layer. Fields after
    ``activated_per_token_excl_embedding`` came with Kimi Linear / K3 and are 0 / False for K2."""

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
    # hybrid attention (Kimi Linear / K3)
    n_mla_layers: int = 0
    n_kda_layers: int = 0
    mla_output_gate: bool = False
    kda_per_layer: int = 0
    kda_full_rank_gate: bool = False
    mla_layers_attention_total: int = 0  # attention blocks only
    kda_layers_attention_total: int = 0
    # latent MoE (K3): down + up (+ norm) per MoE layer, and the up projection alone
    moe_latent_proj: int = 0
    latent_up_proj_per_moe_layer: int = 0
    # K3 block attention residuals
    attn_res_per_layer: int = 0
    attn_res_model: int = 0  # output_attn_res_norm + output_attn_res_proj
    layers: tuple[LayerParams, ...] = ()

    def to_dict(self) -> dict:
        """Scalar fields with stable keys (``layers`` omitted)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "layers"}

    def rows(self) -> list[tuple[str, int]]:
        """(label, count) rows for printing."""
        gated = ", output gate" if self.mla_output_gate else ""
        mla = "MLA per layer" + (f" (q-LoRA{gated})" if self.q_lora else f" (no q-LoRA{gated})")
        rows: list[tuple[str, int]] = [
            ("embedding", self.embedding),
            ("lm_head" + (" (tied)" if self.lm_head == 0 else ""), self.lm_head),
            ("final norm", self.final_norm),
        ]
        if self.attn_res_model:
            rows.append(("output attention residual (norm + proj)", self.attn_res_model))
        rows.append((mla, self.mla_per_layer))
        if self.n_kda_layers:
            gate = "full-rank" if self.kda_full_rank_gate else "low-rank"
            rows += [
                (f"MLA attention total (×{self.n_mla_layers})", self.mla_layers_attention_total),
                (f"KDA per layer ({gate} output gate)", self.kda_per_layer),
                (f"KDA attention total (×{self.n_kda_layers})", self.kda_layers_attention_total),
            ]
        if self.attn_res_per_layer:
            rows.append(("attention residuals per layer (2 norms + 2 projs)", self.attn_res_per_layer))
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
            ]
            if self.moe_latent_proj:
                rows += [
                    ("MoE latent down + up (+ norm) per layer", self.moe_latent_proj),
                    ("MoE latent up projection per layer", self.latent_up_proj_per_moe_layer),
                ]
            rows += [
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
    attn_res_model = 0 if cfg.attn_res_block_size is None else 2 * H
    model_level = embedding + lm_head + final_norm + attn_res_model
    mla_layers = [lp for lp in layers if lp.attention_kind == "mla"]
    kda_layers = [lp for lp in layers if lp.attention_kind == "kda"]
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
        n_mla_layers=len(mla_layers),
        n_kda_layers=len(kda_layers),
        mla_output_gate=cfg.mla_output_gate,
        kda_per_layer=kda_params(cfg),
        kda_full_rank_gate=bool(cfg.kda and cfg.kda.full_rank_gate),
        mla_layers_attention_total=sum(lp.attention for lp in mla_layers),
        kda_layers_attention_total=sum(lp.attention for lp in kda_layers),
        moe_latent_proj=moe_ffn.latent_proj,
        latent_up_proj_per_moe_layer=cfg.hidden_size * cfg.routed_expert_hidden_size
        if moe and cfg.routed_expert_hidden_size else 0,
        attn_res_per_layer=attn_res_params(cfg),
        attn_res_model=attn_res_model,
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
    per MLA layer) and the naive per-head K/V cache (``n_h·(d_n + d_r + d_v)`` per layer). KDA
    layers hold no per-token cache (see :func:`state_bytes_per_sequence`)."""
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


def state_bytes_per_sequence(cfg: ModelConfig, dtype_bytes: int = 2) -> dict:
    """Bytes of KDA state per sequence, independent of its length (MODEL_SPEC §3.6): the recurrent
    state [n_h, d, d] in fp32 (fla needs an fp32 initial state) and the short-conv history of the
    q, k and v streams, W−1 columns of width P each, in ``dtype_bytes``. All 0 without KDA layers."""
    kda_layers = sum(1 for i in range(cfg.num_hidden_layers) if attention_kind(cfg, i) == "kda")
    kda = cfg.kda
    recurrent = kda.num_heads * kda.head_dim * kda.head_dim * 4 if kda and kda_layers else 0
    conv = 3 * kda.proj_dim * (kda.conv_kernel - 1) * dtype_bytes if kda and kda_layers else 0
    return {
        "dtype_bytes": dtype_bytes,
        "kda_layers": kda_layers,
        "recurrent_per_layer": recurrent,
        "conv_per_layer": conv,
        "recurrent": kda_layers * recurrent,
        "conv": kda_layers * conv,
        "total": kda_layers * (recurrent + conv),
    }


def verify_state_bytes(cfg: ModelConfig, sequences: int, positions: int, dtype_bytes: int = 2) -> dict:
    """Transient bytes of KDA state while one attention replica verifies drafts (speculative decoding):
    ``sequences`` sequences carry drafts, padded to ``positions`` query positions each (the input token
    and the drafts). Until the step knows how many drafts were accepted, every KDA layer keeps
    (model/kda.py ``KimiDeltaAttention._attend``, model/cache.py ``KDAStateCache.keep``) the fp32
    recurrent state after each position [Bg, Q, n_h, d, d] and the conv inputs with the W−1 before
    them [Bg, 3, W−1+Q, P] in ``dtype_bytes``; ``stacking``: while a layer stacks its per-position
    states (``torch.stack``), they are held twice. The peak, ``total``, is every layer's ``kept``
    plus one layer's ``stacking``. All 0 without KDA layers."""
    state = state_bytes_per_sequence(cfg, dtype_bytes)
    layers = state["kda_layers"]
    if not layers or sequences <= 0 or positions <= 0:
        return {"sequences": 0, "positions": 0, "kept": 0, "stacking": 0, "total": 0}
    kda = cfg.kda
    recurrent = state["recurrent_per_layer"]
    hist = 3 * (kda.conv_kernel - 1 + positions) * kda.proj_dim * dtype_bytes
    kept = layers * sequences * (positions * recurrent + hist)
    stacking = sequences * positions * recurrent
    return {"sequences": sequences, "positions": positions, "kept": kept, "stacking": stacking,
            "total": kept + stacking}
