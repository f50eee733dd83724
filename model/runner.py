"""The single-process model runner and a batched offline ``generate``.

:class:`ModelRunner` owns the model and its :class:`ModelCache` (latent blocks, KDA slots); it turns a batch of
:class:`Sequence` s (each with a number of new tokens to compute) into tensors and returns the
logits of each sequence's last new token. It does not choose which sequences run — ``generate``
here (and the cluster engine) does that — and it writes cache blocks only where the sequence's
block table says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from .cache import BlockAllocator, CacheFull, build_attn_meta
from .logits import LogitsState
from .model import CausalLM
from .sampling import SamplingParams, draw_seed, sample


@dataclass(eq=False)  # a sequence is itself: compared and found in lists by identity
class Sequence:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None  # KDA slot (hybrid models)
    num_cached: int = 0  # tokens whose latents (and KDA state) are in the cache
    finish_reason: str | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncached(self) -> int:
        return len(self.token_ids) - self.num_cached


def check_stop(seq: Sequence, model_stop_ids: frozenset[int], max_context: int) -> str | None:
    """'stop', 'length' or None after a token was appended."""
    n, p = len(seq.output_ids), seq.params
    last = seq.token_ids[-1]
    if n >= p.min_tokens and (last in p.stop_token_ids or (not p.ignore_eos and last in model_stop_ids)):
        return "stop"
    if n >= p.max_tokens or len(seq.token_ids) >= max_context:
        return "length"
    return None


def banned_ids(seq: Sequence, context: int, model_stop_ids: frozenset[int]) -> tuple[int, ...]:
    """The stop ids the token sampled after ``context`` tokens must not be: before ``min_tokens`` a
    stop would not end the sequence (:func:`check_stop`), so it is masked rather than sampled."""
    p = seq.params
    if context - seq.num_prompt_tokens + 1 >= p.min_tokens:
        return ()
    return tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else model_stop_ids)))


class ModelRunner:
    def __init__(self, model: CausalLM, *, num_blocks: int, block_size: int = 16, num_slots: int = 64,
                 impl: str = "absorbed", dtype: torch.dtype | None = None):
        self.model, self.cfg, self.impl = model, model.cfg, impl
        dtype = dtype or next(model.parameters()).dtype
        self.block_size = block_size
        self.device = model.device
        self.cache = model.make_cache(num_blocks, block_size, num_slots, dtype, self.device)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.slots = BlockAllocator(num_slots, 1) if self.cache.kda is not None else None

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` enough blocks for its first ``num_tokens`` tokens, and a zeroed KDA slot
        (raises CacheFull)."""
        need = self.allocator.blocks_needed(num_tokens, len(seq.block_table))
        if not self.allocator.can_allocate(need):
            raise CacheFull(f"seq {seq.seq_id} needs {need} more cache blocks, {self.allocator.num_free} free")
        if self.slots is not None and seq.state_slot is None:
            (seq.state_slot,) = self.slots.allocate(1)
            self.cache.kda.reset(seq.state_slot)
        seq.block_table.extend(self.allocator.allocate(need))

    def release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        if seq.state_slot is not None:
            self.slots.free([seq.state_slot])
        seq.block_table, seq.num_cached, seq.state_slot = [], 0, None

    def _slots(self, seqs: list[Sequence]) -> list[int] | None:
        return None if self.slots is None else [s.state_slot for s in seqs]

    def forward(self, seqs: list[Sequence], num_new: list[int]) -> torch.Tensor:
        """Compute ``num_new[b]`` uncached tokens of each sequence; logits [B, V] of the last one, on the host."""
        return self.forward_on_device(seqs, num_new).cpu()

    @torch.no_grad()
    def forward_on_device(self, seqs: list[Sequence], num_new: list[int]) -> torch.Tensor:
        """:meth:`forward`, its logits left on the model's device (where :func:`sample` runs)."""
        ids, ctx = [], []
        for seq, n in zip(seqs, num_new):
            assert 0 < n <= seq.num_uncached, f"seq {seq.seq_id}: {n} new of {seq.num_uncached} uncached"
            self.reserve(seq, seq.num_cached + n)
            ids.extend(seq.token_ids[seq.num_cached : seq.num_cached + n])
            ctx.append(seq.num_cached + n)
        meta = build_attn_meta(num_new, ctx, [s.block_table for s in seqs], self.block_size, device=self.device,
                               state_slots=self._slots(seqs))
        h = self.model(torch.tensor(ids, device=self.device), meta, self.cache, self.impl)
        for seq, n in zip(seqs, num_new):
            seq.num_cached += n
        return self.model.logits(h[meta.last_token_index.to(self.device)])

    @torch.no_grad()
    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of every position of one sequence (parity tests); frees its cache."""
        seq = Sequence(-1, list(token_ids), len(token_ids), SamplingParams())
        try:
            self.reserve(seq, len(token_ids))
            meta = build_attn_meta([len(token_ids)], [len(token_ids)], [seq.block_table], self.block_size,
                                   device=self.device, state_slots=self._slots([seq]))
            ids = torch.tensor(token_ids, device=self.device)
            return self.model.logits(self.model(ids, meta, self.cache, self.impl)).cpu()
        finally:
            self.release(seq)


def generate(runner: ModelRunner, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams],
             stop_ids: Iterable[int] = (), *, max_context: int | None = None,
             grammars: Callable[[], object] | None = None) -> list[Sequence]:
    """Batched offline generation: one prefill step for all prompts, then batched decode steps.
    Logits go through :class:`~model.logits.LogitsState` as on the attention actors; ``grammars``
    builds the :class:`~model.grammar.Grammars` that constrained params need."""
    prompts = [list(p) for p in prompts]
    plist = params if isinstance(params, list) else [params] * len(prompts)
    vocab = runner.cfg.vocab_size
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not (0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    max_context = max_context or runner.cfg.max_position_embeddings
    stops = frozenset(stop_ids)
    seqs = [Sequence(i, p, len(p), sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
    running = list(seqs)
    state = LogitsState(runner.cfg.vocab_size, runner.device, grammars)
    try:
        while running:
            for s in running:
                state.feed(s.seq_id, s.num_prompt_tokens, s.num_cached, s.token_ids[s.num_cached:], s.params)
            logits = runner.forward_on_device(running, [s.num_uncached for s in running])
            logits = state.apply(logits, [s.seq_id for s in running], [s.params for s in running],
                                 [banned_ids(s, len(s.token_ids), stops) for s in running])
            seeds = [draw_seed(s.params, len(s.token_ids)) for s in running]
            tokens = sample(logits, [s.params for s in running], seeds).tolist()
            for seq, tok in zip(running, tokens):
                seq.token_ids.append(tok)
                seq.finish_reason = check_stop(seq, stops, max_context)
            for seq in [s for s in running if s.finish_reason]:
                runner.release(seq)
            running = [s for s in running if not s.finish_reason]
    finally:
        for seq in running:
            runner.release(seq)
    return seqs
