"""The compiled decode step: a decode batch's compute between MoE exchanges, compiled (torch.compile).

A decode step (every sequence one new token: the one attention group
:func:`~model.cache.build_attn_meta` builds; or a step verifying drafts, each query token a row of its
own: :func:`decode_batch`) runs as **segments**, one per MoE layer and a tail: a
segment takes the previous MoE block's combined routed rows, finishes that block (latent norm and up
projection, the shared experts' output, the residual), runs every layer up to the next MoE block —
attention (:meth:`MLA.decode <model.mla.MLA.decode>`, :meth:`KimiDeltaAttention.decode
<model.kda.KimiDeltaAttention.decode>`, the cache writes included), dense MLPs, K3's attention
residuals — and that block's gate, latent down projection and shared experts, and returns the rows to
route. The routed experts stay outside (:class:`~model.moe.Dispatch`, as in the eager step): in one
process the block's own experts, in a cluster the exchange. So :meth:`CompiledDecode.stages` is the
same generator protocol as :meth:`CausalLM.stages <model.model.CausalLM.stages>`, and every caller
(the single process, an attention actor, a colocated worker, micro-batches) drives it unchanged.

Each segment is compiled once with symbolic sizes (``dynamic=True``): the batch size and the
context length are symbols, so one graph serves every decode batch from 2 to ``max_batch`` rows
(a step verifying drafts is such a batch too: its rows are its query tokens) and every context
(torch specialises a size of 1, so batch 1 is a graph of its own: the two batch buckets are {1} and
[2, max_batch]). :meth:`CompiledDecode.warm_up` compiles both at start, from the
on-disk inductor cache after the first time. After it, a step the graphs do not cover (a batch above
``max_batch``, a shape that would need another compile, a hybrid model's drafts) runs eager, and is
counted in :attr:`CompiledDecode.fallbacks` by reason: torch never compiles while serving.

What "identical" means: the compiled graph fuses the same operations (inductor's C++ on CPU) and may
order a reduction differently, so its logits equal eager's within floating-point tolerance, not bit
for bit; the greedy and seeded tokens are the same (tests compare tokens exactly and logits within
tolerance; docs/architecture.md, "Compiled decode").
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass
from typing import Callable

import torch

from .cache import AttnMeta, ModelCache
from .decoder import attn_res
from .moe import COMBINE, Dispatch, MoE, RoutedExperts, run_stages, weighted_terms

log = logging.getLogger(__name__)

COMPILE_MODES = ("eager", "decode")
FALLBACK_REASONS = ("batch", "recompile", "error", "drafts")
# the tally's keys: decode forwards that ran compiled (those verifying drafts, and those that ran as the whole-step
# graph, also counted apart), and each fallback reason's
TALLY = ("compiled", "verify", "whole", *FALLBACK_REASONS)


def _own_code(fn: Callable, k: int) -> Callable:
    """``fn`` with a code object of its own: torch keeps compiled graphs per code object, and the
    segments are closures of one function — each gets its own graphs (and recompile limit)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{k}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _input_guards(entries) -> list[bool]:
    """Which of a segment's guards torch checks at each call: the grad mode, the sizes (batch 1 or more)
    and the tensors passed in — not the model's weights and modules, which a segment reaches through
    its closure and which never change under it (the experts that do move are outside the segments).
    Checking every weight's guard cost ~90 µs a segment (measured; docs/step_profile.md)."""
    return [e.guard_type in ("GLOBAL_STATE", "SHAPE_ENV")
            or (e.guard_type == "TENSOR_MATCH" and not isinstance(e.value, torch.nn.Parameter))
            for e in entries]


def routed_rows(experts: RoutedExperts, x: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Each token's row through each of its k experts, unweighted: ``x`` [T, H], ``topk_idx`` [T, k]
    (the local slots: every expert held, in order) → [T, k, H]. Written for the compiler: the gather of
    a pair's expert weights fuses into its two reductions (one pass over the weights a pair touches, as
    a GEMV reads them; no copy of them, no sort, no loop over experts), for a decode step's few pairs."""
    T, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)  # [T·k, H]: pair p = token · k + slot
    inter = experts.w2.shape[-1]
    h = (experts.w13[flat] * xs[:, None, :]).sum(-1)  # [T·k, 2I]: gate columns, then up
    a = experts.act(h[:, :inter], h[:, inter:])
    return (experts.w2[flat] * a[:, None, :]).sum(-1).view(T, k, -1)


