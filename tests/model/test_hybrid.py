"""Kimi K3 / Kimi Linear presets: cached decode == full recompute, batch == alone, and the K3
pieces (latent MoE, SiTU-GLU, the Kimi Linear gate-compat flag) against direct evaluations of
their formulas (MODEL_SPEC §3.7, §3.10)."""

import math

import pytest
import torch

from model.config import parse_config
from model.model import CausalLM, init_random_weights
from model.moe import Gate, MoE
from model.presets import preset_config
from model.runner import ModelRunner, Sequence, generate
from model.sampling import SamplingParams


def _model(name, seed=5):
    m = CausalLM(parse_config(preset_config(name)))
    init_random_weights(m, seed=seed, std=0.08)
    return m.eval()


@pytest.fixture(scope="module", params=["kimi-k3-tiny", "kimi-linear-tiny"])
def model(request):
    return _model(request.param)


def _close(got, ref):
    """fp32 chunked vs recurrent KDA differ by rounding (~1e-6 relative per layer; in float64 the
    gap falls to the fp32 casts of the gate, SiTU and residual mixes) — so the bound scales with
    the reference's magnitude, as in tests/model/test_kda.py."""
    torch.testing.assert_close(got, ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def _ids(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_every_k3_feature_is_on():
    cfg = parse_config(preset_config("kimi-k3-tiny"))
    assert cfg.kda.gate_lower_bound == -5.0 and cfg.kda.full_rank_gate and cfg.mla_output_gate
    assert cfg.rope.kind == "none" and cfg.hidden_act == "situ" and cfg.q_lora_rank
    assert cfg.routed_expert_hidden_size < cfg.hidden_size and cfg.latent_moe_use_norm
    assert cfg.attn_res_block_size and cfg.n_shared_experts == 2
    assert cfg.kda_layers and cfg.mla_layers and cfg.mla_layers[-1] == cfg.num_hidden_layers - 1


def test_cached_decode_equals_full_recompute(model):
    ids = _ids(90, 1)  # prefill crosses a KDA chunk boundary
    r = ModelRunner(model, num_blocks=64, block_size=4, num_slots=4)
    full = r.full_logits(ids)
    assert full.std() > 0.05
    seq = Sequence(0, ids[:70], 70, SamplingParams())
    got = [r.forward([seq], [70])[0]]
    for t in ids[70:]:
        seq.token_ids.append(t)
        got.append(r.forward([seq], [1])[0])
    _close(torch.stack(got), full[69:])


def test_chunked_prefill_equals_whole(model):
    ids = _ids(45, 2)
    r = ModelRunner(model, num_blocks=64, block_size=4, num_slots=4)
    full = r.full_logits(ids)
    seq = Sequence(0, ids, 45, SamplingParams())
    for n in (1, 7, 30):
        r.forward([seq], [n])
    _close(r.forward([seq], [7])[0], full[-1])


def test_batch_equals_each_alone(model):
    prompts = [_ids(n, 20 + n) for n in (2, 33, 9, 70)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = [generate(ModelRunner(model, num_blocks=64, block_size=4, num_slots=2), [p], sp)[0].output_ids
             for p in prompts]
    r = ModelRunner(model, num_blocks=128, block_size=4, num_slots=8)
    assert [s.output_ids for s in generate(r, prompts, sp)] == alone
    assert r.slots.num_free == 8 and r.allocator.num_free == 128  # everything released


def test_slot_reuse_starts_from_zero_state():
    m = _model("kimi-k3-tiny")
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    r = ModelRunner(m, num_blocks=32, block_size=4, num_slots=1)  # one slot, reused
    a = generate(r, [_ids(20, 3)], sp)[0].output_ids
    generate(r, [_ids(30, 4)], sp)
    assert generate(r, [_ids(20, 3)], sp)[0].output_ids == a


def _situ(a, b, beta=4.0, lin=25.0):
    return [beta * math.tanh(x / beta) / (1 + math.exp(-x)) * lin * math.tanh(y / lin) for x, y in zip(a, b)]


def test_latent_moe_equals_its_formula():
    cfg = parse_config(preset_config("kimi-k3-tiny"))
    moe = MoE(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(5, cfg.hidden_size, generator=g)
    got = moe(x)
    I = cfg.moe_intermediate_size
    for t in range(5):  # one token at a time, plain formulas
        s = torch.sigmoid(moe.gate.weight @ x[t])
        idx = torch.topk(s + moe.gate.e_score_correction_bias, cfg.num_experts_per_tok).indices
        w = s[idx] / s[idx].sum() * cfg.routed_scaling_factor
        x_lat = moe.routed_expert_down_proj.weight @ x[t]
        y_lat = torch.zeros(cfg.routed_expert_hidden_size)
        for j, e in enumerate(idx.tolist()):
            w13, w2 = moe.experts.w13[e], moe.experts.w2[e]
            h = torch.tensor(_situ((w13[:I] @ x_lat).tolist(), (w13[I:] @ x_lat).tolist()))
            y_lat += w[j] * (w2 @ h)
        y_lat = y_lat / torch.sqrt(y_lat.pow(2).mean() + cfg.rms_norm_eps) * moe.routed_expert_norm.weight
        sh = moe.shared_experts
        shared = sh.down_proj.weight @ torch.tensor(_situ((sh.gate_proj.weight @ x[t]).tolist(),
                                                          (sh.up_proj.weight @ x[t]).tolist()))
        expect = moe.routed_expert_up_proj.weight @ y_lat + shared
        torch.testing.assert_close(got[t], expect, atol=1e-5, rtol=1e-5)


def test_gate_unbiased_by_default_and_compat_flag_reproduces_biased_weights():
    raw = preset_config("kimi-linear-tiny")
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    weights = {}
    for flag in (False, True):
        gate = Gate(parse_config(raw, gate_bias_in_weights=flag))
        with torch.no_grad():
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(2)))
            gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 16))
        idx, w = gate(x)
        s = torch.sigmoid(x @ gate.weight.t())
        src = s + gate.e_score_correction_bias if flag else s
        picked = src.gather(1, idx)
        torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True) * 2.446)
        weights[flag] = w
    assert not torch.allclose(weights[False], weights[True])
