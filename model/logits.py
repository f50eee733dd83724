"""Logits processing between the lm_head and the sampler: logit bias, the stop ids banned until
``min_tokens``, repetition / frequency / presence penalties and grammar masks.

Owns: per sequence, the history these need — the tokens consumed so far (prompt and generated), the
generated tokens' counts and the set of tokens seen (on the logits' device, only for penalised
sequences) and the grammar matcher (one per constrained sequence). The history is fed with every
chunk's input tokens, so it is rebuilt by itself whenever a sequence is prefilled again from its
first token (recovery, a replica removed, preemption: ``start == 0``), and a chunk that starts
before the end of the history (a step redone after a failure) rolls it back first: the state
always equals what the tokens before the chunk's end give, whatever happened before.
Never: samples, keeps the logits, or decides which sequences run. Vectorised over the batch: a
Python loop only over sequences (their histories and matchers), never over tokens or the vocabulary.

Used by the attention worker (actors/attention.py) and the single-process runner (model/runner.py),
so the cluster and its oracle process logits alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams


def grammars_for(checkpoint: str, vocab_size: int):
    """The :class:`~model.grammar.Grammars` of a checkpoint directory's tokenizer (built on the first
    constrained sequence: unconstrained serving never loads llguidance)."""
    from .grammar import Grammars, lltokenizer
    from .tokenizer import Tokenizer

    return Grammars(lltokenizer(Tokenizer.from_dir(checkpoint), vocab_size))


BROKEN = "broken"  # the matcher of a grammar that did not compile


def stateful(params: SamplingParams | None) -> bool:
    """Whether a sequence's logits depend on its history (penalties or a grammar)."""
    return params is not None and (params.penalised or params.grammar is not None)


@dataclass
class _History:
    prompt_len: int
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    counts: torch.Tensor | None = None  # [V] int32: how often each id was generated (penalised only)
    seen: torch.Tensor | None = None  # [V] bool: ids in the prompt or generated (penalised only)
    matcher: object | None = None  # llguidance.LLMatcher (constrained only)


