"""Checkpoint weight formats: pure-torch (de)quantisation, MODEL_SPEC §1.10 and §3.11.

Three formats, each a pair of functions (quantise for writing test checkpoints,
dequantise for loading real ones):

- FP8 block (K2-Instruct, DeepSeek-V3): float8_e4m3fn weight + fp32 ``weight_scale_inv``
  per 128x128 block. Despite its name the scale is *multiplied*.
- INT4 (K2-Thinking, K2.5; compressed-tensors ``pack-quantized``): int32 words of eight
  offset-coded nibbles + bf16 per-group scale along the input dim.
- MXFP4 (K3; compressed-tensors ``mxfp4-pack-quantized``): uint8 bytes of two E2M1 codes
  + uint8 E8M0 per-group scale along the input dim.

Everything is vectorised and device-agnostic: the result lives on the input's device.
Shape or dtype problems are ``ValueError`` naming the tensor when ``name`` is given.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_MIN, INT4_MAX = -8, 7
# E2M1 magnitudes indexed by code bits 0..2; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E8M0_BIAS = 127


def _label(name: str | None) -> str:
    return f"tensor {name!r}" if name else "tensor"


def _check_dtype(t: Tensor, dtypes: tuple[torch.dtype, ...], what: str, name: str | None) -> None:
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{_label(name)}: {what} must be {want}, got {str(t.dtype).removeprefix('torch.')}")


def _check_shape(t: Tensor, shape: tuple[int, ...], what: str, name: str | None, why: str = "") -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{_label(name)}: {what} has shape {tuple(t.shape)}, expected {tuple(shape)}{why}"
        )


def _check_2d(t: Tensor, what: str, name: str | None) -> None:
    if t.ndim != 2:
        raise ValueError(f"{_label(name)}: {what} must be 2-D [out, in], got shape {tuple(t.shape)}")


def _expand_cols(scale: Tensor, group: int, cols: int) -> Tensor:
    """[out, G] per-group values -> [out, cols] per-element (last group may be partial)."""
    return scale.repeat_interleave(group, dim=1)[:, :cols]


# ---- FP8 block -----------------------------------------------------------------------


def dequant_fp8_block(
    weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128), *, name: str | None = None
) -> Tensor:
    """W[i, j] = Wq[i, j] * S[i // bo, j // bi] in fp32; shapes need not be multiples of the block."""
    _check_dtype(weight, (torch.float8_e4m3fn,), "weight", name)
    _check_dtype(scale_inv, (torch.float32,), "weight_scale_inv", name)
    _check_2d(weight, "weight", name)
    bo, bi = block
    out, inp = weight.shape
    grid = (math.ceil(out / bo), math.ceil(inp / bi))
    _check_shape(scale_inv, grid, "weight_scale_inv", name, f" for weight {tuple(weight.shape)} and block {block}")
    s = scale_inv.repeat_interleave(bo, dim=0)[:out]  # [out, in/bi]
    return weight.float() * _expand_cols(s, bi, inp)


def quant_fp8_block(
    w: Tensor, block: tuple[int, int] = (128, 128), *, name: str | None = None
) -> tuple[Tensor, Tensor]:
    """Per-block absmax scaling: S = amax / 448, Wq = e4m3(W / S). An all-zero block gets S = 1."""
    _check_2d(w, "weight", name)
    bo, bi = block
    out, inp = w.shape
    go, gi = math.ceil(out / bo), math.ceil(inp / bi)
    padded = torch.zeros(go * bo, gi * bi, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    amax = padded.view(go, bo, gi, bi).abs().amax(dim=(1, 3))  # [go, gi]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale = scale.clamp_min(torch.finfo(torch.float32).tiny)
    s = _expand_cols(scale.repeat_interleave(bo, dim=0)[:out], bi, inp)
    # clamp: amax / (amax / 448) may round a hair above 448, which e4m3fn would turn into NaN
    q = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


# ---- INT4, compressed-tensors pack-quantized -------------------------------------------

_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # element j of a word at bits [4j, 4j+3]


def pack_int4(
    w: Tensor, group_size: int = 32, *, name: str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Symmetric group quantisation as compressed-tensors does it (``calculate_qparams``):
    scale = amax / 7.5 (half the int4 range, 15 / 2), q = clamp(round(W / scale), -8, 7).
    This makes the +amax end clip from 7.5 to 7 — an error of half a step, the same bound
    as rounding — and uses the full [-8, 7] range. The scale is rounded to bf16 *before*
    quantising so that unpacking reproduces exactly the values quantised against.

    Returns (weight_packed int32 [out, ceil(in/8)], weight_scale bf16 [out, ceil(in/g)],
    weight_shape int32 [2]). Columns past ``in`` (padding) are coded as q = 0.
    """
    _check_2d(w, "weight", name)
    out, inp = w.shape
    groups = math.ceil(inp / group_size)
    wf = torch.zeros(out, groups * group_size, dtype=torch.float32, device=w.device)
    wf[:, :inp] = w.float()
    amax = wf.view(out, groups, group_size).abs().amax(dim=2)  # [out, G]
    scale = (amax / ((INT4_MAX - INT4_MIN) / 2)).clamp_min(torch.finfo(torch.float32).eps).to(torch.bfloat16)
    q = torch.round(wf / _expand_cols(scale.float(), group_size, wf.shape[1])).clamp(INT4_MIN, INT4_MAX)
    words = math.ceil(inp / 8)
    u = torch.full((out, words * 8), -INT4_MIN, dtype=torch.int64, device=w.device)  # q = 0 padding
    u[:, :inp] = q[:, :inp].to(torch.int64) - INT4_MIN  # offset coding: nibble = q + 8
    packed = (u.view(out, words, 8) << _NIBBLE_SHIFTS.to(w.device, torch.int64)).sum(dim=2)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement
    return packed, scale, torch.tensor([out, inp], dtype=torch.int32)


def unpack_int4(
    packed: Tensor, scale: Tensor, shape: Tensor | tuple[int, int], group_size: int = 32, *, name: str | None = None
) -> Tensor:
    """W[o, i] = (nibble(o, i) - 8) * scale[o, i // group_size], fp32 [out, in]."""
    _check_dtype(packed, (torch.int32,), "weight_packed", name)
    if not scale.is_floating_point():
        raise ValueError(f"{_label(name)}: weight_scale must be a float tensor, got {scale.dtype}")
    dims = [int(x) for x in (shape.tolist() if isinstance(shape, Tensor) else shape)]
    if len(dims) != 2 or min(dims) < 0:
        raise ValueError(f"{_label(name)}: weight_shape must be [out, in], got {dims}")
    out, inp = dims
    _check_2d(packed, "weight_packed", name)
    _check_shape(packed, (out, math.ceil(inp / 8)), "weight_packed", name, f" for weight_shape {dims}")
    _check_shape(scale, (out, math.ceil(inp / group_size)), "weight_scale", name,
                 f" for weight_shape {dims} and group_size {group_size}")
    # arithmetic shift then mask: the sign bits of the int32 never reach the low nibble
    nib = (packed.unsqueeze(-1) >> _NIBBLE_SHIFTS.to(packed.device)) & 0xF  # [out, words, 8]
    q = nib.reshape(out, -1)[:, :inp].float() + INT4_MIN
    return q * _expand_cols(scale.float(), group_size, inp)


# ---- MXFP4, compressed-tensors mxfp4-pack-quantized -------------------------------------


def _e2m1_table(device: torch.device) -> Tensor:
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mag, -mag])  # code -> value, 16 entries


def _e2m1_encode(x: Tensor) -> Tensor:
    """Nearest E2M1 code (ties to the even code, as IEEE rounding does) for |x| <= 6; uint8."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2
    a = x.abs().clamp(max=E2M1_MAX)
    lo = torch.bucketize(a, mids, right=False)  # a tie goes to the smaller magnitude
    hi = torch.bucketize(a, mids, right=True)  # a tie goes to the larger magnitude
    idx = torch.where((lo != hi) & (lo % 2 == 1), hi, lo)
    sign = (x < 0) & (idx > 0)  # no negative zero codes
    return (idx + 8 * sign.to(idx.dtype)).to(torch.uint8)


def pack_mxfp4(w: Tensor, group_size: int = 32, *, name: str | None = None) -> tuple[Tensor, Tensor]:
    """Per group of ``group_size`` input columns the smallest power of two s with amax / s <= 6
    (so nothing clips; an all-zero group gets s = 1), then each element rounds to the nearest
    E2M1 value of W / s. ``in`` must be even.

    Note: the OCP MX recipe (and compressed-tensors) instead takes s = 2^(floor(log2 amax) - 2),
    which can clip the group maximum to 6; ours never clips and is never coarser than 2x that.

    Returns (weight_packed uint8 [out, in/2], even column in the low nibble;
    weight_scale uint8 [out, ceil(in/g)], E8M0 = log2(s) + 127).
    """
    _check_2d(w, "weight", name)
    out, inp = w.shape
    if inp % 2:
        raise ValueError(f"{_label(name)}: MXFP4 packs two columns per byte; in = {inp} is odd")
    groups = math.ceil(inp / group_size)
    wf = torch.zeros(out, groups * group_size, dtype=torch.float32, device=w.device)
    wf[:, :inp] = w.float()
    amax = wf.view(out, groups, group_size).abs().amax(dim=2)  # [out, G]
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / E2M1_MAX)), torch.zeros_like(amax))
    # log2 may be off by an ulp: step so that amax / 2^exp <= 6 < amax / 2^(exp-1)
    exp = exp + (amax / torch.exp2(exp) > E2M1_MAX).float()
    exp = exp - ((amax > 0) & (amax / torch.exp2(exp - 1) <= E2M1_MAX)).float()
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)  # byte 255 is NaN in E8M0
    codes = _e2m1_encode(wf[:, :inp] / _expand_cols(torch.exp2(exp), group_size, inp))  # [out, in]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (exp + E8M0_BIAS).to(torch.uint8)


def unpack_mxfp4(packed: Tensor, scale: Tensor, group_size: int = 32, *, name: str | None = None) -> Tensor:
    """W[o, i] = e2m1(code[o, i]) * 2^(scale[o, i // group_size] - 127), fp32 [out, 2 * packed_cols]."""
    _check_dtype(packed, (torch.uint8,), "weight_packed", name)
    _check_dtype(scale, (torch.uint8,), "weight_scale", name)
    _check_2d(packed, "weight_packed", name)
    out, half = packed.shape
    inp = 2 * half
    _check_shape(scale, (out, math.ceil(inp / group_size)), "weight_scale", name,
                 f" for weight_packed {tuple(packed.shape)} (in = {inp}) and group_size {group_size}")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(out, inp)  # low nibble = even column
    values = _e2m1_table(packed.device)[codes.long()]
    s = torch.exp2(scale.float() - E8M0_BIAS)
    s = torch.where(scale == 255, torch.full_like(s, float("nan")), s)
    return values * _expand_cols(s, group_size, inp)
