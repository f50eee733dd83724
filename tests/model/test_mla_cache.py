"""Oracle 2: absorbed MLA == naive MLA; paged-cache decode == full recompute; batch == alone."""

import pytest
import torch

from model.cache import MAX_QUERY_PAD, BlockAllocator, CacheFull, build_attn_meta, group_sequences
from model.config import parse_config
from model.model import CausalLM, init_random_weights
from model.presets import preset_config
from model.runner import ModelRunner, Sequence, generate
from model.sampling import SamplingParams


@pytest.fixture(scope="module", params=["kimi-k2-tiny", "deepseek-v3-tiny"])
def model(request):
    cfg = parse_config(preset_config(request.param))
    m = CausalLM(cfg)
    init_random_weights(m, seed=7, std=0.08)
    return m.eval()


def _ids(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_not_degenerate(model):
    logits = ModelRunner(model, num_blocks=32, block_size=4).full_logits(_ids(20, 0))
    assert logits.std() > 0.05


def test_absorbed_equals_naive_on_mixed_batch(model):
    """Chunked prefill, decode and fresh prefill in one step: both forms agree."""
    outs = {}
    for impl in ("absorbed", "naive"):
        r = ModelRunner(model, num_blocks=64, block_size=4, impl=impl)
        a = Sequence(0, _ids(23, 1), 23, SamplingParams())
        b = Sequence(1, _ids(9, 2), 9, SamplingParams())
        r.forward([a, b], [10, 9])           # a: first chunk; b: whole prompt
        c = Sequence(2, _ids(5, 3), 5, SamplingParams())
        b.token_ids.append(17)
        outs[impl] = r.forward([a, b, c], [13, 1, 5])  # a: rest, b: decode, c: prefill
    torch.testing.assert_close(outs["absorbed"], outs["naive"], atol=1e-5, rtol=0)


def test_decode_token_by_token_equals_full_recompute(model):
    ids = _ids(40, 4)
    r = ModelRunner(model, num_blocks=64, block_size=4)
    full = r.full_logits(ids)
    seq = Sequence(0, ids[:12], 12, SamplingParams())
    got = [r.forward([seq], [12])[0]]
    for t in ids[12:]:
        seq.token_ids.append(t)
        got.append(r.forward([seq], [1])[0])
    torch.testing.assert_close(torch.stack(got), full[11:], atol=1e-5, rtol=0)
    assert seq.num_cached == len(ids)
    # the cache holds exactly latent_dim values per token per layer
    assert r.cache.latent.data.shape[-1] == model.cfg.kv_lora_rank + model.cfg.qk_rope_head_dim
    assert r.cache.latent.bytes_per_token == model.cfg.num_hidden_layers * model.cfg.latent_dim * 4


def test_cache_entry_is_normed_latent_and_rotated_rope_key(model):
    ids = _ids(6, 5)
    r = ModelRunner(model, num_blocks=8, block_size=4)
    seq = Sequence(0, ids, 6, SamplingParams())
    r.forward([seq], [6])
    layer0 = model.model.layers[0]
    x = layer0.input_layernorm(model.model.embed_tokens(torch.tensor(ids)))
    c, k = layer0.self_attn.kv_a_proj_with_mqa(x).split([model.cfg.kv_lora_rank, model.cfg.qk_rope_head_dim], -1)
    cos, sin = model.rotary.cos_sin(torch.arange(6))
    expect = torch.cat([layer0.self_attn.kv_a_layernorm(c), model.rotary(k, cos, sin)], -1)
    slots = torch.tensor([seq.block_table[i // 4] * 4 + i % 4 for i in range(6)])
    torch.testing.assert_close(r.cache.mla_layer(0)[slots], expect)


def test_batch_of_different_lengths_equals_each_alone(model):
    prompts = [_ids(n, 10 + n) for n in (3, 17, 8, 30, 1)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [generate(ModelRunner(model, num_blocks=64, block_size=4), [p], params)[0].output_ids for p in prompts]
    batched = generate(ModelRunner(model, num_blocks=64, block_size=4), prompts, params)
    assert [s.output_ids for s in batched] == alone
    # and the sampled path: per-request seeds make batched sampling reproducible too
    sp = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=s, ignore_eos=True) for s in range(5)]
    alone = [generate(ModelRunner(model, num_blocks=64, block_size=4), [p], [q])[0].output_ids for p, q in zip(prompts, sp)]
    assert [s.output_ids for s in generate(ModelRunner(model, num_blocks=64, block_size=4), prompts, sp)] == alone


def test_block_allocator_and_meta():
    alloc = BlockAllocator(4, 2)
    blocks = alloc.allocate(3)
    with pytest.raises(CacheFull):
        alloc.allocate(2)
    alloc.free(blocks)
    assert alloc.num_free == 4
    meta = build_attn_meta([2, 1], [5, 3], [[3, 0, 2], [1, 4]], block_size=2)
    # seq0 positions 3, 4 → blocks 0 (offset 1), 2 (offset 0); seq1 position 2 → block 4 (offset 0)
    assert meta.slot_mapping.tolist() == [0 * 2 + 1, 2 * 2 + 0, 4 * 2 + 0]
    assert meta.positions.tolist() == [3, 4, 2]


def _mixed_step(model, impl):
    """One step of decodes at different context lengths and two chunks of different lengths, the
    chunks not first: logits [T, V] of every token, and each sequence's (ids so far, new tokens)."""
    r = ModelRunner(model, num_blocks=96, block_size=4, impl=impl)
    dec = [Sequence(i, _ids(n, 30 + n), n, SamplingParams()) for i, n in enumerate((7, 15, 26))]
    for s in dec:
        r.forward([s], [s.num_uncached])
        s.token_ids.append(11 + s.seq_id)
    a = Sequence(10, _ids(30, 40), 30, SamplingParams())  # a middle chunk: 9 cached, 12 new
    r.forward([a], [9])
    b = Sequence(11, _ids(6, 41), 6, SamplingParams())    # a whole prompt
    batch = [(dec[0], 1), (a, 12), (dec[1], 1), (b, 6), (dec[2], 1)]
    for s, n in batch:
        r.reserve(s, s.num_cached + n)
    meta = build_attn_meta([n for _, n in batch], [s.num_cached + n for s, n in batch],
                           [s.block_table for s, _ in batch], r.block_size)
    assert len(meta.groups) > 1, "a mixed step must not be one padded block"
    ids = torch.tensor([t for s, n in batch for t in s.token_ids[s.num_cached : s.num_cached + n]])
    with torch.no_grad():
        logits = model.logits(model(ids, meta, r.cache, impl))
    return logits, [(s.token_ids[: s.num_cached + n], n) for s, n in batch]


@pytest.mark.parametrize("impl", ["absorbed", "naive"])
def test_mixed_step_equals_each_sequence_alone(model, impl):
    """Grouped attention of a mixed step == each sequence recomputed alone, every new token."""
    logits, seqs = _mixed_step(model, impl)
    alone = ModelRunner(model, num_blocks=96, block_size=4, impl=impl)
    t = 0
    for ids, n in seqs:
        torch.testing.assert_close(logits[t : t + n], alone.full_logits(ids)[-n:], atol=1e-5, rtol=0)
        t += n
    assert t == logits.shape[0]


def test_mixed_step_groups_bound_the_padding():
    """17 decodes at 600–887 and chunks of 493 and 40: the groups pad at most 2× the real queries
    (one padded block would be 19 × 493 rows), and cover every token exactly once."""
    qls = [1] * 8 + [493] + [1] * 9 + [40]
    cls = [887] * 8 + [493] + [600 + b for b in range(9)] + [900]
    meta = build_attn_meta(qls, cls, [list(range(-(-c // 16))) for c in cls], block_size=16)
    T = sum(qls)
    assert sum(g.q_index.numel() for g in meta.groups) <= 2 * T
    assert sum(g.mask.numel() for g in meta.groups) <= 2 * T * max(cls)
    assert sorted(torch.cat([g.tokens for g in meta.groups]).tolist()) == list(range(T))
    for g in meta.groups:  # a group's real queries are the flat tokens of its sequences
        assert g.tokens.tolist() == g.q_index[g.q_valid].tolist()
        assert g.query_lens == [qls[b] for b in g.seqs.tolist()]
    assert sorted(len(g.query_lens) for g in meta.groups) == [1, 1, 17]  # decodes together


def test_group_rule():
    assert group_sequences([1] * 5) == [[0, 1, 2, 3, 4]]           # pure decode: one group, in order
    assert group_sequences([300]) == [[0]]                          # one prefill
    assert group_sequences([3, 1, 2]) == [[0, 1, 2]]                # 3 × 3 ≤ 1.5 × 6: one group, in order
    assert group_sequences([300, 493]) == [[0, 1]]                  # 2 × 493 ≤ 1.5 × 793
    assert group_sequences([1, 493, 1, 40]) == [[0, 2], [3], [1]]  # decodes; then chunks by length
    for qls in ([1, 2, 3, 50, 64, 700, 1, 1, 9], [7] * 3 + [8] * 4 + [100, 120]):
        groups = group_sequences(qls)
        assert sorted(b for g in groups for b in g) == list(range(len(qls)))
        for g in groups:
            assert len(g) * max(qls[b] for b in g) <= MAX_QUERY_PAD * sum(qls[b] for b in g)


def test_a_decode_steps_meta_from_its_fast_path_equals_the_general_one():
    """build_attn_meta builds a decode step's tensors (every sequence one token, no drafts) on a short
    path (_decode_meta): every field equal to the general path's, over random batches (ragged block
    tables, contexts ending anywhere in a block, KDA slots or none)."""
    from model.cache import _decode_meta, _meta

    g = torch.Generator().manual_seed(11)
    for trial in range(200):
        B, bs = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g)) * 4
        ctx = torch.randint(1, 70, (B,), generator=g).tolist()
        tables = [torch.randperm(64, generator=g)[: -(-c // bs) + int(torch.randint(0, 2, (1,), generator=g))].tolist()
                  for c in ctx]
        states = list(range(B)) if trial % 2 else None
        fast = _decode_meta(ctx, tables, bs, "cpu", states)
        want = _meta([1] * B, ctx, tables, bs, "cpu", states, None)
        assert build_attn_meta([1] * B, ctx, tables, bs, state_slots=states).context_lens == ctx
        for f in ("positions", "slot_mapping", "state_slots"):
            a, b = getattr(fast, f), getattr(want, f)
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), (trial, f)
        assert (fast.query_lens, fast.context_lens, len(fast.groups)) == (want.query_lens, want.context_lens, 1)
        (fg,), (wg,) = fast.groups, want.groups
        for f in ("q_index", "q_valid", "kv_slots", "mask", "q_rows"):
            a, b = getattr(fg, f), getattr(wg, f)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (trial, f)
        assert (fg.seqs, fg.tokens, fg.query_lens, fg.verify) == (wg.seqs, wg.tokens, wg.query_lens, wg.verify)
