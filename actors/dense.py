"""The dense exchange format's expert side: the pairs an expert actor (or a colocated worker) runs of
every rank's tokens, and which of their rows go back — a token whose k pairs one actor runs comes
back as one row, its sum; any other as one unweighted row per pair (actors/dispatch.py has the format
and its combine, ``_DenseBack``)."""

from __future__ import annotations

import torch

from model.moe import RoutedExperts, weighted_sum


def dense_returns(actor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense combine's rows, from each pair's expert actor ``actor`` [T, k]: a token whose k pairs
    one actor runs comes back as one row, its sum (carried by slot 0); any other token as one
    unweighted row per pair. → (whole [T]: tokens summed where they ran, returned [T, k]: pairs with a
    row back)."""
    whole = (actor == actor[:, :1]).all(1)  # [T]
    returned = torch.ones_like(actor, dtype=torch.bool)
    returned[:, 1:] = ~whole[:, None]
    return whole, returned


def whole_few(actor: list[list[int]]) -> list[bool]:
    """:func:`dense_returns`' ``whole`` from ``actor`` as lists (a decode step's few pairs, on the host):
    the tokens whose k pairs one actor runs (their slot 0 alone comes back, carrying the sum)."""
    return [all(a == row[0] for a in row) for row in actor]


def serve_dense(experts: RoutedExperts, x: torch.Tensor, w: torch.Tensor, actor: torch.Tensor, local: torch.Tensor,
                 me: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert actor ``me``'s side of the dense format: the pairs it runs of N tokens (``x`` [N, H],
    weights ``w`` [N, k] fp32, each pair's expert actor ``actor`` and local slot ``local`` [N, k]).
    Returns (rows [R, H] back, in batch order — each sender's a contiguous run; rows per token [N];
    the local slot of every pair run [P])."""
    N, k = actor.shape
    if N * k <= FEW_PAIRS and x.device.type == "cpu" and device.type == "cpu":
        y, per_token, served = serve_dense_few(experts, x, w, actor.tolist(), local.tolist(), me, k)
        return y, torch.tensor(per_token, dtype=torch.long), served
    mine = actor == me  # [N, k]
    pairs = mine.reshape(-1).nonzero().squeeze(1)  # [P] this actor's pairs, in batch order
    if pairs.numel() == N * k:  # every pair here (one actor): each token's sum goes back, one row
        served = local.reshape(-1)
        y = experts.grouped(x[pairs // k].to(experts.device), served.to(experts.device)).to(device)  # [N·k, H]
        return weighted_sum(y.view(N, k, x.shape[1]), w), torch.ones(N, dtype=torch.long, device=device), served
    whole, returned = dense_returns(actor)
    served = local.reshape(-1)[pairs]
    y = experts.grouped(x[pairs // k].to(experts.device), served.to(experts.device)).to(device)  # [P, H] unweighted
    summed = (whole & mine[:, 0]).nonzero().squeeze(1)  # [n] tokens whose k pairs all ran here
    if summed.numel():
        at = (torch.cumsum(mine.reshape(-1), 0) - 1).view(N, k)[summed]  # [n, k] their rows in y
        y[at[:, 0]] = weighted_sum(y[at], w[summed])  # slot 0's row carries the token's sum
    back = mine & returned  # [N, k]
    return y[back.reshape(-1)[pairs]], back.sum(1), served


FEW_PAIRS = 64  # a dense step of up to this many pairs keeps its bookkeeping on the host (serve_dense_few)


def serve_dense_few(experts: RoutedExperts, x: torch.Tensor, w: torch.Tensor, actor: list[list[int]],
                    local: list[list[int]], me: int, k: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """:func:`serve_dense` for a decode step's few pairs on CPU, the same bits (its rows per token a
    list): the same expert call over
    the same rows and the same :func:`weighted_sum` for the tokens summed here, with the pairs'
    bookkeeping (which are here, which tokens come back summed, which rows go back) done on the host
    from ``actor`` and ``local`` as lists — ~15 small tensor ops a MoE layer fewer. A loop over the
    step's few pairs on the host (at most :data:`FEW_PAIRS`), not a tensor loop."""
    N = len(actor)
    pairs = [(t, j) for t in range(N) for j in range(k) if actor[t][j] == me]  # batch order
    served_t = torch.tensor([local[t][j] for t, j in pairs], dtype=torch.long)
    y = experts.grouped(x[[t for t, _ in pairs]].to(experts.device), served_t.to(experts.device)).to(x.device)  # [P, H]
    if len(pairs) == N * k:  # every pair here (one actor): each token's sum goes back, one row
        return weighted_sum(y.view(N, k, x.shape[1]), w), [1] * N, served_t
    whole = whole_few(actor)
    summed = [t for t in range(N) if whole[t] and actor[t][0] == me]  # ... this one
    if summed:
        first = {t: i for i, (t, j) in reversed(list(enumerate(pairs)))}  # a token's first row in y
        at = torch.tensor([[first[t] + j for j in range(k)] for t in summed])  # [n, k]
        y[at[:, 0]] = weighted_sum(y[at], w[summed])  # slot 0's row carries the token's sum
    keep = [i for i, (t, j) in enumerate(pairs) if j == 0 or not whole[t]]  # the rows that go back
    per_token = [0] * N
    for i in keep:
        per_token[pairs[i][0]] += 1
    return y[keep], per_token, served_t
