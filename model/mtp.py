"""DeepSeek-V3's multi-token-prediction layer (``num_nextn_predict_layers: 1``), as checkpoints ship it.

The layer after the decoder (``model.layers.{N}``, N = ``num_hidden_layers``) guesses the token after
next. For position i it takes the main model's final-normed hidden state h_i and the embedding of the
next token t_{i+1}::

    x_i = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])      # [H] from [2H]
    y_i = DecoderLayer_N(x_i)                                # one MLA + MoE layer, its own cache
    logits_i = shared_head.head(shared_head.norm(y_i))       # guesses t_{i+2}

at position i's position (as vLLM's DeepSeek MTP runs it). Its tensors, under the checkpoint's names:
``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head`` and one
decoder layer's (``self_attn.*``, ``mlp.*``, the two layer norms) — all under ``model.layers.{N}.``.
:class:`~model.model.CausalLM` holds it as ``mtp`` only when asked (``CausalLM(cfg, mtp=True)``): serving
the main model never reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import AttnMeta, ModelCache
from .config import ModelConfig
from .decoder import DecoderLayer, embedding
from .layers import RMSNorm, RotaryEmbedding
from .moe import run_stages


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding | None, experts: range | None):
        super().__init__()
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("the config declares no MTP layer (num_nextn_predict_layers is 0)")
        if cfg.family != "deepseek_v3":
            raise ValueError(f"an MTP layer is DeepSeek-V3's (MLA decoder layers); this config is {cfg.model_type!r}")
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.index = cfg.num_hidden_layers
        self.embed_tokens = embedding(cfg.vocab_size, H)
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = DecoderLayer(cfg, self.index, rotary, experts)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, eps)
        self.shared_head.head = nn.Linear(H, cfg.vocab_size, bias=False)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, meta: AttnMeta, cache: ModelCache,
                rope, impl: str = "absorbed") -> torch.Tensor:
        """next_ids [T] (t_{i+1} for each position i), hidden [T, H] (the main model's final-normed h_i)
        → logits [T, V] (fp32) for t_{i+2}."""
        return run_stages(self.stages(next_ids, hidden, meta, cache, rope, impl))

    def stages(self, next_ids: torch.Tensor, hidden: torch.Tensor, meta: AttnMeta, cache: ModelCache,
               rope, impl: str = "absorbed", rows: torch.Tensor | None = None):
        """:meth:`forward` as a generator yielding at its MoE exchange (:meth:`MoE.stages`); with
        ``rows``, the logits of those positions only (the head is a vocabulary-wide GEMM)."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(next_ids)), self.hnorm(hidden)], dim=-1))
        y = yield from self.layer.stages(x, meta, cache, rope, impl, [])
        if rows is not None:
            y = y[rows]
        return (self.shared_head.norm(y) @ self.shared_head.head.weight.t()).float()


def mtp_hf_name(name: str, index: int) -> str:
    """``mtp.X`` (the model's parameter name) → ``model.layers.{index}.X`` (the checkpoint's)."""
    rest = name.removeprefix("mtp.").removeprefix("layer.")
    return f"model.layers.{index}.{rest}"


def mtp_shared_names(index: int) -> dict[str, str]:
    """{MTP layer's checkpoint name: the main model's} for the two tensors DeepSeek-V3's MTP module
    shares with the main model, its embedding and its output head (V3 report §2.2); a checkpoint
    stores them under both names."""
    p = f"model.layers.{index}."
    return {p + "embed_tokens.weight": "model.embed_tokens.weight", p + "shared_head.head.weight": "lm_head.weight"}


def with_shared_mtp_tensors(tensors: dict, index: int) -> dict:
    """``tensors`` (checkpoint names) with the MTP layer's copies of the shared embedding and head
    added, as a checkpoint stores them; an error if it already has its own."""
    shared = mtp_shared_names(index)
    if own := sorted(shared.keys() & tensors.keys()):
        raise ValueError(f"the MTP layer already has its own {', '.join(own)}: not shared with the main model")
    return tensors | {mtp_name: tensors[main_name].clone() for mtp_name, main_name in shared.items()}
