"""Per-step statistics of the engine: token counts per logical expert and per expert actor, load
imbalance, exchange and compute times, latencies. Owned by the engine; read by the metrics
exporter and the benchmarks. Plain numbers only (no Prometheus objects here)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from actors.messages import ExpertStepResult, PlacementTable, StepResult


@dataclass
class StepTimes:
    step_s: float
    tokens: int
    attention_exchange_s: tuple[float, ...]
    expert_exchange_s: tuple[float, ...]
    expert_compute_s: tuple[float, ...]
    attention_dispatch_s: tuple[float, ...] = ()
    attention_combine_s: tuple[float, ...] = ()


@dataclass
class EngineStats:
    moe_layers: list[int]
    num_experts: int
    steps: int = 0
    tokens_computed: int = 0
    preemptions: int = 0
    micro_batched_steps: int = 0  # steps split into micro-batches (ping-pong)
    ahead_steps: int = 0  # steps sent ahead of the last one's results (async scheduling)
    # cumulative seconds per part of the step, and the steps they cover (the per-step breakdown)
    breakdown: dict = field(default_factory=lambda: {"steps": 0})
    finished: int = 0
    generation_tokens: int = 0
    prompt_tokens: int = 0
    last_expert_tokens: torch.Tensor | None = None  # [moe layers, experts] of the last step
    last_slot_tokens: torch.Tensor | None = None  # [moe layers, expert actors, max local slots] of the last step
    expert_tokens_total: torch.Tensor | None = None  # [moe layers, experts], over the engine's life
    actor_tokens_total: list[int] = field(default_factory=list)  # per expert actor index, over all epochs
    actor_window: deque = field(default_factory=lambda: deque(maxlen=4096))  # (epoch, [layers, actors]) per step
    epoch_pauses: list = field(default_factory=list)  # (epoch, pause seconds) per epoch change
    actor_failures: dict = field(default_factory=dict)  # actor kind → failures seen
    recoveries: list = field(default_factory=list)  # seconds from a failed step to the recovered cluster
    # since the current epoch began, [layers, expert actors, local slots]: rows the attention workers sent
    # to each physical slot, and rows the expert workers computed there (a replica's copies counted apart)
    epoch: int = -1
    epoch_slot_tokens: torch.Tensor | None = None
    epoch_slot_rows: torch.Tensor | None = None
    recent: deque = field(default_factory=lambda: deque(maxlen=512))
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    e2e_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    listeners: list = field(default_factory=list)  # callables(event: str, **values), e.g. metrics

    def __post_init__(self):
        self.expert_tokens_total = torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.long)

    def record_step(self, tokens: int, attn: list[StepResult], expert: list[ExpertStepResult], step_s: float,
                    table: PlacementTable) -> None:
        self.steps += 1
        self.tokens_computed += tokens
        if table.epoch != self.epoch:
            self.epoch, self.epoch_slot_tokens, self.epoch_slot_rows = table.epoch, None, None
        rows = [r.rows_per_slot for r in expert if r.rows_per_slot]
        if rows and len(rows) == len(expert):
            step_rows = torch.tensor(rows, dtype=torch.long).transpose(0, 1)  # [layers, actors, slots]
            self.epoch_slot_rows = step_rows if self.epoch_slot_rows is None else self.epoch_slot_rows + step_rows
        counts = [_counts(r.expert_tokens) for r in attn if len(r.expert_tokens)]
        slots = [_counts(r.slot_tokens) for r in attn if len(r.slot_tokens)]
        per_actor = None
        if counts:
            step = counts[0] if len(counts) == 1 else torch.stack(counts).sum(0)  # [moe layers, experts]
            self.last_expert_tokens = step
            self.expert_tokens_total += step
        else:
            self.last_expert_tokens = None
        if slots:
            self.last_slot_tokens = slots[0] if len(slots) == 1 else torch.stack(slots).sum(0)  # [layers, actors, slots]
            self.epoch_slot_tokens = (self.last_slot_tokens if self.epoch_slot_tokens is None
                                      else self.epoch_slot_tokens + self.last_slot_tokens)
            layer_actor = self.last_slot_tokens.sum(2)  # [layers, actors]
            self.actor_window.append((table.epoch, layer_actor))
            per_actor = layer_actor.sum(0).tolist()
            if len(self.actor_tokens_total) < len(per_actor):
                self.actor_tokens_total += [0] * (len(per_actor) - len(self.actor_tokens_total))
            for j, n in enumerate(per_actor):
                self.actor_tokens_total[j] += n
        else:
            self.last_slot_tokens = None
        times = StepTimes(step_s, tokens, tuple(r.exchange_s for r in attn), tuple(r.exchange_s for r in expert),
                          tuple(r.compute_s for r in expert), tuple(r.dispatch_s for r in attn),
                          tuple(r.combine_s for r in attn))
        self.recent.append(times)
        self._breakdown_step(attn, expert, step_s)
        for fn in self.listeners:
            fn("step", times=times, expert_tokens=self.last_expert_tokens, actor_tokens=per_actor)

    def add_time(self, **seconds: float) -> None:
        """Add to the breakdown (engine thread; the status reader copies the dict)."""
        for k, v in seconds.items():
            self.breakdown[k] = self.breakdown.get(k, 0.0) + v

    def _breakdown_step(self, attn: list[StepResult], expert: list[ExpertStepResult], step_s: float) -> None:
        """The actors' side of one step: the slowest attention replica's parts, the mean expert actor's."""
        if not attn:
            return
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
        self.add_time(**parts)
        self.breakdown["steps"] += 1

    def actor_imbalance(self, steps: int, epoch: int | None = None) -> list[float]:
        """Measured, per MoE layer: max over mean tokens per expert actor over the last ``steps``
        steps of ``epoch`` (default: the latest epoch seen). Empty when there is no traffic."""
        recent = list(self.actor_window)[-steps:]
        if not recent:
            return []
        epoch = recent[-1][0] if epoch is None else epoch
        rows = [t for e, t in recent if e == epoch]
        if not rows:
            return []
        load = torch.stack(rows).sum(0).double()  # [layers, actors]
        mean = load.mean(1)
        return [float(m / a) if a > 0 else 0.0 for m, a in zip(load.max(1).values, mean)]

    def observe_failure(self, kind: str) -> None:
        self.actor_failures[kind] = self.actor_failures.get(kind, 0) + 1
        for fn in self.listeners:
            fn("failure", kind=kind)

    def observe_recovery(self, seconds: float) -> None:
        self.recoveries.append(seconds)
        for fn in self.listeners:
            fn("recovery", seconds=seconds)

    def observe_epoch(self, epoch: int, pause_s: float) -> None:
        self.epoch_pauses.append((epoch, pause_s))
        for fn in self.listeners:
            fn("epoch", epoch=epoch, pause_s=pause_s)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_s.append(seconds)
        for fn in self.listeners:
            fn("ttft", seconds=seconds)

    def observe_itl(self, seconds: float) -> None:
        for fn in self.listeners:
            fn("itl", seconds=seconds)

    def observe_finished(self, seconds: float, seq) -> None:
        self.finished += 1
        self.e2e_s.append(seconds)
        self.generation_tokens += len(seq.output_ids)
        self.prompt_tokens += seq.num_prompt_tokens
        for fn in self.listeners:
            fn("finished", seconds=seconds, seq=seq)


def _counts(x) -> torch.Tensor:
    """A step result's counts as a long tensor of our own (Ray hands a numpy array over read-only)."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.astype(np.int64, copy=True))
    return torch.as_tensor(x, dtype=torch.long)
