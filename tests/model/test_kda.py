"""Kimi Delta Attention oracles: chunked == recurrent == the closed-form recurrence written out
with explicit matrices (fp64) == transformers' reference kernels; the layer's prefill == decode ==
uneven chunks, batch == alone, and == transformers' ``KimiLinearDeltaAttention``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.cache import build_attn_meta
from model.config import parse_config
from model.kda import KimiDeltaAttention, chunk_kda, kda_gate, l2norm, recurrent_kda

REL = 1e-5  # tolerance relative to the reference's largest magnitude


def assert_near(got: torch.Tensor, ref: torch.Tensor, rel: float = REL) -> None:
    ref = ref.double()
    scale = ref.abs().max().item()
    assert scale > 1e-2, f"reference too small to compare ({scale})"
    torch.testing.assert_close(got.double(), ref, atol=rel * scale, rtol=0)


# ---- the kernels ---------------------------------------------------------------------------

def _inputs(B=2, T=77, H=3, K=16, V=12, seed=0, strong_decay=False):
    """Unscaled L2-normed q, k; v; log decay g; beta; a non-zero initial state. fp32."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = l2norm(r(B, T, H, K)), l2norm(r(B, T, H, K))
    v = r(B, T, H, V)
    if strong_decay:  # K3-like: g ∈ (−5, 0), Γ reaches far below fp32's exp range within a chunk
        g = -5 * torch.sigmoid(2 * r(B, T, H, K))
    else:
        g = -F.softplus(r(B, T, H, K) - 2)
    beta = torch.sigmoid(r(B, T, H))
    S0 = r(B, H, K, V)
    return q, k, v, g, beta, S0


