"""Weight formats (MODEL_SPEC §1.10, §3.11): hand-built bytes against hand-computed values,
then quantise → dequantise round trips with error bounds."""

from __future__ import annotations

import pytest
import torch

from model.quant import (
    dequant_fp8_block,
    pack_int4,
    pack_mxfp4,
    quant_fp8_block,
    unpack_int4,
    unpack_mxfp4,
)


def fp8(*bytes_: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    t = torch.tensor(bytes_, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return t.reshape(shape) if shape else t


def int32_words(*words: int) -> list[int]:
    """Unsigned 32-bit patterns → the signed values an int32 tensor stores."""
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


# ---- FP8 block ---------------------------------------------------------------------------


def test_fp8_hand_bytes_times_block_scale():
    # e4m3: 0x38 = 2^0 = 1.0; 0x40 = 2^1 = 2.0; 0x01 = subnormal 2^-6 * 1/8 = 2^-9;
    # 0xB8 = -1.0; 0x7E = 2^8 * 1.75 = 448 (max); 0x3C = 1.5; 0x00 = 0
    w = fp8(0x38, 0x40, 0x01, 0xB8, 0x7E, 0x3C, 0x00, 0xC0, shape=(2, 4))
    s = torch.tensor([[0.25]], dtype=torch.float32)
    got = dequant_fp8_block(w, s)
    want = torch.tensor([[1.0, 2.0, 2.0**-9, -1.0], [448.0, 1.5, 0.0, -2.0]]) * 0.25
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def test_fp8_scale_grid_for_ragged_shape():
    out, inp = 130, 260  # scale grid ceil(130/128) x ceil(260/128) = 2 x 3
    w = fp8(*([0x38] * (out * inp)), shape=(out, inp))  # all 1.0
    s = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    got = dequant_fp8_block(w, s)
    assert got.shape == (out, inp)
    # block interiors
    assert torch.all(got[:128, :128] == 1.0) and torch.all(got[:128, 128:256] == 2.0)
    assert torch.all(got[:128, 256:] == 3.0) and torch.all(got[128:, :128] == 4.0)
    assert torch.all(got[128:, 128:256] == 5.0) and torch.all(got[128:, 256:] == 6.0)
    # boundaries
    assert got[127, 127] == 1.0 and got[128, 127] == 4.0 and got[127, 128] == 2.0
    assert got[129, 259] == 6.0 and got[0, 255] == 2.0 and got[0, 256] == 3.0


def test_fp8_scale_is_multiplied_not_divided():
    w = fp8(0x40, shape=(1, 1))  # 2.0
    assert dequant_fp8_block(w, torch.tensor([[8.0]])).item() == 16.0


def test_fp8_quant_scale_is_amax_over_448_and_zero_blocks_are_safe():
    w = torch.zeros(130, 260)
    w[0, 0] = -896.0  # block (0, 0): amax 896 → scale 2
    w[129, 259] = 4.48  # block (1, 2): scale 0.01
    q, s = quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (2, 3)
    assert s[0, 0].item() == 2.0
    assert s[1, 2].item() == pytest.approx(0.01, rel=1e-6)
    assert torch.isfinite(s).all() and (s > 0).all()
    back = dequant_fp8_block(q, s)
    assert not back.isnan().any()
    assert back[0, 0].item() == -896.0  # the block max maps to ±448 exactly
    assert back[129, 259].item() == pytest.approx(4.48, rel=1e-6)
    assert torch.count_nonzero(back) == 2


def test_fp8_round_trip_error_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 2, 200)  # per-column magnitudes
    q, s = quant_fp8_block(w)
    back = dequant_fp8_block(q, s)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals; absolute <= half the
    # subnormal step 2^-9 / 2 in the scaled space for tiny values
    s_full = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    bound = w.abs() * 2.0**-4 + s_full * 2.0**-10
    assert ((back - w).abs() <= bound).all()
    # idempotent: values already on the grid come back exactly
    q2, s2 = quant_fp8_block(back)
    assert torch.equal(dequant_fp8_block(q2, s2), back)


def test_fp8_errors_name_the_tensor():
    w = fp8(*([0x38] * 12), shape=(3, 4))
    with pytest.raises(ValueError, match=r"'layers.0.q_a_proj.weight'.*weight_scale_inv.*\(2, 1\).*\(1, 1\)"):
        dequant_fp8_block(w, torch.ones(2, 1), name="layers.0.q_a_proj.weight")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequant_fp8_block(torch.ones(3, 4), torch.ones(1, 1), name="x")
    with pytest.raises(ValueError, match="float32"):
        dequant_fp8_block(w, torch.ones(1, 1, dtype=torch.bfloat16), name="x")


# ---- INT4 pack-quantized -----------------------------------------------------------------


def test_int4_hand_packed_words():
    # word 0x FEDCBA98: nibble j (bits 4j..4j+3, least significant first) = 8 + j → q = j
    # word 0x 76543210: nibble j = j → q = j - 8
    packed = torch.tensor([int32_words(0xFEDCBA98, 0x76543210), int32_words(0x0000000F, 0x88888888)], dtype=torch.int32)
    scale = torch.tensor([[0.5], [2.0]], dtype=torch.bfloat16)  # one group (16 columns < 32)
    got = unpack_int4(packed, scale, torch.tensor([2, 16], dtype=torch.int32))
    want = torch.tensor(
        [
            [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, -4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5],
            [14.0] + [-16.0] * 7 + [0.0] * 8,  # 0xF → q 7; 0x0 → q -8; 0x8 → q 0
        ]
    )
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def test_int4_groups_run_along_the_input_dim():
    packed = torch.tensor([int32_words(*([0x99999999] * 8))], dtype=torch.int32)  # 64 columns of q = 1
    scale = torch.tensor([[0.25, 3.0]], dtype=torch.bfloat16)
    got = unpack_int4(packed, scale, (1, 64))
    assert torch.equal(got[0, :32], torch.full((32,), 0.25)) and torch.equal(got[0, 32:], torch.full((32,), 3.0))


def test_int4_pack_matches_hand_words():
    # amax 7.5 → scale = amax / 7.5 = 1 exactly; -7.5 rounds (half to even) to q = -8
    w = torch.tensor([[float(j) for j in range(8)] + [-7.5] + [float(j - 8) for j in range(1, 8)] + [0.0] * 16])
    packed, scale, shape = pack_int4(w)
    assert packed.dtype == torch.int32 and packed.shape == (1, 4)
    assert scale.dtype == torch.bfloat16 and scale.shape == (1, 1)
    assert scale.item() == 1.0
    assert shape.dtype == torch.int32 and shape.tolist() == [1, 32]
    assert packed[0].tolist() == int32_words(0xFEDCBA98, 0x76543210, 0x88888888, 0x88888888)


def test_int4_round_trip():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 200, generator=g) * 0.02  # 200 columns: last word and group partial
    packed, scale, shape = pack_int4(w)
    assert packed.shape == (48, 25) and scale.shape == (48, 7) and shape.tolist() == [48, 200]
    back = unpack_int4(packed, scale, shape)
    s_full = scale.float().repeat_interleave(32, 1)[:, :200]
    # symmetric scale = amax / 7.5: |w / s| <= 7.5, so the error is half a step, plus what the
    # bf16 rounding of s (relative 2^-8) adds at the clipped end
    assert ((back - w).abs() <= (0.5 + 7.5 * 2.0**-8) * s_full).all()
    amax = torch.nn.functional.pad(w, (0, 24)).abs().view(48, 7, 32).amax(-1)
    assert torch.allclose(scale.float(), amax / 7.5, rtol=2.0**-8)
    # integer codes survive: w = q * 15/16 with -8 in every group has amax 7.5, so scale = 1
    # and round(q * 15/16) = q for every q in [-8, 7]
    q = torch.randint(-8, 8, (4, 64), generator=g).float()
    q[:, 0] = q[:, 32] = -8.0
    p, s, sh = pack_int4(q * 15 / 16)
    assert torch.equal(s.float(), torch.ones(4, 2))
    assert torch.equal(unpack_int4(p, s, sh), q)