def _in_graph(moe: MoE, n_routed: int) -> bool:
    """``moe`` routes its own tokens to dense weights holding every routed expert in order: its routed
    experts can run inside a whole-step graph (:func:`routed_rows`)."""
    e = moe.experts
    return (moe.routed is None and isinstance(e, RoutedExperts) and e.expert_ids == tuple(range(n_routed))
            and e.w13.dtype.is_floating_point and e.w13.dtype.itemsize >= 2)


def _graph_inputs(d: "DecodeBatch", cache: ModelCache) -> tuple:
    """What every graph reads besides its own arguments: the batch's tensors, the cache's tensors."""
    latent = cache.latent.data if cache.latent is not None else None
    conv, recurrent = (cache.kda.conv, cache.kda.recurrent) if cache.kda is not None else (None, None)
    return (d.positions, d.slot_mapping, d.kv_slots, d.mask, d.state_slots), latent, conv, recurrent


@dataclass(frozen=True)
class DecodeBatch:
    """A decode step's attention inputs as plain tensors, one row per query token."""

    positions: torch.Tensor      # [B] (B rows: a sequence's token, or one of its drafts)
    slot_mapping: torch.Tensor   # [B] the cache slot each new token writes
    kv_slots: torch.Tensor       # [B, L] the cache slots each row reads
    mask: torch.Tensor           # [B, 1, L]
    state_slots: torch.Tensor | None  # [B] KDA slots (hybrid models)
    verify: bool = False         # the rows include drafts (a step verifying them, flattened)