class LogitsState:
    """The histories of one process's sequences. ``grammars`` builds the process's
    :class:`model.grammar.Grammars` on first use (it needs the tokenizer)."""

    def __init__(self, vocab_size: int, device: torch.device, grammars: Callable[[], object] | None = None):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self._make_grammars, self._grammars = grammars, None
        self.histories: dict[int, _History] = {}
        self.grammar_errors = 0  # rows whose matcher was in error state when masked

    @property
    def grammars(self):
        if self._grammars is None:
            if self._make_grammars is None:
                raise RuntimeError("a sequence has a grammar, but this process was given no tokenizer for grammars")
            self._grammars = self._make_grammars()
        return self._grammars

    # ---- history -------------------------------------------------------------------------
    def prepare(self, params_list: Iterable[SamplingParams | None]) -> None:
        """Start compiling the grammars a step will need, off the calling thread (overlapping the
        forward); :meth:`feed` waits for them."""
        for p in params_list:
            if p is not None and p.grammar is not None:
                self.grammars.prepare(p.grammar)

    def feed(self, seq_id: int, prompt_len: int, start: int, token_ids: Iterable[int],
             params: SamplingParams | None) -> None:
        """A chunk's input tokens at positions ``start ..``: the history becomes the sequence's first
        ``start + len(token_ids)`` tokens."""
        if not stateful(params):
            self.histories.pop(seq_id, None)
            return
        ids = list(token_ids)
        h = self.histories.get(seq_id)
        if start == 0 or h is None or h.params != params:
            if start != 0:
                raise RuntimeError(f"sequence {seq_id}: a chunk at position {start} without the history before "
                                   "it (a constrained or penalised sequence must be prefilled here from its start)")
            h = self.histories[seq_id] = self._new(prompt_len, params)
        elif start < len(h.tokens):
            self._rollback(h, start)
        elif start > len(h.tokens):
            raise RuntimeError(f"sequence {seq_id}: a chunk at position {start}, but the history ends at "
                               f"{len(h.tokens)}")
        first_out = max(0, h.prompt_len - start)  # the chunk's first generated token
        out = ids[first_out:]
        h.tokens.extend(ids)
        if h.counts is not None:
            t = torch.tensor(ids, device=self.device, dtype=torch.long)
            h.seen[t] = True
            if out:
                o = t[first_out:]
                h.counts.index_add_(0, o, torch.ones_like(o, dtype=torch.int32))
        if h.matcher not in (None, BROKEN) and out:
            h.matcher.consume_tokens(out)  # a token the mask allowed; an error state is kept (see apply)

    def release(self, seq_ids: Iterable[int]) -> None:
        for s in seq_ids:
            self.histories.pop(s, None)

    def _new(self, prompt_len: int, params: SamplingParams) -> _History:
        h = _History(prompt_len, params)
        if params.penalised:
            h.counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
            h.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        if params.grammar is not None:
            try:
                h.matcher = self.grammars.matcher(params.grammar)
            except ValueError:  # checked by the API before it came here; if not, the sequence may only stop
                h.matcher = BROKEN
        return h

    def _rollback(self, h: _History, start: int) -> None:
        """Forget the tokens from position ``start`` on (a step done again)."""
        dropped = h.tokens[start:]
        n_out = len(h.tokens) - max(start, h.prompt_len)
        del h.tokens[start:]
        if h.counts is not None:
            out = dropped[len(dropped) - n_out:] if n_out > 0 else []
            if out:
                o = torch.tensor(out, device=self.device, dtype=torch.long)
                h.counts.index_add_(0, o, torch.full_like(o, -1, dtype=torch.int32))
            h.seen.zero_()
            if h.tokens:
                h.seen[torch.tensor(h.tokens, device=self.device, dtype=torch.long)] = True
        if h.matcher not in (None, BROKEN) and n_out > 0:
            h.matcher.rollback(n_out)

    # ---- processing ------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
              banned: list[tuple[int, ...]] | None = None) -> torch.Tensor:
        """Process logits [R, V] of rows ``seq_ids`` (each fed up to the token it samples after);
        ``banned[r]``: ids row r must not sample (the stop ids before ``min_tokens``). Returns the
        processed logits: the input itself when no row needs anything, else a new tensor (the
        caller keeps the raw logits for logprobs, as vLLM reports them)."""
        R, V = logits.shape
        bias = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias if t < V]
        # a grammar decides where the output may end: the stop ids are not banned from its rows
        ban = [(r, t) for r, ids in enumerate(banned or ()) if params[r].grammar is None for t in ids if t < V]
        pen = [r for r, p in enumerate(params) if p.penalised]
        gram = [r for r, p in enumerate(params) if p.grammar is not None]
        if not (bias or ban or pen or gram):
            return logits
        out = logits.clone()
        dev = out.device
        if bias:
            rows, toks, vals = zip(*bias)
            out.index_put_((torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)),
                           torch.tensor(vals, dtype=out.dtype, device=dev), accumulate=True)
        if pen:
            self._penalise(out, pen, [self._history(seq_ids[r]) for r in pen], [params[r] for r in pen])
        if ban:
            rows, toks = zip(*ban)
            out[torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)] = float("-inf")
        if gram:
            at = torch.tensor(gram, device=dev)
            sub = out.index_select(0, at)
            matchers = [self._history(seq_ids[r]).matcher for r in gram]
            broken = [i for i, m in enumerate(matchers) if m is BROKEN]
            errors = self.grammars.mask_logits([None if m is BROKEN else m for m in matchers], sub)
            if broken:  # a grammar that did not compile: only the stop ids, so the sequence ends
                keep = torch.tensor(self.grammars.stop_ids, device=dev)
                rows = torch.tensor(broken, device=dev)
                stop_logits = sub[rows][:, keep]
                sub[rows] = float("-inf")
                sub[rows[:, None], keep[None, :]] = stop_logits
            out.index_copy_(0, at, sub)
            self.grammar_errors += len(errors) + len(broken)  # such a row may only stop (model.grammar's policy)
        return out

    def _history(self, seq_id: int) -> _History:
        try:
            return self.histories[seq_id]
        except KeyError:
            raise RuntimeError(f"sequence {seq_id} samples with penalties or a grammar, but no history of it "
                               "was fed here") from None

    @staticmethod
    def _penalise(out: torch.Tensor, rows: list[int], hist: list[_History], params: list[SamplingParams]) -> None:
        dev, dt = out.device, out.dtype
        at = torch.tensor(rows, device=dev)
        x = out.index_select(0, at)  # [P, V]
        counts = torch.stack([h.counts for h in hist]).to(dt)
        seen = torch.stack([h.seen for h in hist])
        # a penalty below the dtype's smallest normal would round to 0 and divide a logit to inf (then the
        # softmax to NaN): it is taken as that smallest value, and the quotient kept finite
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=dt, device=dev)[:, None]
        rep = rep.clamp(min=torch.finfo(dt).tiny)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=dt, device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=dt, device=dev)[:, None]
        x = torch.where(seen, torch.where(x > 0, (x / rep).clamp(max=torch.finfo(dt).max), x * rep), x)
        x = x - freq * counts - pres * (counts > 0).to(dt)
        out.index_copy_(0, at, x)
