"""What crosses actor boundaries. Every message is a frozen dataclass of plain Python values
(no tensors): one Ray call per actor per step carries one of these; per-layer traffic never
does — it moves through the process group (see :mod:`actors.dispatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from model.sampling import SamplingParams


@dataclass(frozen=True)
class PlacementTable:
    """Where every logical expert lives, for one epoch. Created by the Router; read by attention
    workers (to dispatch) and expert workers (to know their shard).

    Expert actor ``j`` owns the contiguous logical experts ``ranges[j] = (lo, hi)``; the physical
    slot of logical expert e is (actor j, local index e - lo)."""

    epoch: int
    num_experts: int
    ranges: tuple[tuple[int, int], ...]

    @staticmethod
    def even(num_experts: int, num_actors: int, epoch: int = 0) -> PlacementTable:
        """Contiguous shards as equal as possible (the first ``num_experts % num_actors`` get one more)."""
        if not 1 <= num_actors <= num_experts:
            raise ValueError(f"expert actors must be in 1..{num_experts} (the routed experts), got {num_actors}")
        base, extra = divmod(num_experts, num_actors)
        ranges, lo = [], 0
        for j in range(num_actors):
            hi = lo + base + (1 if j < extra else 0)
            ranges.append((lo, hi))
            lo = hi
        return PlacementTable(epoch, num_experts, tuple(ranges))

    @property
    def num_actors(self) -> int:
        return len(self.ranges)

    @property
    def max_local(self) -> int:
        return max(hi - lo for lo, hi in self.ranges)

    def owner(self) -> list[tuple[int, int]]:
        """logical expert → (expert actor, local slot)."""
        out = []
        for j, (lo, hi) in enumerate(self.ranges):
            out.extend((j, e - lo) for e in range(lo, hi))
        return out


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's work in one step. Created by the scheduler; consumed by the attention worker
    that owns the sequence. ``token_ids`` are the new tokens at positions
    ``num_cached .. num_cached + len(token_ids) - 1``; their latents go to ``block_table``."""

    seq_id: int
    token_ids: tuple[int, ...]
    num_cached: int
    block_table: tuple[int, ...]
    state_slot: int | None = None
    reset_state: bool = False  # zero the KDA slot first: a new or recomputed sequence
    sample: bool = True  # this chunk ends the known tokens: sample the next one
    params: SamplingParams | None = None  # required when ``sample``


@dataclass(frozen=True)
class StepRequest:
    """Engine → attention worker, once per step (possibly with no chunks: the worker still takes
    part in every MoE layer's exchange)."""

    step: int
    epoch: int
    chunks: tuple[SeqChunk, ...] = ()


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepResult:
    """Attention worker → engine. ``expert_tokens[i][e]``: tokens this worker routed to logical
    expert e at its i-th MoE layer in this step."""

    step: int
    actor: str
    tokens: tuple[SampledToken, ...] = ()
    expert_tokens: tuple[tuple[int, ...], ...] = ()
    forward_s: float = 0.0
    exchange_s: float = 0.0  # time inside collectives (dispatch + combine)
    dispatch_s: float = 0.0  # counts + token rows out
    combine_s: float = 0.0  # result rows back


@dataclass(frozen=True)
class ExpertStepResult:
    """Expert worker → engine: rows computed per MoE layer, and where the time went."""

    step: int
    actor: str
    rows_per_layer: tuple[int, ...] = ()
    compute_s: float = 0.0
    exchange_s: float = 0.0
    dispatch_s: float = 0.0
    combine_s: float = 0.0


@dataclass(frozen=True)
class GroupInfo:
    """The process group of one epoch: all attention then all expert actors."""

    epoch: int
    world_size: int
    address: str
    port: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    num_attention: int = 1
    extra: dict = field(default_factory=dict, compare=False, hash=False)
