"""Parameter counts and cache sizes against MODEL_SPEC §4 / §2.4 / §3.6 (Kimi K2-Instruct,
Kimi-Linear-48B, Kimi K3)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from model.config import load_config, parse_config
from model.params import (
    ATTENTION_PARAMS,
    FFN_PARAMS,
    ParamReport,
    attention_kind,
    cache_bytes_per_token,
    count_params,
    ffn_kind,
    format_report,
    kda_params,
    mla_params,
    state_bytes_per_sequence,
)

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
K2_CONFIG = CONFIGS / "kimi-k2-instruct.json"
KL_CONFIG = CONFIGS / "kimi-linear-48b.json"
K3_CONFIG = CONFIGS / "kimi-k3-text.json"
MiB = 1 << 20

H, V = 7168, 163840


@pytest.fixture(scope="module")
def k2_raw() -> dict:
    return json.loads(K2_CONFIG.read_text())


@pytest.fixture(scope="module")
def k2():
    return load_config(K2_CONFIG)


@pytest.fixture(scope="module")
def report(k2) -> ParamReport:
    return count_params(k2)


def test_k2_per_module(report):
    assert report.mla_per_layer == 101_124_096
    assert report.q_lora is True
    assert report.moe_routed_experts == 16_911_433_728
    assert report.moe_shared_experts == 44_040_192
    assert report.moe_router == 2_752_512 + 384
    assert report.moe_block == 16_958_226_816
    assert report.moe_decoder_layer == 17_059_365_248
    assert report.dense_mlp_per_layer == 396_361_728
    assert report.dense_decoder_layer == 497_500_160
    assert report.embedding == 1_174_405_120
    assert report.lm_head == 1_174_405_120
    assert report.final_norm == H


def test_k2_totals(report):
    assert (report.n_dense_layers, report.n_moe_layers) == (1, 60)
    assert report.moe_layers_total == 1_023_561_914_880
    assert report.dense_layers_total == 497_500_160
    assert report.total == 1_026_408_232_448
    assert report.activated_per_token == 32_861_500_928
    assert report.activated_per_token_excl_embedding == 31_687_095_808


def test_k2_layers_breakdown(report):
    assert len(report.layers) == 61
    assert [lp.ffn_kind for lp in report.layers] == ["dense"] + ["moe"] * 60
    assert all(lp.attention_kind == "mla" for lp in report.layers)
    assert report.layers[0].total == 497_500_160
    assert report.layers[1].total == 17_059_365_248
    assert report.total == report.embedding + report.lm_head + report.final_norm + sum(
        lp.total for lp in report.layers
    )


def test_kind_registries(k2):
    for i in range(k2.num_hidden_layers):
        assert attention_kind(k2, i) in ATTENTION_PARAMS
        assert ffn_kind(k2, i) in FFN_PARAMS
    assert ffn_kind(k2, 0) == "dense" and ffn_kind(k2, 1) == "moe"


def test_mla_without_q_lora(k2_raw, report):
    cfg = parse_config({**k2_raw, "q_lora_rank": None})
    n_h, d_n, d_r, d_v, r_kv = 64, 128, 64, 128, 512
    # H·n_h(d_n+d_r) + H(r_kv+d_r) + r_kv + r_kv·n_h(d_n+d_v) + n_h·d_v·H
    expected = H * n_h * (d_n + d_r) + H * (r_kv + d_r) + r_kv + r_kv * n_h * (d_n + d_v) + n_h * d_v * H
    assert expected == 88_080_384 + 4_128_768 + 512 + 8_388_608 + 58_720_256 == 159_318_528
    assert mla_params(cfg) == expected
    r = count_params(cfg)
    assert r.q_lora is False
    assert r.mla_per_layer == expected
    assert r.total == report.total + 61 * (expected - 101_124_096)
    assert "no q-LoRA" in format_report(r)


def test_tied_embeddings(k2_raw, report):
    r = count_params(parse_config({**k2_raw, "tie_word_embeddings": True}))
    assert r.lm_head == 0
    assert r.total == report.total - V * H
    assert r.activated_per_token == report.activated_per_token - V * H
    assert r.activated_per_token_excl_embedding == r.activated_per_token


def test_no_moe_layers(k2_raw):
    r = count_params(parse_config({**k2_raw, "n_routed_experts": 0}))
    dense_layer = 101_124_096 + 3 * H * 18432 + 2 * H
    assert (r.n_dense_layers, r.n_moe_layers) == (61, 0)
    assert r.moe_decoder_layer == r.moe_block == r.moe_layers_total == 0
    assert r.total == r.activated_per_token == 2 * V * H + H + 61 * dense_layer
    assert "MoE" not in format_report(r)


def test_cache_bytes_per_token(k2):
    c = cache_bytes_per_token(k2)
    assert c["latent"] == 70_272 == 61 * (512 + 64) * 2
    assert c["naive"] == 2_498_560 == 61 * 64 * (128 + 64 + 128) * 2
    assert c["latent_per_layer"] == 1_152 and c["naive_per_layer"] == 40_960
    assert c["mla_layers"] == 61
    assert cache_bytes_per_token(k2, dtype_bytes=1)["latent"] == 35_136


def test_format_table(report):
    text = format_report(report)
    assert "1,026,408,232,448" in text
    assert "101,124,096" in text and "17,059,365,248" in text and "32,861,500,928" in text
    assert "\x1b[" not in text  # no colour codes
    for name, count in report.rows():
        assert f"{count:,}" in text


def test_format_json(report):
    data = json.loads(format_report(report, json=True))
    assert data["mla_per_layer"] == 101_124_096
    assert data["moe_decoder_layer"] == 17_059_365_248
    assert data["moe_layers_total"] == 1_023_561_914_880
    assert data["total"] == 1_026_408_232_448
    assert data["activated_per_token"] == 32_861_500_928
    assert data["embedding"] == 1_174_405_120
    assert "layers" not in data
    assert list(data) == list(report.to_dict())


def test_report_is_frozen(report):
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.total = 0  # type: ignore[misc]


# ---- Kimi Linear 48B (MODEL_SPEC §3.1, §4) ---------------------------------------------------

KL_H = 2304


@pytest.fixture(scope="module")
def kl():
    return load_config(KL_CONFIG)


@pytest.fixture(scope="module")
def kl_report(kl) -> ParamReport:
    return count_params(kl)


def test_kimi_linear_per_module(kl_report):
    r = kl_report
    assert (r.mla_per_layer, r.q_lora, r.mla_output_gate) == (29_114_880, False, False)
    assert (r.kda_per_layer, r.kda_full_rank_gate) == (39_514_272, False)
    assert r.moe_block == 1_819_607_296
    assert r.moe_routed_experts == 256 * 3 * KL_H * 1024 and r.moe_shared_experts == 3 * KL_H * 1024
    assert r.moe_router == 256 * KL_H + 256
    assert r.dense_mlp_per_layer == 63_700_992
    assert r.moe_latent_proj == r.latent_up_proj_per_moe_layer == 0
    assert r.attn_res_per_layer == r.attn_res_model == 0
    assert r.embedding == r.lm_head == 163840 * KL_H


def test_kimi_linear_layers_and_total(kl, kl_report):
    r = kl_report
    assert (r.n_kda_layers, r.n_mla_layers, r.n_dense_layers, r.n_moe_layers) == (20, 7, 1, 26)
    mla = [lp.index for lp in r.layers if lp.attention_kind == "mla"]
    assert mla == [3, 7, 11, 15, 19, 23, 26]  # 1-based full_attn_layers 4, 8, …, 27
    assert [attention_kind(kl, i) for i in (0, 3, 25, 26)] == ["kda", "mla", "kda", "mla"]
    assert r.layers[0].attention_kind == "kda" and r.layers[0].ffn_kind == "dense"
    assert r.layers[0].total == 39_514_272 + 63_700_992 + 2 * KL_H == r.dense_decoder_layer
    assert r.layers[3].total == 29_114_880 + 1_819_607_296 + 2 * KL_H
    assert r.mla_layers_attention_total == 7 * 29_114_880
    assert r.kda_layers_attention_total == 20 * 39_514_272
    assert r.total == 49_122_681_728
    assert r.total == 2 * 163840 * KL_H + KL_H + 20 * 39_514_272 + 7 * 29_114_880 + 26 * 1_819_607_296 \
        + 63_700_992 + 27 * 2 * KL_H
    assert round(r.activated_per_token / 1e9, 2) == 3.48  # §4: ≈ 3.48B, 3.11B excl. input embedding
    assert round(r.activated_per_token_excl_embedding / 1e9, 2) == 3.11


def test_kda_formula_by_hand(kl):
    H, n, d, W = KL_H, 32, 128, 4
    P = n * d
    # qkv, convs, A_log, f_a, f_b, dt_bias, b_proj, g_a + g_b, o_norm, o_proj
    assert kda_params(kl) == 3 * H * P + 3 * P * W + n + H * d + d * P + P + H * n + (H * d + d * P) + d + P * H
    assert kda_params(load_config(K2_CONFIG)) == 0  # no KDA config


def test_kimi_linear_cache_and_state(kl):
    c = cache_bytes_per_token(kl)
    assert (c["mla_layers"], c["latent_per_layer"], c["latent"]) == (7, 1_152, 8_064)
    s = state_bytes_per_sequence(kl)
    assert s["kda_layers"] == 20
    assert s["recurrent_per_layer"] == 2 * MiB == 32 * 128 * 128 * 4
    assert s["recurrent"] == 40 * MiB
    assert s["conv_per_layer"] == 73_728 == 3 * 4096 * 3 * 2
    assert s["total"] == 20 * (2 * MiB + 73_728)
    assert state_bytes_per_sequence(kl, dtype_bytes=4)["conv_per_layer"] == 2 * 73_728
    assert state_bytes_per_sequence(kl, dtype_bytes=4)["recurrent_per_layer"] == 2 * MiB  # always fp32


# ---- Kimi K3 (MODEL_SPEC §3.9, §4) -----------------------------------------------------------

K3_H = 7168


@pytest.fixture(scope="module")
def k3():
    return load_config(K3_CONFIG)


@pytest.fixture(scope="module")
def k3_report(k3) -> ParamReport:
    return count_params(k3)


def test_k3_per_module(k3_report):
    r = k3_report
    assert (r.n_kda_layers, r.n_mla_layers, r.n_dense_layers, r.n_moe_layers) == (69, 24, 1, 92)
    assert (r.mla_per_layer, r.q_lora, r.mla_output_gate) == (232_196_096, True, True)
    assert (r.kda_per_layer, r.kda_full_rank_gate) == (443_740_384, True)
    assert r.moe_routed_experts == 29_595_009_024
    assert r.moe_shared_experts == 132_120_576
    assert r.moe_router == 6_423_424
    assert r.moe_latent_proj == 51_383_808 == 2 * 25_690_112 + 3_584
    assert r.latent_up_proj_per_moe_layer == 25_690_112
    assert r.moe_block == 29_784_936_832
    assert r.dense_mlp_per_layer == 726_663_168
    assert (r.attn_res_per_layer, r.attn_res_model) == (4 * K3_H, 2 * K3_H)


def test_k3_total(k3_report):
    r = k3_report
    assert 92 * r.latent_up_proj_per_moe_layer == 2_363_490_304
    assert r.total == 2_779_484_476_000
    assert r.total == 2 * 163840 * K3_H + K3_H + 2 * K3_H + 69 * 443_740_384 + 24 * 232_196_096 \
        + 92 * 29_784_936_832 + 726_663_168 + 93 * 6 * K3_H
    assert r.layers[0].attention_kind == "kda" and r.layers[0].attn_res == 4 * K3_H
    assert r.layers[92].attention_kind == "mla" and r.layers[91].attention_kind == "mla"
    assert r.layers[90].attention_kind == "kda"
    assert round(r.activated_per_token / 1e9, 2) == 105.36  # §4
    assert round(r.activated_per_token_excl_embedding / 1e9, 2) == 104.19


def test_k3_switches_one_at_a_time(k3):
    """Each K3 switch changes the count by its §4 term."""
    raw = dict(k3.raw)
    base = count_params(k3).total
    lac = raw["linear_attn_config"]
    low_rank = count_params(parse_config({**raw, "linear_attn_config": {**lac, "use_full_rank_gate": False}}))
    assert base - low_rank.total == 69 * (K3_H * 12288 - (K3_H * 128 + 128 * 12288))
    ungated = count_params(parse_config({**raw, "mla_use_output_gate": False}))
    assert base - ungated.total == 24 * K3_H * 96 * 128
    no_res = count_params(parse_config({**raw, "attn_res_block_size": None}))
    assert base - no_res.total == 93 * 4 * K3_H + 2 * K3_H and no_res.attn_res_model == 0
    no_norm = count_params(parse_config({**raw, "latent_moe_use_norm": False}))
    assert base - no_norm.total == 92 * 3_584


def test_k3_cache_and_state(k3):
    c = cache_bytes_per_token(k3)
    assert (c["mla_layers"], c["latent"]) == (24, 27_648)
    s = state_bytes_per_sequence(k3)
    assert (s["kda_layers"], s["recurrent_per_layer"], s["conv_per_layer"]) == (69, 6 * MiB, 221_184)
    assert s["recurrent"] == 414 * MiB and s["total"] == 69 * (6 * MiB + 221_184)


def test_k2_has_no_kda_state(k2, report):
    assert state_bytes_per_sequence(k2)["total"] == 0 and state_bytes_per_sequence(k2)["kda_layers"] == 0
    assert (report.n_mla_layers, report.n_kda_layers, report.kda_per_layer) == (61, 0, 0)
    assert report.attn_res_model == report.moe_latent_proj == 0


K2_KEYS = [  # the JSON keys the K2 report had before Kimi Linear: stable, in this order
    "embedding", "lm_head", "final_norm", "mla_per_layer", "q_lora", "dense_mlp_per_layer", "moe_routed_experts",
    "moe_shared_experts", "moe_router", "moe_block", "moe_block_activated", "layer_norms_per_layer",
    "dense_decoder_layer", "moe_decoder_layer", "n_dense_layers", "n_moe_layers", "dense_layers_total",
    "moe_layers_total", "total", "activated_per_token", "activated_per_token_excl_embedding",
]


@pytest.mark.parametrize("which", ["k2", "kl", "k3"])
def test_json_keys_stable_and_extended(which, report, kl_report, k3_report):
    r = {"k2": report, "kl": kl_report, "k3": k3_report}[which]
    data = json.loads(format_report(r, json=True))
    assert list(data)[: len(K2_KEYS)] == K2_KEYS
    for key in ("n_kda_layers", "n_mla_layers", "kda_per_layer", "latent_up_proj_per_moe_layer",
                "moe_latent_proj", "attn_res_per_layer", "attn_res_model", "mla_output_gate"):
        assert key in data, key
    assert data == r.to_dict() and "layers" not in data


def test_format_tables_for_kimi_linear_and_k3(kl_report, k3_report):
    kl_text = format_report(kl_report)
    assert "49,122,681,728" in kl_text and "39,514,272" in kl_text and "29,114,880" in kl_text
    assert "KDA" in kl_text and "(×20)" in kl_text and "(×7)" in kl_text and "latent" not in kl_text
    k3_text = format_report(k3_report)
    for n in ("2,779,484,476,000", "232,196,096", "443,740,384", "29,784,936,832", "25,690,112", "726,663,168"):
        assert n in k3_text, n
    assert "output gate" in k3_text and "full-rank" in k3_text
    for r, text in ((kl_report, kl_text), (k3_report, k3_text)):
        for _, count in r.rows():
            assert f"{count:,}" in text


def test_verify_state_bytes_are_what_a_kda_layer_keeps():
    """The bytes the planner counts for verifying drafts on a hybrid model are the tensors a KDA layer
    keeps for the step's acceptance (per-position states and conv inputs), layer for layer; the
    peak adds one layer's per-position states held twice while they are stacked."""
    import torch

    from model.cache import build_attn_meta
    from model.kda import KimiDeltaAttention
    from model.params import verify_state_bytes
    from model.presets import preset_config

    cfg = parse_config(preset_config("kimi-k3-tiny"))
    layer = KimiDeltaAttention(cfg).float()
    k, B, Q = cfg.kda, 3, 4
    meta = build_attn_meta([Q] * B, [10] * B, [[b] for b in range(B)], 16, state_slots=list(range(B)), verify=[True] * B)
    conv = torch.zeros(B, 3, k.conv_kernel - 1, k.num_heads * k.head_dim)
    recurrent = torch.zeros(B, k.num_heads, k.head_dim, k.head_dim)
    keep = []
    layer(torch.randn(B * Q, cfg.hidden_size), meta, conv, recurrent, torch.arange(B), keep)
    v = verify_state_bytes(cfg, B, Q, dtype_bytes=4)
    assert sum(states.nbytes + hist.nbytes for _, states, hist in keep) * len(cfg.kda_layers) == v["kept"]
    assert v["stacking"] == keep[0][1].nbytes and v["total"] == v["kept"] + v["stacking"]
    assert verify_state_bytes(load_config(K2_CONFIG), 8, 5)["total"] == 0  # no KDA layers
