"""Grammar-constrained sampling with llguidance: the tokenizer adapter, compiled grammars, masks.

Used where sampling happens (the attention actor's step thread). A *grammar* is text that
``llguidance.LLMatcher`` accepts: llguidance's Lark dialect (``deploy/structured.py`` builds it from
API requests) or its JSON form. A *matcher* is one sequence's parse state: it starts at the
grammar's start, says which ids may come next (:meth:`Grammars.mask_logits`) and is advanced by
each sampled id (:meth:`Grammars.consume`, or ``matcher.consume_token``).

Owns: one process's compiled grammars for one tokenizer (an LRU keyed by the grammar text, each
entry a matcher at the start state that new matchers are deep copies of) and the threads that
compile them. Never: holds a sequence's matcher (its owner keeps it beside the sequence), builds
grammars from requests, or decides that a sequence stops (a grammar only *allows*; the stop
check is the scheduler's).

Policies:

- End of turn: the llguidance tokenizer's EOS set is every id of ``tokenizer.stop_token_ids``, so
  a grammar that may end allows any end-of-turn id, and one that must end allows only those.
- Error state: a matcher that consumed an id its grammar forbids (a caller that sampled outside
  the mask, a forced id) or that hit a parser limit stays in error for good. Its row allows only
  the stop ids, so its sequence ends at the next step rather than crash the step or run
  unconstrained; :meth:`Grammars.mask_logits` returns such rows so the caller reports them.
- Padded vocabulary: ids in ``[tokenizer.vocab_size, n_vocab)`` are never allowed.
- Masks are computed on the host (llguidance, on its own threads, without the GIL) into a
  ``[R, ceil(V/32)]`` int32 bitmask, then unpacked and applied on the logits' device.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.numpy  # not llguidance.torch: importing it compiles nothing but loads torch.compile (~3 s of CPU per process)
import torch

from model.tokenizer import Tokenizer
from model.tokenizer_backends import K2_PAT_STR, TiktokenBackend

MAX_ERROR_CHARS = 2000  # llguidance's messages can list every special token of the vocabulary


def _message(error: str) -> str:
    error = error.strip()
    return error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS] + " …"


def lltokenizer(tokenizer: Tokenizer, n_vocab: int) -> llguidance.LLTokenizer:
    """The llguidance view of ``tokenizer`` (~0.5 s for a 160k vocabulary: build it once). EOS is
    every end-of-turn id; ``n_vocab`` is the model's logits width (config.json ``vocab_size``,
    which may exceed the tokenizer's). Special tokens are addressable in Lark by their text
    (``<|tool_call_begin|>``) or id (``<[163597]>``)."""
    if not isinstance(n_vocab, int) or n_vocab < tokenizer.vocab_size:
        raise ValueError(f"n_vocab must be an int >= the tokenizer's vocab_size {tokenizer.vocab_size}, "
                         f"got {n_vocab!r}")
    eos = sorted(tokenizer.stop_token_ids)
    if not eos:
        raise ValueError("the tokenizer has no end-of-turn token (stop_token_ids is empty): a grammar could never end")
    backend = tokenizer._backend  # the loaded vocabulary itself; Tokenizer exposes no public view of it
    if isinstance(backend, TiktokenBackend):
        return llguidance.LLTokenizer.from_tiktoken(encoder=backend._ranks, special_tokens=backend._specials,
                                                    pattern=K2_PAT_STR, eos_token=eos, n_vocab=n_vocab)
    return llguidance.LLTokenizer(backend._spec_json, n_vocab=n_vocab, eos_token=eos)


def check(grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """ValueError with llguidance's message if ``grammar`` does not compile. Without a tokenizer,
    special tokens named by text cannot be resolved (by id, ``<[N]>``, they can)."""
    if not isinstance(grammar, str):
        raise ValueError(f"a grammar must be a str, got {type(grammar).__name__}")
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"invalid grammar: {_message(error)}")


def _bitmask_row(token_ids: Sequence[int], n_vocab: int) -> torch.Tensor:
    """An int32 ``[ceil(n_vocab/32)]`` bitmask with only ``token_ids`` set (bit i%32 of word i//32)."""
    allowed = torch.zeros(llguidance.numpy.get_bitmask_shape(1, n_vocab)[1] * 32, dtype=torch.int64)
    allowed[list(token_ids)] = 1
    words = (allowed.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _allocate_bitmask(rows: int, n_vocab: int) -> torch.Tensor:
    """A host int32 ``[rows, ceil(n_vocab/32)]`` bitmask, every id allowed."""
    return torch.from_numpy(llguidance.numpy.allocate_token_bitmask(rows, n_vocab))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed ids to -inf, in place. logits: [R, V] on any device; bitmask:
    [R, ceil(V/32)] int32 (host). A plain unpack, not llguidance's torch.compile'd kernel: no
    compile on the step thread's first use, no C++ compiler needed on CPU hosts."""
    rows, vocab = logits.shape
    assert sys.byteorder == "little", "apply_bitmask reads llguidance's int32 words as little-endian bytes"
    assert bitmask.shape == (rows, (vocab + 31) // 32), \
        f"bitmask {tuple(bitmask.shape)} for logits {tuple(logits.shape)}"
    packed = bitmask.contiguous().view(torch.uint8).to(logits.device)  # [R, 4W]; id i is bit i%8 of byte i//8
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab]  # [R, 4W, 8] → [R, V]
    logits.masked_fill_(allowed == 0, float("-inf"))


class Grammars:
    """Compiled grammars for one tokenizer, shared by every sequence of the process.

    :meth:`prepare` starts a compile in the background (so the step thread overlaps it with a
    forward); :meth:`matcher` waits for it and returns a fresh matcher. A grammar text is compiled
    once while it stays among the ``max_cached`` most recently used; a failed compile is cached too
    and raises the same ValueError every time."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, *, max_cached: int = 256, compile_threads: int = 2,
                 mask_threads: int | None = None, limits: llguidance.LLParserLimits | None = None):
        if max_cached < 1 or compile_threads < 1:
            raise ValueError(f"max_cached and compile_threads must be >= 1, got {max_cached}, {compile_threads}")
        self.tokenizer, self.n_vocab = tokenizer, tokenizer.vocab_size
        self.stop_ids = tuple(tokenizer.eos_tokens)
        self.num_compiles = 0  # cache misses, for tests and stats
        self._limits, self._max_cached = limits, max_cached
        self._cache: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(compile_threads, thread_name_prefix="grammar-compile")
        self._executor = llguidance.LLExecutor(mask_threads)
        self._stop_row = _bitmask_row(self.stop_ids, self.n_vocab)
        self._bitmask = _allocate_bitmask(1, self.n_vocab)  # grown to the widest batch

    def _compile(self, grammar: str) -> llguidance.LLMatcher | str:
        """The start-state matcher, or llguidance's error message. Its first mask is computed here
        too: the lexer states that builds are shared with every copy, so the step thread's first
        mask of a new grammar is not the slow one (~0.2 ms at 160k ids)."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if not matcher.is_error():
            matcher.compute_bitmask()
        return _message(matcher.get_error()) if matcher.is_error() else matcher

    def _entry(self, grammar: str) -> concurrent.futures.Future:
        if not isinstance(grammar, str):
            raise ValueError(f"a grammar must be a str, got {type(grammar).__name__}")
        with self._lock:
            future = self._cache.get(grammar)
            if future is not None:
                self._cache.move_to_end(grammar)
                return future
            future = self._pool.submit(self._compile, grammar)
            self._cache[grammar] = future
            self.num_compiles += 1
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return future

    def prepare(self, grammar: str) -> None:
        """Start compiling ``grammar`` in the background, unless it is cached or compiling."""
        self._entry(grammar)

    def matcher(self, grammar: str, *, timeout_s: float = 60.0) -> llguidance.LLMatcher:
        """A fresh matcher at the start of ``grammar``; waits for its compile (started here if
        :meth:`prepare` was not called). ValueError with llguidance's message if it does not compile."""
        try:
            compiled = self._entry(grammar).result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"compiling a grammar of {len(grammar)} chars took over {timeout_s} s: "
                               f"{grammar[:200]!r}") from None
        if isinstance(compiled, str):
            raise ValueError(f"invalid grammar: {compiled}")
        return compiled.deep_copy()

    def check(self, grammar: str) -> None:
        """:func:`check` with this tokenizer (special tokens by name resolve); compiles nothing."""
        check(grammar, self.tokenizer)

    def fill(self, matchers: Sequence[llguidance.LLMatcher | None], bitmask: torch.Tensor) -> list[int]:
        """Write each row's allowed ids into ``bitmask`` ([R, ceil(V/32)] int32, host, contiguous;
        R = len(matchers)); a None row (an unconstrained sequence) allows every id. Returns the
        rows whose matcher is in error state; they allow only the stop ids."""
        assert bitmask.shape == (len(matchers), self._stop_row.numel()), \
            f"bitmask {tuple(bitmask.shape)} for {len(matchers)} matchers over {self.n_vocab} ids"
        bitmask.fill_(-1)
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if rows:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, bitmask.numpy())  # a view: same memory
        errors = [i for m, i in rows if m.is_error()]
        for i in errors:
            bitmask[i] = self._stop_row
        return errors

    def mask_logits(self, matchers: Sequence[llguidance.LLMatcher | None], logits: torch.Tensor) -> list[int]:
        """Mask ``logits`` [R, V] in place (V = n_vocab) to what each row's matcher allows (None:
        unconstrained). Returns the rows in error state (:meth:`fill`). Called on one thread only
        (it reuses one host buffer)."""
        rows, vocab = logits.shape
        if len(matchers) != rows or vocab != self.n_vocab:
            raise ValueError(f"logits {tuple(logits.shape)} do not fit {len(matchers)} matchers "
                             f"over {self.n_vocab} ids")
        constrained = [i for i, m in enumerate(matchers) if m is not None]
        if not constrained:
            return []
        if self._bitmask.shape[0] < len(constrained):
            self._bitmask = _allocate_bitmask(len(constrained), self.n_vocab)
        bitmask = self._bitmask[:len(constrained)]
        errors = [constrained[i] for i in self.fill([matchers[i] for i in constrained], bitmask)]
        if len(constrained) == rows:
            apply_bitmask(logits, bitmask)
        else:
            index = torch.tensor(constrained, device=logits.device)
            sub = logits.index_select(0, index)
            apply_bitmask(sub, bitmask)
            logits.index_copy_(0, index, sub)
        return errors

    def consume(self, matchers: Sequence[llguidance.LLMatcher | None], token_ids: Sequence[int]) -> list[int]:
        """Advance each row's matcher by its sampled id (None rows are skipped), in parallel.
        Returns the rows whose id was refused: their matcher is now in error state."""
        pairs = [(m, int(t)) for m, t in zip(matchers, token_ids, strict=True) if m is not None]
        rows = [i for i, m in enumerate(matchers) if m is not None]
        accepted = llguidance.numpy.consume_token_par(self._executor, pairs) if pairs else []
        return [i for i, ok in zip(rows, accepted) if not ok]

    def close(self) -> None:
        """Stop the compile threads (a compile in flight finishes first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
