"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, per-request seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # ignore the model's own stop ids (vLLM's meaning)
    min_tokens: int = 0
    logprobs: int | None = None  # how many top alternatives to report per token

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


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [B, V] outside each row's top-k (0 = all) and nucleus top-p."""
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


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]) -> torch.Tensor:
    """logits [B, V] fp32 → next token ids [B]. ``seeds[b]`` from :func:`draw_seed` (None: unseeded)."""
    out = logits.argmax(-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    sub = logits[rows]
    temp = torch.tensor([params[b].temperature for b in rows], dtype=sub.dtype)
    top_k = torch.tensor([params[b].top_k for b in rows])
    top_p = torch.tensor([params[b].top_p for b in rows], dtype=sub.dtype)
    probs = _filter(sub / temp[:, None], top_k, top_p).softmax(-1)
    for i, b in enumerate(rows):  # one draw per sequence, each from its own generator
        gen = None if seeds[b] is None else torch.Generator().manual_seed(seeds[b])
        out[b] = torch.multinomial(probs[i], 1, generator=gen).item()
    return out


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the chosen tokens [B] and the top-k alternatives ([B, k] ids, values)."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    top = lp.topk(max(k, 1), dim=-1)
    return chosen, top.indices[:, :k], top.values[:, :k]
