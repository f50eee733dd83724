"""What the exchange tests compare bit for bit: the single process's routed rows
(``RoutedExperts.forward`` of every expert over one step's tokens) and the exchanges' answers.

Owns: the test experts (the same weights for a logical expert wherever it lives), the single-process
oracle over every rank's tokens, and the tally of rows that differ. Never: starts processes."""

from __future__ import annotations

import torch

from model.layers import silu_glu
from model.moe import RoutedExperts

H, I, E, K = 16, 8, 10, 3
DTYPES = (torch.bfloat16, torch.float32)
FORMATS = ("dense", "sparse")


def row_by_row(ex: RoutedExperts) -> RoutedExperts:
    """``ex`` running each row through its expert's GEMM alone. A replicated expert's rows are split
    between its copies, so each copy's GEMM has fewer rows than the single process's, and a CPU BLAS
    may round a row differently with another row count (docs/architecture.md, "Exactness"): the
    replicated cases so check what the exchange owes, the same bits from the same expert rows."""
    grouped = ex.grouped
    ex.grouped = lambda x, local: torch.cat([grouped(x[i: i + 1], local[i: i + 1]) for i in range(len(x))]) \
        if len(x) else grouped(x, local)
    return ex


def experts(ids, layer: int, dtype: torch.dtype, one_row_gemms: bool = False) -> RoutedExperts:
    """Logical experts ``ids`` of MoE ``layer`` in ``dtype``, the same weights wherever they live."""
    g = torch.Generator().manual_seed(layer)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3
    ex = RoutedExperts(H, I, ids, silu_glu).to(dtype)
    with torch.no_grad():
        ex.w13.copy_(w13[list(ids)])
        ex.w2.copy_(w2[list(ids)])
    return row_by_row(ex) if one_row_gemms else ex


def single(whole: RoutedExperts, parts: list, rank: int) -> torch.Tensor:
    """The single process's routed rows of ``rank``'s tokens: every rank's tokens (``parts[s]`` =
    (x, topk_idx, topk_w)) in one batch, in rank order, the batch each expert's GEMM sees in the
    exchange too."""
    x, idx, w = (torch.cat([p[i] for p in parts]) for i in range(3))
    start = sum(len(p[0]) for p in parts[:rank])
    return whole(x, idx, w)[start: start + len(parts[rank][0])]


class Tally:
    """Rows compared, rows that differ in any bit, and the largest difference."""

    def __init__(self):
        self.unequal, self.rows, self.diff = 0, 0, 0.0

    def check(self, got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
        self.unequal += int((got != want).any(1).sum())
        self.rows += len(got)
        if len(got):
            self.diff = max(self.diff, float((got.float() - want.float()).abs().max()))

    def answer(self) -> tuple[int, int, float]:
        return self.unequal, self.rows, self.diff
