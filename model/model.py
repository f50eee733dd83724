"""The causal LMs, written for one device: DeepSeek-V3 / Kimi K2 (MODEL_SPEC §1.2) and the
Kimi Linear / K3 hybrid (§3.2, §3.10): KDA or MLA attention per layer, dense or (latent) MoE FFN,
and K3's block attention residuals.

Parameter names equal the Hugging Face checkpoint names, except the routed experts of a layer,
which are stacked (``<ffn>.experts.w13`` / ``<ffn>.experts.w2``); :func:`load_hf_weights` and
:func:`to_hf_tensors` translate. The model sees only ``(input_ids, AttnMeta, ModelCache)``; it
never decides which sequences run or where their cache lives.
"""

from __future__ import annotations

import re
import time

import torch
from torch import nn

from .cache import AttnMeta, KDAStateCache, LatentCache, ModelCache
from .compiled import CompiledDecode
from .decoder import DecoderLayer, attn_res, embedding
from .config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding
from .names import EXPERT_WEIGHT_NAMES, ffn_name
from .moe import MoE, RoutedExperts, run_stages
from .mtp import MTPLayer, mtp_hf_name

EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<which>w13|w2)$")


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding | None, experts: range | None):
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, experts) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)


class CausalLM(nn.Module):
    """``experts`` limits which routed experts this instance holds (``range(0)``: none, e.g. an
    attention actor whose MoE layers dispatch elsewhere)."""

    def __init__(self, cfg: ModelConfig, experts: range | None = None, *, mtp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.rotary = (
            None if cfg.rope.kind == "none" else RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave)
        )
        self.model = Backbone(cfg, self.rotary, experts)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the multi-token-prediction layer (model/mtp.py), only when asked: serving never reads it
        self.mtp = MTPLayer(cfg, self.rotary, experts) if mtp else None
        self.compiled = None  # its compiled decode step (model/compiled.py: compile_decode), when asked for

    def compile_decode(self, cache: ModelCache, impl: str = "absorbed", *, max_batch: int = 256,
                       warm_up: bool = True, whole: bool | None = None) -> CompiledDecode:
        """Run this model's decode steps over ``cache`` compiled (:class:`~model.compiled.CompiledDecode`),
        compiling now unless ``warm_up`` is False; returns the compiled step. ``whole``: also one graph
        for the whole step, routed experts in it, which :meth:`forward` runs (None: where this model
        holds every routed expert, dense; False for a model whose tokens an exchange routes)."""
        self.compiled = CompiledDecode(self, cache, impl, max_batch=max_batch, whole=whole)
        if warm_up:
            self.compiled.warm_up()
        return self.compiled

    def make_cache(self, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype,
                   device: str | torch.device = "cpu", num_snapshots: int = 0) -> ModelCache:
        """The cache this model needs: latent blocks for its MLA layers, KDA slots (and
        ``num_snapshots`` state snapshots, for prefix caching) for its KDA layers."""
        cfg = self.cfg
        mla, kda = cfg.mla_layers + ([self.mtp.index] if self.mtp is not None else []), cfg.kda_layers
        latent = LatentCache(len(mla), num_blocks, block_size, cfg.latent_dim, dtype, device) if mla else None
        states = None
        if kda:
            k = cfg.kda
            states = KDAStateCache(len(kda), num_slots, k.num_heads, k.head_dim, k.conv_kernel, dtype, device,
                                   num_snapshots=num_snapshots)
        return ModelCache(latent, states, {l: i for i, l in enumerate(mla)}, {l: i for i, l in enumerate(kda)})

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta, cache: ModelCache,
                impl: str = "absorbed") -> torch.Tensor:
        """input_ids [T] → final-normed hidden states [T, H], the routed experts this model's own."""
        c = self.compiled
        if c is not None and c.whole and impl == c.impl:
            d = c.covers(meta)
            if d is not None and c.takes_whole(d):  # one graph, the routed experts in it (model/compiled.py)
                return c.forward(input_ids, d, cache)
            return run_stages(self._stages(input_ids, meta, cache, impl, d))
        return run_stages(self.stages(input_ids, meta, cache, impl))

    def stages(self, input_ids: torch.Tensor, meta: AttnMeta, cache: ModelCache, impl: str = "absorbed"):
        """:meth:`forward` as a generator that yields at every MoE block's exchange
        (:class:`~model.moe.Dispatch`, then ``COMBINE``): the caller routes the tokens, and may run
        other micro-batches meanwhile. Returns the final-normed hidden states."""
        compiled = self.compiled is not None and impl == self.compiled.impl
        return (yield from self._stages(input_ids, meta, cache, impl, self.compiled.covers(meta) if compiled else None))

    def _stages(self, input_ids: torch.Tensor, meta: AttnMeta, cache: ModelCache, impl: str, d):
        """:meth:`stages`, ``d`` the compiled step's tensors when it covers ``meta`` (else None: eager)."""
        if d is not None:  # a decode step: the compiled segments (model/compiled.py)
            return (yield from self.compiled.stages(input_ids, d, cache))
        t = time.perf_counter()
        h = self.model.embed_tokens(input_ids)
        rope = None if self.rotary is None else self.rotary.cos_sin(meta.positions)
        if cache.times is not None:
            cache.times.add("embed_norm", time.perf_counter() - t)
        blocks: list[torch.Tensor] = []
        for layer in self.model.layers:
            h = yield from layer.stages(h, meta, cache, rope, impl, blocks)
        t = time.perf_counter()
        if self.cfg.attn_res_block_size:
            h = attn_res(blocks + [h], self.model.output_attn_res_norm, self.model.output_attn_res_proj)
        h = self.model.norm(h)
        if cache.times is not None:
            cache.times.add("embed_norm", time.perf_counter() - t)
        return h

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (h @ w.t()).float()

    def mtp_logits(self, next_ids: torch.Tensor, h: torch.Tensor, meta: AttnMeta, cache: ModelCache,
                   impl: str = "absorbed") -> torch.Tensor:
        """The MTP layer's logits for the token after next (see :class:`~model.mtp.MTPLayer`): ``h`` is
        :meth:`forward`'s output for the same ``meta``, ``next_ids`` the token after each position's."""
        if self.mtp is None:
            raise ValueError("this model was built without its MTP layer: CausalLM(cfg, mtp=True)")
        rope = None if self.rotary is None else self.rotary.cos_sin(meta.positions)
        return self.mtp(next_ids, h, meta, cache, rope, impl)

    def mtp_stages(self, next_ids: torch.Tensor, h: torch.Tensor, meta: AttnMeta, cache: ModelCache,
                   impl: str = "absorbed", rows: torch.Tensor | None = None):
        """:meth:`mtp_logits` as a generator that yields at the MTP layer's MoE exchange (as
        :meth:`stages` does); returns the logits (of ``rows`` only, when given)."""
        if self.mtp is None:
            raise ValueError("this model was built without its MTP layer: CausalLM(cfg, mtp=True)")
        rope = None if self.rotary is None else self.rotary.cos_sin(meta.positions)
        return (yield from self.mtp.stages(next_ids, h, meta, cache, rope, impl, rows))

    def moe_blocks(self) -> dict[int, MoE]:
        """Decoder layer → its MoE block (the MTP layer's too, when the model holds it)."""
        out = {l.index: l.ffn for l in self.model.layers if isinstance(l.ffn, MoE)}
        if self.mtp is not None and isinstance(self.mtp.layer.ffn, MoE):
            out[self.mtp.index] = self.mtp.layer.ffn
        return out


