"""The vectorised sampler against the one it replaced (issue 10): the same tokens for the same seeds —
greedy, temperature, top-p, top-k, both, mixed batches of seeded and greedy rows — on many random
logits (several vocabularies up to Kimi's 163,840), and the same logprobs. Unseeded rows draw by a
different (cheaper) method: they are checked for their distribution and never to pick a masked token.
Also: which path each batch takes (no filter, topk window, full-sort fallback)."""

import random

import pytest
import torch

import model.sampling as sampling
from actors.attention import AttentionWorker
from actors.messages import SampledToken
from model.sampling import SamplingParams, draw_seed, sample, top_logprobs


# ---- the reference oracle: the sampler before issue 10, copied verbatim from model/sampling.py ------
# (only renamed: _filter → old_filter, sample → old_sample). Do not "fix" it: it defines the tokens
# the new sampler must reproduce.
def old_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
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


def old_sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]) -> torch.Tensor:
    """logits [B, V] fp32 → next token ids [B]. ``seeds[b]`` from :func:`draw_seed` (None: unseeded)."""
    out = logits.argmax(-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    sub = logits[rows]
    temp = torch.tensor([params[b].temperature for b in rows], dtype=sub.dtype)
    top_k = torch.tensor([params[b].top_k for b in rows])
    top_p = torch.tensor([params[b].top_p for b in rows], dtype=sub.dtype)
    probs = old_filter(sub / temp[:, None], top_k, top_p).softmax(-1)
    for i, b in enumerate(rows):  # one draw per sequence, each from its own generator
        gen = None if seeds[b] is None else torch.Generator().manual_seed(seeds[b])
        out[b] = torch.multinomial(probs[i], 1, generator=gen).item()
    return out


def old_package(seq_ids, logits, next_ids, params) -> tuple[SampledToken, ...]:
    """AttentionWorker._package before issue 10, verbatim (logits on the host)."""
    k = max((p.logprobs or 0) for p in params)
    want = any(p.logprobs is not None for p in params)
    chosen, top_ids, top_vals = top_logprobs(logits, next_ids, k) if want else (None, None, None)
    out = []
    for i, (sid, tok, p) in enumerate(zip(seq_ids, next_ids.tolist(), params)):
        if p.logprobs is None:
            out.append(SampledToken(sid, tok))
            continue
        top = tuple(zip(top_ids[i, : p.logprobs].tolist(), top_vals[i, : p.logprobs].tolist()))
        out.append(SampledToken(sid, tok, float(chosen[i]), top))
    return tuple(out)
# -------------------------------------------------------------------------------------------------------

KINDS = ("greedy", "temperature", "top_p", "top_k", "top_k+top_p")


def _params(kind: str, rng: random.Random, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0 if kind == "greedy" else rng.choice([0.3, 0.8, 1.0, 1.7]),
                          top_p=rng.choice([0.3, 0.8, 0.95]) if "top_p" in kind else 1.0,
                          top_k=rng.choice([1, 2, 20, 300, 1500]) if "top_k" in kind else 0,
                          seed=rng.randrange(1 << 40), logprobs=logprobs)


def _batch(V: int, seed: int, kinds=KINDS, batch: int | None = None):
    """Random logits [B, V] (peaked or flat) and one random request per row, every sampled row seeded."""
    rng = random.Random(seed)
    B = batch or rng.choice([1, 2, 5, 9])
    scale = rng.choice([0.5, 1.0, 3.0, 6.0])
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * scale
    params = [_params(rng.choice(kinds), rng) for _ in range(B)]
    seeds = [draw_seed(p, rng.randrange(1, 4000)) for p in params]
    return logits, params, seeds


@pytest.mark.parametrize("V", [3, 50, 1000, 32000])
@pytest.mark.parametrize("seed", range(12))
def test_same_tokens_as_the_old_sampler(V, seed):
    logits, params, seeds = _batch(V, seed)
    assert sample(logits, params, seeds).tolist() == old_sample(logits, params, seeds).tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_same_tokens_at_kimi_vocabulary(kind, seed):
    logits, params, seeds = _batch(163840, 100 + seed, kinds=(kind,), batch=3)
    assert sample(logits, params, seeds).tolist() == old_sample(logits, params, seeds).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_mixed_batches_of_seeded_and_greedy_rows(seed):
    """Every kind in one batch, greedy rows between them; each row also equals itself sampled alone."""
    logits, params, seeds = _batch(4096, 200 + seed, batch=12)
    params[::3] = [SamplingParams() for _ in params[::3]]
    seeds[::3] = [None for _ in seeds[::3]]
    got = sample(logits, params, seeds).tolist()
    assert got == old_sample(logits, params, seeds).tolist()
    assert got == [sample(logits[b : b + 1], params[b : b + 1], seeds[b : b + 1]).item() for b in range(12)]


def test_a_changed_seed_changes_the_tokens():
    """The comparison can fail: the same logits with other seeds give other tokens."""
    logits, params, seeds = _batch(32000, 7, kinds=("temperature",), batch=8)
    other = [s + 1 for s in seeds]
    assert sample(logits, params, other).tolist() != old_sample(logits, params, seeds).tolist()


def test_logprobs_unchanged():
    rng = random.Random(3)
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(3)) * 3
    params = [_params(k, rng, lp) for k, lp in zip(KINDS + ("temperature",), [None, 0, 3, 20, None, 5])]
    seeds = [draw_seed(p, 17) for p in params]
    ids = sample(logits, params, seeds)
    assert ids.tolist() == old_sample(logits, params, seeds).tolist()
    seq_ids = list(range(10, 16))
    assert AttentionWorker._package(seq_ids, logits, ids, params) == old_package(seq_ids, logits, ids, params)


