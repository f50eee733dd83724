"""The engine's statistics: typed records with one writer (the engine thread), handed to listeners.

Each thing measured is a frozen record — :class:`StepRecord` (one finished step), :class:`TokenTiming`
(a first or a later token), :class:`Finished` (a request), :class:`EpochPaused`, :class:`ActorFailed`,
:class:`ActorHung`, :class:`Recovered` — and :class:`EngineStats` keeps the running figures the status and the
benchmarks read, then hands each record to its listeners (the metrics exporter: a stat logger, as
vLLM's). Per-expert token counts are not kept here: the router keeps them, once.
Plain numbers and tensors only (no Prometheus objects here).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from actors.messages import ExpertStepResult, PlacementTable, StepResult


@dataclass(frozen=True)
class StepRecord:
    """One finished step, made by the engine from the actors' results (:meth:`of`)."""

    epoch: int
    tokens: int
    step_s: float
    attention_exchange_s: tuple[float, ...] = ()
    expert_exchange_s: tuple[float, ...] = ()
    expert_compute_s: tuple[float, ...] = ()
    attention_dispatch_s: tuple[float, ...] = ()
    attention_combine_s: tuple[float, ...] = ()
    expert_tokens: torch.Tensor | None = None  # [moe layers, experts]: tokens per logical expert
    slot_tokens: torch.Tensor | None = None  # [moe layers, expert actors, local slots]: rows sent there
    slot_rows: torch.Tensor | None = None  # [moe layers, expert actors, local slots]: rows computed there
    parts: tuple[tuple[str, float], ...] = ()  # the actors' side of the step, for the breakdown
    profile: tuple[tuple[str, float], ...] = ()  # where the step's time went (:func:`step_profile`), when measured
    compiled: tuple[tuple[str, int], ...] = ()  # the replicas' decode forwards, compiled or fallen back (by reason)

    @property
    def actor_tokens(self) -> torch.Tensor | None:
        """[moe layers, expert actors]: rows sent to each expert actor."""
        return None if self.slot_tokens is None else self.slot_tokens.sum(2)

    @classmethod
    def of(cls, tokens: int, attn: list[StepResult], expert: list[ExpertStepResult], step_s: float,
           table: PlacementTable, stamps: tuple[float, float, float, float] | None = None) -> "StepRecord":
        counts = [_counts(r.expert_tokens) for r in attn if len(r.expert_tokens)]
        slots = [_counts(r.slot_tokens) for r in attn if len(r.slot_tokens)]
        rows = [r.rows_per_slot for r in expert if r.rows_per_slot]
        return cls(
            table.epoch, tokens, step_s, tuple(r.exchange_s for r in attn), tuple(r.exchange_s for r in expert),
            tuple(r.compute_s for r in expert), tuple(r.dispatch_s for r in attn), tuple(r.combine_s for r in attn),
            expert_tokens=_sum(counts), slot_tokens=_sum(slots),
            slot_rows=(torch.tensor(rows, dtype=torch.long).transpose(0, 1)  # [layers, actors, slots]
                       if rows and len(rows) == len(expert) else None),
            parts=tuple(_parts(attn, expert, step_s).items()),
            profile=tuple(step_profile(stamps, attn).items()) if stamps is not None else (),
            compiled=tuple(pair for r in attn for pair in r.compiled))


@dataclass(frozen=True)
class TokenTiming:
    """A request's first token (``first``: time to first token) or a later one (inter-token latency)."""

    seconds: float
    first: bool


@dataclass(frozen=True)
class Finished:
    """A request that ended (by a stop condition; aborted ones are not counted)."""

    seconds: float  # arrival to last token
    prompt_tokens: int
    generation_tokens: int
    finish_reason: str
    queue_s: float = 0.0  # arrival to first scheduled
    prefill_s: float = 0.0  # first scheduled to first token
    decode_s: float = 0.0  # first token to last token


@dataclass(frozen=True)
class EpochPaused:
    epoch: int
    pause_s: float


@dataclass(frozen=True)
class ActorFailed:
    kind: str  # "attention" | "expert"


@dataclass(frozen=True)
class ActorHung:
    """An actor found hung by the watchdog (silent past its budget, no heartbeat) and killed."""

    kind: str  # "attention" | "expert"
    index: int
    step: int
    at: float  # time.time()


@dataclass(frozen=True)
class Recovered:
    seconds: float  # from the failed step to the cluster serving again


Record = StepRecord | TokenTiming | Finished | EpochPaused | ActorFailed | ActorHung | Recovered


