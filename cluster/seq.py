"""A sequence as the engine's owners see it (nano-vllm's ``sequence.py``): the record the scheduler
and the prefix cache both read, in a module of its own so that neither imports the other for it.

Owns: the fields, nothing else. Who writes them: :class:`Seq`'s own fields only the scheduler
(:mod:`cluster.scheduler`), its :class:`CacheHold` only the prefix cache (:mod:`cluster.prefix_cache`);
static tests (tests/test_owners.py) hold both to that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.runner import Sequence


@dataclass
class CacheHold:
    """One sequence's standing with the prefix cache; created with the sequence, written only by
    :class:`~cluster.prefix_cache.PrefixCache`."""

    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks (a memo)
    snapshot: int | None = None  # the KDA snapshot it holds: its state after its first snapshot_at tokens
    snapshot_at: int = 0
    pending_snapshot: tuple[int, int] | None = None  # (snapshot, boundary) a step in flight saves into
    on_grid: bool = True  # every chunk so far ended on the snapshot grid (its snapshots are exact)
    num_registered_blocks: int = 0  # its first blocks whose content is registered (each once)
    branch_point: int = 0  # hybrid: a grid boundary where its prompt leaves a cached prefix with no snapshot yet


@dataclass(eq=False)
class Seq(Sequence):
    """A sequence as the scheduler sees it: the runner's sequence plus where it lives."""

    replica: int | None = None  # the attention replica it is pinned to while it has cache
    num_preemptions: int = 0
    cache_salt: str | None = None  # its blocks are shared only with sequences of the same salt
    num_hit: int | None = None  # prompt tokens found cached at its first admission (usage's cached_tokens)
    is_refresh: bool = False  # a refresh of a finished sequence's cache (no request, never samples)
    reset_state_next: bool = False  # its next chunk is its first on its replica: zero or restore its KDA state
    cache: CacheHold = field(default_factory=CacheHold)  # its standing with the prefix cache (the cache's)
    home: int | None = None  # the replica its first admission must take (its prompt's blocks were sent there: cluster/pd.py)
