"""Mixture of experts: the noaux_tc gate, grouped routed experts and the MoE block (§1.7, §1.8).

:class:`RoutedExperts` owns the weights of some logical experts of one layer (``expert_ids``, in local
slot order: a contiguous range in one process, any set on an expert actor), stacked
``w13 [n, 2I, H]`` (gate rows then up rows) and ``w2 [n, H, I]``. It computes grouped: the
(token, expert) pairs are sorted by expert and each expert that received tokens runs one GEMM —
no loop over tokens, no work for idle experts.

:class:`MoE` calls ``self.routed(x, topk_idx, topk_w)`` for the routed part. In one process that
is its own :class:`RoutedExperts` (``routed is None``); a cluster sets it to a dispatcher that exchanges the
tokens with expert actors (parallelism is a transform applied afterwards).

:meth:`MoE.stages` is the same block as a generator that hands the routed part to its caller:
it yields ``Dispatch`` (start the exchange), computes the shared experts meanwhile, yields
``COMBINE`` and receives the routed rows. A caller driving several micro-batches' generators can
so run one micro-batch's attention while another's tokens are with the expert actors
(:func:`run_stages` is the one-micro-batch driver that :meth:`MoE.forward` uses).
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generator, Iterable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import GatedMLP, RMSNorm, glu_activation, silu_glu
from .threads import adopt_torch_threads


class RoutedFn(Protocol):
    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor: ...


class Gate(nn.Module):
    """Sigmoid router with selection-only bias and group-limited top-k, all in fp32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.bias_in_weights = cfg.gate_bias_in_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (topk_idx [T, k] long, topk_w [T, k] fp32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1 and self.topk_group < self.n_group:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
        idx = choice.topk(self.top_k, dim=-1).indices
        # standard noaux_tc: weights from the unbiased scores; the original Kimi Linear HF code
        # added the bias in place, so its weights are biased (§3.7) — reproduced only on request
        w = (scores + self.e_score_correction_bias.float() if self.bias_in_weights else scores).gather(1, idx)
        if self.top_k > 1 and self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling


def grouped_ffn(x: torch.Tensor, expert_ids: torch.Tensor, n: int,
                expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Rows of ``x`` [N, H] go through local expert ``expert_ids`` [N] (0..n-1); returns [N, H].

    Rows are sorted by expert; ``expert(e, rows [c, H]) -> [c, H]`` runs once per expert with rows."""
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    order = expert_ids.argsort(stable=True)
    counts = torch.bincount(expert_ids, minlength=n).tolist()
    xs = x[order]
    ys = torch.empty_like(xs)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        ys[start : start + c] = expert(e, xs[start : start + c])
        start += c
    out[order] = ys
    return out


def grouped_expert_ffn(x: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       threads: ExpertThreads | None = None) -> torch.Tensor:
    """:func:`grouped_ffn` over stacked dense weights: one GEMM pair per expert with rows.

    On CPU the pairs run as two grouped GEMMs (``torch._grouped_mm``, no Python loop over experts),
    which give every row bit for bit what its expert's own GEMM over the same rows gives: a row's
    result does not depend on the other experts in the call, nor on its position among its expert's
    rows, so an expert actor holding a shard computes what the single process computes for the same
    rows. It can depend on how many rows its expert has (the BLAS blocks a GEMM by its row count:
    MKL's fp32 GEMMs round a row differently at 1 row than at 2, bf16 ones past ~32 rows at larger
    hidden sizes) and on the intra-op thread count (docs/architecture.md, "Exactness"). With
    ``threads`` (w of them) the experts are cut into w contiguous
    ranges whose grouped GEMMs run at once, this thread running the first: the
    weights are read on w cores (a decode batch's expert GEMMs are bound by reading them), and
    torch releases the GIL inside each GEMM. Each row still meets its own expert's GEMM alone."""
    if _grouped_gemm(x, w13):
        if x.shape[0] == 0:
            return torch.empty_like(x)
        n = w13.shape[0]
        order = expert_ids.argsort(stable=True)
        ends = torch.cumsum(torch.bincount(expert_ids, minlength=n), 0)
        xs = x[order]
        ranges = [(0, n)] if threads is None else threads.ranges(n, x.shape[0])
        if len(ranges) == 1:
            ys = _grouped_pair(xs, ends, w13, w2, act)
        else:
            rows = [0] + ends[[hi - 1 for _, hi in ranges]].tolist()  # host tensor: no device sync
            jobs = [(xs[rows[i]: rows[i + 1]], ends[lo:hi] - rows[i], w13[lo:hi], w2[lo:hi], act)
                    for i, (lo, hi) in enumerate(ranges)]
            rest = [threads.pool.submit(_grouped_pair, *job) for job in jobs[1:]]
            ys = torch.cat([_grouped_pair(*jobs[0])] + [f.result() for f in rest])
        return torch.empty_like(x).index_copy_(0, order, ys)

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = (xs @ w13[e].t()).chunk(2, dim=-1)  # [c, 2I] → 2 × [c, I]
        return act(gate, up) @ w2[e].t()

    return grouped_ffn(x, expert_ids, w13.shape[0], expert)


def _grouped_pair(xs: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act) -> torch.Tensor:
    """Rows ``xs`` sorted by expert (expert e's end at ``ends[e]``) through their experts' GEMM pair.

    torch's grouped GEMM on CPU visits every expert of the call, rows or none (a slice, a select and a
    GEMM each: ~240 µs for 32 experts at 4 rows). A decode step's few rows go instead through a GEMM pair
    per expert that has rows — the same GEMM over the same rows as the grouped one makes for that
    expert, so the same bits (tests/model/test_moe.py checks it)."""
    if xs.shape[0] * FEW_ROWS <= w13.shape[0]:
        return _expert_pairs(xs, ends.tolist(), w13, w2, act)
    offs = ends.to(torch.int32)
    gate, up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(act(gate, up), w2.transpose(1, 2), offs=offs)


FEW_ROWS = 4  # rows × this ≤ the call's experts: a GEMM pair per expert with rows (_grouped_pair)


def _expert_pairs(xs: torch.Tensor, ends: list[int], w13: torch.Tensor, w2: torch.Tensor, act) -> torch.Tensor:
    """:func:`_grouped_pair` one expert with rows at a time."""
    out = torch.empty_like(xs)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            gate, up = (xs[start:end] @ w13[e].t()).chunk(2, dim=-1)
            out[start:end] = act(gate, up) @ w2[e].t()
            start = end
    return out


class ExpertThreads:
    """``count`` threads for the routed experts' GEMMs on CPU: the caller's and a pool of count - 1
    (see :func:`grouped_expert_ffn`). Best with one torch intra-op thread (``actor_threads`` 1): a torch
    pool under each of these threads would oversubscribe the cores, and on these small GEMMs its
    spinning costs more than it gives."""

    def __init__(self, count: int):
        if isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise ValueError(f"expert threads must be an integer >= 2 (1: no pool), got {count!r}")
        self.count = count
        self.pool = ThreadPoolExecutor(count - 1, thread_name_prefix="experts", initializer=adopt_torch_threads)

    MIN_ROWS = 16  # per thread: below it the hand-off costs more than the second core gives (measured)

    def ranges(self, n: int, rows: int) -> list[tuple[int, int]]:
        """``n`` experts as one contiguous range per thread, or one range when ``rows`` are too few."""
        w = max(1, min(n, self.count, rows // self.MIN_ROWS))
        cuts = [n * i // w for i in range(w + 1)]
        return list(zip(cuts, cuts[1:]))

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def attach_threads(modules: Iterable[nn.Module], threads: ExpertThreads | None) -> None:
    """Give every dense :class:`RoutedExperts` among ``modules`` these GEMM threads (None: one
    thread); a quantised module keeps its own path."""
    for m in modules:
        if isinstance(m, RoutedExperts):
            m.threads = threads


def _grouped_gemm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped GEMM serves this call: CPU, fp32 or bf16 (on GPU it wants other layouts and
    dtypes per architecture; the per-expert loop serves there)."""
    return (hasattr(torch, "_grouped_mm") and x.device.type == "cpu" and w.device.type == "cpu"
            and x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16))


class RoutedExperts(nn.Module):
    """Logical experts ``expert_ids`` of one MoE layer; local slot i holds ``expert_ids[i]``."""

    def __init__(self, hidden: int, intermediate: int, expert_ids: Sequence[int], act=silu_glu):
        super().__init__()
        self.expert_ids = tuple(int(e) for e in expert_ids)
        if len(set(self.expert_ids)) != len(self.expert_ids):
            raise ValueError(f"expert ids must be distinct, got {self.expert_ids}")
        n = len(self.expert_ids)
        self.w13 = nn.Parameter(torch.empty(n, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, intermediate))
        self.act = act
        self.threads: ExpertThreads | None = None  # set by the owner: its GEMMs over several threads

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.w13.dtype

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def grouped(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Row r of ``x`` [N, H] through local slot ``local_ids[r]``; returns [N, H] (unweighted)."""
        if _few(self, x, x.shape[0]):
            rows = list(range(x.shape[0]))
            return self._expert_rows(x, rows, local_ids.tolist(), rows, x.shape[0])
        return grouped_expert_ffn(x, local_ids, self.w13, self.w2, self.act, self.threads)

    def weight_bytes(self) -> int:
        """Bytes of the weights held (what an expert actor's memory is made of)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """Σ_j w_j · E_{idx_j}(x) over the selected experts that live here, summed as
        :func:`weighted_sum` sums (an expert held elsewhere adds nothing). x [T, H] → [T, H]."""
        T, k = topk_idx.shape
        if _few(self, x, T * k):
            return weighted_sum(self._few_rows(x, topk_idx).view(T, k, x.shape[1]), topk_w).to(x.dtype)
        flat = topk_idx.reshape(-1)
        ids = torch.tensor(self.expert_ids, dtype=torch.long, device=flat.device)
        lut = torch.full((max(self.expert_ids, default=-1) + 2,), -1, dtype=torch.long, device=flat.device)
        lut[ids] = torch.arange(len(ids), device=flat.device)  # logical → local slot, -1: not here
        local = lut[flat.clamp(max=lut.numel() - 1)]  # [T·k]
        pair = (local >= 0).nonzero().squeeze(1)  # (token, slot) pairs handled here
        if pair.numel() == T * k:  # every pair here: the rows in (token, slot) order as they are
            rows = self.grouped(x[pair // k], local)  # [T·k, H]
        else:
            rows = x.new_zeros(T * k, x.shape[1])  # a pair held elsewhere: a zero row, which adds nothing
            rows[pair] = self.grouped(x[pair // k], local[pair])
        return weighted_sum(rows.view(T, k, x.shape[1]), topk_w).to(x.dtype)


    def _few_rows(self, x: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """:meth:`forward`'s unweighted rows [T·k, H] (pair = token · k + slot; zero for a pair whose
        expert is held elsewhere) when the pairs are few (:meth:`_expert_rows`)."""
        T, k = topk_idx.shape
        slot = self._slots()
        pairs = [(p, slot[e]) for p, e in enumerate(topk_idx.reshape(-1).tolist()) if e in slot]
        return self._expert_rows(x, [p // k for p, _ in pairs], [s for _, s in pairs], [p for p, _ in pairs], T * k)

    def _expert_rows(self, x: torch.Tensor, src: list[int], slots: list[int], dst: list[int], n: int) -> torch.Tensor:
        """Row ``src[i]`` of ``x`` through local slot ``slots[i]`` into row ``dst[i]`` of the result [n, H]
        (rows no pair names: zero), for the few pairs of a decode step on CPU: the same GEMM pair per
        expert over the same rows, gathered in the same buffer at the same offsets, as
        :func:`grouped_expert_ffn` makes — so the same bits — with the pairs sorted on the host instead
        of by a dozen small tensor ops (look-up table, nonzero, argsort, bincount, cumsum: ~100 µs of
        dispatch a layer at 4 pairs, against ~40 µs of GEMMs). A loop over the experts with rows."""
        out = x.new_zeros(n, x.shape[1]) if len(dst) < n else x.new_empty(n, x.shape[1])
        if not dst:
            return out
        order = sorted(range(len(dst)), key=lambda i: (slots[i], dst[i]))  # by expert, then as sent
        xs = x[torch.tensor([src[i] for i in order], device=x.device)]
        ys = torch.empty_like(xs)
        w13t, w2t = self._transposed()
        act, inter = self.act, self.w2.shape[-1]
        start = 0
        for end in range(1, len(order) + 1):  # one GEMM pair per expert with rows (≤ experts / FEW_ROWS)
            e = slots[order[start]]
            if end == len(order) or slots[order[end]] != e:
                h = torch.mm(xs[start:end], w13t[e])  # [c, 2I]: gate columns, then up
                ys[start:end] = torch.mm(act(h[:, :inter], h[:, inter:]), w2t[e])
                start = end
        return out.index_copy_(0, torch.tensor([dst[i] for i in order], device=x.device), ys)

    def _slots(self) -> dict[int, int]:
        """Logical expert → local slot (cached per ``expert_ids``)."""
        cached = self.__dict__.get("_slot_cache")
        if cached is None or cached[0] is not self.expert_ids:
            cached = (self.expert_ids, {e: i for i, e in enumerate(self.expert_ids)})
            self.__dict__["_slot_cache"] = cached
        return cached[1]

    def _transposed(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each slot's ``w13[e].t()`` and ``w2[e].t()`` views (cached per weight tensor: a view shares
        its storage, so weights loaded in place show through; replaced ones rebuild the views)."""
        w13, w2 = self.w13, self.w2
        cached = self.__dict__.get("_views")
        if cached is None or cached[0] is not w13 or cached[1] is not w2:
            cached = (w13, w2, [w.t() for w in w13.detach()], [w.t() for w in w2.detach()])
            self.__dict__["_views"] = cached
        return cached[2], cached[3]


def _few(experts: nn.Module, x: torch.Tensor, rows: int) -> bool:
    """``rows`` rows of ``x`` take :meth:`RoutedExperts._expert_rows`: few for the experts held (a
    decode step's), dense weights (a quantised module borrows :meth:`RoutedExperts.forward` and keeps
    its own GEMMs), on CPU, in inference (its cached weight views carry no gradient)."""
    w13 = experts._parameters.get("w13")
    return (w13 is not None and rows * FEW_ROWS <= len(experts.expert_ids) and _grouped_gemm(x, w13)
            and not (w13.requires_grad and torch.is_grad_enabled()))


def weighted_sum(rows: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """Each token's routed output, summed in the one order every path uses: ``rows`` [T, k, H] (the k
    experts' unweighted rows, top-k slot order), ``topk_w`` [T, k] → [T, H] in ``rows``' dtype.

    y = Σ_j w_j · rows_j for j = 0 … k-1 in top-k order: each product in fp32 (a bf16 row widens
    exactly), added left to right from the j = 0 term in fp32, then cast to the compute dtype once.
    The single process, the in-process dispatcher and both layouts' combines (dense and sparse, any
    number of workers, replicated experts) all end here, so a token's sum does not depend on where its
    rows were computed: given the same expert rows, the same bits. Elementwise ops only (no
    ``index_add_``, no atomics), so also run to run deterministic on GPUs. A loop over k, not tokens."""
    T, k, H = rows.shape
    if k == 0:
        return rows.new_zeros(T, H)
    if rows.numel() <= SMALL_SUM:  # the k products in one op (fewer ops: decode's batches)
        return weighted_terms(rows, topk_w).to(rows.dtype)
    w = topk_w.to(rows.device, torch.float32)[..., None]  # [T, k, 1]
    acc = rows[:, 0].float() * w[:, 0]  # a product at a time: [T, H] fp32 temporaries (prefill's batches)
    for j in range(1, k):
        acc = acc + rows[:, j].float() * w[:, j]
    return acc.to(rows.dtype)


def weighted_terms(rows: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """:func:`weighted_sum` in fp32 (not cast back), the k products formed at once: [T, k, H], [T, k] → [T, H]."""
    terms = (rows.float() * topk_w.to(rows.device, torch.float32)[..., None]).unbind(1)  # each product rounded once
    if len(terms) == 1:
        return terms[0]
    acc = terms[0] + terms[1]
    for t in terms[2:]:  # (in place into the first sum: the same adds in the same order, fewer ops)
        acc.add_(t)
    return acc


SMALL_SUM = 1 << 18  # rows' elements up to which weighted_sum forms all k products at once (same bits either way)


def gather_experts(parts: Sequence[tuple[RoutedExperts, int]]) -> RoutedExperts:
    """A module holding ``parts[i] = (module, local slot)`` at local slot i, reusing held weights
    (an expert actor keeping the experts it already has across an epoch change). Works for any
    experts module whose tensors are all stacked per expert along dim 0 (dense or quantised)."""
    if not parts:
        raise ValueError("gather_experts needs at least one expert")
    first = parts[0][0]
    out = copy.copy(first)  # shallow: then every tensor is replaced, never shared with the sources
    out._parameters = {name: nn.Parameter(torch.cat([m._parameters[name][i : i + 1] for m, i in parts]),
                                          requires_grad=False)
                       for name in first._parameters}
    out._buffers = {name: torch.cat([m._buffers[name][i : i + 1] for m, i in parts]) for name in first._buffers}
    out.expert_ids = tuple(m.expert_ids[i] for m, i in parts)
    return out


class MoE(nn.Module):
    """gate → top-k → routed experts (via ``self.routed``) + shared experts.

    Latent MoE (K3, §3.10.5): the routed experts work in ``routed_expert_hidden_size``:
    x_lat = down(x); y_lat = Σ w·E(x_lat); y = up(norm(y_lat)). The routed function receives and
    returns the latent rows, so a dispatcher moves the narrower vectors and the sum over expert
    actors happens before the norm, as it must."""

    def __init__(self, cfg: ModelConfig, experts: range | None = None):
        super().__init__()
        act = glu_activation(cfg)
        H, He = cfg.hidden_size, cfg.expert_hidden_size
        self.gate = Gate(cfg)
        ids = range(cfg.n_routed_experts) if experts is None else experts
        self.experts = RoutedExperts(He, cfg.moe_intermediate_size, ids, act)
        self.shared_experts = (
            GatedMLP(H, cfg.moe_intermediate_size * cfg.n_shared_experts, act) if cfg.n_shared_experts else None
        )
        self.latent = cfg.routed_expert_hidden_size is not None
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(H, He, bias=False)
            self.routed_expert_up_proj = nn.Linear(He, H, bias=False)
            self.routed_expert_norm = RMSNorm(He, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.routed: RoutedFn | None = None  # None → the local experts

        self.layer = -1  # the decoder layer this block belongs to (set by the model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_stages(self.stages(x))

    def stages(self, x: torch.Tensor) -> Generator:
        """The block as a generator: yields :class:`Dispatch`, then ``COMBINE`` (receiving the
        routed rows ``[T, expert hidden]``, weighted and summed per token); returns the output."""
        x_r, idx, w = self.route(x)
        yield Dispatch(self, x_r, idx, w)
        shared = self.shared(x)
        y = yield COMBINE
        return self.finish(y, shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] → (the rows the routed experts receive [T, He], topk_idx [T, k], topk_w [T, k])."""
        idx, w = self.gate(x)
        return (self.routed_expert_down_proj(x) if self.latent else x), idx, w

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts(x) if self.shared_experts is not None else None

    def finish(self, y: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """The block's output from the combined routed rows ``y`` [T, He] and the shared experts' output."""
        if self.latent:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        return y if shared is None else y + shared


@dataclass(frozen=True)
class Dispatch:
    """A MoE block's request to route ``x`` [T, He] to experts ``topk_idx`` [T, k] with weights ``topk_w``."""

    moe: MoE
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor

    def local(self) -> torch.Tensor:
        """The routed rows computed where the block is told to (``moe.routed``) or by its own experts."""
        return (self.moe.routed or self.moe.experts)(self.x, self.topk_idx, self.topk_w)


COMBINE = "combine"


def run_stages(gen: Generator, issue=None, collect=None):
    """Drive one micro-batch's stages to the end, routing each :class:`Dispatch` in place — or, given
    ``issue`` (Dispatch → pending) and ``collect`` (pending → combined rows), through an exchange,
    each collected before the next is issued."""
    value, pending = None, None
    while True:
        try:
            req = gen.send(value)
        except StopIteration as stop:
            return stop.value
        if isinstance(req, Dispatch):
            pending, value = (req.local() if issue is None else issue(req)), None
        else:
            value, pending = (pending if collect is None else collect(pending)), None
