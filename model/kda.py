"""Kimi Delta Attention (MODEL_SPEC §3.3–3.6, §3.10 items 2–3).

Owns one layer's KDA weights (named as the checkpoint's ``self_attn.*`` tensors) and the math:
the short causal conv, the channel-wise forget gate, the gated delta rule (recurrent form for
decode, chunked form for prefill) and the gated output norm.

It does not own its caches. The caller hands in this layer's two state tensors, indexed by a
per-sequence *slot*:

* ``conv_state``      [num_slots, 3, W-1, P]: the last W-1 conv *inputs* of the q, k and v streams,
  oldest first;
* ``recurrent_state`` [num_slots, n_h, d_k, d_v] fp32: the delta-rule state S (fla's [K, V] layout).

``forward`` reads and rewrites, in place, only the rows ``slots`` of the batch. It never
allocates, frees or zeroes a slot: a new sequence's slot must arrive zeroed (zero = no history).

The chunked and recurrent kernels are pure functions of fp32 tensors, kept side by side so that
each is the other's oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import AttnGroup, AttnMeta, write_rows
from .config import ModelConfig

L2NORM_EPS = 1e-6  # inside the sqrt, as fla's l2norm


# The chunked form's chunk length. Chunks start at the call's first token, so two prefills split at a
# multiple of it run the same per-chunk arithmetic as one (prefix caching's snapshot grid relies on it).
KDA_CHUNK = 64


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) over the last dim, in fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def kda_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None) -> torch.Tensor:
    """Log-space forget gate g [..., n_h, d] fp32 from g_raw [..., n_h, d].

    ``A_log`` holds one value per head (any shape with n_h elements), ``dt_bias`` one per channel
    [n_h·d]. Kimi Linear (lower_bound None): g = −exp(A_log_h)·softplus(g_raw + dt_bias), ≤ 0.
    K3: g = lower_bound·sigmoid(exp(A_log_h)·(g_raw + dt_bias)) ∈ (lower_bound, 0).
    """
    n_h, d = g_raw.shape[-2:]
    a = A_log.float().reshape(n_h, 1).exp()  # [n_h, 1]
    x = g_raw.float() + dt_bias.float().view(n_h, d)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor | None, states: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (§3.4), vectorised over batch and heads.

    q, k [B, T, H, K] (already L2-normed; q already scaled); v [B, T, H, V]; g [B, T, H, K] log
    decay; beta [B, T, H]; state [B, H, K, V] or None (zeros). Returns o [B, T, H, V] fp32
    and the final state [B, H, K, V] fp32. Meant for decode (T == 1), and for a decode with drafts
    (speculative decoding): ``states``, when given, gets the state after each token.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if state is None else state.float()
    out = []
    for t in range(T):
        S = S * g[:, t, :, :, None].exp()                             # row i scaled by α_t[i]
        k_t = k[:, t]                                                  # [B, H, K]
        u = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)            # prediction error [B, H, V]
        S = S + beta[:, t, :, None, None] * k_t[..., :, None] * u[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        if states is not None:
            states.append(S)
    o = torch.stack(out, dim=1) if out else v.new_zeros(B, 0, H, V)
    return o, S


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None, chunk_size: int = KDA_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence in chunks of ``chunk_size`` (§3.4 chunked form), for prefill.

    Arguments and results as :func:`recurrent_kda`; any T (padded internally with steps that
    leave the state unchanged: g = 0, β = 0, k = 0). Within a chunk Γ_r = Σ_{s≤r} g_s, and
    L[r,s] = β_r Σ_i k_r[i] k_s[i] exp(Γ_r[i] − Γ_s[i]) (s < r); (I + L)⁻¹ is applied by a
    triangular solve. Loops over chunks only; each step holds a [B, H, C, C, K] decay tensor.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    B, T, H, K = k.shape
    V, C = v.shape[-1], chunk_size
    pad = (-T) % C
    N = (T + pad) // C

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, X] → [B, H, N, C, X] fp32
        x = F.pad(x.float().transpose(1, 2), (0, 0, 0, pad))
        return x.reshape(B, H, N, C, x.shape[-1])

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta[..., None]))
    S = q.new_zeros(B, H, K, V) if state is None else state.float()
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    o = q.new_empty(B, H, N, C, V)
    for n in range(N):
        q_c, k_c, v_c, b_c = q[:, :, n], k[:, :, n], v[:, :, n], beta[:, :, n]  # [B, H, C, *]
        gam = g[:, :, n].cumsum(-2)                                             # Γ [B, H, C, K]
        # exp(Γ_r − Γ_s) for s ≤ r, exactly 0 above the diagonal (masked before exp: no overflow)
        diff = gam[..., :, None, :] - gam[..., None, :, :]                      # [B, H, C(r), C(s), K]
        decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()
        kk = torch.einsum("bhrk,bhrsk,bhsk->bhrs", k_c, decay, k_c)
        qk = torch.einsum("bhrk,bhrsk,bhsk->bhrs", q_c, decay, k_c)            # diagonal included
        A = eye + (b_c * kk).tril(-1)                                           # I + L
        # WY vectors: [w | u] = (I + L)⁻¹ Diag(β) [exp(Γ) ⊙ K | V]
        wu = torch.linalg.solve_triangular(A, b_c * torch.cat([gam.exp() * k_c, v_c], -1),
                                           upper=False, unitriangular=True)
        w, u = wu.split([K, V], dim=-1)
        v_new = u - w @ S                                                       # ṽ [B, H, C, V]
        o[:, :, n] = (q_c * gam.exp()) @ S + qk @ v_new
        last = gam[..., -1:, :]                                                 # Γ_C [B, H, 1, K]
        S = last.transpose(-1, -2).exp() * S + ((last - gam).exp() * k_c).transpose(-1, -2) @ v_new
    o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o, S


class GatedRMSNorm(nn.Module):
    """``o_norm``: RMSNorm over one head's d channels, times sigmoid(gate). All in fp32 with the
    weight in fp32 (fla ``FusedRMSNormGated``), cast back to the input dtype at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.float() * h * torch.sigmoid(gate.float())
        return h.to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """One KDA layer. Parameter names match the checkpoint's ``model.layers.N.self_attn.*``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.kda is None:
            raise ValueError("KimiDeltaAttention needs config field 'linear_attn_config' (cfg.kda is None)")
        kda = cfg.kda
        H, n, d, W = cfg.hidden_size, kda.num_heads, kda.head_dim, kda.conv_kernel
        P = n * d
        self.num_heads, self.head_dim, self.conv_kernel = n, d, W
        self.lower_bound = kda.gate_lower_bound
        self.full_rank_gate = kda.full_rank_gate
        self.q_proj = nn.Linear(H, P, bias=False)
        self.k_proj = nn.Linear(H, P, bias=False)
        self.v_proj = nn.Linear(H, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)  # weight [P, 1, W]
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        # Kimi Linear stores A_log as [1, 1, n_h, 1]; K3 as [n_h]
        a_shape = (1, 1, n, 1) if self.lower_bound is None else (n,)
        self.A_log = nn.Parameter(torch.zeros(a_shape, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        self.f_a_proj = nn.Linear(H, d, bias=False)
        self.f_b_proj = nn.Linear(d, P, bias=False)
        self.b_proj = nn.Linear(H, n, bias=False)
        if self.full_rank_gate:
            self.g_proj = nn.Linear(H, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(H, d, bias=False)
            self.g_b_proj = nn.Linear(d, P, bias=False)
        self.o_norm = GatedRMSNorm(d, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(P, H, bias=False)

    # ---- per-token pieces ------------------------------------------------------
    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] → log-space forget gate g [T, n_h, d] fp32."""
        g_raw = self.f_b_proj(self.f_a_proj(x)).view(x.shape[0], self.num_heads, self.head_dim)
        return kda_gate(g_raw, self.A_log, self.dt_bias, self.lower_bound)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] → gate pre-activation z [T, n_h, d] of the output norm."""
        z = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        return z.view(x.shape[0], self.num_heads, self.head_dim)

    def _conv(self, x: torch.Tensor, q_lens: torch.Tensor, conv_state: torch.Tensor,
              slots: torch.Tensor, row: int | None = None) -> torch.Tensor:
        """Causal depthwise conv + SiLU of x [B, 3, Q, P] (pads zero) with each sequence's W−1
        previous inputs prepended; rewrites ``conv_state[slots]`` with the W−1 inputs ending at
        each sequence's last real token (old state included when q_len < W−1). With ``row``,
        ``conv_state`` is every layer's and this layer's is its ``row`` (written on the whole)."""
        B, _, Q, P = x.shape
        W = self.conv_kernel
        state = conv_state if row is None else conv_state[row]
        hist = torch.cat([state[slots].to(x.dtype), x], dim=2)  # [B, 3, W-1+Q, P]
        weight = torch.stack([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
        weight = weight.to(x.dtype)[None, :, None]                     # [1, 3, 1, P, W]
        # y_t = Σ_j w[:, j] · x_{t−W+1+j}; x_t sits at hist index W−1+t
        y = sum(hist[:, :, j : j + Q] * weight[..., j] for j in range(W))
        idx = q_lens[:, None] + torch.arange(W - 1, device=x.device)    # [B, W-1] into hist
        new = hist.gather(2, idx[:, None, :, None].expand(B, 3, W - 1, P))
        if row is None:
            conv_state[slots] = new.to(conv_state.dtype)
        else:
            write_rows(conv_state, row, slots, new)
        return F.silu(y)

    # ---- the layer ---------------------------------------------------------------
    def _attend(self, grp: AttnGroup, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                conv_state: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor,
                keep: list | None = None) -> torch.Tensor:
        """Conv and delta rule of one group, padded [Bg, Qg]; the outputs [Tg, n, d] fp32 of its
        real queries (``grp.q_rows`` order). Updates the group's state rows ``slots`` in place. A
        group of sequences with drafts (``grp.verify``) runs the recurrent form, token by token as
        decoding would, and appends to ``keep`` what going back to an earlier token needs."""
        B, Q = grp.q_index.shape
        n, d = self.num_heads, self.head_dim
        pad0 = grp.q_valid[..., None, None].to(torch.float32)          # [B, Q, 1, 1]; 0 on pads
        q_lens = grp.q_valid.sum(1)                                     # [B]
        x = qkv[grp.q_index] * pad0.to(qkv.dtype)                       # [B, Q, 3, P]
        if grp.verify and keep is not None:
            hist = torch.cat([conv_state[slots].to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, 3, W-1+Q, P]
        x = self._conv(x.transpose(1, 2), q_lens, conv_state, slots)   # [B, 3, Q, P]
        q, k, v = (x[:, i].reshape(B, Q, n, d) for i in range(3))
        q = l2norm(q) * d**-0.5
        k = l2norm(k) * pad0                                            # pads: k = 0
        v = v.float()
        g = g[grp.q_index] * pad0                                       # [B, Q, n, d]; pads: g = 0
        beta = beta[grp.q_index] * pad0[..., 0]                         # [B, Q, n]; pads: 0
        if grp.verify:
            states = [] if keep is not None else None
            o, S = recurrent_kda(q, k, v, g, beta, recurrent_state[slots], states)
            if keep is not None:
                keep.append((slots, torch.stack(states, dim=1), hist))
        else:
            kernel = recurrent_kda if all(ql == 1 for ql in grp.query_lens) else chunk_kda
            o, S = kernel(q, k, v, g, beta, recurrent_state[slots])
        recurrent_state[slots] = S
        return o.flatten(0, 1)[grp.q_rows]

    def forward(self, x: torch.Tensor, meta: AttnMeta, conv_state: torch.Tensor,
                recurrent_state: torch.Tensor, slots: torch.Tensor, keep: list | None = None) -> torch.Tensor:
        """x [T, H] (normed) → [T, H]. Sequence b's states live in row ``slots[b]`` of
        ``conv_state`` [num_slots, 3, W−1, P] and ``recurrent_state`` [num_slots, n_h, d, d] fp32;
        both are updated in place. Projections run over the flat tokens; the conv and the delta
        rule per attention group of ``meta`` (recurrent for a group of decodes or of sequences with
        drafts, whose per-token states go to ``keep``; chunked otherwise)."""
        T = x.shape[0]
        n, d, W = self.num_heads, self.head_dim, self.conv_kernel
        B = len(meta.query_lens)
        assert slots.shape == (B,), f"slots {tuple(slots.shape)} != batch ({B},)"
        assert conv_state.shape[1:] == (3, W - 1, n * d), f"conv_state {tuple(conv_state.shape)}"
        assert recurrent_state.shape[1:] == (n, d, d) and recurrent_state.dtype == torch.float32, \
            f"recurrent_state {tuple(recurrent_state.shape)} {recurrent_state.dtype}"
        qkv = torch.stack([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=1)  # [T, 3, P]
        g = self.gate(x)                                                 # [T, n, d]
        beta = torch.sigmoid(self.b_proj(x).float())                    # [T, n]
        o = None
        for grp in meta.groups:  # sequences of similar query length (decodes together)
            grp_slots = slots if grp.seqs is None else slots[grp.seqs]
            og = self._attend(grp, qkv, g, beta, conv_state, recurrent_state, grp_slots, keep)  # [Tg, n, d]
            if grp.tokens is None:
                o = og  # the whole batch in order
            else:
                o = og.new_empty(T, n, d) if o is None else o
                o[grp.tokens] = og
        return self._out(o, x)

    def decode(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor, row: int,
               slots: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for a batch of B decodes (one token each, the batch in order: the one
        group :func:`~model.cache.build_attn_meta` builds) from plain tensors, for the compiled
        decode step (model/compiled.py): the recurrent form over the same values as
        :meth:`_attend` (its pads are none here: multiplying by its all-ones pad mask is exact).
        ``conv_state`` and ``recurrent_state`` are every KDA layer's; this layer's are their ``row``
        (written on the whole tensors: :func:`~model.cache.write_rows`)."""
        B = x.shape[0]
        n, d = self.num_heads, self.head_dim
        qkv = torch.stack([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=1)  # [B, 3, P]
        g = self.gate(x)[:, None]                                        # [B, 1, n, d] fp32
        beta = torch.sigmoid(self.b_proj(x).float())[:, None]            # [B, 1, n]
        ones = torch.ones(B, dtype=torch.long, device=x.device)
        xc = self._conv(qkv[:, None].transpose(1, 2), ones, conv_state, slots, row)  # [B, 3, 1, P]
        q, k, v = (xc[:, i].reshape(B, 1, n, d) for i in range(3))
        q = l2norm(q) * d**-0.5
        k = l2norm(k).float()  # as _attend's k · pad0 (fp32 ones)
        o, S = recurrent_kda(q, k, v.float(), g, beta, recurrent_state[row][slots])
        write_rows(recurrent_state, row, slots, S)
        return self._out(o.flatten(0, 1), x)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The heads' outputs o [T, n, d] fp32 → [T, H]: the gated output norm, then o_proj."""
        o = self.o_norm(o.to(x.dtype), self.output_gate(x))
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.head_dim))
