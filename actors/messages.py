"""What crosses actor boundaries. Every message is a frozen dataclass of plain Python values (and
a step result's two count arrays): once per actor per step the engine sends one of these over the actor's
step channel (:mod:`actors.channel`) and gets one back; per-layer traffic never
does — it moves through the process group (see :mod:`actors.dispatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from model.sampling import SamplingParams

from .framing import check_token


@dataclass(frozen=True)
class PlacementTable:
    """The shape of one epoch: where every logical expert lives, per MoE layer. Built only by the
    Router (:mod:`actors.router`); read by the engine, attention workers (to dispatch) and expert
    workers (to know which experts to hold).

    ``slots[i][j]`` are the logical experts in expert actor j's physical slots at the i-th MoE layer
    (``moe_layers[i]``), in local-slot order. A logical expert has one or more copies per layer
    (replicas of hot experts); an actor never holds two copies of one expert in one layer.

    Two layouts. Disaggregated: the process group of the epoch is ``num_attention`` attention ranks,
    then the expert actors. ``colocated``: W workers, each one process holding attention replica i
    and expert shard i (``num_attention == num_actors == W``); the group is the W workers."""

    epoch: int
    num_experts: int
    num_attention: int
    moe_layers: tuple[int, ...]
    slots: tuple[tuple[tuple[int, ...], ...], ...]
    colocated: bool = False

    def __post_init__(self):
        if len(self.slots) != len(self.moe_layers) or not self.slots:
            raise ValueError(f"placement: {len(self.slots)} slot layouts for {len(self.moe_layers)} MoE layers")
        if self.num_attention < 1:
            raise ValueError(f"placement: num_attention must be >= 1, got {self.num_attention}")
        if self.colocated and self.num_attention != len(self.slots[0]):
            raise ValueError(f"placement: a colocated table has as many attention replicas as expert shards "
                             f"(one per worker), got {self.num_attention} and {len(self.slots[0])}")
        for layer, per_actor in zip(self.moe_layers, self.slots):
            if len(per_actor) != len(self.slots[0]) or not per_actor:
                raise ValueError(f"placement: MoE layer {layer} has {len(per_actor)} expert actors, "
                                 f"layer {self.moe_layers[0]} has {len(self.slots[0])}")
            held = [e for ids in per_actor for e in ids]
            if set(held) != set(range(self.num_experts)):
                missing = sorted(set(range(self.num_experts)) - set(held))
                raise ValueError(f"placement: MoE layer {layer} leaves logical experts {missing[:8]} without a "
                                 f"slot (or names ids outside 0..{self.num_experts - 1})")
            for j, ids in enumerate(per_actor):
                if len(set(ids)) != len(ids):
                    raise ValueError(f"placement: expert actor {j} holds one expert twice in MoE layer {layer}")

    @property
    def num_actors(self) -> int:
        return len(self.slots[0])

    @property
    def world_size(self) -> int:
        return self.num_actors if self.colocated else self.num_attention + self.num_actors

    def expert_rank(self, actor: int) -> int:
        """The process-group rank of expert actor ``actor`` (in a colocated table, its worker's)."""
        return actor if self.colocated else self.num_attention + actor

    @property
    def max_local(self) -> int:
        """The most physical slots any expert actor has in any layer."""
        return max(len(ids) for per_actor in self.slots for ids in per_actor)

    def layer_index(self, layer: int) -> int:
        return self.moe_layers.index(layer)

    def experts_of(self, actor: int) -> dict[int, tuple[int, ...]]:
        """MoE layer → the logical experts expert actor ``actor`` holds, in local-slot order."""
        return {layer: per_actor[actor] for layer, per_actor in zip(self.moe_layers, self.slots)}

    def copies(self, layer_index: int) -> list[list[tuple[int, int]]]:
        """logical expert → its copies as (expert actor, local slot), at the i-th MoE layer."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        for j, ids in enumerate(self.slots[layer_index]):
            for local, e in enumerate(ids):
                out[e].append((j, local))
        return out

    def replicated(self, layer_index: int) -> list[int]:
        """Logical experts with more than one copy at the i-th MoE layer."""
        return [e for e, c in enumerate(self.copies(layer_index)) if len(c) > 1]

    def num_physical(self) -> int:
        """Physical expert slots over all actors, per layer (the largest layer)."""
        return max(sum(len(ids) for ids in per_actor) for per_actor in self.slots)

    def shape(self) -> str:
        if self.colocated:
            return f"{self.num_actors} workers (attention + experts each)"
        return f"{self.num_attention} attention × {self.num_actors} expert actors"


AHEAD = -1  # a token id the engine does not know yet: the one the attention worker sampled for the
# sequence in the step before (a step sent ahead of the last one's results, see StepRequest.ahead)


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
    reset_state: bool = False  # its first chunk on this replica: zero the KDA slot (and take ``params``)
    sample: bool = True  # this chunk ends the known tokens: sample the next one
    # the sequence's sampling params, only on its first chunk on its replica (reset_state): the actor keeps
    # them until StepRequest.release names the sequence; None on every other chunk and on refresh jobs
    params: SamplingParams | None = None
    prompt_len: int = 0  # the sequence's prompt tokens: positions from here on are generated ones
    banned: tuple[int, ...] = ()  # ids the sampled token must not be: the stop ids before min_tokens
    # prefix caching: with reset_state, load the KDA state from this snapshot instead of zeroing it
    # (the sequence's first num_cached tokens were found cached); after the step, save the state into
    # ``snapshot``; ``prefix`` = the tokens before num_cached, for a new history (penalties, grammar)
    restore: int | None = None
    snapshot: int | None = None
    prefix: tuple[int, ...] = ()
    # speculative decoding: the last ``draft`` of token_ids are proposed tokens to verify: the actor samples
    # after the chunk's known tokens and after each draft, and returns its samples up to the first that
    # differs from the draft there (the accepted drafts, then one token of its own)
    draft: int = 0
    # speculative decoding with the MTP layer: the token after this chunk when it is known (a prefill chunk
    # before the prompt's end); -1 otherwise
    lookahead: int = -1


@dataclass(frozen=True)
class StepRequest:
    """Engine → attention worker, once per step (possibly with no chunks: the worker still takes
    part in every MoE layer's exchange)."""

    step: int
    epoch: int
    chunks: tuple[SeqChunk, ...] = ()
    micro: tuple[int, ...] = ()  # chunks per micro-batch, in order (ping-pong); () → one micro-batch
    # sent before step - 1's results reached the engine (async scheduling): its AHEAD tokens are what
    # step - 1 sampled here, and an actor where step - 1 did not complete refuses it at once
    ahead: bool = False
    release: tuple[int, ...] = ()  # sequences that left this replica since its last step: forget them
    # every worker's (colocated: to serve its shard's rows) or attention actor's token count per micro-batch
    # (ExpertStep.tokens): what the mailbox exchange (actors/board.py) decides its path and sizes by
    peer_tokens: tuple[tuple[int, ...], ...] = ()
    # MoE layers nobody exchanges in this step (the MTP layer's, in a step whose batch drafts nothing)
    skip: tuple[int, ...] = ()
    # the KV tier: ("block" | "snapshot", id, prefix hash) registered since the last step, copied out as this
    # step begins and written through by the actor's writer thread (actors/tier.py)
    tier_writes: tuple[tuple[str, int, bytes], ...] = ()


@dataclass(frozen=True)
class ExpertStep:
    """Engine → expert worker, once per step: ``tokens[m][s]`` is attention rank s's token count in
    micro-batch m (every attention rank runs the same number of micro-batches)."""

    step: int
    epoch: int
    tokens: tuple[tuple[int, ...], ...]
    ahead: bool = False  # as StepRequest.ahead: refused at once where step - 1 did not complete
    skip: tuple[int, ...] = ()  # as StepRequest.skip


def refuse_ahead(actor: str, step: int, ahead: bool, completed: int) -> None:
    """A step sent ahead needs the step before it to have completed on this actor (``completed``):
    it reads that step's samples, and peers that saw that step fail will not take part in its
    exchanges — so it fails at once instead of waiting out the collective timeout."""
    if ahead and completed != step - 1:
        raise RuntimeError(f"{actor}: step {step} was sent ahead of step {step - 1}, which did not complete here")


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepResult:
    """Attention worker → engine. ``expert_tokens[i][e]``: tokens this worker routed to logical
    expert e at the i-th MoE layer in this step; ``slot_tokens[i][j][s]``: the rows it sent to
    expert actor j's local slot s there (a replicated expert's copies counted apart). Both are
    integer numpy arrays from a worker (tensors and nested tuples are accepted too); empty when the
    step ran no tokens here."""

    step: int
    actor: str
    tokens: tuple[SampledToken, ...] = ()
    # speculative decoding with the MTP layer: (sequence, context length, the guessed token after it)
    drafts: tuple[tuple[int, int, int], ...] = ()
    expert_tokens: np.ndarray | torch.Tensor | tuple = ()
    slot_tokens: np.ndarray | torch.Tensor | tuple = ()
    forward_s: float = 0.0  # the micro-batches' forward, exchanges included
    sample_s: float = 0.0  # logits and sampling
    exchange_s: float = 0.0  # time inside collectives (dispatch + combine)
    dispatch_s: float = 0.0  # counts + token rows out
    combine_s: float = 0.0  # result rows back
    cpu_s: float = 0.0  # the actor thread's CPU time in the step (its wall time less this: waiting or descheduled)
    # the step's timeline on this host's monotonic clock (time.perf_counter: CLOCK_MONOTONIC, one clock
    # for every process of a node), for the per-token profile (cluster/stats.py:step_profile): the
    # request's frame read, the forward begun, the result made (then pickled and sent)
    received_at: float = 0.0
    started_at: float = 0.0
    replied_at: float = 0.0
    forward_exchange_s: float = 0.0  # exchange_s within the forward (the MTP layer's comes after sampling)
    # seconds of the forward by part: the inputs made, each layer kind's compute (model/timing.py), the
    # local experts' rows (colocated, in process) and the exchange's own packing around its collectives
    forward_parts: tuple[tuple[str, float], ...] = ()
    # the compiled decode step (model/compiled.py): its micro-batches that ran compiled ("compiled") and
    # those that fell back to eager, by reason; empty with compile off or no decode step
    compiled: tuple[tuple[str, int], ...] = ()
    # the KV tier's counters on this actor (actors/tier.py ``counters``), when they changed since its last step
    tier: dict | None = None


@dataclass(frozen=True)
class ExpertStepResult:
    """Expert worker → engine: rows computed per MoE layer (and per local slot), and where the time went."""

    step: int
    actor: str
    rows_per_layer: tuple[int, ...] = ()
    rows_per_slot: tuple[tuple[int, ...], ...] = ()
    compute_s: float = 0.0
    exchange_s: float = 0.0
    dispatch_s: float = 0.0
    combine_s: float = 0.0
    cpu_s: float = 0.0  # the actor thread's CPU time in the step


@dataclass(frozen=True)
class WorkerStepResult:
    """Colocated worker → engine: both halves of its step (the executor hands them on as an attention
    replica's and an expert actor's results)."""

    attention: StepResult
    experts: ExpertStepResult


@dataclass(frozen=True)
class GroupInfo:
    """The process group of one epoch (all attention then all expert actors; sizes in the epoch's
    :class:`PlacementTable`): a fresh rendezvous per epoch. Created by the engine's worker group.
    ``token`` (:data:`~actors.framing.TOKEN_BYTES` secret bytes, fresh per epoch) is what every
    connection of the epoch's exchange sockets presents; anything without it is refused."""

    epoch: int
    address: str
    port: int
    token: bytes = field(repr=False)
    backend: str = "gloo"
    timeout_s: float = 60.0  # each collective and exchange wait
    transport: str = "auto"  # the exchange on gloo: "socket" (and "auto") direct sockets (actors/wire.py), "shm"
    # shared memory on one node and sockets between nodes (actors/shm.py), "group" gloo's own
    # the rendezvous (None: timeout_s): a member may still be finishing the last step, which waits up to
    # timeout_s on a dead peer, or starting on a loaded node, while the others wait for it
    join_timeout_s: float | None = None

    @property
    def rendezvous_timeout_s(self) -> float:
        return self.timeout_s if self.join_timeout_s is None else max(self.join_timeout_s, self.timeout_s)

    def __post_init__(self):
        check_token(self.token, "group: token")