def _expert_names(cfg: ModelConfig, prefix: str, e: int) -> tuple[str, str, str]:
    """Checkpoint names of expert ``e``'s (gate, up, down) weights."""
    return tuple(f"{prefix}.{e}.{p}.weight" for p in EXPERT_WEIGHT_NAMES[cfg.family])


def experts_prefix(cfg: ModelConfig, layer: int) -> str:
    """Checkpoint name prefix of a MoE layer's routed experts."""
    return f"model.layers.{layer}.{ffn_name(cfg, layer)}.experts"


@torch.no_grad()
def fill_experts(experts: RoutedExperts, cfg: ModelConfig, prefix: str, tensors: dict[str, torch.Tensor]) -> None:
    """Stack the per-expert checkpoint tensors of ``experts.expert_ids`` into ``w13`` / ``w2``."""
    I = experts.w2.shape[-1]
    for j, e in enumerate(experts.expert_ids):
        gate, up, down = _expert_names(cfg, prefix, e)
        experts.w13[j, :I].copy_(tensors[gate])
        experts.w13[j, I:].copy_(tensors[up])
        experts.w2[j].copy_(tensors[down])


def hf_name(model: CausalLM, name: str) -> str:
    """A parameter's (or an expert prefix's) checkpoint name: the MTP layer's are ``model.layers.{N}.*``."""
    return mtp_hf_name(name, model.mtp.index) if name.startswith("mtp.") else name


@torch.no_grad()
def load_hf_weights(model: CausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors (HF logical names, already dequantised) into the model.

    The checkpoint reader has validated names and shapes; a gap here is a bug, hence ``KeyError``."""
    for name, p in model.named_parameters():
        m = EXPERT_PARAM.match(name)
        if m is None:
            p.copy_(tensors[hf_name(model, name)])
        elif m["which"] == "w13":  # w2 is filled together with w13
            fill_experts(model.get_submodule(m["prefix"]), model.cfg, hf_name(model, m["prefix"]), tensors)


@torch.no_grad()
def to_hf_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under the checkpoint's names (per-expert tensors unstacked)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        m = EXPERT_PARAM.match(name)
        if m is None:
            out[hf_name(model, name)] = p.detach().clone()
            continue
        experts = model.get_submodule(m["prefix"])
        I = experts.w2.shape[-1]
        for j, e in enumerate(experts.expert_ids):
            gate, up, down = _expert_names(model.cfg, hf_name(model, m["prefix"]), e)
            if m["which"] == "w13":
                out[gate], out[up] = p[j, :I].clone(), p[j, I:].clone()
            else:
                out[down] = p[j].clone()
    return out


@torch.no_grad()
def init_random_weights(model: CausalLM, seed: int, std: float = 0.02) -> None:
    """Seeded random weights for the presets: normal(0, std) matrices, norms near 1, a small
    random selection bias (so the bias path is exercised), KDA decay parameters in the ranges
    fla initialises them to."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("e_score_correction_bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        elif name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=g) * 2.7)  # exp(A_log) in [1, 16)
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        elif name.endswith("conv1d.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        elif p.dim() == 1:
            p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.05)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * std)
