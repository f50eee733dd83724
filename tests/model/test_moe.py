"""The routed experts' few-rows path (model/moe.py, ``_grouped_pair``): a decode step's few rows go
through a GEMM pair per expert that has rows instead of torch's grouped GEMM (which visits every expert
of the call). Both must give every row the same bits — every layout's exactness rests on it
(docs/architecture.md, "Exactness") — in fp32 and bf16, with any row count and spread."""

import pytest
import torch

from model.layers import SituGLU, silu_glu
from model.moe import FEW_ROWS, _expert_pairs, _grouped_pair


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
