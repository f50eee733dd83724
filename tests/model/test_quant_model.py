"""A model loaded from an FP8 / INT4 checkpoint written by `make-checkpoint` runs and equals the
model built from hand-dequantised weights (the reference), logits and greedy tokens."""

import pytest
import torch
from safetensors import safe_open

from model.config import load_config
from model.loader import load_model
from model.model import CausalLM, load_hf_weights
from model.presets import build_preset
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams


def _raw(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _hand_fp8(raw):
    """W = Wq · S, S repeated over 128×128 blocks — written here independently of model.quant."""
    out = {}
    for k, v in raw.items():
        if k.endswith("_scale_inv"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            s = raw[k + "_scale_inv"]
            s = s.repeat_interleave(128, 0)[: v.shape[0]].repeat_interleave(128, 1)[:, : v.shape[1]]
            out[k] = v.float() * s
        else:
            out[k] = v.float()
    return out


def _hand_int4(raw):
    out = {}
    for k, v in raw.items():
        if k.endswith("weight_packed"):
            base = k[: -len("_packed")]
            shifts = torch.arange(8, dtype=torch.int32) * 4
            q = ((v[..., None] >> shifts) & 0xF).reshape(v.shape[0], -1) - 8  # LSB nibble first, offset 8
            out[base] = q.float() * raw[base + "_scale"].float().repeat_interleave(32, 1)
        elif not (k.endswith("weight_scale") or k.endswith("weight_shape")):
            out[k] = v.float()
    return out


FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _hand_mxfp4(raw):
    """E2M1 nibbles (even column low), sign bit 3, E8M0 scale 2^(byte-127) per 32 columns."""
    out = {}
    table = torch.tensor(FP4 + [-x for x in FP4])
    for k, v in raw.items():
        if k.endswith("weight_packed"):
            base = k[: -len("_packed")]
            codes = torch.stack([v & 0xF, v >> 4], -1).reshape(v.shape[0], -1).long()
            scale = torch.pow(2.0, raw[base + "_scale"].float() - 127).repeat_interleave(32, 1)
            out[base] = table[codes] * scale
        elif not k.endswith("weight_scale"):
            out[k] = v.float()
    return out


@pytest.mark.parametrize("preset,quant,hand", [("kimi-k2-tiny", "fp8", _hand_fp8), ("kimi-k2-tiny", "int4", _hand_int4),
                                               ("kimi-k3-tiny", "mxfp4", _hand_mxfp4)])
def test_quantised_checkpoint_matches_dequantised_reference(tmp_path, preset, quant, hand):
    path = build_preset(preset, tmp_path / quant, quant=quant, seed=1)
    raw = _raw(path)
    if quant == "mxfp4":
        assert raw["model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"].dtype == torch.uint8
        assert raw["model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"].dtype == torch.uint8
        assert raw["model.layers.1.block_sparse_moe.routed_expert_down_proj.weight"].dtype == torch.bfloat16
    elif quant == "fp8":
        assert raw["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
        assert raw["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
        assert raw["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # the router is not quantised
        assert "model.layers.1.self_attn.q_a_proj.weight_scale_inv" in raw
    else:
        assert raw["model.layers.1.mlp.experts.0.gate_proj.weight_packed"].dtype == torch.int32
        assert raw["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.bfloat16  # only experts are int4
    loaded = load_model(path, progress=False)
    ref = CausalLM(load_config(path))
    load_hf_weights(ref, hand(raw))
    ids = list(range(5, 40))
    ref.to(torch.float32)
    a = ModelRunner(loaded, num_blocks=16, block_size=8, num_slots=2)
    b = ModelRunner(ref.eval(), num_blocks=16, block_size=8, num_slots=2)
    torch.testing.assert_close(a.full_logits(ids), b.full_logits(ids), atol=1e-6, rtol=0)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    assert generate(a, [ids], sp)[0].output_ids == generate(b, [ids], sp)[0].output_ids
