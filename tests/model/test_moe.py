"""The routed experts' few-rows path (model/moe.py, ``_grouped_pair``): a decode step's few rows go
through a GEMM pair per expert that has rows instead of torch's grouped GEMM (which visits every expert
of the call). Both must give every row the same bits — every layout's exactness rests on it
(docs/architecture.md, "Exactness") — in fp32 and bf16, with any row count and spread."""

import pytest
import torch

from model.layers import SituGLU, silu_glu
from model.moe import FEW_ROWS, RoutedExperts, _expert_pairs, _grouped_pair, weighted_sum


def _grouped(xs, ends, w13, w2, act):
    offs = ends.to(torch.int32)
    gate, up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(act(gate, up), w2.transpose(1, 2), offs=offs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", [silu_glu, SituGLU(3.0, 10.0)], ids=["silu", "situ"])
def test_the_per_expert_pairs_give_the_grouped_gemms_bits(dtype, act):
    g = torch.Generator().manual_seed(0)
    for n, inter, hidden in ((32, 64, 256), (8, 32, 64), (64, 128, 512)):
        w13 = torch.randn(n, 2 * inter, hidden, generator=g).to(dtype)
        w2 = torch.randn(n, hidden, inter, generator=g).to(dtype)
        for rows in (1, 2, 3, 4, 8, 16, 33):
            ids = torch.randint(0, n, (rows,), generator=g).sort().values
            xs = torch.randn(rows, hidden, generator=g).to(dtype)
            ends = torch.cumsum(torch.bincount(ids, minlength=n), 0)
            want = _grouped(xs, ends, w13, w2, act)
            assert torch.equal(_expert_pairs(xs, ends.tolist(), w13, w2, act), want), (n, rows)
            assert torch.equal(_grouped_pair(xs, ends, w13, w2, act), want), (n, rows)  # whichever path it takes
    assert FEW_ROWS >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", [silu_glu, SituGLU(3.0, 10.0)], ids=["silu", "situ"])
def test_a_decode_steps_few_pairs_give_the_grouped_gemms_bits(dtype, act):
    """RoutedExperts' few-pairs path (a decode step's: pairs sorted on the host) against torch's
    grouped GEMMs over every held expert: the same bits — for forward (top-k pairs, some of them
    held elsewhere, two tokens on one expert) and for grouped (an expert actor's or worker's rows)."""
    g = torch.Generator().manual_seed(1)
    for n, inter, hidden, k in ((32, 64, 256, 4), (64, 128, 512, 8)):
        held = torch.randperm(n, generator=g)[: 3 * n // 4].tolist()  # local slot i holds expert held[i]
        m = RoutedExperts(hidden, inter, held, act)
        with torch.no_grad():
            m.w13.copy_(torch.randn(m.w13.shape, generator=g))
            m.w2.copy_(torch.randn(m.w2.shape, generator=g))
        m = m.to(dtype)
        slot = {e: i for i, e in enumerate(held)}
        for T in range(1, len(held) // (k * FEW_ROWS) + 1):  # every T the few-pairs path serves
            idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(T)])
            if T > 1:
                idx[1, 0] = idx[0, 1]  # two tokens on one expert: its GEMM over both rows
            x = torch.randn(T, hidden, generator=g).to(dtype)
            w = torch.rand(T, k, generator=g)
            pairs = sorted((slot[e], p) for p, e in enumerate(idx.reshape(-1).tolist()) if e in slot)
            slots = torch.tensor([s for s, _ in pairs])
            ends = torch.cumsum(torch.bincount(slots, minlength=len(held)), 0)
            ys = _grouped(x[torch.tensor([p // k for _, p in pairs])], ends, m.w13.detach(), m.w2.detach(), act)
            rows = torch.zeros(T * k, hidden, dtype=dtype)
            rows[torch.tensor([p for _, p in pairs])] = ys
            with torch.no_grad():
                assert torch.equal(m(x, idx, w), weighted_sum(rows.view(T, k, hidden), w).to(dtype)), (n, T)
                # grouped: the same pairs' rows, unsorted, through their slots
                perm = torch.randperm(len(pairs), generator=g)
                xin = x[torch.tensor([p // k for _, p in pairs])][perm]
                assert torch.equal(m.grouped(xin, slots[perm]), ys[perm]), (n, T)


def test_the_few_pairs_path_leaves_training_its_gradients():
    """With gradients on (training), few pairs take the differentiable path: the weights get gradients."""
    m = RoutedExperts(64, 32, range(32), silu_glu)
    with torch.no_grad():
        m.w13.normal_()
        m.w2.normal_()
    x = torch.randn(1, 64, requires_grad=True)
    m(x, torch.tensor([[3, 7, 11, 30]]), torch.rand(1, 4)).sum().backward()
    assert m.w13.grad is not None and m.w13.grad[[3, 7, 11, 30]].abs().sum() > 0 and x.grad.abs().sum() > 0
