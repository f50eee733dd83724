"""The simulator's step as a pipeline of micro-batches (issue 34, Must show 1-3): a hand timeline of
micro-batches through attention, dispatch, experts and combine against cluster/capacity/pipeline.py's cycle; one
full-batch K2 FP8 step on H200 against hand arithmetic, both layouts, 1-3 micro-batches, every exchange
model; and the room for sequences per layout (a dedicated attention GPU against a colocated one)."""

import math

import numpy as np
import pytest

from cluster.costmodel import EFFICIENCY, attention_cost, exchange_cost, expert_bytes, load_gpu
from cluster.capacity.pipeline import Stages, cycle_s, makespan_s, timeline
from cluster.planner import ATTENTION_WORKSPACE, DEVICES, EXPERT_WORKSPACE, plan_colocated, plan_shape, weight_bytes
from cluster.capacity.stepcost import GPU_OVERHEAD_S, GpuCost, Shape
from model.config import load_config
from model.params import cache_bytes_per_token

K2 = "tests/fixtures/configs/kimi-k2-instruct.json"
CTX = 4096 + 64  # a 4k prompt and its answer


# ---- Must show 2: the pipeline bound against a timeline drawn by hand ---------------------------------
def test_three_micro_batches_by_hand_equal_the_cycle():
    """Attention 3, dispatch 1, experts 2, combine 1 (the attention device binds: 3 · 3 = 9 > the chain,
    7), drawn by hand for two layers; then a case where one micro-batch's chain binds."""
    st = Stages(attention_s=3, dispatch_s=1, experts_s=2, combine_s=1)
    # (start, end) per micro-batch, stage by stage. Layer 1: attention back to back; each dispatch as its
    # attention ends; experts after the dispatch and the previous micro-batch's experts; combines likewise.
    layer1 = [[(0, 3), (3, 6), (6, 9)],
              [(3, 4), (6, 7), (9, 10)],
              [(4, 6), (7, 9), (10, 12)],
              [(6, 7), (9, 10), (12, 13)]]
    # Layer 2: micro-batch 0's combine ended at 7, but the attention device is busy until 9.
    layer2 = [[(9, 12), (12, 15), (15, 18)],
              [(12, 13), (15, 16), (18, 19)],
              [(13, 15), (16, 18), (19, 21)],
              [(15, 16), (18, 19), (21, 22)]]
    assert timeline(st, 3, 2, colocated=False) == layer1 + layer2
    assert cycle_s(st, 3, colocated=False) == 9 == layer2[0][0][0] - layer1[0][0][0]
    # the cycle repeats: every later layer starts 9 after the one before
    t = timeline(st, 3, 6, colocated=False)
    assert [t[4 * layer][0][0] for layer in range(6)] == [0, 9, 18, 27, 36, 45]

    # dispatch and combine 2 each: one micro-batch's chain (6) outlasts m · the busiest stage (2 · 2)
    st = Stages(attention_s=1, dispatch_s=2, experts_s=1, combine_s=2)
    t = timeline(st, 2, 3, colocated=False)
    assert [t[4 * layer][0] for layer in range(3)] == [(0, 1), (6, 7), (12, 13)]  # micro-batch 0 never waits
    assert cycle_s(st, 2, colocated=False) == 6 == st.chain_s
    # colocated: one device computes attention and experts, one link carries both exchanges
    st = Stages(attention_s=3, dispatch_s=1, experts_s=2, combine_s=1)
    t = timeline(st, 2, 8, colocated=True)
    assert t[4 * 7][0][0] - t[4 * 6][0][0] == cycle_s(st, 2, colocated=True) == 2 * (3 + 2)