def test_int4_errors_name_the_tensor():
    packed = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"'experts.3.w1'.*weight_scale.*\(2, 2\).*\(2, 1\)"):
        unpack_int4(packed, torch.ones(2, 2, dtype=torch.bfloat16), (2, 32), name="experts.3.w1")
    with pytest.raises(ValueError, match=r"'e'.*weight_packed.*\(2, 4\).*\(2, 8\)"):
        unpack_int4(packed, torch.ones(2, 2, dtype=torch.bfloat16), (2, 64), name="e")
    with pytest.raises(ValueError, match="int32"):
        unpack_int4(packed.to(torch.int64), torch.ones(2, 1, dtype=torch.bfloat16), (2, 32), name="e")


# ---- MXFP4 -------------------------------------------------------------------------------


def test_mxfp4_hand_packed_bytes():
    # 0x21: low nibble 1 → 0.5 (column 0), high nibble 2 → 1.0 (column 1)
    # 0x9F: low nibble F = sign + 7 → -6, high nibble 9 = sign + 1 → -0.5
    # 0x7C: low C = sign + 4 → -2, high 7 → 6; 0x53: low 3 → 1.5, high 5 → 3
    row = [0x21, 0x9F, 0x7C, 0x53] + [0x00] * 12  # columns 0..31, group 0
    row += [0x21, 0x64] + [0x00] * 14  # columns 32..63, group 1
    packed = torch.tensor([row], dtype=torch.uint8)
    scale = torch.tensor([[128, 125]], dtype=torch.uint8)  # E8M0: 2^1 and 2^-2
    got = unpack_mxfp4(packed, scale)
    want = torch.zeros(1, 64)
    want[0, :8] = torch.tensor([0.5, 1.0, -6.0, -0.5, -2.0, 6.0, 1.5, 3.0]) * 2.0
    want[0, 32:36] = torch.tensor([0.5, 1.0, 2.0, 4.0]) * 0.25  # 0x64: low 4 → 2, high 6 → 4
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def test_mxfp4_e8m0_extremes():
    packed = torch.tensor([[0x22] * 16], dtype=torch.uint8)  # every value 1.0
    assert unpack_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8)).unique().tolist() == [1.0]
    assert unpack_mxfp4(packed, torch.tensor([[0]], dtype=torch.uint8)).unique().tolist() == [2.0**-127]
    assert unpack_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8)).isnan().all()  # E8M0 NaN


