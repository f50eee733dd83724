"""One step's MoE layers as a pipeline of micro-batches, for the simulator (:mod:`cluster.capacity.stepcost`).

A decode step's batch is cut into ``m`` micro-batches; each goes through every MoE layer as four
stages: attention (this layer, on the attention device), dispatch (attention → experts, "A2F"),
the experts (on the expert device) and combine (experts → attention, "F2A"). Disaggregated, the
four stages run on four resources — the attention device, the expert device and the link's two
directions (full duplex) — so different micro-batches' stages overlap; colocated, one device does
both compute stages and every worker's link carries both exchanges. Per layer, the steady-state
cycle is bounded by the busiest resource (``m`` stages of it) and by one micro-batch's chain
(MegaScale-Infer's ping-pong pipeline, Step-3's AFD):

    disaggregated: max(m·T_attention, m·T_dispatch, m·T_experts, m·T_combine, chain)
    colocated:     max(m·(T_attention + T_experts), m·(T_dispatch + T_combine), chain)

:func:`timeline` plays the stages out task by task (each resource in the engine's order: every
micro-batch's attention, then their dispatches, experts, combines), and is what a step costs;
:func:`cycle_s` is the bound: disaggregated, the period it settles to, exactly, and the whole step
(L − 1)·cycle + one chain + (m − 1)·the busiest stage; colocated, a lower bound (in the engine's
order a device may wait for a dispatch). Both checked in tests/cluster/test_pipeline.py.

Owns: composing stage times into a step's MoE time. Never: prices a stage (:mod:`cluster.costmodel`).
"""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("attention", "dispatch", "experts", "combine")


@dataclass(frozen=True)
class Stages:
    """One micro-batch's four stages in one MoE layer, in seconds (each on its busiest device)."""

    attention_s: float
    dispatch_s: float
    experts_s: float
    combine_s: float

    @property
    def chain_s(self) -> float:
        return self.attention_s + self.dispatch_s + self.experts_s + self.combine_s

    def times(self) -> tuple[float, float, float, float]:
        return self.attention_s, self.dispatch_s, self.experts_s, self.combine_s


def resources(colocated: bool) -> tuple[str, str, str, str]:
    """The resource each stage runs on."""
    if colocated:
        return "device", "link", "device", "link"
    return "attention device", "dispatch link", "expert device", "combine link"


def cycle_s(st: Stages, m: int, colocated: bool) -> float:
    """The steady-state time per MoE layer of ``m`` micro-batches (the bound above; colocated, a lower
    bound)."""
    if m < 1:
        raise ValueError(f"micro-batches must be >= 1, got {m}")
    if colocated:
        return max(m * (st.attention_s + st.experts_s), m * (st.dispatch_s + st.combine_s), st.chain_s)
    return max(m * max(st.times()), st.chain_s)


def timeline(st: Stages, m: int, layers: int, colocated: bool) -> list[list[tuple[float, float]]]:
    """(start, end) of every stage, ``[layer * 4 + stage][micro-batch]``: each stage starts when its
    micro-batch's previous stage has ended and its resource is free; a resource takes its stages in
    the engine's order (per layer: the micro-batches' attention, then their dispatches, experts and
    combines)."""
    if m < 1 or layers < 0:
        raise ValueError(f"micro-batches must be >= 1 and layers >= 0, got {m} and {layers}")
    res, times = resources(colocated), st.times()
    free: dict[str, float] = {}
    ready = [0.0] * m  # when each micro-batch's previous stage ended
    out = []
    for _layer in range(layers):
        for s in range(4):
            row = []
            for j in range(m):
                start = max(ready[j], free.get(res[s], 0.0))
                end = start + times[s]
                free[res[s]] = ready[j] = end
                row.append((start, end))
            out.append(row)
    return out


def makespan_s(st: Stages, m: int, layers: int, colocated: bool) -> float:
    """When the last micro-batch's last combine ends (0 without layers)."""
    t = timeline(st, m, layers, colocated)
    return max(end for _, end in t[-1]) if t else 0.0
