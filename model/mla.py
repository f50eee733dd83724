"""Multi-head Latent Attention (MODEL_SPEC §1.4, §2).

Owns one layer's MLA weights. Per token it writes exactly ``kv_lora_rank + qk_rope_head_dim``
values into the paged latent cache (the normed latent c^KV and the rotated rope key k^R) and
attends over the cache:

* ``absorbed`` (default): W_UK folded into the query, W_UV into the output — MQA with one
  576-wide key head whose value is the latent itself (§2.3).
* ``naive``: up-projects every cached latent to per-head K/V and runs ordinary MHA (§2.2). Kept as
  the oracle for the absorbed form.

Both use the same σ (qk_head_dim^-1/2 · mscale²). Rope may be None (NoPE, Kimi Linear / K3:
the rope dims enter the dot product unrotated, and cache entries do not depend on position).
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import AttnMeta, write_rows
from .config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding

MLA_IMPLS = ("absorbed", "naive")


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding | None):
        super().__init__()
        H, n = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads, self.d_nope, self.d_rope, self.d_v = n, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(H, n * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6)  # HF builds it without eps
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * cfg.v_head_dim, H, bias=False)
        # K3's gated MLA: o ← o ⊙ sigmoid(g_proj x) after W_UV, before o_proj (§3.10.1)
        self.g_proj = nn.Linear(H, n * cfg.v_head_dim, bias=False) if cfg.mla_output_gate else None
        self.rotary = rotary

    # ---- projections ----------------------------------------------------------
    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.n_heads, self.d_nope + self.d_v, self.kv_lora_rank)
        return w[:, : self.d_nope], w[:, self.d_nope :]  # [n, P, Lkv], [n, V, Lkv]

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        """x [T, H] → q_nope [T,n,P], q_rope [T,n,R], latent entry [T, Lkv+R] (normed c^KV ; k^R)."""
        T = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.n_heads, self.d_nope + self.d_rope)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.d_rope], dim=-1)
        c = self.kv_a_layernorm(c)
        if self.rotary is not None:
            cos, sin = rope
            q_rope = self.rotary(q_rope, cos, sin)
            k_rope = self.rotary(k_rope, cos, sin)
        return q_nope, q_rope, torch.cat([c, k_rope], dim=-1)

    # ---- attention over the cache ---------------------------------------------
    def forward(self, x: torch.Tensor, meta: AttnMeta, cache: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None, impl: str = "absorbed") -> torch.Tensor:
        """x [T, H] (normed); cache [slots, Lkv+R] of this layer (written in place). Projections and
        the cache write run over the flat tokens; attention runs per group of ``meta`` (padded to
        the group's longest query and context) and each group's outputs return to their tokens."""
        if impl not in MLA_IMPLS:
            raise ValueError(f"unknown MLA impl {impl!r}; choose one of {MLA_IMPLS}")
        attend = self._absorbed if impl == "absorbed" else self._naive
        q_nope, q_rope, entry = self.project(x, rope)
        cache[meta.slot_mapping] = entry.to(cache.dtype)
        o = None
        for g in meta.groups:
            ctx = cache[g.kv_slots].to(x.dtype)  # [Bg, Lg, Lkv+R]
            og = attend(q_nope[g.q_index], q_rope[g.q_index], ctx, g.mask)  # [Bg, Qg, n, V]
            og = og.flatten(0, 1)[g.q_rows]  # [Tg, n, V]
            if g.tokens is None:
                o = og  # the whole batch in order
            else:
                o = og.new_empty(x.shape[0], *og.shape[1:]) if o is None else o
                o[g.tokens] = og
        return self._out(o, x)

    def decode(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, latent: torch.Tensor,
               row: int, slot_mapping: torch.Tensor, kv_slots: torch.Tensor, mask: torch.Tensor,
               impl: str = "absorbed") -> torch.Tensor:
        """:meth:`forward` for a batch of B decodes (one query token each, the batch in order: the
        one-group step :func:`~model.cache.build_attn_meta` builds) from plain tensors: this layer's
        cache is ``latent[row]`` (the whole latent cache: written on it, :func:`~model.cache.write_rows`),
        ``kv_slots`` [B, L] and ``mask`` [B, 1, L] are that group's. The same ops on the same values as
        :meth:`forward`, without the group bookkeeping, so the compiled decode step
        (model/compiled.py) can trace it."""
        attend = self._absorbed if impl == "absorbed" else self._naive
        q_nope, q_rope, entry = self.project(x, rope)
        write_rows(latent, row, slot_mapping, entry)
        ctx = latent[row][kv_slots].to(x.dtype)  # [B, L, Lkv+R]
        return self._out(attend(q_nope[:, None], q_rope[:, None], ctx, mask), x)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The heads' outputs o [T, n, V] (or [T, 1, n, V]) → [T, H]: K3's output gate, then o_proj."""
        o = o.reshape(x.shape[0], -1)  # [T, n·V]
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _softmax(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = scores.float().masked_fill(~mask[:, None], float("-inf"))  # [B, n, Q, L]
        return scores.softmax(-1)

    def _absorbed(self, qn, qr, ctx, mask) -> torch.Tensor:
        w_uk, w_uv = self._w_uk_uv()
        c, k_rope = ctx.split([self.kv_lora_rank, self.d_rope], dim=-1)
        q_lat = torch.einsum("bqnp,npc->bqnc", qn, w_uk)  # [B, Q, n, Lkv]
        scores = (torch.einsum("bqnc,blc->bnql", q_lat, c) + torch.einsum("bqnr,blr->bnql", qr, k_rope)) * self.scale
        p = self._softmax(scores, mask).to(c.dtype)
        o_lat = torch.einsum("bnql,blc->bqnc", p, c)  # [B, Q, n, Lkv]
        return torch.einsum("bqnc,nvc->bqnv", o_lat, w_uv)

    def _naive(self, qn, qr, ctx, mask) -> torch.Tensor:
        B, L = ctx.shape[:2]
        c, k_rope = ctx.split([self.kv_lora_rank, self.d_rope], dim=-1)
        kv = self.kv_b_proj(c).view(B, L, self.n_heads, self.d_nope + self.d_v)
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, self.n_heads, -1)], dim=-1)
        q = torch.cat([qn, qr], dim=-1)
        scores = torch.einsum("bqnd,blnd->bnql", q, k) * self.scale
        p = self._softmax(scores, mask).to(v.dtype)
        return torch.einsum("bnql,blnv->bqnv", p, v)
