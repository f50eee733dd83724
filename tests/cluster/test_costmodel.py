"""The GPU cost model (issue 27) against hand arithmetic for one Kimi K2 layer on an H200 (Must show 1),
its monotonicity, and its GPU data files. No Ray, no torch."""

import json
import math
from pathlib import Path

import pytest

from cluster.costmodel import (EFFICIENCY, GPU_DIR, attention_cost, exchange_cost, experts_cost, gpu_names,
                               load_gpu)
from model.config import load_config

ROOT = Path(__file__).parents[2]
K2 = load_config(ROOT / "tests" / "fixtures" / "configs" / "kimi-k2-instruct.json")
H200 = load_gpu("h200")

# the factors as documented in cluster/costmodel.py, written out so that a change to them fails here
HBM, GEMM, GROUPED, A2A = 0.80, 0.65, 0.60, 0.80
# H200 vendor figures (cluster/gpus/h200.json)
HBM_BW, BF16, FP8, NIC_BW, NIC_LAT, NVL_BW, NVL_LAT = 4.8e12, 989.4e12, 1978.9e12, 400e9 / 8, 9.6e-6, 450e9, 3.4e-6


def roofline(flops, nbytes, peak, eff):
    return max(flops / (peak * eff), nbytes / (HBM_BW * HBM))


def test_k2_config_is_model_spec():
    c = K2
    assert (c.hidden_size, c.num_hidden_layers, c.first_k_dense_replace, c.q_lora_rank, c.kv_lora_rank) == \
        (7168, 61, 1, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.num_attention_heads) == (128, 64, 128, 64)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.n_shared_experts, c.vocab_size) == \
        (384, 8, 2048, 1, 163840)
    assert EFFICIENCY == {"hbm": HBM, "gemm": GEMM, "grouped_gemm": GROUPED, "all_to_all": A2A}
    assert (H200.hbm_bytes_per_s, H200.bf16_flops_per_s, H200.fp8_flops_per_s, H200.nic_bytes_per_s) == \
        (HBM_BW, BF16, FP8, NIC_BW)
    assert H200.nic_latency_s == pytest.approx(NIC_LAT) and H200.nvlink_latency_s == pytest.approx(NVL_LAT)


