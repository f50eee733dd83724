"""The capacity planner against hand arithmetic (issue 11, Must show 3) and the preflight that
refuses a shape the cluster cannot hold before reserving anything (Must show 4)."""

import json
import math
from pathlib import Path

import pytest
from cli_runner import in_process
from ray.util.placement_group import placement_group_table

from cluster.engine import Engine, EngineConfig
from cluster.planner import (ATTENTION_WORKSPACE, DEVICES, EXPERT_WORKSPACE, format_plan, plan_colocated, plan_shape,
                             propose, sequence_bytes, weight_bytes)
from cluster.preflight import PreflightError, check
from cluster.spec import ClusterSpec, NodeInfo
from model.config import load_config
from model.presets import build_preset

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"
K2 = load_config(CONFIGS / "kimi-k2-instruct.json")
K3 = load_config(CONFIGS / "kimi-k3-text.json")
H200 = DEVICES["h200"]


def test_k2_fp8_weight_bytes_by_hand():
    # routed experts: 60 MoE layers × 384 experts × (gate, up, down) of 2048 × 7168 fp8 bytes, plus one
    # fp32 weight_scale_inv of 16 × 56 (or 56 × 16) blocks per matrix
    per_matrix = 2048 * 7168 + 4 * 16 * 56
    routed = 60 * 384 * 3 * per_matrix
    assert routed == 1_014_933_749_760
    # everything else: fp8 linears (+ 128×128 block scales), bf16 norms / router / embeddings, fp32 bias
    fp8 = lambda o, i: o * i + 4 * math.ceil(o / 128) * math.ceil(i / 128)
    mla = fp8(1536, 7168) + fp8(12288, 1536) + fp8(576, 7168) + fp8(16384, 512) + fp8(7168, 8192) + 2 * (1536 + 512)
    norms = 2 * 2 * 7168
    dense = 2 * fp8(18432, 7168) + fp8(7168, 18432)
    shared = 2 * fp8(2048, 7168) + fp8(7168, 2048)
    router = 2 * 384 * 7168 + 4 * 384
    rest = 61 * (mla + norms) + dense + 60 * (shared + router) + 2 * 2 * 163840 * 7168 + 2 * 7168
    w = weight_bytes(K2)
    assert (w.routed_experts, w.total) == (routed, routed + rest) == (1_014_933_749_760, 1_029_173_249_888)


