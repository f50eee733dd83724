"""What one engine step costs, for the simulator (:mod:`cluster.capacity.simulator`): on GPUs from the
roofline of :mod:`cluster.costmodel` (one documented set of efficiency factors), on CPUs from a
profile of this machine (:mod:`cluster.capacity.profile`).

The interface (:class:`StepCost`, its answer :class:`StepTime`) and the shape it prices
(:class:`Shape`) are here too, with their two implementations.

Owns: turning a step's batch (chunks per attention replica, rows per expert slot) into seconds.
Never: measures (the profile does), or knows about scheduling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.config import ModelConfig

from ..costmodel import EFFICIENCY, FORMATS, GPU, attention_cost, exchange_cost, expert_bytes, matrix_bytes
from .pipeline import Stages, makespan_s

# The engine's own per-step work on a GPU deployment (scheduling, the step messages, the results
# back, stop checks): measured on this machine's CPU engine as the profile's ``overhead_s``
# (≈ 1–3 ms); a GPU deployment's engine does the same Python work.

# ---- the shape and the costs ------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    attention: int
    experts: int
    redundant_slots: int = 0
    standbys: int = 0  # warm standby actors (each takes a device)
    ping_pong: bool = False  # the engine's ping-pong: micro_batches 2 unless more are asked for
    rebalanced: bool = False  # experts placed by load (`moeray rebalance`); implied by redundant slots
    # worker i holds attention replica i and expert shard i on one device (`moeray up --layout colocated`;
    # SGLang's and DeepSeek's "DP attention + EP"): their compute adds up on the device
    colocated: bool = False
    micro_batches: int = 1  # a step's batch in this many micro-batches, pipelined (cluster/capacity/pipeline.py)

    def __post_init__(self):
        if self.colocated and self.attention != self.experts:
            raise ValueError(f"a colocated shape puts one attention replica and one expert actor on each device: "
                             f"attention ({self.attention}) must equal experts ({self.experts})")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.ping_pong and self.micro_batches == 1:
            object.__setattr__(self, "micro_batches", 2)
        elif self.micro_batches > 1 and not self.ping_pong:
            object.__setattr__(self, "ping_pong", True)

    @property
    def layout(self) -> str:
        return "colocated" if self.colocated else "disaggregated"

    @property
    def devices(self) -> int:
        return (self.attention if self.colocated else self.attention + self.experts) + self.standbys


@dataclass(frozen=True)
class StepTime:
    seconds: float
    attention_s: float  # the busiest attention replica, all layers
    experts_s: float  # Σ over MoE layers of the busiest expert actor
    exchange_s: float


class StepCost:
    """What one step costs (a :class:`~cluster.costmodel`-based :class:`GpuCost`, or a profiled
    :class:`CpuCost`). ``chunks[r]``: (new tokens, context after the step) per sequence of
    attention replica r; ``rows`` / ``touched`` [MoE layers, expert actors]: the rows each expert
    actor computes in each MoE layer, and how many of its slots have any."""

    overhead_s: float = 0.0
    # step_parts() prices each micro-batch's stages and pipelines them (GpuCost); otherwise step() on the
    # whole batch (CpuCost: a profile of this machine's whole steps)
    pipelined: bool = False

    def step_parts(self, chunks: list[list[tuple[int, int]]],
                   parts: list[tuple[list[list[tuple[int, int]]], np.ndarray, np.ndarray]], shape: Shape,
                   num_moe_layers: int) -> StepTime:
        raise NotImplementedError

    def attention_s(self, chunks: list[tuple[int, int]]) -> float:  # one replica, every layer
        raise NotImplementedError

    def experts_s(self, rows: np.ndarray, touched: np.ndarray) -> np.ndarray:  # seconds, [layers, actors]
        raise NotImplementedError

    def exchange_s(self, tokens: int, attention: int, experts: int, *, colocated: bool = False) -> float:
        """One MoE layer's exchange, ``tokens`` per attention replica (``colocated``: the expert shards
        live in the attention replicas' processes)."""
        raise NotImplementedError

    def step(self, chunks: list[list[tuple[int, int]]], rows: np.ndarray, touched: np.ndarray, shape: Shape,
             num_moe_layers: int) -> StepTime:
        attn = max((self.attention_s(c) for c in chunks), default=0.0)
        tokens = max((sum(n for n, _ in c) for c in chunks), default=0)
        xch = self.exchange_s(tokens, shape.attention, shape.experts, colocated=shape.colocated) * num_moe_layers
        exp = float(self.experts_s(rows, touched).max(1).sum()) if rows.size else 0.0
        if shape.ping_pong:
            # two micro-batches: one's exchange runs while the other computes, so compute C and
            # exchange X overlap but for one half of the shorter: max(C, X) + min(C, X) / 2
            compute = attn + exp
            return StepTime(self.overhead_s + max(compute, xch) + min(compute, xch) / 2, attn, exp, xch)
        return StepTime(self.overhead_s + attn + exp + xch, attn, exp, xch)


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


