"""GPU cost model: bytes, FLOPs and seconds of ONE layer of one engine step, per op class.

Owns: the GPU data (``cluster/gpus/<name>.json``: vendor peak figures) and the one set of
efficiency factors (:data:`EFFICIENCY`). Pure functions of a :class:`ModelConfig` and a batch
description; the simulator (issue 27) adds up layers and steps.
Never: measures anything, talks to Ray or torch, or tunes a factor per GPU, model or case.

Roofline, per op: ``seconds = max(flops / (peak · EFFICIENCY[kind]), bytes / (hbm · EFFICIENCY["hbm"]))``,
summed over a layer's ops. FLOPs count 2 per multiply-add of the matmuls (norms, softmax and
activations are left out: < 0.5 %). Bytes are what HBM moves: weights once per step, the latent
cache, and no activations (≪ weights at decode; prefill is compute-bound). Op kinds: ``gemm``
(dense matmuls, attention core included), ``grouped_gemm`` (routed experts), ``hbm`` (no FLOPs),
``all_to_all`` (the expert exchange: per phase ``latency + bytes / (link · EFFICIENCY["all_to_all"])``).

Weight formats (MODEL_SPEC §1.10), bytes of a ``[out, in]`` matrix and the MMA rate they run at:
``bf16`` 2·out·in (bf16 rate); ``fp8`` out·in + 4·⌈out/128⌉·⌈in/128⌉ fp32 block scales (fp8 rate);
``int4`` 4·out·⌈in/8⌉ + 2·out·⌈in/32⌉ (weight-only: bf16 rate); ``mxfp4`` out·in/2 + out·⌈in/32⌉
(MXFP8 activations: fp8 rate).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from model.config import ModelConfig

GPU_DIR = Path(__file__).parent / "gpus"

# One set for every GPU and every case, fixed from published kernel measurements before any
# comparison and never tuned per anchor (a change here is a change of model, for every result).
EFFICIENCY = {
    # H800 (3.35 TB/s): FlashMLA decode 3,000 GB/s (0.90); DeepGEMM FP8 GEMMs at M = 64-128,
    # 1,509-2,604 GB/s (0.45-0.78). 0.80: a round value inside that range.
    "hbm": 0.80,
    # DeepGEMM dense FP8 at M = 4096 on H800: 1,025-1,358 of 1,979 TFLOPS (0.52-0.69); FlashMLA
    # compute-bound: 580-660 of 989 TFLOPS (0.59-0.67).
    "gemm": 0.65,
    # DeepGEMM contiguous grouped FP8 (MoE): 1,093-1,297 of 1,979 TFLOPS (0.55-0.66).
    "grouped_gemm": 0.60,
    # DeepEP normal kernels: 153-158 of ~160 GB/s NVLink (0.96), 43-58 GB/s of ~50 GB/s RDMA.
    # moeray exchanges with NCCL all_to_all_single, not those kernels: a lower round value.
    "all_to_all": 0.80,
}
FORMATS = {"bf16": "bf16", "fp8": "fp8", "int4": "bf16", "mxfp4": "fp8"}  # weight format → MMA rate
FP8_BLOCK, GROUP = 128, 32


@dataclass(frozen=True)
class GPU:
    """Vendor peak figures of one GPU. Link bandwidths are per GPU and per direction."""

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    nvlink_bytes_per_s: float
    nvlink_latency_s: float
    nic_bytes_per_s: float
    nic_latency_s: float
    gpus_per_node: int
    sources: tuple[str, ...] = ()


# JSON field → (GPU attribute, scale to SI units)
_FIELDS = {
    "hbm_gb": ("hbm_bytes", 1e9), "hbm_tb_per_s": ("hbm_bytes_per_s", 1e12),
    "bf16_dense_tflops": ("bf16_flops_per_s", 1e12), "fp8_dense_tflops": ("fp8_flops_per_s", 1e12),
    "nvlink_gb_per_s": ("nvlink_bytes_per_s", 1e9), "nvlink_latency_us": ("nvlink_latency_s", 1e-6),
    "nic_gbit_per_s": ("nic_bytes_per_s", 1e9 / 8), "nic_latency_us": ("nic_latency_s", 1e-6),
    "gpus_per_node": ("gpus_per_node", 1),
}


def gpu_names(directory: Path = GPU_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.json"))


def load_gpu(name: str, directory: Path = GPU_DIR) -> GPU:
    """``<directory>/<name>.json`` → :class:`GPU`; a missing, unknown or non-positive field is a
    ``ValueError`` naming the file and the field."""
    path = directory / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown GPU {name!r}: no {path}; known: {', '.join(gpu_names(directory))}")
    raw = json.loads(path.read_text())
    known = {"name", "sources", *_FIELDS}
    missing, extra = sorted(known - raw.keys()), sorted(raw.keys() - known)
    if missing or extra:
        raise ValueError(f"{path}: missing field(s) {missing}, unknown field(s) {extra}")
    values = {}
    for field, (attr, scale) in _FIELDS.items():
        v = raw[field]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{path}: field {field!r} must be a positive number, got {v!r}")
        values[attr] = int(v) if attr == "gpus_per_node" else v * scale
    return GPU(name=str(raw["name"]), sources=tuple(raw["sources"]), **values)


@dataclass(frozen=True)
class Part:
    """One op: ``kind`` is gemm, grouped_gemm, hbm or all_to_all."""

    name: str
    kind: str
    flops: float
    bytes: float
    seconds: float


@dataclass(frozen=True)
class Cost:
    """One layer's totals on one GPU and the ops they add up from. FLOPs and bytes are exact ints
    for an exact batch (decode lengths, chunks, per-expert counts); expectations under uniform
    routing are floats."""

    flops: float
    bytes: float
    seconds: float
    parts: tuple[Part, ...] = ()

    def by_kind(self) -> dict[str, Cost]:
        out: dict[str, Cost] = {}
        for p in self.parts:
            c = out.get(p.kind, Cost(0, 0, 0))
            out[p.kind] = Cost(c.flops + p.flops, c.bytes + p.bytes, c.seconds + p.seconds, c.parts + (p,))
        return out


def _total(parts: list[Part]) -> Cost:
    return Cost(sum(p.flops for p in parts), sum(p.bytes for p in parts), sum(p.seconds for p in parts), tuple(parts))


def _roofline(gpu: GPU, name: str, kind: str, flops: float, nbytes: float, rate: str = "bf16") -> Part:
    peak = gpu.fp8_flops_per_s if rate == "fp8" else gpu.bf16_flops_per_s
    compute = flops / (peak * EFFICIENCY[kind]) if flops else 0.0
    memory = nbytes / (gpu.hbm_bytes_per_s * EFFICIENCY["hbm"])
    return Part(name, kind, flops, nbytes, max(compute, memory))


def matrix_bytes(out: int, inp: int, fmt: str) -> int:
    """Bytes of one ``[out, in]`` weight in ``fmt`` (module docstring), scales included."""
    if fmt == "bf16":
        return 2 * out * inp
    if fmt == "fp8":
        return out * inp + 4 * math.ceil(out / FP8_BLOCK) * math.ceil(inp / FP8_BLOCK)
    if fmt == "int4":
        return 4 * out * math.ceil(inp / 8) + 2 * out * math.ceil(inp / GROUP)
    if fmt == "mxfp4":
        return out * (inp // 2) + out * math.ceil(inp / GROUP)
    raise ValueError(f"weight format must be one of {sorted(FORMATS)}, got {fmt!r}")


def _chunks(tokens, context, chunks) -> list[tuple[int, int]]:
    """The batch as (new tokens, context after the step) per sequence."""
    if chunks is None:
        if tokens is None or tokens < 0:
            raise ValueError(f"tokens must be >= 0 (or give chunks), got {tokens!r}")
        ctx = [context] * tokens if isinstance(context, int) else list(context)
        if len(ctx) != tokens:
            raise ValueError(f"context has {len(ctx)} lengths for {tokens} decode tokens")
        chunks = [(1, c) for c in ctx]
    elif tokens is not None:
        raise ValueError("give tokens/context (decode) or chunks, not both")
    for new, ctx in chunks:
        if new < 0 or ctx < new:
            raise ValueError(f"chunk (new={new}, context={ctx}): need 0 <= new <= context")
    return [(n, c) for n, c in chunks if n]


def attention_cost(cfg: ModelConfig, gpu: GPU, *, tokens: int | None = None, context: int | Sequence[int] = 1,
                   chunks: Sequence[tuple[int, int]] | None = None, weights: str = "bf16",
                   cache_bytes: int = 2, moe: bool = True) -> Cost:
    """Everything one attention rank runs in one MLA layer (absorbed path, as moeray runs prefill and
    decode): norms, MLA, and the MoE gate + shared expert (``moe``) or the dense MLP (``moe=False``).

    Batch: ``tokens`` decode sequences, each attending ``context`` cache entries (its own new one
    included; one int, or one per sequence), or ``chunks``: (new tokens, context after the step)
    per sequence (chunked prefill). T = Σ new; S = Σ n·c − n(n−1)/2 attended (query, entry) pairs.
    Per op, with H hidden, Lq q_lora, N heads, P/R/V nope/rope/v dims, Lkv kv_lora, E experts:
      q_a 2·T·H·Lq · q_b 2·T·Lq·N(P+R) · kv_a 2·T·H(Lkv+R)  [``weights``]
      W_UK 2·T·N·P·Lkv · W_UV 2·T·N·Lkv·V  [bf16: moeray keeps kv_b_proj dequantised]
      core 2·S·N·(Lkv+R + Lkv) (scores over Lkv+R, weighted sum over Lkv; bf16 MMA);
           bytes Σ c·(Lkv+R)·cache_bytes (each sequence's latent cache read once)
      cache_write T·(Lkv+R)·cache_bytes · o_proj 2·T·N·V·H (+ K3's g_proj) [``weights``]
      gate 2·T·H·E, bf16 weight + fp32 bias · shared 2·T·3·H·(n_shared·I_moe) [``weights``]
      norms (2H + Lq + Lkv)·2 bytes.
    KDA layers (Kimi Linear, K3) are not modelled here.
    """
    rate = FORMATS.get(weights)
    if rate is None:
        raise ValueError(f"weights must be one of {sorted(FORMATS)}, got {weights!r}")
    if cache_bytes <= 0:
        raise ValueError(f"cache_bytes must be > 0, got {cache_bytes}")
    batch = _chunks(tokens, context, chunks)
    T = sum(n for n, _ in batch)
    if T == 0:
        return Cost(0, 0, 0)
    S = sum(n * c - n * (n - 1) // 2 for n, c in batch)
    H, N, Lkv = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    P, R, V, Lq = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    latent = Lkv + R

    def linear(name: str, out: int, inp: int, fmt: str = weights) -> Part:
        return _roofline(gpu, name, "gemm", 2 * T * out * inp, matrix_bytes(out, inp, fmt), FORMATS[fmt])

    parts = [_roofline(gpu, "norms", "hbm", 0, 2 * (2 * H + (Lq or 0) + Lkv))]
    if Lq:
        parts += [linear("q_a", Lq, H), linear("q_b", N * (P + R), Lq)]
    else:
        parts.append(linear("q_proj", N * (P + R), H))
    parts += [linear("kv_a", latent, H), linear("w_uk", N * P, Lkv, "bf16"),
              _roofline(gpu, "core", "gemm", 2 * S * N * (latent + Lkv),
                        sum(c for _, c in batch) * latent * cache_bytes),
              _roofline(gpu, "cache_write", "hbm", 0, T * latent * cache_bytes),
              linear("w_uv", N * V, Lkv, "bf16"), linear("o_proj", H, N * V)]
    if cfg.mla_output_gate:
        parts.append(linear("g_proj", N * V, H))
    if moe:
        E, inter = cfg.n_routed_experts, cfg.n_shared_experts * cfg.moe_intermediate_size
        parts.append(_roofline(gpu, "gate", "gemm", 2 * T * H * E, 2 * E * H + 4 * E))
        name = "shared"
    else:
        inter, name = cfg.intermediate_size, "mlp"
    if inter:
        parts.append(_roofline(gpu, name, "gemm", 2 * T * 3 * H * inter,
                               2 * matrix_bytes(inter, H, weights) + matrix_bytes(H, inter, weights), rate))
    return _total(parts)


def expert_bytes(cfg: ModelConfig, fmt: str) -> int:
    """One routed expert of one layer: gate/up [I, He] and down [He, I] in ``fmt``."""
    He, inter = cfg.expert_hidden_size, cfg.moe_intermediate_size
    return 2 * matrix_bytes(inter, He, fmt) + matrix_bytes(He, inter, fmt)


def experts_cost(cfg: ModelConfig, gpu: GPU, *, tokens: int | None = None, counts: Sequence[int] | None = None,
                 experts_touched: float | None = None, experts_held: int | None = None,
                 weights: str = "fp8") -> Cost:
    """The routed experts one GPU runs in one MoE layer (one grouped GEMM).

    ``counts``: rows (token, expert pairs) per expert held here; rows = Σ counts, touched = experts
    with a row. Otherwise ``tokens`` routed uniformly over the E experts of which this GPU holds
    ``experts_held`` (default all): rows = tokens·k·held/E and, unless ``experts_touched`` is given,
    the expected distinct experts touched = held·(1 − (1 − k/E)^tokens).
    FLOPs 2·rows·He·I·3 (gate, up, down); bytes touched · (2·[I, He] + [He, I] in ``weights``).
    """
    if weights not in FORMATS:
        raise ValueError(f"weights must be one of {sorted(FORMATS)}, got {weights!r}")
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    held = E if experts_held is None else experts_held
    if not 1 <= held <= E:
        raise ValueError(f"experts_held must be in [1, {E}], got {held}")
    if counts is not None:
        if tokens is not None or experts_touched is not None:
            raise ValueError("give counts, or tokens (and optionally experts_touched), not both")
        if len(counts) > held or any(c < 0 for c in counts):
            raise ValueError(f"counts must be >= 0, at most one per expert held ({held}), got {len(counts)}")
        rows, touched = sum(counts), sum(1 for c in counts if c)
    else:
        if tokens is None or tokens < 0:
            raise ValueError(f"tokens must be >= 0 (or give counts), got {tokens!r}")
        rows = tokens * k * held / E if held != E else tokens * k
        if experts_touched is None:
            touched = held * (1 - (1 - k / E) ** tokens)
        elif 0 <= experts_touched <= min(held, tokens * k):
            touched = experts_touched
        else:
            raise ValueError(f"experts_touched must be in [0, {min(held, tokens * k)}], got {experts_touched}")
    flops = 2 * rows * cfg.expert_hidden_size * cfg.moe_intermediate_size * 3
    return _total([_roofline(gpu, "routed_experts", "grouped_gemm", flops, touched * expert_bytes(cfg, weights),
                             FORMATS[weights])])


def exchange_cost(cfg: ModelConfig, gpu: GPU, *, tokens: int, attention_ranks: int, expert_ranks: int,
                  across_nodes: bool, dtype_bytes: int = 2, wire: str = "sparse") -> Cost:
    """Dispatch + combine of one MoE layer, ``tokens`` per attention rank (actors/dispatch.py).

    ``sparse``: a counts collective (X·⌈E/X⌉ int64 per attention rank), each token's hidden vector
    to its k experts (T·k·He·dtype_bytes out) and the rows back (the same in); an expert rank
    moves A·T·k/X rows each way (uniform routing). ``dense`` (moeray's choice while X ≤ k): every
    token to every expert rank with its k ids and weights (X·T·(He·dtype_bytes + 8k) out) and each
    token's k pair rows back, for its owner to sum in top-k order (T·k·He·dtype_bytes in; one row per
    token with one expert rank, which sums them itself). ``bytes`` is the busiest endpoint's;
    each collective costs one link latency + bytes / (link · EFFICIENCY["all_to_all"]), over NVLink
    or, ``across_nodes``, the NIC: every peer's send and receive are posted together (NCCL groups
    them), so the messages are in flight at once, not one latency per peer. (DeepEP's published
    low-latency kernels — dispatch of 128 tokens to 256 expert ranks over RDMA in 194 µs — fit
    this form: 9.6 µs + 7.3 MB at ~40 GB/s; one latency per peer would be 2.5 ms.)
    """
    A, X, T = attention_ranks, expert_ranks, tokens
    if A < 1 or X < 1 or T < 0 or dtype_bytes <= 0:
        raise ValueError(f"need attention_ranks, expert_ranks >= 1, tokens >= 0, dtype_bytes > 0; got "
                         f"{A}, {X}, {T}, {dtype_bytes}")
    if wire not in ("sparse", "dense"):
        raise ValueError(f"wire must be 'sparse' or 'dense', got {wire!r}")
    if T == 0:
        return Cost(0, 0, 0)
    k, row = cfg.num_experts_per_tok, cfg.expert_hidden_size * dtype_bytes
    if wire == "sparse":
        n_local = math.ceil(cfg.n_routed_experts / X)
        phases = [("counts", X * n_local * 8, A * n_local * 8), ("dispatch", T * k * row, A * T * k * row / X),
                  ("combine", T * k * row, A * T * k * row / X)]
    else:
        back = T * (1 if X == 1 else k) * row  # rows back per attention rank
        phases = [("dispatch", X * T * (row + 8 * k), A * T * (row + 8 * k)), ("combine", back, A * back / X)]
    link = (gpu.nic_bytes_per_s, gpu.nic_latency_s), (gpu.nvlink_bytes_per_s, gpu.nvlink_latency_s)
    bw, lat = link[0] if across_nodes else link[1]
    parts = []
    for name, attn_side, expert_side in phases:
        nbytes = max(attn_side, expert_side)
        parts.append(Part(name, "all_to_all", 0, nbytes, lat + nbytes / (bw * EFFICIENCY["all_to_all"])))
    return _total(parts)