def test_one_k2_layer_on_h200_by_hand():
    """64 decode tokens at 4,096 context; bf16 attention weights and latent cache; FP8 (128×128
    block) experts; 4 attention ranks and 12 expert ranks on different nodes, bf16 exchange."""
    # ---- attention rank: (flops, bytes) per op, 2 FLOPs per multiply-add, bf16 = 2 bytes
    hand = {
        "norms": (0, (7168 + 7168 + 1536 + 512) * 2),
        "q_a": (2 * 64 * 7168 * 1536, 1536 * 7168 * 2),
        "q_b": (2 * 64 * 1536 * (64 * 192), 64 * 192 * 1536 * 2),
        "kv_a": (2 * 64 * 7168 * 576, 576 * 7168 * 2),
        "w_uk": (2 * 64 * 64 * 128 * 512, 64 * 128 * 512 * 2),
        # per head: scores over 512 + 64 dims, weighted sum over 512, for 64 × 4,096 (query, entry)
        # pairs; the cache: 4,096 entries × 576 values × 2 bytes per sequence
        "core": (2 * 64 * 4096 * 64 * (576 + 512), 64 * 4096 * 576 * 2),
        "cache_write": (0, 64 * 576 * 2),
        "w_uv": (2 * 64 * 64 * 512 * 128, 64 * 128 * 512 * 2),
        "o_proj": (2 * 64 * 8192 * 7168, 7168 * 8192 * 2),
        "gate": (2 * 64 * 7168 * 384, 384 * 7168 * 2 + 384 * 4),
        "shared": (2 * 64 * 3 * 7168 * 2048, 3 * 7168 * 2048 * 2),
    }
    assert hand["core"] == (36_507_222_016, 301_989_888)
    attn = attention_cost(K2, H200, tokens=64, context=4096, weights="bf16", cache_bytes=2)
    assert {p.name: (p.flops, p.bytes) for p in attn.parts} == hand
    assert attn.flops == sum(f for f, _ in hand.values()) == 55_440_310_272
    assert attn.bytes == sum(b for _, b in hand.values()) == 597_927_424
    seconds = sum(roofline(f, b, BF16, GEMM) for f, b in hand.values())
    assert attn.seconds == pytest.approx(seconds, rel=1e-12)
    assert attn.by_kind()["hbm"].bytes == (7168 + 7168 + 1536 + 512) * 2 + 64 * 576 * 2

    # ---- routed experts: 3 matrices of 2048 × 7168 FP8 bytes + fp32 scales of 16 × 56 blocks
    per_expert = 3 * (2048 * 7168 + 4 * 16 * 56)
    assert per_expert == 44_050_944
    flops = 2 * 64 * 8 * 7168 * 2048 * 3
    assert flops == 45_097_156_608
    touched = 384 * (1 - (1 - 8 / 384) ** 64)  # expected distinct experts, uniform routing (≈ 284.2)
    uniform = experts_cost(K2, H200, tokens=64, weights="fp8")
    assert uniform.flops == flops
    assert uniform.bytes == pytest.approx(touched * per_expert, rel=1e-12)
    assert uniform.seconds == pytest.approx(roofline(flops, touched * per_expert, FP8, GROUPED), rel=1e-12)
    skewed = experts_cost(K2, H200, counts=[8] * 64 + [0] * 320, weights="fp8")  # the 512 pairs on 64 experts
    assert (skewed.flops, skewed.bytes) == (flops, 64 * per_expert) == (45_097_156_608, 2_819_260_416)
    assert skewed.seconds == pytest.approx(roofline(flops, 64 * per_expert, FP8, GROUPED), rel=1e-12)

    # ---- exchange: counts (12 ranks × 32 local experts × int64), then 64 × 8 rows of 7,168 bf16
    # values out and back; the attention rank is the busiest end (an expert rank moves 4·64·8/12 rows)
    counts, rows = 12 * 32 * 8, 64 * 8 * 7168 * 2
    assert rows == 7_340_032
    ex = exchange_cost(K2, H200, tokens=64, attention_ranks=4, expert_ranks=12, across_nodes=True)
    assert [(p.name, p.bytes) for p in ex.parts] == [("counts", counts), ("dispatch", rows), ("combine", rows)]
    assert ex.flops == 0 and ex.bytes == counts + 2 * rows == 14_683_136
    assert ex.seconds == pytest.approx(3 * NIC_LAT + (counts + 2 * rows) / (NIC_BW * A2A), rel=1e-12)
    inside = exchange_cost(K2, H200, tokens=64, attention_ranks=4, expert_ranks=12, across_nodes=False)
    assert inside.seconds == pytest.approx(3 * NVL_LAT + (counts + 2 * rows) / (NVL_BW * A2A), rel=1e-12)