def test_k2_fp8_does_not_fit_one_h200_node_and_fits_two_with_the_proposed_shape():
    kw = dict(model="k2", device=H200, context=32768)
    one = plan_shape(K2, nodes=1, gpus_per_node=8, attention=1, experts=7, **kw)
    assert not one.fits and "expert device" in one.problems[0]
    assert propose(K2, nodes=1, gpus_per_node=8, **kw) is None
    best = propose(K2, nodes=2, gpus_per_node=8, **kw)
    assert best is not None and best.fits and best.attention + best.experts <= 16
    # the proposal is the smallest: one expert actor fewer does not fit
    fewer = plan_shape(K2, nodes=2, gpus_per_node=8, attention=1, experts=best.experts - 1, **kw)
    assert not fewer.fits
    # its numbers: ceil(384 / E) experts per actor, each 1,014,933,749,760 / 384 bytes over 60 layers
    assert best.expert_actor_weight_bytes == math.ceil(384 / best.experts) * (1_014_933_749_760 // 384)
    assert best.total_weight_bytes == 1_029_173_249_888
    assert best.concurrent_sequences == best.cache_bytes // (32768 * 61 * 576 * 2)


def test_k3_per_sequence_bytes_include_the_kda_state():
    seq = sequence_bytes(K3, 4096)
    kda_layers = len(K3.kda_layers)
    k = K3.kda
    state = kda_layers * (k.num_heads * k.head_dim * k.head_dim * 4 + 3 * k.num_heads * k.head_dim * (k.conv_kernel - 1) * 2)
    assert seq["kda_state"] == state > 0
    assert seq["total"] == 4096 * len(K3.mla_layers) * K3.latent_dim * 2 + state
    plan = plan_shape(K3, model="k3", device=H200, nodes=2, gpus_per_node=8, attention=2, experts=14, context=4096)
    assert plan.sequence_bytes == seq and plan.concurrent_sequences == plan.cache_bytes // seq["total"]


def test_kda_snapshots_for_prefix_caching_come_out_of_the_sequences_room():
    """A hybrid model's snapshot bytes (prefix caching) are taken from each attention replica's room
    for sequences; a model without KDA layers keeps no snapshots."""
    kw = dict(device=H200, nodes=2, gpus_per_node=8, attention=2, experts=14, context=4096)
    none = plan_shape(K3, model="k3", **kw)
    snap = plan_shape(K3, model="k3", snapshot_bytes=8 << 30, **kw)
    assert (none.snapshot_bytes, snap.snapshot_bytes) == (0, 8 << 30)
    assert none.cache_bytes - snap.cache_bytes == 8 << 30
    assert snap.concurrent_sequences == snap.cache_bytes // snap.sequence_bytes["total"] < none.concurrent_sequences
    assert "8.6 GB of KDA snapshots" in format_plan(snap, None)
    k2 = plan_shape(K2, model="k2", snapshot_bytes=8 << 30, **kw)
    assert k2.snapshot_bytes == 0 and k2.cache_bytes == plan_shape(K2, model="k2", **kw).cache_bytes


def test_moeray_plan_json(tmp_path):
    """In this process (cli_runner.in_process: the same app and error handling)."""
    model = str(CONFIGS / "kimi-k2-instruct.json")
    run = in_process("plan", "--model", model, "--gpu", "h200", "--nodes", "1", "--gpus-per-node", "8", "--json")
    out = json.loads(run.stdout)
    assert out["fits"] is False and out["total_weight_bytes"] == 1_029_173_249_888 and out["proposal"] is None
    run = in_process("plan", "--model", model, "--gpu", "h200", "--nodes", "2", "--gpus-per-node", "8", "--json")
    out = json.loads(run.stdout)
    assert out["fits"] is True and out["proposal"] == {"attention": out["attention"], "experts": out["experts"]}
    bad = in_process("plan", "--model", model, "--gpu", "tpu")
    assert bad.returncode == 2 and "--gpu must be one of" in bad.stderr


def test_preflight_refuses_k2_on_one_h200_node_with_numbers():
    nodes = [NodeInfo("n0", "10.0.0.1", {"CPU": 64, "GPU": 8, "accelerator_type:H200": 1, "memory": 1e12})]
    spec = ClusterSpec(attention=1, experts=7, attention_resources={"CPU": 1, "GPU": 1},
                       expert_resources={"CPU": 1, "GPU": 1})
    with pytest.raises(PreflightError, match=r"expert actor needs .* GB .* 1 GPU holds 126\.90 GB usable") as e:
        check(K2, spec, nodes, "bfloat16")
    assert "1,029,173,249,888 B of weights" in str(e.value)


def test_preflight_refuses_before_reserving_on_the_local_cluster(ray_cluster, tmp_path):
    path = build_preset("kimi-k2-tiny", tmp_path / "k2", seed=1, progress=False)
    before = placement_group_table()
    eng = Engine(EngineConfig.of(model=str(path)), ClusterSpec(attention=6, experts=8))  # 14 CPUs > 3 × 4
    with pytest.raises(PreflightError) as e:
        eng.start()
    msg = str(e.value)
    assert "cannot be placed" in msg and "CPU 14" in msg and "CPU 12" in msg
    assert "a shape that fits: --attention 6 --experts 6" in msg
    assert placement_group_table() == before and not eng.executor.fleet.reservations and not eng.executor.fleet.started


def test_colocated_k2_fp8_on_2x8_h200_per_gpu_bytes_and_sequences_at_4k():
    """Issue 33, Must show 5: 16 workers, each the attention weights + 1/16 of the routed experts (24 of
    384, by hand) + workspace; the rest of 90 % of an H200 holds 4k sequences of 61 layers × 576 latent
    values in bf16. `moeray plan --layout colocated` prints the same numbers."""
    plan = plan_colocated(K2, model="k2", device=H200, nodes=2, gpus_per_node=8, workers=16, context=4096)
    assert plan.fits and plan.layout == "colocated" and plan.attention == plan.experts == 16
    assert plan.expert_actor_weight_bytes == 24 * (1_014_933_749_760 // 384) == 63_433_359_360
    w = weight_bytes(K2)
    assert plan.attention_weight_bytes == w.attention
    per_gpu = w.attention + 63_433_359_360 + ATTENTION_WORKSPACE + EXPERT_WORKSPACE
    assert plan.expert_device_bytes == per_gpu and plan.usable_device_bytes == int(H200.memory_bytes * 0.9)
    assert plan.sequence_bytes["total"] == 4096 * 61 * 576 * 2 == 287_834_112  # the latent cache alone: no KDA state
    assert plan.concurrent_sequences == (plan.usable_device_bytes - per_gpu) // plan.sequence_bytes["total"] == 150
    run = in_process("plan", "--model", str(CONFIGS / "kimi-k2-instruct.json"), "--gpu", "h200", "--nodes", "2",
                     "--gpus-per-node", "8", "--layout", "colocated", "--context", "4096")
    assert run.returncode == 0, run.stderr
    assert "16 workers" in run.stdout and "63.4 GB experts" in run.stdout and "150 concurrent sequences" in run.stdout


def test_colocated_refuses_a_shard_that_does_not_fit():
    """K2 FP8 on one 8 × H200 node: a worker's 1/8 shard (126.9 GB) and the attention weights exceed a GPU;
    refused with the numbers and what to do, exit 1."""
    plan = plan_colocated(K2, model="k2", device=H200, nodes=1, gpus_per_node=8, workers=8, context=4096)
    assert not plan.fits and "use more workers" in plan.problems[0] and "1/8 shard" in plan.problems[0]
    run = in_process("plan", "--model", str(CONFIGS / "kimi-k2-instruct.json"), "--gpu", "h200", "--nodes", "1",
                     "--gpus-per-node", "8", "--layout", "colocated", "--context", "4096")
    assert run.returncode == 1 and "use more workers" in run.stdout + run.stderr
    more = in_process("plan", "--model", str(CONFIGS / "kimi-k2-instruct.json"), "--gpu", "h200", "--nodes", "2",
                      "--gpus-per-node", "8", "--layout", "colocated", "--workers", "17")
    assert more.returncode == 1 and "17 workers need 17 devices" in more.stdout + more.stderr


# ---- speculative decoding's KDA verify buffers (review 2026-12-06, finding 6) -------------------

def _verify_by_hand(cfg, sequences, positions, dtype_bytes=2) -> int:
    """model/kda.py ``_attend`` with drafts: every KDA layer keeps, per sequence, the fp32 state
    after each position and the conv inputs with the W−1 before them; the layer being computed
    holds its per-position states twice while ``torch.stack`` copies them."""
    k = cfg.kda
    state = k.num_heads * k.head_dim * k.head_dim * 4
    hist = 3 * (k.conv_kernel - 1 + positions) * k.num_heads * k.head_dim * dtype_bytes
    return len(cfg.kda_layers) * sequences * (positions * state + hist) + sequences * positions * state


def test_kda_verify_buffers_come_out_of_the_sequences_room():
    """K = 4, full_draft_batch = 2: the largest verification is 8 sequences with one draft each
    (16 positions; 2 sequences × 5 positions is less), ~7.3 GB on K3 — taken from each attention
    replica's room for sequences, as the snapshots are. Off, or on a model without KDA layers,
    nothing changes."""
    from cluster.config import SpeculativeConfig

    kw = dict(device=H200, nodes=2, gpus_per_node=8, attention=2, experts=14, context=4096)
    off = plan_shape(K3, model="k3", **kw)
    on = plan_shape(K3, model="k3", speculative=SpeculativeConfig(method="ngram"), **kw)
    assert (on.verify["sequences"], on.verify["positions"]) == (8, 2)
    assert on.verify["total"] == _verify_by_hand(K3, 8, 2) > _verify_by_hand(K3, 2, 5)
    assert 7e9 < on.verify["total"] < 7.5e9
    assert off.verify["total"] == 0 and off.cache_bytes - on.cache_bytes == on.verify["total"]
    assert on.fits and on.concurrent_sequences == on.cache_bytes // on.sequence_bytes["total"] < off.concurrent_sequences
    assert "7.2 GB of KDA verify buffers" in format_plan(on, None)
    # K = 16 does not fit next to K3's 113 GB of attention weights: the problem names the knobs
    big = plan_shape(K3, model="k3", speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=16), **kw)
    assert not big.fits and "num_speculative_tokens" in big.problems[0] and "full_draft_batch" in big.problems[0]
    k2 = plan_shape(K2, model="k2", speculative=SpeculativeConfig(method="ngram"), **kw)
    assert k2.verify["total"] == 0 and k2.cache_bytes == plan_shape(K2, model="k2", **kw).cache_bytes
    # colocated (Kimi Linear 48B on one H200 node): each worker's room loses its verify buffers
    linear = load_config(CONFIGS / "kimi-linear-48b.json")
    colocated = dict(device=H200, nodes=1, gpus_per_node=8, workers=8, context=4096)
    c_off = plan_colocated(linear, model="linear", **colocated)
    c_on = plan_colocated(linear, model="linear", speculative=SpeculativeConfig(method="ngram"), **colocated)
    assert c_off.fits and c_on.fits and c_on.verify["total"] == _verify_by_hand(linear, 8, 2)
    assert c_off.cache_bytes - c_on.cache_bytes == c_on.verify["total"]
    # `moeray plan --speculative-config` shows them
    run = in_process("plan", "--model", str(CONFIGS / "kimi-k3-text.json"), "--gpu", "h200", "--nodes", "2",
                     "--attention", "2", "--experts", "14", "--context", "4096", "--speculative-config",
                     '{"method": "ngram"}')
    assert run.returncode == 0 and "7.2 GB of KDA verify buffers, transient: 8 sequences × 2 positions" in run.stdout
    out = json.loads(in_process("plan", "--model", str(CONFIGS / "kimi-k3-text.json"), "--gpu", "h200", "--nodes", "2",
                                "--attention", "2", "--experts", "14", "--context", "4096", "--json",
                                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 16}').stdout)
    assert out["fits"] is False and out["verify"]["total"] == _verify_by_hand(K3, 32, 2)


def test_the_verify_bound_follows_the_schedulers_draft_length():
    """The planner's bound walks SpeculativeConfig.draft_length (the scheduler's own: it calls it)."""
    from cluster.config import SpeculativeConfig
    from cluster.planner import verify_buffer

    for K, F in ((4, 2), (16, 8), (1, 2), (3, 0), (5, 3)):
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, full_draft_batch=F)
        want = [0, K, K * F // (F + 1), K * F // (4 * F + 9)] if F else [0, 0, 0, 0]
        assert [spec.draft_length(n) for n in (0, max(F, 1), F + 1, 4 * F + 9)] == want
        # the bound: the most bytes over every batch size that drafts, up to max_num_seqs
        best = max((_verify_by_hand(K3, n, 1 + spec.draft_length(n)) for n in range(1, 65) if spec.draft_length(n)),
                   default=0)
        assert verify_buffer(K3, spec, 64)["total"] == best


def test_preflight_counts_kda_verify_buffers():
    """K3's attention replica fits one H200 with the default drafts (7.3 GB of verify buffers next to
    113 GB of weights), not with K = 16: refused, naming the knobs. K2 is unchanged."""
    nodes = [NodeInfo(f"n{i}", f"10.0.0.{i}", {"CPU": 64, "GPU": 8, "accelerator_type:H200": 1, "memory": 1e12})
             for i in range(2)]
    spec = ClusterSpec(attention=2, experts=14, attention_resources={"CPU": 1, "GPU": 1},
                       expert_resources={"CPU": 1, "GPU": 1})
    default = EngineConfig.of("k3", speculative={"method": "suffix"})
    big = EngineConfig.of("k3", speculative={"method": "suffix", "num_speculative_tokens": 16})
    check(K3, spec, nodes, "bfloat16")
    check(K3, spec, nodes, "bfloat16", config=EngineConfig.of("k3"))
    check(K3, spec, nodes, "bfloat16", config=default)
    with pytest.raises(PreflightError, match=r"num_speculative_tokens=16.*full_draft_batch=2") as e:
        check(K3, spec, nodes, "bfloat16", config=big)
    assert "KDA verify" in str(e.value) and "GB" in str(e.value)
    # a model without KDA layers: the same answer with drafts as without
    k2_nodes = [NodeInfo(f"n{i}", f"10.0.0.{i}", {"CPU": 64, "GPU": 8, "accelerator_type:H200": 1, "memory": 1e12})
                for i in range(2)]
    check(K2, spec, k2_nodes, "bfloat16", config=big)


def test_preflight_counts_kda_verify_buffers_of_a_hybrid_preset_on_cpu():
    """kimi-k3-tiny on one CPU node with just enough memory for its actors' weights: fine without
    drafts, refused with K = 16 over a batch that drafts 64 sequences (its verify buffers)."""
    from cluster.preflight import _actor_bytes
    from model.config import parse_config
    from model.presets import preset_config

    tiny = parse_config(preset_config("kimi-k3-tiny"))
    spec = ClusterSpec(attention=1, experts=1)
    attn, expert = _actor_bytes(tiny, spec, 4)
    nodes = [NodeInfo("n0", "10.0.0.1", {"CPU": 8, "memory": attn + expert + (1 << 20)})]
    big = EngineConfig.of("tiny", speculative={"method": "ngram", "num_speculative_tokens": 16,
                                               "full_draft_batch": 4})
    check(tiny, spec, nodes, "float32")
    check(tiny, spec, nodes, "float32", config=EngineConfig.of("tiny", speculative={"method": "ngram"}))
    with pytest.raises(PreflightError, match="num_speculative_tokens=16"):
        check(tiny, spec, nodes, "float32", config=big)


def test_preflight_counts_the_kv_tier_on_each_node_with_an_attention_replica():
    """The KV tier's host memory (kv_offloading_size) counts on every node holding an attention replica, once
    per node: a tier that fits beside the weights passes, one that does not is refused naming the knob. On GPU
    nodes (the weights in HBM) the tier alone must fit the node's memory."""
    from cluster.preflight import _actor_bytes
    from model.config import parse_config
    from model.presets import preset_config

    tiny = parse_config(preset_config("kimi-k2-tiny"))
    spec = ClusterSpec(attention=1, experts=1)
    attn, expert = _actor_bytes(tiny, spec, 4)
    gib = 1 << 30
    nodes = [NodeInfo("n0", "10.0.0.1", {"CPU": 8, "memory": attn + expert + gib + (1 << 20)})]
    check(tiny, spec, nodes, "float32", config=EngineConfig.of("tiny", kv_offloading_size=1.0))
    with pytest.raises(PreflightError, match=r"with its KV tier: .*a 2 GiB KV tier \(kv_offloading_size\).*lower it"):
        check(tiny, spec, nodes, "float32", config=EngineConfig.of("tiny", kv_offloading_size=2.0))
    gpu = [NodeInfo("n0", "10.0.0.1", {"CPU": 64, "GPU": 8, "accelerator_type:H200": 1, "memory": 100 * gib})]
    on_gpus = ClusterSpec(attention=1, experts=1, attention_resources={"CPU": 1, "GPU": 1},
                          expert_resources={"CPU": 1, "GPU": 1})
    check(tiny, on_gpus, gpu, "bfloat16", config=EngineConfig.of("tiny", kv_offloading_size=64.0))
    with pytest.raises(PreflightError, match="KV tier"):
        check(tiny, on_gpus, gpu, "bfloat16", config=EngineConfig.of("tiny", kv_offloading_size=128.0))


@pytest.mark.parametrize("knobs, words", [
    (dict(kv_offloading_size=1.0, prefix_caching=False), ["kv_offloading_size", "prefix_caching"]),
    (dict(kv_offloading_size=1.0, kv_offloading_disk="/tmp/x"), ["kv_offloading_disk", "go together"]),
    (dict(kv_offloading_disk="/tmp/x", kv_offloading_disk_size=4.0), ["kv_offloading_disk", "kv_offloading_size"]),
    (dict(kv_offloading_size=-1.0), ["kv_offloading_size", ">= 0"]),
])
def test_kv_tier_settings_that_cannot_work_are_refused_naming_them(knobs, words):
    with pytest.raises(ValueError) as e:
        EngineConfig.of("m", **knobs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_moeray_plan_shows_what_a_node_s_kv_tier_holds():
    """`moeray plan --kv-offloading-size`: K2's bf16 latent is 61 layers × 576 × 2 B = 70,272 B per token, so a
    512 GiB tier holds 7,823,255 tokens; a negative size is refused naming the flag."""
    import json as _json
    from pathlib import Path

    from cli_runner import in_process

    k2 = str(Path(__file__).parents[1] / "fixtures" / "configs" / "kimi-k2-instruct.json")
    base = ["plan", "--model", k2, "--gpu", "h200", "--nodes", "2", "--gpus-per-node", "8"]
    for layout in ("disaggregated", "colocated"):
        r = in_process(*base, "--layout", layout, "--kv-offloading-size", "512", "--json")
        assert r.returncode == 0, r.stderr
        tier = _json.loads(r.stdout)["kv_tier"]
        assert (tier["bytes_per_token"], tier["tokens"]) == (61 * 576 * 2, 512 * 2**30 // (61 * 576 * 2)), tier
    text = in_process(*base, "--kv-offloading-size", "512").stdout
    assert "KV tier: 512 GiB of host memory per node holds 7,823,255 tokens" in text
    assert "kv_tier" not in in_process(*base, "--json").stdout or _json.loads(in_process(*base, "--json").stdout)["kv_tier"] is None
    bad = in_process(*base, "--kv-offloading-size", "-1")
    assert bad.returncode != 0 and "--kv-offloading-size must be >= 0" in bad.stderr + bad.stdout
