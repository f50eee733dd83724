"""Parameter counts and cache sizes against MODEL_SPEC §4 / §2.4 (Kimi K2-Instruct)."""

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
    mla_params,
)

K2_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "kimi-k2-instruct.json"

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
