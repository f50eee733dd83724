"""The DeepSeek-V3 / Kimi K2 causal LM, written for one device (MODEL_SPEC §1.2).

Parameter names equal the Hugging Face checkpoint names, except the routed experts of a layer,
which are stacked (``mlp.experts.w13`` / ``mlp.experts.w2``); :func:`load_hf_weights` and
:func:`to_hf_tensors` translate. The model sees only ``(input_ids, AttnMeta, cache)``; it never
decides which sequences run or where their cache lives.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .cache import AttnMeta, LatentCache
from .config import ModelConfig
from .layers import GatedMLP, RMSNorm, RotaryEmbedding
from .mla import MLA
from .moe import MoE

EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<which>w13|w2)$")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, rotary: RotaryEmbedding | None, experts: range | None):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, rotary)
        self.mlp = MoE(cfg, experts) if cfg.is_moe_layer(index) else GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, meta: AttnMeta, cache: torch.Tensor, rope, impl: str) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), meta, cache, rope, impl)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding | None, experts: range | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, experts) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``experts`` limits which routed experts this instance holds (``range(0)``: none, e.g. an
    attention actor whose MoE layers dispatch elsewhere)."""

    def __init__(self, cfg: ModelConfig, experts: range | None = None):
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave)
        self.model = Backbone(cfg, self.rotary, experts)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def num_cache_layers(self) -> int:
        return len(self.model.layers)

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta, cache: LatentCache,
                impl: str = "absorbed") -> torch.Tensor:
        """input_ids [T] → final-normed hidden states [T, H]."""
        h = self.model.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(meta.positions)
        for layer in self.model.layers:
            h = layer(h, meta, cache.layer(layer.index), rope, impl)
        return self.model.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (h @ w.t()).float()

    def moe_blocks(self) -> dict[int, MoE]:
        return {l.index: l.mlp for l in self.model.layers if isinstance(l.mlp, MoE)}


def _expert_names(prefix: str, e: int) -> tuple[str, str, str]:
    return tuple(f"{prefix}.{e}.{p}_proj.weight" for p in ("gate", "up", "down"))


@torch.no_grad()
def load_hf_weights(model: CausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors (HF logical names, already dequantised) into the model.

    The checkpoint reader has validated names and shapes; a gap here is a bug, hence ``KeyError``."""
    for name, p in model.named_parameters():
        m = EXPERT_PARAM.match(name)
        if m is None:
            p.copy_(tensors[name])
            continue
        experts = model.get_submodule(m["prefix"])
        I = experts.w2.shape[-1]
        for j, e in enumerate(range(experts.lo, experts.hi)):
            gate, up, down = _expert_names(m["prefix"], e)
            if m["which"] == "w13":
                p[j, :I].copy_(tensors[gate])
                p[j, I:].copy_(tensors[up])
            else:
                p[j].copy_(tensors[down])


@torch.no_grad()
def to_hf_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under the checkpoint's names (per-expert tensors unstacked)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        m = EXPERT_PARAM.match(name)
        if m is None:
            out[name] = p.detach().clone()
            continue
        experts = model.get_submodule(m["prefix"])
        I = experts.w2.shape[-1]
        for j, e in enumerate(range(experts.lo, experts.hi)):
            gate, up, down = _expert_names(m["prefix"], e)
            if m["which"] == "w13":
                out[gate], out[up] = p[j, :I].clone(), p[j, I:].clone()
            else:
                out[down] = p[j].clone()
    return out


@torch.no_grad()
def init_random_weights(model: CausalLM, seed: int, std: float = 0.02) -> None:
    """Seeded random weights for the presets: normal(0, std) matrices, norms near 1, a small
    random selection bias (so the bias path is exercised)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("e_score_correction_bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        elif p.dim() == 1:
            p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.05)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * std)
