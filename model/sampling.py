"""Sampling parameters and the batched sampler (greedy, temperature, min-p, top-k, top-p, per-request seed).

Owns: turning a step's logits into next token ids, on the logits' device, vectorised over the batch
(a Python loop only to seed each seeded row's generator). A seeded row's tokens are a function of its
logits and seed alone — the same alone or batched, and the same as the per-row ``torch.multinomial``
sampler gives (tests/model/test_sampling.py keeps that sampler as the oracle).
Never: moves the logits to the host, sorts a whole vocabulary when a top-k window decides, or keeps
state between steps (seeds come from :func:`draw_seed`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NUCLEUS_WINDOW = 1024  # top-p without top-k looks for its nucleus among this many best tokens first


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is generated: what the attention actors sample with (temperature … grammar)
    and the limits the scheduler stops it at (max_tokens, min_tokens, stop ids, ignore_eos), as
    vLLM's SamplingParams. Nothing about text: decoding options and stop strings are the front end's
    (deploy/output.py), and the cache salt is the request's (cluster.engine.EngineRequest)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # ignore the model's own stop ids (vLLM's meaning)
    min_tokens: int = 0  # the stop ids are masked until this many tokens were generated
    logprobs: int | None = None  # how many top alternatives to report per token
    # penalties over the sequence's tokens (vLLM's / OpenAI's meanings): presence and frequency over
    # the generated tokens, repetition (divides positive logits, multiplies negative) over prompt and
    # generated tokens; min_p drops tokens below min_p × the best token's probability
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: str | None = None  # an llguidance grammar (Lark or its JSON form) every token must follow

    def __post_init__(self):
        def bad(field: str, why: str):
            raise ValueError(f"sampling parameter {field!r} {why}, got {getattr(self, field)!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not (0.0 <= self.temperature <= 100.0):
            bad("temperature", "must be in [0, 100]")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not isinstance(self.min_tokens, int) or not (0 <= self.min_tokens <= self.max_tokens):
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad("logprobs", "must be in [0, 20]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                bad(name, "must be in [-2, 2]")
        if not (0.0 < self.repetition_penalty <= 10.0):
            bad("repetition_penalty", "must be in (0, 10]")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if any(not (-100.0 <= b <= 100.0) or t < 0 for t, b in self.logit_bias):
            bad("logit_bias", "must map token ids >= 0 to biases in [-100, 100]")

    @property
    def penalised(self) -> bool:
        """Whether sampling this sequence needs its token history (penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def draw_seed(params: SamplingParams, context_len: int) -> int | None:
    """The seed of one draw of a seeded request: a function of the request's seed and the length
    of the context the token follows, nothing else. So a seeded request samples the same tokens
    alone or batched, before or after a preemption, on any replica — no sampler state to carry."""
    if params.greedy or params.seed is None:
        return None
    return (params.seed * 0x9E3779B1 + context_len * 0x85EBCA77) % (1 << 63)


def _filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [R, V] outside each row's top-k (0 = all) and nucleus top-p, by a full sort of
    every row: the reference algorithm, and :func:`_filter`'s fallback for a nucleus wider than its
    window."""
    V = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    drop = rank >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # mass strictly above this token
    drop |= before >= top_p[:, None]
    drop[:, 0] = False  # always keep the best token
    return logits.scatter(1, sorted_idx, sorted_logits.masked_fill(drop, float("-inf")))


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """:func:`_filter_sorted`'s result (the same kept tokens, the same values) from a ``topk`` window
    instead of a full sort: the best ``max(top_k)`` tokens when every row has a top-k (its nucleus
    lies inside them), else at least :data:`NUCLEUS_WINDOW`. A top-p row whose nucleus reaches the
    window's end is refiltered by the full sort. Rows [R, V]; top_k 0 = off, top_p 1 = off."""
    R, V = logits.shape
    window = int(top_k.max())
    if bool((top_k == 0).any()) or window > V:
        window = max(window, NUCLEUS_WINDOW)
    window = min(window, V)
    vals, idx = logits.topk(window, dim=-1)  # [R, W] descending
    rank = torch.arange(window, device=logits.device)[None, :]
    drop = rank >= torch.where(top_k > 0, top_k, V)[:, None]
    nucleus = top_p < 1.0
    if bool(nucleus.any()):
        probs = vals.masked_fill(drop, float("-inf")).softmax(-1)  # exact where the top-k fits the window
        wide = top_k == 0  # the mass outside the window counts: normalise over the whole row
        if bool(wide.any()):
            probs[wide] = logits[wide].softmax(-1).gather(1, idx[wide])
        before = probs.cumsum(-1) - probs  # mass strictly above this token
        drop |= nucleus[:, None] & (before >= top_p[:, None])
    drop[:, 0] = False  # always keep the best token
    out = torch.full_like(logits, float("-inf")).scatter_(1, idx, vals.masked_fill(drop, float("-inf")))
    spill = (~drop[:, -1]) & (top_k == 0) & (window < V)  # the nucleus may go on past the window
    if bool(spill.any()):
        rows = spill.nonzero().squeeze(1)
        out[rows] = _filter_sorted(logits[rows], top_k[rows], top_p[rows])
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]) -> torch.Tensor:
    """logits [B, V] → next token ids [B], on the logits' device. ``seeds[b]`` from :func:`draw_seed`
    (None: unseeded). Vectorised over the batch: rows without top-k/top-p skip the filter, and a
    seeded row draws exactly what ``torch.multinomial(probs_b, 1, generator=seeded)`` draws."""
    out = logits.argmax(-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    dev = logits.device
    every = len(rows) == len(params)
    index = None if every else torch.tensor(rows, device=dev)
    sub = logits if every else logits.index_select(0, index)  # [R, V]
    temp = torch.tensor([params[b].temperature for b in rows], dtype=sub.dtype, device=dev)
    # kept finite: a penalised logit near the dtype's max over a temperature below 1 would be inf (NaN softmax)
    scaled = (sub / temp[:, None]).clamp(max=torch.finfo(sub.dtype).max)
    floor = [i for i, b in enumerate(rows) if params[b].min_p > 0.0]
    if floor:  # min_p: drop tokens less likely than min_p × the row's best one
        at = torch.tensor(floor, device=dev)
        min_p = torch.tensor([params[rows[i]].min_p for i in floor], dtype=sub.dtype, device=dev)
        part = scaled.index_select(0, at)
        lp = part.log_softmax(-1)
        keep = lp >= lp.max(-1, keepdim=True).values + min_p.log()[:, None]
        scaled.index_copy_(0, at, part.masked_fill(~keep, float("-inf")))
    cut = [i for i, b in enumerate(rows) if params[b].top_k > 0 or params[b].top_p < 1.0]
    if cut:
        at = torch.tensor(cut, device=dev)
        top_k = torch.tensor([params[rows[i]].top_k for i in cut], device=dev)
        top_p = torch.tensor([params[rows[i]].top_p for i in cut], dtype=sub.dtype, device=dev)
        scaled.index_copy_(0, at, _filter(scaled.index_select(0, at), top_k, top_p))
    chosen = _draw(scaled.softmax(-1), [seeds[b] for b in rows])
    return chosen if every else out.index_copy_(0, index, chosen)


def _draw(probs: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
    """One token id per row of probs [R, V]. A seeded row repeats ``torch.multinomial``'s draw for one
    sample bit for bit (ATen: ``q = empty_like(p).exponential_(1, gen)``, ``argmax(p / q)``) with the
    row's own generator. Unseeded rows share one inverse-CDF draw: one uniform per row against the
    running sum (fp32; the CPU sums in fp64), the same distribution within an ulp of the total per token
    and far cheaper than a vocabulary of exponentials. Never a token of probability 0."""
    R, V = probs.shape
    dev = probs.device
    out = torch.empty(R, dtype=torch.long, device=dev)
    seeded = [i for i, s in enumerate(seeds) if s is not None]
    free = [i for i, s in enumerate(seeds) if s is None]
    if seeded:
        q = torch.empty(len(seeded), V, dtype=probs.dtype, device=dev)
        for j, i in enumerate(seeded):
            q[j].exponential_(1, generator=torch.Generator(dev).manual_seed(seeds[i]))
        at = torch.tensor(seeded, device=dev)
        p = probs if len(seeded) == R else probs.index_select(0, at)
        out.index_copy_(0, at, (p / q).argmax(-1))
    if free:
        at = torch.tensor(free, device=dev)
        p = probs if len(free) == R else probs.index_select(0, at)
        out.index_copy_(0, at, _inverse_cdf(p))
    return out


def _inverse_cdf(p: torch.Tensor) -> torch.Tensor:
    """One draw per row of p [F, V] (unnormalised is fine): the first token whose running sum passes
    ``uniform * total``. A token of probability 0 adds nothing to the sum, so it is never the first to
    pass; the clamp to the token completing the sum and the final check guard against rounding."""
    cdf = p.cumsum(-1)  # [F, V]
    total = cdf[:, -1:].contiguous()
    u = torch.rand(p.shape[0], 1, dtype=cdf.dtype, device=p.device) * total
    last = torch.searchsorted(cdf, total)  # the first index holding the whole mass: its token has p > 0
    tok = torch.minimum(torch.searchsorted(cdf, u, right=True), last)  # [F, 1]
    zero = p.gather(1, tok) <= 0
    if bool(zero.any()):  # only a scan that is not monotone (parallel fp32 rounding) gets here
        tok = torch.where(zero, p.argmax(-1, keepdim=True), tok)
    return tok.squeeze(1)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the chosen tokens [B] and the top-k alternatives ([B, k] ids, values)."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    top = lp.topk(max(k, 1), dim=-1)
    return chosen, top.indices[:, :k], top.values[:, :k]