def test_chunks_and_dense_wire_by_hand():
    # a prefill chunk of 512 tokens ending at 2,048: its cache is read once; token j attends 1,537 + j entries
    chunk = attention_cost(K2, H200, chunks=[(512, 2048)])
    core = {p.name: p for p in chunk.parts}["core"]
    assert core.flops == 2 * 64 * 1088 * (512 * 2048 - 512 * 511 // 2)
    assert core.bytes == 2048 * 576 * 2
    decode = attention_cost(K2, H200, chunks=[(1, 100), (1, 300)])
    assert decode == attention_cost(K2, H200, tokens=2, context=[100, 300])
    # dense wire (moeray's choice for ≤ k expert ranks): every token to each of 4 expert ranks with
    # 8 int32 ids and 8 fp32 weights; each token's 8 pair rows back (its owner sums them in top-k order)
    dense = exchange_cost(K2, H200, tokens=64, attention_ranks=2, expert_ranks=4, across_nodes=False, wire="dense")
    out, back = 4 * 64 * (7168 * 2 + 8 * 8), 64 * 8 * 7168 * 2
    assert [(p.name, p.bytes) for p in dense.parts] == [("dispatch", out), ("combine", back)]
    assert dense.seconds == pytest.approx(2 * NVL_LAT + (out + back) / (NVL_BW * A2A), rel=1e-12)
    # one expert rank sums each token itself: one row per token back
    one = exchange_cost(K2, H200, tokens=64, attention_ranks=2, expert_ranks=1, across_nodes=False, wire="dense")
    assert [(p.name, p.bytes) for p in one.parts] == [("dispatch", 64 * (7168 * 2 + 8 * 8) * 2),
                                                      ("combine", 2 * 64 * 7168 * 2)]


@pytest.mark.parametrize("name", ["a100", "h100", "h200", "b200"])
def test_more_work_never_costs_less(name):
    gpu = load_gpu(name)
    for fmt in ("bf16", "fp8", "int4", "mxfp4"):
        prev = None
        for tokens in (1, 2, 8, 64, 256, 2048):
            cost = (attention_cost(K2, gpu, tokens=tokens, context=4096, weights=fmt),
                    experts_cost(K2, gpu, tokens=tokens, weights=fmt),
                    experts_cost(K2, gpu, tokens=tokens, weights=fmt, experts_held=24),
                    exchange_cost(K2, gpu, tokens=tokens, attention_ranks=8, expert_ranks=24, across_nodes=True))
            if prev:
                for now, before in zip(cost, prev):
                    assert now.flops >= before.flops and now.bytes >= before.bytes and now.seconds >= before.seconds
                    assert now.seconds > 0
            prev = cost
    contexts = [attention_cost(K2, gpu, tokens=32, context=c) for c in (1, 512, 4096, 131072)]
    assert all(b.seconds >= a.seconds and b.bytes > a.bytes for a, b in zip(contexts, contexts[1:]))
    # the same 512 (token, expert) pairs: on 64 experts, 256 experts, and uniform (≈ 284 expected)
    skewed = experts_cost(K2, gpu, counts=[8] * 64 + [0] * 320)
    spread = experts_cost(K2, gpu, counts=[2] * 256 + [0] * 128)
    uniform = experts_cost(K2, gpu, tokens=64)
    assert skewed.flops == spread.flops == uniform.flops
    assert skewed.bytes < spread.bytes < uniform.bytes and skewed.seconds <= spread.seconds <= uniform.seconds
    for wire in ("sparse", "dense"):
        for a, x in ((1, 1), (4, 12), (16, 48)):
            kw = dict(tokens=64, attention_ranks=a, expert_ranks=x, wire=wire)
            assert exchange_cost(K2, gpu, across_nodes=True, **kw).seconds > \
                exchange_cost(K2, gpu, across_nodes=False, **kw).seconds


def test_bad_batches_are_value_errors():
    with pytest.raises(ValueError, match="weights"):
        attention_cost(K2, H200, tokens=1, context=8, weights="fp16")
    with pytest.raises(ValueError, match="context"):
        attention_cost(K2, H200, chunks=[(9, 8)])
    with pytest.raises(ValueError, match="context has 2 lengths"):
        attention_cost(K2, H200, tokens=3, context=[1, 2])
    with pytest.raises(ValueError, match="experts_touched"):
        experts_cost(K2, H200, tokens=1, experts_touched=9)
    with pytest.raises(ValueError, match="expert_ranks"):
        exchange_cost(K2, H200, tokens=1, attention_ranks=1, expert_ranks=0, across_nodes=False)
    assert attention_cost(K2, H200, tokens=0).seconds == experts_cost(K2, H200, tokens=0).seconds == 0


def test_gpu_files_load_with_every_field():
    assert {"a100", "h100", "h200", "b200"} <= set(gpu_names())
    for name in gpu_names():
        gpu = load_gpu(name)
        assert gpu.name and gpu.sources and gpu.gpus_per_node >= 1
        assert gpu.fp8_flops_per_s >= gpu.bf16_flops_per_s > 0 and gpu.nvlink_bytes_per_s > gpu.nic_bytes_per_s > 0
        assert gpu.hbm_bytes > 0 and gpu.hbm_bytes_per_s > 0 and gpu.nvlink_latency_s < gpu.nic_latency_s
    assert 'cluster = ["gpus/*.json"]' in (ROOT / "pyproject.toml").read_text()  # the files ship with the package


def test_a_missing_or_bad_field_is_named(tmp_path):
    raw = json.loads((GPU_DIR / "h200.json").read_text())
    del raw["nic_latency_us"]
    (tmp_path / "broken.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="nic_latency_us"):
        load_gpu("broken", tmp_path)
    raw["nic_latency_us"], raw["hbm_tb_per_s"] = 9.6, 0
    (tmp_path / "zero.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="hbm_tb_per_s"):
        load_gpu("zero", tmp_path)
    with pytest.raises(ValueError, match="unknown GPU 'tpu'"):
        load_gpu("tpu")
    assert math.isclose(load_gpu("b200").hbm_bytes_per_s, 8.0e12)