EXCHANGES = {
    "moeray": "what the engine sends today: bf16 rows, one copy per (token, expert), counts first "
              "(cluster/costmodel.py exchange_cost), every byte on the NIC once the shape spans nodes",
    "fp8-dedup": "what DeepEP/StepMesh-class transports send (not moeray): FP8 dispatch with its scales, one copy "
                 "per destination node, NVLink inside a node (not charged), one bf16 partial sum per node back",
    "fp8-ll": "what DeepEP's low-latency kernels send, which the published decode deployments run (not moeray): "
              "one FP8 copy (with its scales) per (token, expert), one bf16 row back per (token, expert), "
              "every byte over RDMA once the shape spans nodes",
}


class GpuCost(StepCost):
    """Roofline step cost on one kind of GPU, one actor per GPU. Attention per replica: every
    layer's :func:`~cluster.costmodel.attention_cost` (KDA layers costed as MLA ones: left out of
    the model) and the lm_head; experts: :func:`~cluster.costmodel.experts_cost` of the rows each
    actor's slots get; the exchange (``exchange``, one of :data:`EXCHANGES`) over NVLink when the
    shape fits one node, else the NIC. A step's MoE layers are a pipeline of the shape's
    micro-batches (:mod:`cluster.capacity.pipeline`): each micro-batch priced on its own (its experts' weights
    read again), the stages overlapping on their resources."""

    pipelined = True

    def __init__(self, cfg: ModelConfig, gpu: GPU, shape: Shape, *, overhead_s: float = GPU_OVERHEAD_S,
                 cache_bytes: int = 2, exchange_dtype_bytes: int = 2, exchange: str = "moeray"):
        """``exchange_dtype_bytes``: bytes per hidden value on the wire of the ``moeray`` exchange (2,
        bf16; about 1 for an FP8 dispatch, which the published anchors use)."""
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {sorted(EXCHANGES)}, got {exchange!r}")
        self.cfg, self.gpu, self.overhead_s, self.cache_bytes = cfg, gpu, overhead_s, cache_bytes
        self.exchange_dtype_bytes, self.exchange = exchange_dtype_bytes, exchange
        self.fmt = weight_format(cfg)
        self.across_nodes = shape.devices > gpu.gpus_per_node
        self.num_moe = len(cfg.moe_layers)
        self.num_dense = cfg.num_hidden_layers - self.num_moe

    def moe_attention_s(self, chunks: list[tuple[int, int]]) -> float:
        """One MoE layer's attention (norms, MLA, gate and shared expert) on one replica."""
        if not chunks:
            return 0.0
        return attention_cost(self.cfg, self.gpu, chunks=chunks, weights=self.fmt, cache_bytes=self.cache_bytes).seconds

    def rest_s(self, chunks: list[tuple[int, int]]) -> float:
        """The dense layers and the lm_head on one replica."""
        if not chunks:
            return 0.0
        cfg, gpu = self.cfg, self.gpu
        dense = attention_cost(cfg, gpu, chunks=chunks, weights=self.fmt, cache_bytes=self.cache_bytes,
                               moe=False).seconds if self.num_dense else 0.0
        # the lm_head over each sequence's last token (bf16), as a dense GEMM
        flops, nbytes = 2 * len(chunks) * cfg.vocab_size * cfg.hidden_size, matrix_bytes(cfg.vocab_size,
                                                                                          cfg.hidden_size, "bf16")
        head_s = max(flops / (gpu.bf16_flops_per_s * EFFICIENCY["gemm"]),
                     nbytes / (gpu.hbm_bytes_per_s * EFFICIENCY["hbm"]))
        return self.num_dense * dense + head_s

    def attention_s(self, chunks: list[tuple[int, int]]) -> float:
        return self.num_moe * self.moe_attention_s(chunks) + self.rest_s(chunks)

    def experts_s(self, rows: np.ndarray, touched: np.ndarray) -> np.ndarray:
        """:func:`~cluster.costmodel.experts_cost`'s roofline, over every (layer, actor) at once
        (checked equal to it in the tests)."""
        cfg, gpu = self.cfg, self.gpu
        flops = 2 * rows * cfg.expert_hidden_size * cfg.moe_intermediate_size * 3
        peak = gpu.fp8_flops_per_s if FORMATS[self.fmt] == "fp8" else gpu.bf16_flops_per_s
        return np.maximum(flops / (peak * EFFICIENCY["grouped_gemm"]),
                          touched * expert_bytes(cfg, self.fmt) / (gpu.hbm_bytes_per_s * EFFICIENCY["hbm"]))

    def exchange_s(self, tokens: int, attention: int, experts: int, *, colocated: bool = False) -> float:
        return sum(self.exchange_phases(tokens, attention, experts, colocated=colocated))

    def exchange_phases(self, tokens: int, attention: int, experts: int, *, colocated: bool) -> tuple[float, float]:
        """(dispatch, combine) of one MoE layer, ``tokens`` per attention replica.

        ``moeray``: :func:`~cluster.costmodel.exchange_cost`'s counts and dispatch, then its combine.
        ``fp8-ll``: as ``moeray``'s sparse wire without the counts, FP8 (and a 4-byte scale per 128
        values) out, bf16 back.
        ``fp8-dedup``, with n = the nodes a token's k experts may be on and p(n) = 1 − (1 − 1/n)^k the
        chance that a node holds one of them: colocated on N workers (n = N / 8 nodes), a token goes to
        the (n − 1)·p(n) other nodes it needs, FP8 with a 4-byte scale per 128 values out, one bf16
        partial sum back; disaggregated, the busier of an attention NIC (its tokens to ⌈X/8⌉ expert nodes)
        and an expert NIC (every attention replica's tokens, shared by a node's min(8, X) GPUs)."""
        cfg, gpu = self.cfg, self.gpu
        if tokens <= 0:
            return 0.0, 0.0
        if self.exchange == "moeray":
            wire = "dense" if experts <= cfg.num_experts_per_tok else "sparse"
            cost = exchange_cost(cfg, gpu, tokens=tokens, attention_ranks=attention, expert_ranks=experts,
                                 across_nodes=self.across_nodes, wire=wire, dtype_bytes=self.exchange_dtype_bytes)
            combine = sum(p.seconds for p in cost.parts if p.name == "combine")
            return cost.seconds - combine, combine
        k, H = cfg.num_experts_per_tok, cfg.expert_hidden_size
        out_row, back_row = H + H // 128 * 4, H * 2
        if self.exchange == "fp8-ll":
            bw, lat = ((gpu.nic_bytes_per_s, gpu.nic_latency_s) if self.across_nodes else
                       (gpu.nvlink_bytes_per_s, gpu.nvlink_latency_s))
            A, X = attention, experts
            return tuple(lat + max(tokens * k * row, A * tokens * k * row / X) / (bw * EFFICIENCY["all_to_all"])
                         for row in (out_row, back_row))
        if not self.across_nodes:
            return 0.0, 0.0  # one node: NVLink, not charged
        bw, lat = gpu.nic_bytes_per_s * EFFICIENCY["all_to_all"], gpu.nic_latency_s

        def link(nbytes: float) -> float:
            return lat + nbytes / bw if nbytes > 0 else 0.0

        def p_node(n: int) -> float:
            return 1 - (1 - 1 / n) ** k

        per_node = gpu.gpus_per_node
        if colocated:
            n = max(1, attention // per_node)
            copies = (n - 1) * p_node(n) if n > 1 else 0.0
            return link(tokens * copies * out_row), link(tokens * copies * back_row)
        nx, g = max(1, -(-experts // per_node)), min(per_node, experts)
        p = p_node(nx)
        return (link(max(tokens * nx * p * out_row, attention * tokens * p * out_row / g)),
                link(max(tokens * nx * p * back_row, attention * tokens * p * back_row / g)))

    def step(self, chunks, rows, touched, shape: Shape, num_moe_layers: int) -> StepTime:
        return self.step_parts(chunks, [(chunks, rows, touched)], shape, num_moe_layers)

    def step_parts(self, chunks, parts, shape: Shape, num_moe_layers: int) -> StepTime:
        """The whole batch's dense layers and lm_head, then the MoE layers as a pipeline of the
        micro-batches in ``parts`` ((chunks per replica, rows, touched) each): each stage the
        slowest micro-batch's on its busiest device, the experts' the mean over MoE layers of the
        busiest actor's."""
        stages, attn_total, exp_total, xch_total = [], 0.0, 0.0, 0.0
        for part_chunks, rows, touched in parts:
            distinct = _distinct(part_chunks)
            ta = max((self.moe_attention_s(list(c)) for c in distinct), default=0.0)
            tokens = max((sum(n for n, _ in c) for c in distinct), default=0)
            d, c = self.exchange_phases(tokens, shape.attention, shape.experts, colocated=shape.colocated)
            te = float(self.experts_s(rows, touched).max(1).sum()) if rows.size else 0.0
            stages.append((ta, d, te / max(num_moe_layers, 1), c))
            attn_total, exp_total, xch_total = attn_total + ta, exp_total + te, xch_total + d + c
        st = Stages(*(max(s[i] for s in stages) for i in range(4)))
        rest = max((self.rest_s(list(c)) for c in _distinct(chunks)), default=0.0)  # on the whole batch
        moe = makespan_s(st, len(parts), num_moe_layers, shape.colocated)
        return StepTime(self.overhead_s + rest + moe, num_moe_layers * attn_total + rest, exp_total,
                        num_moe_layers * xch_total)


def _distinct(chunks: list[list[tuple[int, int]]]) -> set[tuple[tuple[int, int], ...]]:
    """The replicas' distinct chunk lists (a decode node's replicas are often alike: each priced once)."""
    return {tuple(c) for c in chunks}


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

    def exchange_s(self, tokens: int, attention: int, experts: int, *, colocated: bool = False) -> float:
        """Per MoE layer: a message per peer, the tokens, and each actor process beyond the two of a
        1 × 1 shape (every exchange wakes every process, which share the cores). ``colocated``: the
        ``attention`` workers are the only processes, each also serving the others' rows (the
        profile's ``colocated`` term)."""
        x = self.p["exchange"]
        processes = attention if colocated else attention + experts
        extra = (x.get("per_process_s", 0.0) + x.get("per_process_token_s", 0.0) * tokens) * max(0, processes - 2)
        together = self.p.get("colocated", {}) if colocated else {}
        return (x["per_peer_s"] * (attention if colocated else max(attention, experts)) + x["per_token_s"] * tokens
                + extra + together.get("base_s", 0.0) + together.get("per_token_s", 0.0) * tokens)

    def step(self, chunks, rows, touched, shape: Shape, num_moe_layers: int) -> StepTime:
        base = super().step(chunks, rows, touched, shape, num_moe_layers)
        work = sum(self.attention_s(c) for c in chunks) + float(self.experts_s(rows, touched).sum())
        body = base.seconds - self.overhead_s - base.exchange_s
        return StepTime(self.overhead_s + max(body, work / self.cores) + base.exchange_s, base.attention_s,
                        base.experts_s, base.exchange_s)
