"""An expert actor's weights: any set of logical experts per MoE layer (a shard, replicas of hot
experts), read lazily from the checkpoint, equal to the same experts of the whole model."""

import pytest
import torch

from model.config import load_config
from model.loader import load_model, load_routed_experts
from tests.presets import preset


@pytest.fixture(scope="module")
def k2():
    return preset("kimi-k2-tiny", seed=3, dtype="float32")


def test_any_experts_per_layer_equal_the_whole_models(k2):
    cfg = load_config(k2)
    whole = load_model(k2, progress=False).moe_blocks()
    a, b = cfg.moe_layers[0], cfg.moe_layers[-1]
    wanted = {a: [7, 0, 3], b: [2, 7]}  # not contiguous, not sorted, different per layer
    got = load_routed_experts(k2, cfg, wanted)
    assert sorted(got) == sorted(wanted)
    for layer, ids in wanted.items():
        ex = got[layer]
        assert ex.expert_ids == tuple(ids)
        ref = whole[layer].experts
        assert torch.equal(ex.w13, ref.w13[ids]) and torch.equal(ex.w2, ref.w2[ids])
        assert ex.weight_bytes() == len(ids) * (ref.w13[0].numel() + ref.w2[0].numel()) * 4
        x = torch.randn(5, cfg.expert_hidden_size)
        local = torch.tensor([0, len(ids) - 1, 0, 1, 1])
        expect = torch.stack([ref.grouped(x[r:r + 1], torch.tensor([ids[int(local[r])]]))[0] for r in range(5)])
        torch.testing.assert_close(ex.grouped(x, local), expect)