def test_mxfp4_pack_matches_hand_bytes():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([1.0, 2.0, -12.0, -1.0])  # amax 12 → scale 2 (12 / 2 = 6)
    packed, scale = pack_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 16) and scale.shape == (1, 1)
    assert scale.item() == 128
    assert packed[0, :2].tolist() == [0x21, 0x9F]
    assert torch.equal(unpack_mxfp4(packed, scale), w)


def test_mxfp4_round_trip():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-4, 1, 96)
    packed, scale = pack_mxfp4(w)
    back = unpack_mxfp4(packed, scale)
    s = torch.exp2(scale.float() - 127).repeat_interleave(32, 1)
    amax = w.abs().view(40, 3, 32).amax(-1)
    ratio = amax / torch.exp2(scale.float() - 127)
    assert ((ratio > 3) & (ratio <= 6)).all()  # smallest power of two with nothing clipping
    # the E2M1 grid step is <= 1/4 of the value above 1 and 0.5 below: error <= half a step
    assert ((back - w).abs() <= torch.maximum(0.25 * w.abs(), 0.25 * s) + 1e-12).all()
    # values on the grid survive exactly
    codes = torch.randint(0, 16, (8, 64), generator=g)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])[codes]
    grid[:, 0] = 6.0  # fix each group's amax so the scale is 1
    grid[:, 32] = -6.0
    p, s2 = pack_mxfp4(grid * 0.125)
    assert torch.equal(unpack_mxfp4(p, s2), grid * 0.125)


def test_mxfp4_ties_round_to_even_code():
    w = torch.zeros(1, 32)
    w[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    back = unpack_mxfp4(*pack_mxfp4(w))
    assert back[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_mxfp4_errors_name_the_tensor():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"'k3.w2'.*weight_scale.*\(2, 2\).*\(2, 1\)"):
        unpack_mxfp4(packed, torch.zeros(2, 2, dtype=torch.uint8), name="k3.w2")
    with pytest.raises(ValueError, match="uint8"):
        unpack_mxfp4(packed, torch.zeros(2, 1, dtype=torch.float32), name="k3.w2")
    with pytest.raises(ValueError, match="odd"):
        pack_mxfp4(torch.zeros(2, 33), name="k3.w2")