@pytest.mark.parametrize("colocated", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_the_timeline_settles_to_the_cycle_and_costs_one_fill(m, colocated):
    """Random stage times: disaggregated, the per-layer period is the cycle and the whole step one fill
    more; colocated, the cycle bounds the period from below."""
    rng = np.random.default_rng(m + 10 * colocated)
    for _ in range(20):
        st = Stages(*rng.uniform(0.1, 3.0, 4))
        t = timeline(st, m, 400, colocated)
        # the mean over the last 200 layers: where the two bounds are close, a backlog builds up slowly
        period = (t[4 * 399][0][0] - t[4 * 199][0][0]) / 200
        if colocated:  # a bound: the engine's order (every attention, then every expert stage) may leave the
            # device waiting for a dispatch
            assert period >= cycle_s(st, m, True) * (1 - 1e-9)
        else:
            assert period == pytest.approx(cycle_s(st, m, False))
        if not colocated:  # the first micro-batch's chain, the others one busiest stage apart, L - 1 cycles
            assert makespan_s(st, m, 40, False) == pytest.approx(39 * cycle_s(st, m, False) + st.chain_s
                                                                 + (m - 1) * max(st.times()))


# ---- Must show 1: one full-batch K2 FP8 step on H200, by hand ----------------------------------------
@pytest.fixture(scope="module")
def k2():
    return load_config(K2)


def _hand_stages(cfg, gpu, *, batch, attention, experts, m, colocated, exchange, across_nodes):
    """One micro-batch's stages and the rest (dense layer, lm_head) of the whole batch, from the roofline
    definitions (cluster/costmodel.py's), written out here: uniform routing, every expert touched."""
    L, E, k, H = len(cfg.moe_layers), cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    mb = batch // m
    ta = attention_cost(cfg, gpu, tokens=mb, context=CTX, weights="fp8").seconds
    dense = attention_cost(cfg, gpu, tokens=batch, context=CTX, weights="fp8", moe=False).seconds
    head = max(2 * batch * cfg.vocab_size * H / (gpu.bf16_flops_per_s * EFFICIENCY["gemm"]),
               cfg.vocab_size * H * 2 / (gpu.hbm_bytes_per_s * EFFICIENCY["hbm"]))
    rest = (cfg.num_hidden_layers - L) * dense + head
    rows = attention * mb * k / experts  # every attention replica's micro-batch, spread evenly
    flops = 2 * rows * cfg.expert_hidden_size * cfg.moe_intermediate_size * 3
    te = max(flops / (gpu.fp8_flops_per_s * EFFICIENCY["grouped_gemm"]),
             (E / experts) * expert_bytes(cfg, "fp8") / (gpu.hbm_bytes_per_s * EFFICIENCY["hbm"]))
    if exchange == "moeray":
        cost = exchange_cost(cfg, gpu, tokens=mb, attention_ranks=attention, expert_ranks=experts,
                             across_nodes=across_nodes, wire="sparse")
        parts = {p.name: p.seconds for p in cost.parts}
        d, c = parts["counts"] + parts["dispatch"], parts["combine"]
    elif exchange == "fp8-ll":  # a copy per (token, expert), FP8 + scales out, bf16 back, all over RDMA
        bw, lat = gpu.nic_bytes_per_s * EFFICIENCY["all_to_all"], gpu.nic_latency_s
        busiest = max(mb * k, attention * mb * k / experts)
        d, c = lat + busiest * (H + H / 128 * 4) / bw, lat + busiest * H * 2 / bw
    else:
        bw, lat = gpu.nic_bytes_per_s * EFFICIENCY["all_to_all"], gpu.nic_latency_s
        p_node = lambda n: 1 - (1 - 1 / n) ** k  # noqa: E731
        if colocated:
            n = attention // 8
            copies = (n - 1) * p_node(n)
            d, c = lat + mb * copies * (H + H / 128 * 4) / bw, lat + mb * copies * H * 2 / bw
        else:
            nx, g = math.ceil(experts / 8), min(8, experts)
            d = lat + max(mb * nx * p_node(nx) * (H + H / 128 * 4), attention * mb * p_node(nx) * (H + H / 128 * 4) / g) / bw
            c = lat + max(mb * nx * p_node(nx) * H * 2, attention * mb * p_node(nx) * H * 2 / g) / bw
    return Stages(ta, d, te, c), rest


@pytest.mark.parametrize("exchange", ["moeray", "fp8-ll", "fp8-dedup"])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("batch", [256, 96])
@pytest.mark.parametrize("layout", ["colocated 16", "6 + 10"])
def test_a_full_batch_step_equals_hand_arithmetic(k2, layout, batch, m, exchange):
    gpu = load_gpu("h200")
    colocated = layout.startswith("colocated")
    A, X = (16, 16) if colocated else (6, 10)
    shape = Shape(A, X, colocated=colocated, micro_batches=m)
    cost = GpuCost(k2, gpu, shape, exchange=exchange)
    L, E = len(k2.moe_layers), k2.n_routed_experts
    mb = batch // m
    chunks = [[(1, CTX)] * batch] * A
    parts = [([[(1, CTX)] * mb] * A, np.full((L, X), A * mb * k2.num_experts_per_tok / X), np.full((L, X), E / X))
             for _ in range(m)]
    got = cost.step_parts(chunks, parts, shape, L)

    st, rest = _hand_stages(k2, gpu, batch=batch, attention=A, experts=X, m=m, colocated=colocated,
                            exchange=exchange, across_nodes=True)
    for name, a, b in zip(("attention", "dispatch", "experts", "combine"), st.times(),
                          (cost.moe_attention_s([(1, CTX)] * mb),
                           *cost.exchange_phases(mb, A, X, colocated=colocated)[:1],
                           float(cost.experts_s(parts[0][1], parts[0][2]).max(1).mean()),
                           cost.exchange_phases(mb, A, X, colocated=colocated)[1])):
        assert a == pytest.approx(b, rel=1e-9), name
    if colocated:
        moe = makespan_s(st, m, L, True)
        assert moe >= L * cycle_s(st, m, True) * (1 - 1e-9)
    else:  # the closed form: one chain, the other micro-batches one busiest stage behind, L - 1 cycles
        moe = (L - 1) * cycle_s(st, m, False) + st.chain_s + (m - 1) * max(st.times())
    assert got.seconds == pytest.approx(GPU_OVERHEAD_S + rest + moe, rel=1e-9)
    if m == 1:  # one micro-batch: nothing overlaps, the serial sum
        assert got.seconds == pytest.approx(GPU_OVERHEAD_S + rest + L * st.chain_s, rel=1e-9)
    # the experts' weights are read once per micro-batch: m micro-batches read them m times
    assert got.experts_s == pytest.approx(m * L * st.experts_s, rel=1e-9)


# ---- Must show 3: the room for sequences per layout --------------------------------------------------
def test_kv_room_per_layout_by_hand(k2):
    """K2 FP8 on H200 at 4,096 + 64 tokens: a dedicated attention GPU holds 368 sequences; a colocated
    worker at 16 GPUs also holds 1/16 of the experts and fits 148."""
    h200 = DEVICES["h200"]
    usable = int(h200.memory_bytes * 0.9)
    w = weight_bytes(k2)
    per_seq = cache_bytes_per_token(k2)["latent"] * CTX
    dedicated = (usable - w.attention - ATTENTION_WORKSPACE) // per_seq
    colocated = (usable - w.attention - math.ceil(k2.n_routed_experts / 16) * w.per_expert
                 - ATTENTION_WORKSPACE - EXPERT_WORKSPACE) // per_seq
    assert (dedicated, colocated) == (368, 148)
    afd = plan_shape(k2, model="k2", device=h200, nodes=2, gpus_per_node=8, attention=6, experts=10, context=CTX)
    col = plan_colocated(k2, model="k2", device=h200, nodes=2, gpus_per_node=8, workers=16, context=CTX)
    assert (afd.concurrent_sequences, col.concurrent_sequences) == (368, 148)
