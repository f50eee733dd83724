"""Small building blocks shared by every architecture: RMSNorm, rotary embedding
(plain and YaRN, interleaved or NeoX pairing) and the gated MLP.

Pure tensor math; no state beyond weights."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import RopeConfig, yarn_mscale


class RMSNorm(nn.Module):
    """y = w ⊙ x / sqrt(mean(x²) + eps); statistics in fp32, cast back before the weight (as HF)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin amplitude μ (MODEL_SPEC §1.5)."""
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extra = 1.0 / pos_freqs
    if rope.kind != "yarn":
        return extra, 1.0
    inter = 1.0 / (rope.factor * pos_freqs)

    def corr_dim(rot: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 → original frequency, 0 → divided by factor
    inv_freq = inter * (1 - keep) + extra * keep
    if rope.attention_factor is not None:
        mu = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        mu = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        mu = yarn_mscale(rope.factor)
    return inv_freq, float(mu)


class RotaryEmbedding:
    """Rotates the last dim of q/k by position.

    ``interleave=True``: adjacent pairs (x[2i], x[2i+1]) share a frequency (the DeepSeek/Kimi
    checkpoints). The output is laid out [rotated evens, rotated odds] — a fixed permutation of
    the pairs, applied identically to q and k, so dot products are exact (MODEL_SPEC §1.6).
    ``interleave=False``: NeoX halves (x[i], x[i + d/2]).

    A plain object, not a module: it holds no weights, and a model built on the meta device still
    gets real frequencies.
    """

    def __init__(self, rope: RopeConfig, dim: int, interleave: bool):
        self.inv_freq, self.mu = rope_inv_freq(rope, dim)
        self.interleave = interleave

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
        return angles.cos() * self.mu, angles.sin() * self.mu

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., d]; cos/sin: [T, d/2]."""
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) ⊙ up."""
    return F.silu(gate) * up


class SituGLU:
    """K3's SiTU-GLU (MODEL_SPEC §3.10.4), in fp32:
    β·tanh(a/β)·sigmoid(a) · β_l·tanh(b/β_l) for gate pre-activation a and up pre-activation b."""

    def __init__(self, beta: float, linear_beta: float):
        self.beta, self.linear_beta = beta, linear_beta

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        a, b = gate.float(), up.float()
        act = self.beta * torch.tanh(a / self.beta) * torch.sigmoid(a) * (self.linear_beta * torch.tanh(b / self.linear_beta))
        return act.to(gate.dtype)


def glu_activation(cfg) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The gated activation every FFN of ``cfg`` uses (dense, shared and routed experts)."""
    return SituGLU(cfg.situ_beta, cfg.situ_linear_beta) if cfg.hidden_act == "situ" else silu_glu


class GatedMLP(nn.Module):
    """Gated FFN: down(act(gate(x), up(x))). Used for dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int, act=silu_glu):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