def reference_kda(q, k, v, g, beta, S0):
    """S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ; o_t = S_tᵀ q_t. fp64, one
    sequence and head at a time, explicit matrices. q already scaled."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    q, k, v, g, beta, S0 = (t.double() for t in (q, k, v, g, beta, S0))
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    S_out = torch.zeros(B, H, K, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = S0[b, h].clone()
            for t in range(T):
                kt, b_t = k[b, t, h][:, None], beta[b, t, h]  # [K, 1]
                S = (eye - b_t * kt @ kt.T) @ torch.diag(g[b, t, h].exp()) @ S + b_t * kt @ v[b, t, h][None, :]
                o[b, t, h] = S.T @ q[b, t, h]
            S_out[b, h] = S
    return o, S_out


@pytest.mark.parametrize("strong_decay", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_and_recurrent_equal_reference(chunk_size, strong_decay):
    q, k, v, g, beta, S0 = _inputs(strong_decay=strong_decay)  # T = 77: not a multiple of 16 or 64
    qs = q * q.shape[-1] ** -0.5
    o_ref, S_ref = reference_kda(qs, k, v, g, beta, S0)
    o_c, S_c = chunk_kda(qs, k, v, g, beta, S0, chunk_size=chunk_size)
    o_r, S_r = recurrent_kda(qs, k, v, g, beta, S0)
    assert S_c.dtype == S_r.dtype == torch.float32
    for o, S in ((o_c, S_c), (o_r, S_r)):
        assert_near(o, o_ref)
        assert_near(S, S_ref)


def test_matches_transformers_kernels():
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention, recurrent_kimi_delta_attention)

    q, k, v, g, beta, S0 = _inputs(seed=1)
    qs = q * q.shape[-1] ** -0.5  # transformers scales q itself
    o_c, S_c = chunk_kda(qs, k, v, g, beta, S0)
    o_r, S_r = recurrent_kda(qs, k, v, g, beta, S0)
    o_hc, S_hc = chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=64, initial_state=S0.clone(),
                                            output_final_state=True)
    o_hr, S_hr = recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state=S0.clone(),
                                                output_final_state=True)
    for o_h, S_h in ((o_hc, S_hc), (o_hr, S_hr)):
        assert_near(o_c, o_h)
        assert_near(o_r, o_h)
        assert_near(S_c, S_h)
        assert_near(S_r, S_h)


def test_chunk_size_and_split_invariance():
    q, k, v, g, beta, S0 = _inputs(seed=2, T=100)
    o16, S16 = chunk_kda(q, k, v, g, beta, S0, chunk_size=16)
    o64, S64 = chunk_kda(q, k, v, g, beta, S0, chunk_size=64)
    assert_near(o16, o64)
    assert_near(S16, S64)
    cut = 37
    o_a, S_a = chunk_kda(*(t[:, :cut] for t in (q, k, v, g, beta)), S0)
    o_b, S_b = chunk_kda(*(t[:, cut:] for t in (q, k, v, g, beta)), S_a)
    assert_near(torch.cat([o_a, o_b], 1), o64)
    assert_near(S_b, S64)


def test_zero_steps_leave_state_unchanged():
    """The padding contract the layer relies on: g = 0, β = 0, k = 0 is the identity step."""
    q, k, v, g, beta, S0 = _inputs(seed=3, T=10)
    k[:, 4:], g[:, 4:], beta[:, 4:] = 0, 0, 0
    _, S_full = chunk_kda(q, k, v, g, beta, S0, chunk_size=8)
    _, S_head = chunk_kda(*(t[:, :4] for t in (q, k, v, g, beta)), S0, chunk_size=8)
    assert_near(S_full, S_head)


def test_gates_hand_computed():
    # Kimi Linear: g = −exp(A_log)·softplus(g_raw + dt_bias); A_log = ln 2 → exp = 2
    A_log = torch.full((1, 1, 2, 1), math.log(2.0))
    dt_bias = torch.tensor([0.0, 1.0, -1.0, 0.5])
    g_raw = torch.tensor([[0.0, 0.0], [0.0, 0.5]])  # [n_h = 2, d = 2]
    want = torch.tensor([[-2 * math.log(2.0), -2 * math.log(1 + math.e)],
                         [-2 * math.log(1 + math.exp(-1.0)), -2 * math.log(1 + math.e)]])
    got = kda_gate(g_raw, A_log, dt_bias, None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # K3: g = lb·sigmoid(exp(A_log)·(g_raw + dt_bias)); A_log [n_h]
    A_log = torch.tensor([math.log(2.0), 0.0])
    dt_bias = torch.tensor([0.0, math.log(3.0) / 2, 0.0, -100.0])
    g_raw = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    want = torch.tensor([[-2.5, -3.75], [-3.75, 0.0]])
    got = kda_gate(g_raw, A_log, dt_bias, -5.0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# ---- the layer -----------------------------------------------------------------------------

def _cfg(k3: bool = False):
    lac = {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1], "full_attn_layers": [2]}
    if k3:
        lac.update(gate_lower_bound=-5.0, use_full_rank_gate=True)
    raw = {
        "model_type": "kimi_linear", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "mla_use_nope": True, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_token": 2,
        "num_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
        "num_expert_group": 1, "topk_group": 1, "linear_attn_config": lac, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "model_max_length": 4096,
        "torch_dtype": "float32",
    }
    return parse_config(raw)


def _layer(k3: bool = False, seed: int = 0) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(_cfg(k3))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if name == "A_log":  # mild decays, so history reaches across chunks
                p.copy_(torch.log(0.1 + 0.9 * torch.rand(p.shape, generator=gen)))
            elif name == "dt_bias":
                p.copy_(0.5 * r - 1)
            elif name == "o_norm.weight":
                p.copy_(1 + 0.1 * r)
            elif "conv1d" in name:
                p.copy_(0.5 * r)
            else:  # Linear [out, in]
                p.copy_(r / math.sqrt(p.shape[1]))
    return layer.eval()


def _meta(query_lens, context_lens):
    return build_attn_meta(query_lens, context_lens, [[0]] * len(query_lens), block_size=1 << 16)


def _states(layer: KimiDeltaAttention, num_slots: int):
    n, d, W = layer.num_heads, layer.head_dim, layer.conv_kernel
    return torch.zeros(num_slots, 3, W - 1, n * d), torch.zeros(num_slots, n, d, d)


def _run_pieces(layer, x, pieces, slot=1, num_slots=3):
    """Feed one sequence in consecutive pieces of the given lengths; outputs and final states."""
    conv, rec = _states(layer, num_slots)
    outs, done = [], 0
    for n in pieces:
        meta = _meta([n], [done + n])
        outs.append(layer(x[done : done + n], meta, conv, rec, torch.tensor([slot])))
        done += n
    assert done == x.shape[0]
    return torch.cat(outs), conv[slot], rec[slot]


@pytest.mark.parametrize("k3", [False, True], ids=["kimi_linear", "k3"])
def test_prefill_equals_decode_equals_chunks(k3):
    layer = _layer(k3)
    x = torch.randn(80, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full, conv_f, rec_f = _run_pieces(layer, x, [80])
        assert full.abs().mean() > 0.1 and rec_f.abs().mean() > 0.02
        for pieces in ([1] * 80, [1, 2, 5, 72], [3, 1, 40, 36]):
            out, conv, rec = _run_pieces(layer, x, pieces)
            assert_near(out, full)
            assert_near(rec, rec_f)
            assert_near(conv, conv_f)
    # the conv state is the last W−1 raw projections
    torch.testing.assert_close(conv_f[0], layer.q_proj(x[-3:]).detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("steps, slots", [
    ([[7, 1, 20], [1, 9, 3], [1, 1, 1]], [4, 0, 2]),  # fresh prefills; mixed; all decode
    # decodes at different positions beside two chunks of different lengths, the chunks not first
    ([[5, 12, 3, 6, 9], [1, 30, 1, 11, 1], [1, 1, 1, 1, 1]], [5, 0, 2, 6, 4]),
], ids=["three", "decodes_and_chunks"])
def test_batch_equals_alone(steps, slots):
    layer = _layer(seed=1)
    gen = torch.Generator().manual_seed(6)
    B = len(steps[0])
    total = [sum(s[b] for s in steps) for b in range(B)]
    xs = [torch.randn(n, 64, generator=gen) for n in total]
    slots = torch.tensor(slots)
    others = [i for i in range(B + 2) if i not in slots.tolist()]
    with torch.no_grad():
        conv, rec = _states(layer, B + 2)
        conv[others], rec[others] = 7.0, 7.0  # rows of other sequences: must not be touched
        outs, done = [[] for _ in range(B)], [0] * B
        for ql in steps:
            x = torch.cat([xs[b][done[b] : done[b] + ql[b]] for b in range(B)])
            done = [done[b] + ql[b] for b in range(B)]
            meta = _meta(ql, done)
            if ql[0] == 1 and max(ql) > 1:  # a mixed step attends in groups
                assert len(meta.groups) > 1
            y = layer(x, meta, conv, rec, slots)
            for b, part in enumerate(y.split(ql)):
                outs[b].append(part)
        for b in range(B):
            alone, conv_b, rec_b = _run_pieces(layer, xs[b], [s[b] for s in steps])
            assert_near(torch.cat(outs[b]), alone)
            assert_near(rec[slots[b]], rec_b)
            assert_near(conv[slots[b]], conv_b)
        assert (conv[others] == 7.0).all() and (rec[others] == 7.0).all()


def test_matches_transformers_layer():
    import transformers
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    hf_cfg = transformers.KimiLinearConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_act="silu",
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": [1], "full_attn_layers": [2]})
    ours = _layer(seed=2)
    hf = KimiLinearDeltaAttention(hf_cfg, layer_idx=0).eval()
    sd = ours.state_dict()
    mapped = {
        "conv1d.weight": torch.cat([sd.pop(f"{s}_conv1d.weight") for s in "qkv"]),
        **{f"forget_gate.{name}": sd.pop(name) for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")},
        **sd,
    }
    hf.load_state_dict(mapped, strict=True)
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(8))  # two chunks of 64
    with torch.no_grad():
        want = hf(x[None])[0]
        got, _, _ = _run_pieces(ours, x, [70])
        got_dec, _, _ = _run_pieces(ours, x, [1] * 70)
    assert_near(got, want)
    assert_near(got_dec, want)


def test_parameter_names_and_k3_gate():
    kl, k3 = _layer(False), _layer(True, seed=3)
    common = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
              "v_conv1d.weight", "A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight",
              "o_norm.weight", "o_proj.weight"}
    shapes = dict(kl.named_parameters())
    assert set(shapes) == common | {"g_a_proj.weight", "g_b_proj.weight"}
    assert set(dict(k3.named_parameters())) == common | {"g_proj.weight"}
    assert shapes["A_log"].shape == (1, 1, 4, 1) and k3.A_log.shape == (4,)
    assert shapes["q_conv1d.weight"].shape == (64, 1, 4) and shapes["dt_bias"].dtype == torch.float32
    x = 3 * torch.randn(50, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        g = k3.gate(x)
    assert g.shape == (50, 4, 16) and g.dtype == torch.float32
    assert bool((g > -5).all()) and bool((g < 0).all())
    assert g.min() < -4 and g.max() > -1  # the range is actually exercised