def _spy(monkeypatch, name):
    calls = []
    real = getattr(sampling, name)
    monkeypatch.setattr(sampling, name, lambda *a: calls.append(a[0].shape) or real(*a))
    return calls


def test_no_filter_without_top_k_or_top_p(monkeypatch):
    calls = _spy(monkeypatch, "_filter")
    logits, params, seeds = _batch(1000, 1, kinds=("greedy", "temperature"), batch=8)
    sample(logits, params, seeds)
    assert calls == []


def test_top_k_and_a_narrow_nucleus_use_the_topk_window_not_a_full_sort(monkeypatch):
    full = _spy(monkeypatch, "_filter_sorted")
    window = _spy(monkeypatch, "_filter")
    peaked = torch.randn(4, 163840, generator=torch.Generator().manual_seed(0)) * 6
    params = [SamplingParams(temperature=1.0, top_k=50, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, seed=3), SamplingParams()]
    seeds = [draw_seed(p, 5) for p in params]
    assert sample(peaked, params, seeds).tolist() == old_sample(peaked, params, seeds).tolist()
    assert window == [torch.Size([2, 163840])] and full == []  # only the two rows that cut, no sort


def test_a_wide_nucleus_falls_back_to_the_full_sort(monkeypatch):
    full = _spy(monkeypatch, "_filter_sorted")
    flat = torch.randn(2, 163840, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1), SamplingParams(temperature=1.0, top_k=5, seed=2)]
    seeds = [draw_seed(p, 9) for p in params]
    assert sample(flat, params, seeds).tolist() == old_sample(flat, params, seeds).tolist()
    assert full == [torch.Size([1, 163840])]  # the top-p row only: a top-k row never spills


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.8),
                                    SamplingParams(temperature=1.0, top_k=4, top_p=0.9)])
def test_unseeded_rows_follow_the_filtered_distribution(params):
    """Unseeded rows are drawn by inverse CDF, not by multinomial: the frequencies of 40,000 draws match
    the old sampler's probabilities, and a masked token is never drawn."""
    n, logits = 40000, torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0, 0.2]])
    torch.manual_seed(0)
    got = torch.bincount(sample(logits.expand(n, -1).contiguous(), [params] * n, [None] * n), minlength=7) / n
    top_k, top_p = torch.tensor([params.top_k]), torch.tensor([params.top_p])
    want = old_filter(logits / params.temperature, top_k, top_p).softmax(-1)[0]
    assert got[want == 0].sum() == 0
    assert torch.allclose(got, want, atol=0.01), (got, want)