@dataclass
class EngineStats:
    """Running figures of one engine. Written only on the engine thread, through the ``observe_*``
    and ``record_step`` methods; readers on other threads copy what they read."""

    num_moe_layers: int
    steps: int = 0
    tokens_computed: int = 0
    preemptions: int = 0
    micro_batched_steps: int = 0  # steps split into micro-batches (ping-pong)
    ahead_steps: int = 0  # steps sent ahead of the last one's results (async scheduling)
    # cumulative seconds per part of the step, and the steps they cover (the per-step breakdown)
    breakdown: dict = field(default_factory=lambda: {"steps": 0})
    # cumulative seconds per category of the per-token profile (:func:`step_profile`), and its steps
    profile: dict = field(default_factory=lambda: {"steps": 0})
    finished: int = 0
    generation_tokens: int = 0
    prompt_tokens: int = 0
    epoch_pauses: list = field(default_factory=list)  # (epoch, pause seconds) per epoch change
    actor_failures: dict = field(default_factory=dict)  # actor kind → failures seen
    recoveries: list = field(default_factory=list)  # seconds from a failed step to the recovered cluster
    actor_hangs: dict = field(default_factory=dict)  # actor kind → actors found hung and killed
    last_hang: ActorHung | None = None
    # since the current epoch began, [layers, expert actors, local slots]: rows the attention workers sent
    # to each physical slot, and rows the expert workers computed there (a replica's copies counted apart)
    epoch: int = -1
    epoch_slot_tokens: torch.Tensor | None = None
    epoch_slot_rows: torch.Tensor | None = None
    recent: deque = field(default_factory=lambda: deque(maxlen=512))  # the last StepRecords, without their counts
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    e2e_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    listeners: list[Callable[[Record], None]] = field(default_factory=list)  # stat loggers, e.g. metrics
    # speculative decoding (vLLM's spec_decode counters): sequences that carried drafts in a step, their
    # draft tokens, those accepted, and accepted per draft position; steps that verified drafts and the
    # sum over them of the mean distinct experts each MoE layer touched
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list = field(default_factory=list)
    spec_verify_steps: int = 0
    spec_experts_touched: float = 0.0
    # the compiled decode step: decode forwards that ran compiled ("compiled") and those that ran eager, by reason
    compiled: dict = field(default_factory=dict)

    def record_step(self, rec: StepRecord) -> None:
        self.steps += 1
        self.tokens_computed += rec.tokens
        if rec.epoch != self.epoch:
            self.epoch, self.epoch_slot_tokens, self.epoch_slot_rows = rec.epoch, None, None
        if rec.slot_rows is not None:
            self.epoch_slot_rows = _add(self.epoch_slot_rows, rec.slot_rows)
        if rec.slot_tokens is not None:
            self.epoch_slot_tokens = _add(self.epoch_slot_tokens, rec.slot_tokens)
        self.recent.append(dataclasses.replace(rec, expert_tokens=None, slot_tokens=None, slot_rows=None))
        if rec.parts:
            self.add_time(**dict(rec.parts))
            self.breakdown["steps"] += 1
        if rec.profile:
            for k, v in rec.profile:
                self.profile[k] = self.profile.get(k, 0.0) + v
            self.profile["steps"] += 1
        for path, n in rec.compiled:
            self.compiled[path] = self.compiled.get(path, 0) + n
        self._emit(rec)

    def observe_drafts(self, verified) -> None:
        """A finished step's :class:`~cluster.scheduler.Verified` drafts."""
        for v in verified:
            self.spec_drafts += 1
            self.spec_draft_tokens += v.drafted
            self.spec_accepted_tokens += v.accepted
            if len(self.spec_accepted_per_pos) < v.drafted:
                self.spec_accepted_per_pos += [0] * (v.drafted - len(self.spec_accepted_per_pos))
            for i in range(v.accepted):
                self.spec_accepted_per_pos[i] += 1

    def observe_verify_experts(self, expert_tokens) -> None:
        """A step that verified drafts routed ``expert_tokens`` [MoE layers, experts]."""
        self.spec_verify_steps += 1
        self.spec_experts_touched += float((expert_tokens > 0).sum(-1).float().mean())

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a sequence with drafts gained per step (accepted drafts plus its own), vLLM's."""
        return 1 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else None

    def add_time(self, **seconds: float) -> None:
        """Add to the breakdown (engine thread; the status reader copies the dict)."""
        for k, v in seconds.items():
            self.breakdown[k] = self.breakdown.get(k, 0.0) + v

    def observe_failure(self, kind: str) -> None:
        self.actor_failures[kind] = self.actor_failures.get(kind, 0) + 1
        self._emit(ActorFailed(kind))

    def observe_hang(self, kind: str, index: int, step: int) -> None:
        self.actor_hangs[kind] = self.actor_hangs.get(kind, 0) + 1
        self.last_hang = ActorHung(kind, index, step, time.time())
        self._emit(self.last_hang)

    def observe_recovery(self, seconds: float) -> None:
        self.recoveries.append(seconds)
        self._emit(Recovered(seconds))

    def observe_epoch(self, epoch: int, pause_s: float) -> None:
        self.epoch_pauses.append((epoch, pause_s))
        self._emit(EpochPaused(epoch, pause_s))

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_s.append(seconds)
        self._emit(TokenTiming(seconds, True))

    def observe_itl(self, seconds: float) -> None:
        self._emit(TokenTiming(seconds, False))

    def observe_finished(self, seconds: float, seq, *, queue_s: float = 0.0, prefill_s: float = 0.0,
                         decode_s: float = 0.0) -> None:
        self.finished += 1
        self.e2e_s.append(seconds)
        self.generation_tokens += len(seq.output_ids)
        self.prompt_tokens += seq.num_prompt_tokens
        self._emit(Finished(seconds, seq.num_prompt_tokens, len(seq.output_ids), str(seq.finish_reason),
                            queue_s, prefill_s, decode_s))

    def _emit(self, rec: Record) -> None:
        for fn in self.listeners:
            fn(rec)


