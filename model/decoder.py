"""One decoder layer of the causal LMs (MLA or KDA attention, then a dense or MoE FFN, K3's block
attention residuals around them), the shared embedding builder, and the attention residual: what
both the main model (:mod:`model.model`) and DeepSeek's MTP layer (:mod:`model.mtp`) are made of,
in a module of its own so that neither imports the other for it."""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from .cache import AttnMeta, ModelCache
from .config import ModelConfig
from .kda import KimiDeltaAttention
from .layers import GatedMLP, RMSNorm, RotaryEmbedding, glu_activation
from .mla import MLA
from .moe import MoE
from .names import ffn_name
from .timing import StepTimes


def attn_res(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """K3's attention residual AR(sources): softmax over sources of a learned query
    (norm.weight ⊙ proj.weight) against each RMS-normalised source; returns Σ p_i v_i (§3.10.6)."""
    v = torch.stack(sources).float()  # [m, T, H]
    kappa = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps)
    query = norm.weight.float() * proj.weight[0].float()  # [H]
    p = (kappa @ query).softmax(0)  # [m, T]
    return (p[..., None] * v).sum(0).to(sources[0].dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, rotary: RotaryEmbedding | None, experts: range | None):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.index, self.is_kda = index, cfg.is_kda_layer(index)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = KimiDeltaAttention(cfg) if self.is_kda else MLA(cfg, rotary)
        self.ffn_name = ffn_name(cfg, index)
        ffn = MoE(cfg, experts) if cfg.is_moe_layer(index) else GatedMLP(H, cfg.intermediate_size, glu_activation(cfg))
        if isinstance(ffn, MoE):
            ffn.layer = index
        setattr(self, self.ffn_name, ffn)
        self.block_size = cfg.attn_res_block_size
        if self.block_size:  # K3 block attention residuals
            self.self_attention_res_norm = RMSNorm(H, eps)
            self.self_attention_res_proj = nn.Linear(H, 1, bias=False)
            self.mlp_res_norm = RMSNorm(H, eps)
            self.mlp_res_proj = nn.Linear(H, 1, bias=False)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_name)

    def attend(self, x: torch.Tensor, meta: AttnMeta, cache: ModelCache, rope, impl: str) -> torch.Tensor:
        if self.is_kda:
            conv, recurrent = cache.kda_layer(self.index)
            keep = cache.kda.keep(cache.kda_index[self.index]) if meta.verifying else None
            return self.self_attn(x, meta, conv, recurrent, meta.state_slots, keep)
        return self.self_attn(x, meta, cache.mla_layer(self.index), rope, impl)

    def ffn_stages(self, x: torch.Tensor):
        """The FFN as stages: a MoE block yields at its exchange, a dense MLP just returns."""
        if isinstance(self.ffn, MoE):
            return (yield from self.ffn.stages(x))
        return self.ffn(x)

    def stages(self, h: torch.Tensor, meta: AttnMeta, cache: ModelCache, rope, impl: str,
               blocks: list[torch.Tensor]):
        """The layer as a generator (see :meth:`MoE.stages`); returns the new hidden states. With
        ``cache.times`` (model/timing.py), what comes before the FFN is timed as the layer's attention
        (``mla`` or ``kda``), the FFN as ``moe_local`` or ``dense_mlp`` while it runs."""
        times = cache.times
        t = time.perf_counter() if times is not None else 0.0
        residual, x = self.pre_ffn(h, blocks, lambda x: self.attend(x, meta, cache, rope, impl))
        return residual + (yield from self._ffn_timed(x, times, t))

    def pre_ffn(self, h: torch.Tensor, blocks: list[torch.Tensor],
                attend: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before the FFN, attention by ``attend`` (normed x → its output): returns (the
        residual the FFN's output is added to, the FFN's input). The eager step and the compiled
        decode step (model/compiled.py) both run it."""
        if not self.block_size:
            h = h + attend(self.input_layernorm(h))
            return h, self.post_attention_layernorm(h)
        # K3 block attention residuals: ``blocks`` holds the block-start snapshots (appended here)
        x = attn_res(blocks + [h], self.self_attention_res_norm, self.self_attention_res_proj) if blocks else h
        prefix = None
        if self.index % self.block_size == 0:
            blocks.append(h)
        else:
            prefix = h
        a = attend(self.input_layernorm(x))
        prefix = a if prefix is None else prefix + a
        x = attn_res(blocks + [prefix], self.mlp_res_norm, self.mlp_res_proj)
        return prefix, self.post_attention_layernorm(x)

    def _ffn_timed(self, x: torch.Tensor, times: StepTimes | None, t0: float):
        if times is None:
            return (yield from self.ffn_stages(x))
        times.add("kda" if self.is_kda else "mla", time.perf_counter() - t0)
        return (yield from times.stages("moe_local" if isinstance(self.ffn, MoE) else "dense_mlp", self.ffn_stages(x)))


def embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table; built on the meta device (a checkpoint fills it) without its random init,
    whose normal_ on meta tensors imports torch._dynamo: 1.7 s of every actor's start."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)