def test_layers_that_are_not_moe_layers_are_refused(k2):
    cfg = load_config(k2)
    dense = next(i for i in range(cfg.num_hidden_layers) if i not in cfg.moe_layers)
    with pytest.raises(ValueError, match=f"layers \\[{dense}\\] are not MoE layers"):
        load_routed_experts(k2, cfg, {dense: [0]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_experts_give_each_row_its_own_experts_gemm_bit_for_bit(dtype, threads):
    """The grouped GEMM (CPU) equals one GEMM pair per expert exactly, and a row's result does not
    depend on which rows share the call: an expert actor's shard computes what the whole model does."""
    from model.layers import silu_glu
    from model.moe import grouped_expert_ffn, grouped_ffn

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(5)
        E, H, inter = 16, 64, 32
        w13, w2 = (torch.randn(E, 2 * inter, H, generator=g) / 8).to(dtype), (torch.randn(E, H, inter, generator=g) / 8).to(dtype)

        def expert(e, xs):
            gate, up = (xs @ w13[e].t()).chunk(2, dim=-1)
            return silu_glu(gate, up) @ w2[e].t()

        for n in (0, 1, 5, 40, 130):
            x, ids = torch.randn(n, H, generator=g).to(dtype), torch.randint(0, E, (n,), generator=g)
            got = grouped_expert_ffn(x, ids, w13, w2, silu_glu)
            assert torch.equal(got, grouped_ffn(x, ids, E, expert))
            part = (ids % 3 == 1).nonzero().squeeze(1)
            assert torch.equal(grouped_expert_ffn(x[part], ids[part], w13, w2, silu_glu), got[part])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [2, 3])
def test_expert_threads_give_the_one_thread_results_bit_for_bit(dtype, count):
    """The experts cut into ranges over ``count`` threads (an expert actor's ``expert_threads``) give
    exactly the one-thread grouped GEMMs' rows, with experts left empty, rows below the split's
    threshold (one thread runs them) and far above it; a thread's error reaches the caller."""
    from model.layers import silu_glu
    from model.moe import ExpertThreads, grouped_expert_ffn

    g = torch.Generator().manual_seed(7)
    E, H, inter = 16, 64, 32
    w13, w2 = (torch.randn(E, 2 * inter, H, generator=g) / 8).to(dtype), (torch.randn(E, H, inter, generator=g) / 8).to(dtype)
    threads = ExpertThreads(count)
    try:
        assert threads.ranges(E, 8) == [(0, E)]  # too few rows: no hand-off
        assert threads.ranges(E, 16 * count) == [(E * i // count, E * (i + 1) // count) for i in range(count)]
        used = []
        uniform = lambda n: torch.randint(0, E, (n,), generator=g)  # noqa: E731
        low = lambda n: torch.randint(0, 3, (n,), generator=g)  # noqa: E731 — the later ranges empty
        high = lambda n: E - 1 - torch.randint(0, 3, (n,), generator=g)  # noqa: E731 — the first ranges empty
        for n, draw in ((1, uniform), (15, uniform), (40, uniform), (130, uniform), (200, low), (200, high)):
            x, ids = torch.randn(n, H, generator=g).to(dtype), draw(n)
            assert torch.equal(grouped_expert_ffn(x, ids, w13, w2, silu_glu, threads),
                               grouped_expert_ffn(x, ids, w13, w2, silu_glu))
            used.append(len(threads.ranges(E, n)))
        assert max(used) == count and min(used) == 1

        def broken(gate, up):
            raise RuntimeError("boom in an expert thread")

        with pytest.raises(RuntimeError, match="boom in an expert thread"):
            grouped_expert_ffn(torch.randn(64, H).to(dtype), torch.arange(64) % E, w13, w2, broken, threads)
    finally:
        threads.close()
    with pytest.raises(ValueError, match="expert threads must be an integer >= 2"):
        ExpertThreads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_position_among_its_experts_rows(dtype):
    """What the exchange's exactness rests on (docs/architecture.md, "Exactness"): rows reordered
    within each expert, and other experts' rows added or removed, leave every row's bits unchanged.
    (How many rows an expert has may change them: the BLAS blocks a GEMM by its row count.)"""
    from model.layers import silu_glu
    from model.moe import grouped_expert_ffn

    g = torch.Generator().manual_seed(11)
    E, H, inter = 8, 64, 32
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / 8).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) / 8).to(dtype)
    for n in (1, 9, 70, 300):
        x, ids = torch.randn(n, H, generator=g).to(dtype), torch.randint(0, E - 1, (n,), generator=g)
        got = grouped_expert_ffn(x, ids, w13, w2, silu_glu)
        perm = torch.randperm(n, generator=g)
        assert torch.equal(grouped_expert_ffn(x[perm], ids[perm], w13, w2, silu_glu), got[perm])
        extra = torch.randn(5, H, generator=g).to(dtype)  # rows of the expert that had none
        both = grouped_expert_ffn(torch.cat([extra, x]), torch.cat([torch.full((5,), E - 1), ids]), w13, w2, silu_glu)
        assert torch.equal(both[5:], got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_sum_each_token_in_top_k_order_in_fp32(dtype):
    """RoutedExperts.forward is the canonical sum: for each token, w_j · E_{idx_j}(x) in fp32, added
    in top-k order from slot 0, cast once; a shard adds only its own experts' terms (a zero row for
    the others adds nothing)."""
    from model.layers import silu_glu
    from model.moe import RoutedExperts, weighted_sum

    g = torch.Generator().manual_seed(13)
    E, H, inter, k, T = 8, 32, 16, 4, 37
    whole = RoutedExperts(H, inter, range(E), silu_glu).to(dtype)
    with torch.no_grad():
        whole.w13.copy_(torch.randn(E, 2 * inter, H, generator=g) / 4)
        whole.w2.copy_(torch.randn(E, H, inter, generator=g) / 4)
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g) * 2.5
    with torch.no_grad():
        got = whole(x, idx, w)
        rows = whole.grouped(x.repeat_interleave(k, 0), idx.reshape(-1)).view(T, k, H)  # the same GEMMs
        want = torch.empty(T, H, dtype=dtype)
        for t in range(T):  # the definition, token by token
            acc = rows[t, 0].float() * w[t, 0]
            for j in range(1, k):
                acc = acc + rows[t, j].float() * w[t, j]
            want[t] = acc.to(dtype)
        assert got.dtype == dtype and torch.equal(got, want)
        assert torch.equal(weighted_sum(rows, w), want)
        shard = RoutedExperts(H, inter, (5, 1, 6), silu_glu).to(dtype)  # any experts, any order
        shard.w13.copy_(whole.w13[[5, 1, 6]])
        shard.w2.copy_(whole.w2[[5, 1, 6]])
        here = (idx == 5) | (idx == 1) | (idx == 6)  # [T, k]
        assert torch.equal(shard(x, idx, w), weighted_sum(rows * here[..., None].to(dtype), w))


def test_the_weighted_sum_gives_the_same_bits_in_one_op_and_a_product_at_a_time(monkeypatch):
    """weighted_sum forms the k products at once for small batches and one at a time for large ones:
    the same fp32 products added in the same order, so the same bits."""
    import model.moe as moe

    g = torch.Generator().manual_seed(17)
    for dtype in (torch.float32, torch.bfloat16):
        rows, w = torch.randn(33, 8, 48, generator=g).to(dtype), torch.rand(33, 8, generator=g) * 3
        monkeypatch.setattr(moe, "SMALL_SUM", 1 << 30)
        at_once = moe.weighted_sum(rows, w)
        monkeypatch.setattr(moe, "SMALL_SUM", 0)
        assert torch.equal(moe.weighted_sum(rows, w), at_once)