def decode_batch(meta: AttnMeta) -> DecodeBatch | None:
    """``meta``'s tensors when it is a decode step (one query token per sequence); else None.

    A step whose sequences decode one token or verify drafts (no prefill chunk in it)
    is one too, flattened: each query token becomes a row of its own — its position, its slot, its
    sequence's context slots and its own row of the causal mask (a draft sees the tokens before it).
    A layer writes every row's latent before any row reads the cache (:meth:`MLA.decode
    <model.mla.MLA.decode>`), so a draft row attends over the earlier drafts of its step as the
    grouped verification does. Not for hybrid models (``state_slots``): KDA verifies drafts one at a
    time, keeping the state after each (:class:`~model.kda.KDAStateCache`), which rows cannot."""
    if not meta.verifying:
        if len(meta.groups) != 1 or any(q != 1 for q in meta.query_lens):
            return None
        g = meta.groups[0]
        return DecodeBatch(meta.positions, meta.slot_mapping, g.kv_slots, g.mask, meta.state_slots)
    if meta.state_slots is not None or not _drafts_only(meta):
        return None
    T = meta.positions.shape[0]
    device = meta.positions.device
    L = max(g.kv_slots.shape[1] for g in meta.groups)
    kv_slots = torch.zeros(T, L, dtype=torch.long, device=device)
    mask = torch.zeros(T, 1, L, dtype=torch.bool, device=device)
    for g in meta.groups:  # (a decode group and the verifying one: a loop over groups, not tokens)
        Bg, Q, Lg = g.mask.shape
        rows = g.tokens if g.tokens is not None else torch.arange(T, device=device)  # flat token of each query
        kv_slots[rows, :Lg] = g.kv_slots[g.q_rows // Q]
        mask[rows, 0, :Lg] = g.mask.reshape(Bg * Q, Lg)[g.q_rows]
    return DecodeBatch(meta.positions, meta.slot_mapping, kv_slots, mask, None, verify=True)


def _drafts_only(meta: AttnMeta) -> bool:
    """``meta`` verifies drafts and every other sequence in it decodes one token (no prefill chunk)."""
    return meta.verifying and all(q == 1 for g in meta.groups if not g.verify for q in g.query_lens)


class CompiledDecode:
    """The decode step of ``model`` (a :class:`~model.model.CausalLM`, any routed experts or none)
    over ``cache``, compiled per segment (see the module's docstring). :meth:`stages` runs a decode
    step; :meth:`warm_up` compiles; :attr:`fallbacks` counts the decode steps that ran eager."""

    def __init__(self, model, cache: ModelCache, impl: str = "absorbed", *, max_batch: int = 256,
                 whole: bool | None = None):
        if max_batch < 1:
            raise ValueError(f"compile max_batch must be >= 1, got {max_batch}")
        self.model, self.cache, self.impl, self.max_batch = model, cache, impl, max_batch
        layers = list(model.model.layers)
        self.moes = [l.ffn for l in layers if isinstance(l.ffn, MoE)]
        cuts = [l.index for l in layers if isinstance(l.ffn, MoE)]
        starts = [0] + [c + 1 for c in cuts]
        ends = cuts + [len(layers) - 1]
        self._eager = [self._segment(k, layers[s : e + 1]) for k, (s, e) in enumerate(zip(starts, ends))]
        able = all(_in_graph(m, model.cfg.n_routed_experts) for m in self.moes)
        if whole and not able:
            raise ValueError("a whole-step graph needs every routed expert here, dense (not quantised), "
                             "and no routed function set: compile the segments (whole=False)")
        # the whole step as one graph, routed experts included (a model that routes its own tokens: the
        # single process, CausalLM.forward); a step of more pairs than experts still takes the segments
        self.whole = able if whole is None else whole
        if self.whole:
            self._eager.append(self._segment(len(self._eager), layers, whole=True))
        self._compiled = [torch.compile(_own_code(f, k), dynamic=True, fullgraph=True,
                                        options={"guard_filter_fn": _input_guards})
                          for k, f in enumerate(self._eager)]
        self.warm = False  # set by warm_up: from then on a shape that needs a compile runs eager
        self.steps = 0  # decode steps that ran compiled
        self.verify_steps = 0  # those of them that verified drafts
        self.whole_steps = 0  # those of them that ran as the whole-step graph
        self.fallbacks: dict[str, int] = dict.fromkeys(FALLBACK_REASONS, 0)
        self.compile_s = 0.0

    # ---- the segments ------------------------------------------------------------------------
    def _segment(self, k: int, layers: list, whole: bool = False) -> Callable:
        """Segment ``k``'s function of plain tensors: (k == 0: the token ids, else the previous MoE
        block's combined rows, shared output and residual), K3's block list, the rope, the batch's
        tensors and the cache tensors → (residual, routed rows, topk_idx, topk_w, shared output,
        blocks, rope) at a MoE block, or the final-normed hidden states at the end. ``whole``: every
        layer from the token ids to the final norm, each MoE block's routed experts in the graph
        (:func:`routed_rows`)."""
        model, impl = self.model, self.impl
        backbone, rotary = model.model, model.rotary
        prev = self.moes[k - 1] if k > 0 and not whole else None
        cache = self.cache
        mla_rows = {l.index: cache.mla_index[l.index] for l in layers if not l.is_kda}
        kda_rows = {l.index: cache.kda_index[l.index] for l in layers if l.is_kda}

        def attention(layer, rope, d: tuple, latent, conv, recurrent):
            positions, slot_mapping, kv_slots, mask, state_slots = d
            if layer.is_kda:
                row = kda_rows[layer.index]
                return lambda x: layer.self_attn.decode(x, conv, recurrent, row, state_slots)
            row = mla_rows[layer.index]
            return lambda x: layer.self_attn.decode(x, rope, latent, row, slot_mapping, kv_slots, mask, impl)

        def segment(first, shared, residual, blocks, rope, d, latent, conv, recurrent):
            blocks = list(blocks)
            if prev is None:
                h = backbone.embed_tokens(first)
                rope = None if rotary is None else rotary.cos_sin(d[0])
            else:
                h = residual + prev.finish(first, shared)
            for layer in layers:
                residual, x = layer.pre_ffn(h, blocks, attention(layer, rope, d, latent, conv, recurrent))
                if isinstance(layer.ffn, MoE):
                    x_r, idx, w = layer.ffn.route(x)
                    if not whole:
                        return residual, x_r, idx, w, layer.ffn.shared(x), blocks, rope
                    y = weighted_terms(routed_rows(layer.ffn.experts, x_r, idx), w).to(x_r.dtype)
                    h = residual + layer.ffn.finish(y, layer.ffn.shared(x))
                    continue
                h = residual + layer.ffn(x)
            if model.cfg.attn_res_block_size:
                h = attn_res(blocks + [h], backbone.output_attn_res_norm, backbone.output_attn_res_proj)
            return backbone.norm(h)

        return segment

    def _run(self, k: int, *args):
        """Segment ``k``, compiled — or eager where that would need a compile after warm-up."""
        if not self.warm:
            return self._compiled[k](*args)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._compiled[k](*args)
        except Exception as e:  # a guard failed (a shape never compiled) or torch refused the graph
            reason = "recompile" if "recompil" in str(e).lower() else "error"
            self._fallback = reason
            log.debug("compiled decode segment %d fell back to eager (%s): %s", k, reason, e)
            return self._eager[k](*args)

    def tally(self) -> dict[str, int]:
        """Decode steps so far: ``compiled`` (of them ``verify``: those that verified drafts; ``whole``: those
        that ran as one graph), and each fallback reason's."""
        return {"compiled": self.steps, "verify": self.verify_steps, "whole": self.whole_steps, **self.fallbacks}

    def since(self, before: dict[str, int]) -> tuple[tuple[str, int], ...]:
        """What :meth:`tally` added since ``before`` (the nonzero counts)."""
        return tuple((k, n - before[k]) for k, n in self.tally().items() if n > before[k])

    # ---- a step ------------------------------------------------------------------------------
    def covers(self, meta: AttnMeta) -> DecodeBatch | None:
        """The step's tensors when this compiled step runs ``meta`` (a decode step no larger than
        ``max_batch``); None otherwise, counting a decode batch too large as a fallback."""
        d = decode_batch(meta)
        if d is None and meta.state_slots is not None and _drafts_only(meta):
            self.fallbacks["drafts"] += 1  # a hybrid model's drafts: KDA verifies them one at a time, eager
        if d is not None and d.positions.shape[0] > self.max_batch:
            self.fallbacks["batch"] += 1
            return None
        return d

    def stages(self, ids: torch.Tensor, d: DecodeBatch, cache: ModelCache):
        """The decode step of ``ids`` [B] as :meth:`CausalLM.stages` runs it (same protocol: yields a
        :class:`Dispatch` and then ``COMBINE`` per MoE block); returns the final-normed hidden states."""
        tensors, latent, conv, recurrent = _graph_inputs(d, cache)
        times = cache.times
        self._fallback = None
        first, shared, residual, blocks, rope = ids, None, None, [], None
        for k, moe in enumerate(self.moes):
            t = time.perf_counter()
            residual, x_r, idx, w, shared, blocks, rope = self._run(k, first, shared, residual, blocks, rope,
                                                                     tensors, latent, conv, recurrent)
            if times is not None:
                times.add("compiled", time.perf_counter() - t)
            yield Dispatch(moe, x_r, idx, w)
            first = yield COMBINE
            if first._base is not None or first.stride() != (first.shape[1], 1):
                # a view (of an exchange's buffer: torch would guard on its base) or rows with other
                # strides (the colocated combine's one-row copy of a [T, k, H] slot: a graph guards
                # on strides, and every batch-1 step fell back) → plain rows
                first = first.clone(memory_format=torch.contiguous_format)
        t = time.perf_counter()
        h = self._run(len(self.moes), first, shared, residual, blocks, rope, tensors, latent, conv, recurrent)
        if times is not None:
            times.add("compiled", time.perf_counter() - t)
        self._count(d)
        return h

    def takes_whole(self, d: DecodeBatch) -> bool:
        """The whole-step graph runs ``d``: there is one, and its pairs (rows × top-k) are no more than the
        experts (each pair reads its expert's weights; more pairs than experts read them more than once,
        where the segments' grouped GEMMs read each expert once)."""
        return d.positions.shape[0] <= self.whole_max

    @property
    def whole_max(self) -> int:
        """The largest batch the whole-step graph takes (0: there is none)."""
        cfg = self.model.cfg
        return cfg.n_routed_experts // cfg.num_experts_per_tok if self.whole else 0

    def forward(self, ids: torch.Tensor, d: DecodeBatch, cache: ModelCache) -> torch.Tensor:
        """The decode step of ``ids`` [B] as one graph (:meth:`takes_whole`), the routed experts in it;
        returns the final-normed hidden states."""
        tensors, latent, conv, recurrent = _graph_inputs(d, cache)
        self._fallback = None
        t = time.perf_counter()
        h = self._run(len(self._eager) - 1, ids, None, None, [], None, tensors, latent, conv, recurrent)
        if cache.times is not None:
            cache.times.add("compiled", time.perf_counter() - t)
        self._count(d, whole=True)
        return h

    def _count(self, d: DecodeBatch, whole: bool = False) -> None:
        if self._fallback is None:
            self.steps += 1
            self.verify_steps += d.verify
            self.whole_steps += whole
        else:
            self.fallbacks[self._fallback] += 1

    # ---- warm-up -----------------------------------------------------------------------------
    @torch.no_grad()
    def warm_up(self, context: int = 37) -> float:
        """Compile the graphs for batch 1 and for a batch of 2 (the symbolic one) — the segments, and the
        whole step where there is one, each for the batches it takes — on dummy tokens written to cache
        slots no sequence holds yet (call it before serving); returns the seconds it took. Afterwards a
        shape that needs another compile runs eager (:meth:`_run`). Torch's duck sizing (equal sizes
        share one symbol) is off while compiling: with it a batch of 2 beside a model of 2 MLA layers
        made a graph for batches of exactly as many rows as layers. ``context`` is the dummy context
        length (a prime: the same lesson, learned first with duck sizing on)."""
        import torch.fx.experimental._config as fx_config

        with fx_config.patch(use_duck_shape=False):
            return self._warm_up(context)

    def _warm_up(self, context: int) -> float:
        t0 = time.perf_counter()
        cache = self.cache
        device = next(self.model.parameters()).device
        slots = cache.latent.data.shape[1] if cache.latent is not None else context + 2
        n_state = cache.kda.num_slots if cache.kda is not None else 1
        whole_max = self.whole_max
        for batch, length in ((1, context), (2, context), (2, context + 1)):
            length = max(2, min(length, slots))
            d = DecodeBatch(
                positions=torch.full((batch,), length - 1, dtype=torch.long, device=device),
                slot_mapping=torch.full((batch,), length - 1, dtype=torch.long, device=device),
                kv_slots=torch.arange(length, device=device).repeat(batch, 1),  # no view: as a step's
                mask=torch.ones(batch, 1, length, dtype=torch.bool, device=device),
                state_slots=(torch.arange(batch, device=device) % n_state) if cache.kda is not None else None)
            ids = torch.zeros(batch, dtype=torch.long, device=device)
            if batch <= whole_max:
                self.forward(ids, d, cache)
            if not self.whole or (batch > 1 and self.max_batch > whole_max):  # a batch the segments take
                # the routed rows: zeros (the experts' values do not change the graphs)
                run_stages(self.stages(ids, d, cache), lambda req: torch.zeros_like(req.x), lambda rows: rows)
        self.steps = self.verify_steps = self.whole_steps = 0
        self.warm = True
        self.compile_s = time.perf_counter() - t0
        log.info("compiled decode: %d segments%s for batch 1 and 2..%d in %.1f s", len(self.moes) + 1,
                 " and the whole step" if self.whole else "", self.max_batch, self.compile_s)
        return self.compile_s
