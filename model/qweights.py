"""Quantised-resident weights: FP8 block, INT4 and MXFP4 matrices kept in their checkpoint format.

Owns: :class:`QuantTensor` (one logical ``[out, in]`` weight as the checkpoint stores it),
:class:`QuantStack` (``n`` same-shape ones, e.g. one projection of every expert an actor holds),
:class:`QuantLinear` (an ``nn.Linear`` replacement) and :class:`QuantRoutedExperts` (the
:class:`~model.moe.RoutedExperts` interface — ``expert_ids``, ``grouped``, ``weight_bytes``,
``forward`` — over checkpoint-format experts).
Never: changes a number. Every weight is dequantised by the same :mod:`model.quant` functions
the load-time path uses and cast to the compute dtype the same way, just later and only for
the experts that received rows (one expert's matrix at a time is the tile), so outputs are
bit-identical to load-time dequantisation (on CPU fp32, and on any device where the dense
path is used).

Storage: every buffer is kept as an *integer view* of the checkpoint bytes (fp8 → uint8, a
bf16 scale → int16, an fp32 scale → int32), so a module-wide ``.to(dtype)`` can never convert
a quantised tensor, and ``weight_bytes`` is exactly the checkpoint's bytes (weights + scales;
INT4's two-int ``weight_shape`` is kept as Python ints, not a tensor).

On CUDA, FP8 blocks whose dims are multiples of 128 go through :func:`fp8_block_matmul`
(``torch._scaled_mm`` per 128-wide K block with row-wise scales, fp32 accumulation — the
DeepSeek-V3 "dynamic" activation scheme of MODEL_SPEC §1.10). That path is guarded by the
device and untested here (no GPU); INT4/MXFP4 dequantise the tile to the compute dtype and
use a dense GEMM on every device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .moe import RoutedExperts, grouped_ffn
from .quant import FP8_MAX, dequant_fp8_block, unpack_int4, unpack_mxfp4

FORMATS = ("fp8", "int4", "mxfp4")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: Tensor) -> Tensor:
    """The same bytes as an integer tensor (immune to ``Module.to(dtype)``)."""
    return t.view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t


@dataclass(frozen=True)
class QuantTensor:
    """One logical weight ``shape = (out, in)`` in checkpoint format ``fmt``: ``data`` (fp8
    weight, int32 INT4 words or uint8 MXFP4 pairs) and ``scale`` (fp32 ``weight_scale_inv``
    per ``block``, or the per-``group`` INT4 / E8M0 scale). Made by the checkpoint reader."""

    fmt: str
    data: Tensor
    scale: Tensor
    shape: tuple[int, int]
    block: tuple[int, int] = (128, 128)
    group: int = 32
    name: str | None = None

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"tensor {self.name!r}: quantised format must be one of {FORMATS}, got {self.fmt!r}")

    def dequant(self) -> Tensor:
        """fp32 ``[out, in]``, exactly what the load-time path produces."""
        return dequantize(self.fmt, self.data, self.scale, self.shape, self.block, self.group, self.name)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale))


def dequantize(fmt: str, data: Tensor, scale: Tensor, shape: tuple[int, int], block: tuple[int, int],
               group: int, name: str | None = None) -> Tensor:
    if fmt == "fp8":
        return dequant_fp8_block(data, scale, block, name=name)
    if fmt == "int4":
        return unpack_int4(data, scale, shape, group, name=name)
    return unpack_mxfp4(data, scale, group, name=name)


class QuantStack(nn.Module):
    """``n`` quantised matrices of one format and shape, stacked on a leading dim (buffers)."""

    def __init__(self, parts: Sequence[QuantTensor]):
        super().__init__()
        if not parts:
            raise ValueError("a QuantStack needs at least one tensor")
        first = parts[0]
        for q in parts:
            if (q.fmt, q.shape, q.block, q.group) != (first.fmt, first.shape, first.block, first.group):
                raise ValueError(f"tensor {q.name!r}: format/shape {q.fmt} {q.shape} differs from "
                                 f"{first.name!r} ({first.fmt} {first.shape}); a stack holds one kind")
        self.fmt, self.shape, self.block, self.group = first.fmt, first.shape, first.block, first.group
        self.data_dtype, self.scale_dtype = first.data.dtype, first.scale.dtype
        self.register_buffer("data", torch.stack([_raw(q.data) for q in parts]))
        self.register_buffer("scale", torch.stack([_raw(q.scale) for q in parts]))

    def __len__(self) -> int:
        return self.data.shape[0]

    def part(self, j: int) -> tuple[Tensor, Tensor]:
        """(data, scale) of matrix ``j`` in their checkpoint dtypes."""
        return self.data[j].view(self.data_dtype), self.scale[j].view(self.scale_dtype)

    def dequant(self, j: int) -> Tensor:
        """Matrix ``j`` as fp32 ``[out, in]``."""
        data, scale = self.part(j)
        return dequantize(self.fmt, data, scale, self.shape, self.block, self.group)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale))


def fp8_fast_path(x: Tensor, stack: QuantStack) -> bool:
    """Whether :func:`fp8_block_matmul` applies: CUDA, FP8, 128x128 blocks, dims multiples of 128."""
    out, inp = stack.shape
    return (x.is_cuda and stack.fmt == "fp8" and stack.block == (128, 128) and out % 128 == 0
            and inp % 128 == 0 and hasattr(torch, "_scaled_mm"))


def fp8_block_matmul(x: Tensor, wq: Tensor, scale_inv: Tensor) -> Tensor:
    """``x [M, K] @ dequant(wq [N, K], scale_inv [N/128, K/128]).T`` on CUDA without dequantising W:
    per 128-wide K block, x is quantised per row to e4m3 (``s = amax / 448``) and one
    ``torch._scaled_mm`` with row-wise scales (x: ``s [M, 1]``, W: its block scale repeated over
    the block's 128 rows, ``[1, N]``) adds into an fp32 accumulator. Untested without a GPU."""
    M, K = x.shape
    N = wq.shape[0]
    pad = (-M) % 16  # _scaled_mm wants the row count a multiple of 16
    xf = F.pad(x.float(), (0, 0, 0, pad))
    acc = torch.zeros(M + pad, N, dtype=torch.float32, device=x.device)
    for kb in range(K // 128):
        xs = xf[:, kb * 128:(kb + 1) * 128]
        sx = (xs.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        xq = (xs / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        sw = scale_inv[:, kb].repeat_interleave(128).view(1, N).float()
        acc += torch._scaled_mm(xq, wq[:, kb * 128:(kb + 1) * 128].t(), scale_a=sx, scale_b=sw,
                                out_dtype=torch.float32)
    return acc[:M].to(x.dtype)


class QuantLinear(nn.Module):
    """A bias-free ``nn.Linear`` whose weight stays in checkpoint format; computes in ``dtype``."""

    def __init__(self, q: QuantTensor, dtype: torch.dtype):
        super().__init__()
        self.w = QuantStack([q])
        self.out_features, self.in_features = q.shape
        self.dtype = dtype

    @property
    def weight(self) -> Tensor:
        """The dequantised weight (for code that reads ``.weight``; built on each access)."""
        return self.w.dequant(0).to(self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if fp8_fast_path(x, self.w):
            return fp8_block_matmul(x, *self.w.part(0))
        return F.linear(x, self.weight)

    def weight_bytes(self) -> int:
        return self.w.nbytes()


class QuantRoutedExperts(nn.Module):
    """Logical experts ``expert_ids`` of one MoE layer, local slot i holding ``expert_ids[i]``, with
    gate/up/down projections in checkpoint format. Same interface as :class:`RoutedExperts`.

    Its six buffers (``{gate,up,down}_{data,scale}``) are its own and stacked per expert on dim 0,
    so :func:`model.moe.gather_experts` regroups slots of dense and quantised experts alike."""

    PROJS = ("gate", "up", "down")

    def __init__(self, expert_ids: Sequence[int], gate: QuantStack, up: QuantStack, down: QuantStack, act,
                 dtype: torch.dtype):
        super().__init__()
        self.expert_ids = tuple(int(e) for e in expert_ids)
        if len(set(self.expert_ids)) != len(self.expert_ids):
            raise ValueError(f"expert ids must be distinct, got {self.expert_ids}")
        if not len(gate) == len(up) == len(down) == len(self.expert_ids):
            raise ValueError(f"gate/up/down hold {len(gate)}/{len(up)}/{len(down)} experts, "
                             f"expected {len(self.expert_ids)}")
        self.meta = {}  # proj → (fmt, shape, block, group, data dtype, scale dtype)
        for proj, stack in zip(self.PROJS, (gate, up, down)):
            self.register_buffer(f"{proj}_data", stack.data)
            self.register_buffer(f"{proj}_scale", stack.scale)
            self.meta[proj] = (stack.fmt, stack.shape, stack.block, stack.group, stack.data_dtype, stack.scale_dtype)
        self.act, self.dtype = act, dtype
        self.hidden_size = down.shape[0]

    @property
    def device(self) -> torch.device:
        return self.gate_data.device

    def part(self, proj: str, e: int) -> tuple[Tensor, Tensor]:
        """(data, scale) of projection ``proj`` of local expert ``e`` in their checkpoint dtypes."""
        *_, data_dtype, scale_dtype = self.meta[proj]
        return getattr(self, f"{proj}_data")[e].view(data_dtype), getattr(self, f"{proj}_scale")[e].view(scale_dtype)

    def dequant(self, proj: str, e: int) -> Tensor:
        """Projection ``proj`` of local expert ``e`` as fp32 ``[out, in]`` (the load-time values)."""
        fmt, shape, block, group, *_ = self.meta[proj]
        return dequantize(fmt, *self.part(proj, e), shape, block, group)

    def _linear(self, x: Tensor, proj: str, e: int) -> Tensor:
        fmt, (out, inp), block, *_ = self.meta[proj]
        if x.is_cuda and fmt == "fp8" and block == (128, 128) and out % 128 == 0 and inp % 128 == 0:
            return fp8_block_matmul(x, *self.part(proj, e))
        return x @ self.dequant(proj, e).to(self.dtype).t()

    def grouped(self, x: Tensor, local_ids: Tensor) -> Tensor:
        """Row r of ``x`` [N, H] through local slot ``local_ids[r]``; returns [N, H] (unweighted).
        Only experts with rows are dequantised, one at a time."""
        return grouped_ffn(x, local_ids, len(self.expert_ids), self._expert)

    def _expert(self, e: int, xs: Tensor) -> Tensor:
        if xs.is_cuda and self.meta["gate"][0] == "fp8":
            h = torch.cat([self._linear(xs, "gate", e), self._linear(xs, "up", e)], -1)
        else:  # the exact load-time weight: [gate; up] rows in the compute dtype, one GEMM
            w13 = torch.cat([self.dequant("gate", e).to(self.dtype), self.dequant("up", e).to(self.dtype)])
            h = xs @ w13.t()  # [c, 2I]
        gate, up = h.chunk(2, dim=-1)
        return self._linear(self.act(gate, up), "down", e)

    def weight_bytes(self) -> int:
        """Checkpoint bytes of the experts held (weights + scales)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    forward = RoutedExperts.forward
