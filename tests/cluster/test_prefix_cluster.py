"""Prefix caching on a real Ray cluster with the real model: a KDA snapshot restored on a hit is bit
for bit the state a from-scratch prefill reaches at its boundary (CPU, fp32) when that prefill is
chunked on the same grid, and a snapshot registered under the wrong boundary is caught by that
comparison, though the tokens it produces may not change.

The reference is chunked on the grid because the cached chain was (each snapshot is restored and
the next grid chunk computed from it): one 192-token chunk and three 64-token chunks are the same
math but not always the same bits, since the BLAS may block a 64-row GEMM differently from a
192-row one (measured on an AMD EPYC with AVX2: 2e-8 apart in the last KDA layers)."""

import random

import pytest
import ray
import torch

from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.prefix_cache import PrefixCache
from cluster.spec import ClusterSpec
from model.sampling import SamplingParams
from tests.presets import preset

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def k3(ray_cluster):
    path = preset("kimi-k3-tiny", seed=2, dtype="float32")
    eng = Engine(EngineConfig.of(model=str(path), max_tokens_per_step=512), ClusterSpec(attention=1, experts=1)).start()
    yield eng
    eng.shutdown()


def _read(eng: Engine, snap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Snapshot ``snap``'s (conv, recurrent) of every KDA layer, from the attention actor."""
    actor = eng.executor.fleet.attention[0].actor
    return ray.get(actor.__ray_call__.remote(lambda w: tuple(t.clone() for t in w.cache.kda.snapshot(snap))),
                   timeout=30)


def _fresh(eng: Engine, tokens: list[int], boundary: int, salt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The state a from-scratch prefill reaches after ``tokens[:boundary]``: a request under a salt
    nothing else uses (so nothing is found cached), whose prompt's last grid boundary is
    ``boundary``, snapshots it there. Its prefill is chunked on the grid (one grid's tokens per
    step), as the cached chain of snapshots was computed."""
    sched = eng.scheduler
    budget, sched.budget = sched.budget, sched.cache.grid
    try:
        eng.generate([tokens[:boundary] + [1]], SamplingParams(max_tokens=1), cache_salt=salt)
    finally:
        sched.budget = budget
    key = sched.cache.blocks[0].chain([], tokens, salt, boundary // sched.block_size)[-1]
    snap = sched.cache.snaps[0].lookup(key)
    assert snap is not None, f"the fresh prefill to {boundary} saved no snapshot"
    return _read(eng, snap)


def _registered(eng: Engine, tokens: list[int]) -> dict[int, int]:
    """boundary → snapshot, for the unsalted snapshots whose key is a grid boundary of ``tokens``."""
    sched = eng.scheduler
    hashes = sched.cache.blocks[0].chain([], tokens, None, len(tokens) // sched.block_size)
    at = {h: (i + 1) * sched.block_size for i, h in enumerate(hashes)}
    return {at[key]: snap for key, snap in sched.cache.snaps[0]._table.items() if key in at}


def _mismatches(eng: Engine, tokens: list[int], tag: str) -> list[int]:
    """The boundaries whose registered snapshot differs from a from-scratch prefill's state there."""
    bad = []
    for b, snap in sorted(_registered(eng, tokens).items()):
        got, want = _read(eng, snap), _fresh(eng, tokens, b, f"{tag}-{b}")
        if not all(torch.equal(g, w) for g, w in zip(got, want)):
            bad.append(b)
    return bad


def test_restored_kda_state_is_bit_for_bit_a_from_scratch_prefill(k3):
    eng = k3
    g = eng.scheduler.cache.grid
    rng = random.Random(1)
    conv = [rng.randrange(1, 700) for _ in range(100)]
    for _ in range(3):  # the answer's snapshots come from refresh jobs chained on the prompt's
        seq = eng.generate([conv], GREEDY)[0]
        conv = seq.token_ids + [rng.randrange(1, 700) for _ in range(10)]
    hit = eng.generate([conv], GREEDY)[0]
    assert hit.num_hit >= 3 * g  # the last turn restored a snapshot deep in the conversation
    registered = _registered(eng, conv)
    assert len(registered) >= 3 and max(registered) >= 3 * g, registered
    assert _mismatches(eng, conv, "fresh") == []

    # the comparison can fail: a snapshot holds a different state from its neighbour's
    b = max(registered)
    assert not torch.equal(_read(eng, registered[b])[1], _fresh(eng, conv, b - g, "neighbour")[1])


def test_a_snapshot_registered_one_boundary_early_is_caught(k3, monkeypatch):
    """The scheduler of the running engine registers each new snapshot under the key of the grid
    boundary before its own: the comparison names that boundary."""
    eng = k3
    g = eng.scheduler.cache.grid
    real = PrefixCache._snapshot_key
    monkeypatch.setattr(eng.scheduler.cache, "_snapshot_key",
                        lambda seq, b: real(eng.scheduler.cache, seq, b - g if b > g else b))
    rng = random.Random(2)
    conv = [rng.randrange(1, 700) for _ in range(3 * g + 20)]  # a prompt snapshot at 3g, keyed as 2g
    eng.generate([conv], SamplingParams(max_tokens=2, ignore_eos=True))
    monkeypatch.undo()
    assert 2 * g in _registered(eng, conv)
    assert _mismatches(eng, conv, "caught") == [2 * g]
