"""What one engine step costs, for the simulator (:mod:`cluster.simulator`): on GPUs from the
roofline of :mod:`cluster.costmodel` (one documented set of efficiency factors), on CPUs from a
profile of this machine (:mod:`cluster.profile`).

Owns: turning a step's batch (chunks per attention replica, rows per expert slot) into seconds.
Never: measures (the profile does), or knows about scheduling.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from model.config import ModelConfig

from .costmodel import EFFICIENCY, FORMATS, GPU, attention_cost, exchange_cost, expert_bytes, matrix_bytes
from .simulator import Shape, StepCost, StepTime

# The engine's own per-step work on a GPU deployment (scheduling, the step messages, the results
# back, stop checks): measured on this machine's CPU engine as the profile's ``overhead_s``
# (≈ 1–3 ms); a GPU deployment's engine does the same Python work.
GPU_OVERHEAD_S = 0.002


def weight_format(cfg: ModelConfig) -> str:
    """The routed experts' (and projections') storage format as the checkpoint ships it."""
    q = cfg.quant
    if q is None:
        return "bf16"
    method = q.method
    if method == "fp8":
        return "fp8"
    if method == "mxfp4":
        return "mxfp4"
    return "int4"  # compressed-tensors pack-quantized (K2-Thinking)


class GpuCost(StepCost):
    """Roofline step cost on one kind of GPU, one actor per GPU. Attention per replica: every
    layer's :func:`~cluster.costmodel.attention_cost` (KDA layers costed as MLA ones: left out of
    the model) and the lm_head; experts: :func:`~cluster.costmodel.experts_cost` of the rows each
    actor's slots get; the exchange over NVLink when the shape fits one node, else the NIC."""

    def __init__(self, cfg: ModelConfig, gpu: GPU, shape: Shape, *, overhead_s: float = GPU_OVERHEAD_S,
                 cache_bytes: int = 2, exchange_dtype_bytes: int = 2):
        """``exchange_dtype_bytes``: bytes per hidden value on the wire (moeray: 2, bf16; DeepEP's
        FP8 dispatch is about 1, which the published anchors use)."""
        self.cfg, self.gpu, self.overhead_s, self.cache_bytes = cfg, gpu, overhead_s, cache_bytes
        self.exchange_dtype_bytes = exchange_dtype_bytes
        self.fmt = weight_format(cfg)
        self.across_nodes = shape.devices > gpu.gpus_per_node
        self.num_moe = len(cfg.moe_layers)
        self.num_dense = cfg.num_hidden_layers - self.num_moe

    def attention_s(self, chunks: list[tuple[int, int]]) -> float:
        if not chunks:
            return 0.0
        cfg, gpu = self.cfg, self.gpu
        moe = attention_cost(cfg, gpu, chunks=chunks, weights=self.fmt, cache_bytes=self.cache_bytes).seconds
        dense = attention_cost(cfg, gpu, chunks=chunks, weights=self.fmt, cache_bytes=self.cache_bytes,
                               moe=False).seconds if self.num_dense else 0.0
        # the lm_head over each sequence's last token (bf16), as a dense GEMM
        flops, nbytes = 2 * len(chunks) * cfg.vocab_size * cfg.hidden_size, matrix_bytes(cfg.vocab_size,
                                                                                          cfg.hidden_size, "bf16")
        head_s = max(flops / (gpu.bf16_flops_per_s * EFFICIENCY["gemm"]),
                     nbytes / (gpu.hbm_bytes_per_s * EFFICIENCY["hbm"]))
        return self.num_moe * moe + self.num_dense * dense + head_s

    def experts_s(self, rows: np.ndarray, touched: np.ndarray) -> np.ndarray:
        """:func:`~cluster.costmodel.experts_cost`'s roofline, over every (layer, actor) at once
        (checked equal to it in the tests)."""
        cfg, gpu = self.cfg, self.gpu
        flops = 2 * rows * cfg.expert_hidden_size * cfg.moe_intermediate_size * 3
        peak = gpu.fp8_flops_per_s if FORMATS[self.fmt] == "fp8" else gpu.bf16_flops_per_s
        return np.maximum(flops / (peak * EFFICIENCY["grouped_gemm"]),
                          touched * expert_bytes(cfg, self.fmt) / (gpu.hbm_bytes_per_s * EFFICIENCY["hbm"]))

    def exchange_s(self, tokens: int, attention: int, experts: int) -> float:
        wire = "dense" if experts <= self.cfg.num_experts_per_tok else "sparse"
        return exchange_cost(self.cfg, self.gpu, tokens=tokens, attention_ranks=attention, expert_ranks=experts,
                             across_nodes=self.across_nodes, wire=wire, dtype_bytes=self.exchange_dtype_bytes).seconds


class CpuCost(StepCost):
    """Step cost from a profile of this machine (``moeray simulate --profile``): linear fits of the
    real actors' timings, and the machine's cores shared by every actor (a step takes at least its
    CPU work divided by the cores)."""

    FIELDS = ("attention", "experts", "exchange", "overhead_s", "cores", "num_moe_layers")

    def __init__(self, profile: dict):
        missing = [f for f in self.FIELDS if f not in profile]
        if missing:
            raise ValueError(f"the CPU profile lacks {missing}; run `moeray simulate --profile` again")
        self.p = profile
        self.overhead_s = float(profile["overhead_s"])
        self.cores = max(1, int(profile["cores"]))

    @classmethod
    def load(cls, path: str | Path) -> "CpuCost":
        try:
            return cls(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the CPU profile {path}: {e}; make one with `moeray simulate --profile`")

    def attention_s(self, chunks: list[tuple[int, int]]) -> float:
        if not chunks:
            return 0.0
        a = self.p["attention"]
        T = sum(n for n, _ in chunks)
        S = sum(n * c - n * (n - 1) // 2 for n, c in chunks)
        return a["base_s"] + a["per_token_s"] * T + a["per_pair_s"] * S

    def experts_s(self, rows: np.ndarray, touched: np.ndarray) -> np.ndarray:
        e = self.p["experts"]
        return np.where(rows > 0, e["base_s"] + e["per_row_s"] * rows + e["per_expert_s"] * touched, 0.0)

    def exchange_s(self, tokens: int, attention: int, experts: int) -> float:
        """Per MoE layer: a message per peer, the tokens, and each actor process beyond the two of a
        1 × 1 shape (every exchange wakes every process, which share the cores)."""
        x = self.p["exchange"]
        return (x["per_peer_s"] * max(attention, experts) + x["per_token_s"] * tokens
                + x.get("per_process_s", 0.0) * max(0, attention + experts - 2))

    def step(self, chunks, rows, touched, shape: Shape, num_moe_layers: int) -> StepTime:
        base = super().step(chunks, rows, touched, shape, num_moe_layers)
        work = sum(self.attention_s(c) for c in chunks) + float(self.experts_s(rows, touched).sum())
        body = base.seconds - self.overhead_s - base.exchange_s
        return StepTime(self.overhead_s + max(body, work / self.cores) + base.exchange_s, base.attention_s,
                        base.experts_s, base.exchange_s)