def _parts(attn: list[StepResult], expert: list[ExpertStepResult], step_s: float) -> dict[str, float]:
    """The actors' side of one step: the slowest attention replica's parts, the mean expert actor's."""
    if not attn:
        return {}
    a = max(attn, key=lambda r: r.forward_s + r.sample_s)
    parts = {"step": step_s, "attention_compute": a.forward_s - a.exchange_s, "attention_wait": a.combine_s,
             "attention_post": a.dispatch_s, "sample": a.sample_s, "attention_cpu": a.cpu_s,
             "round_trip": step_s - a.forward_s - a.sample_s}
    if expert:
        n = len(expert)
        parts |= {"expert_compute": sum(r.compute_s for r in expert) / n,
                  "expert_receive": sum(r.dispatch_s for r in expert) / n,
                  "expert_send": sum(r.combine_s for r in expert) / n,
                  "expert_cpu": sum(r.cpu_s for r in expert) / n}
    return parts


# The per-token profile's categories, in the order a step passes through them: the engine schedules
# and sends (control_out: the request pickled, sent and read), the attention actor makes the inputs,
# computes each layer kind, exchanges (its collectives' own time; the exchange's packing around them;
# the routed experts where it computes them itself; ``compiled``: a compiled decode step's segments,
# attention, dense and MoE-block parts together — model/compiled.py), samples, makes its result (actor_post), which
# comes back (control_back: pickled, sent, read) and is applied (engine_update: stop checks, the
# scheduler's update). ``unaccounted`` is what none of them measured (the rest of the forward: the
# residual adds, the stage generators; a category missing); ``step`` is the step measured whole.
PROFILE = ("schedule", "control_out", "actor_prep", "inputs", "compiled", "embed_norm", "mla", "kda", "dense_mlp",
           "moe_local", "pack", "exchange", "experts", "sample", "actor_post", "control_back", "engine_update")


def step_profile(stamps: tuple[float, float, float, float], attn: list[StepResult]) -> dict[str, float]:
    """Where one step's time went, each category measured on its own (the engine's and the attention
    actors' clocks: ``time.perf_counter``, one monotonic clock per host). ``stamps``: the engine's
    (scheduling began, sending began, every result back, results applied). The attention replica
    whose result was made last is the step's critical path; its categories are the actor's. Across
    hosts the two control categories mix two clocks: meaningful only on one node (their sum is)."""
    planned, sending, back, done = stamps
    timed = [r for r in attn if r.replied_at]
    out = dict.fromkeys(PROFILE, 0.0)
    out["schedule"] = sending - planned
    if timed:
        a = max(timed, key=lambda r: r.replied_at)
        out |= {"control_out": a.received_at - sending, "actor_prep": a.started_at - a.received_at}
        for kind, s in a.forward_parts:
            out[kind] = out.get(kind, 0.0) + s
        out["exchange"] = a.forward_exchange_s
        out["sample"] = a.sample_s
        out["actor_post"] = a.replied_at - (a.started_at + a.forward_s + a.sample_s)
        out["control_back"] = back - a.replied_at
    # (no attention result carried a timeline: the whole round trip stays unaccounted)
    out["engine_update"] = done - back
    out["step"] = done - planned
    out["unaccounted"] = out["step"] - sum(v for k, v in out.items() if k != "step")
    return out


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    if not tensors:
        return None
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors).sum(0)


def _add(total: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return x if total is None else total + x


def _counts(x) -> torch.Tensor:
    """A step result's counts as a long tensor of our own (Ray hands a numpy array over read-only)."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.astype(np.int64, copy=True))
    return torch.as_tensor(x, dtype=torch.long)
