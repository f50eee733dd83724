"""Per-step statistics of the engine: token counts per logical expert and per expert actor, load
imbalance, exchange and compute times, latencies. Owned by the engine; read by the metrics
exporter and the benchmarks. Plain numbers only (no Prometheus objects here)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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
    finished: int = 0
    generation_tokens: int = 0
    prompt_tokens: int = 0
    last_expert_tokens: list[list[int]] | None = None
    expert_tokens_total: torch.Tensor | None = None  # [moe layers, experts], over the engine's life
    actor_tokens_total: list[int] = field(default_factory=list)
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
        counts = [r.expert_tokens for r in attn if r.expert_tokens]
        if counts:
            step = torch.tensor(counts, dtype=torch.long).sum(0)  # [moe layers, experts]
            summed = step.tolist()
            self.last_expert_tokens = summed
            self.expert_tokens_total += step
            per_layer_actor = step.sum(0)
            per_actor = [int(per_layer_actor[lo:hi].sum()) for lo, hi in table.ranges]
            if not self.actor_tokens_total:
                self.actor_tokens_total = [0] * len(per_actor)
            self.actor_tokens_total = [a + b for a, b in zip(self.actor_tokens_total, per_actor)]
        else:
            self.last_expert_tokens = None
        times = StepTimes(step_s, tokens, tuple(r.exchange_s for r in attn), tuple(r.exchange_s for r in expert),
                          tuple(r.compute_s for r in expert), tuple(r.dispatch_s for r in attn),
                          tuple(r.combine_s for r in attn))
        self.recent.append(times)
        for fn in self.listeners:
            fn("step", times=times, expert_tokens=self.last_expert_tokens, table=table)

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

    def observe_epoch(self, epoch: int, pause_s: float) -> None:
        """A placement-epoch change took effect after serving paused for ``pause_s`` seconds."""
        for fn in self.listeners:
            fn("epoch", epoch=epoch, pause_s=pause_s)
