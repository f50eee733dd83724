"""The capacity search of `moeray simulate` / `moeray plan`: every split of a device count into
attention replicas and expert actors (or colocated workers), each simulated or priced at steady
state, ranked, and the Pareto front marked.

Owns: the candidate shapes and their ranking. Never: prices a step itself (a :class:`StepCost`
does) or runs the engine.
"""

from __future__ import annotations

from typing import Iterable

from model.config import ModelConfig

from ..config import EngineConfig
from .simulator import Routing, Simulator
from .stepcost import Shape, StepCost
from .workload import SimRequest


def _shapes(model_cfg: ModelConfig, devices: int, redundant_slots: tuple[int, ...], colocated: bool,
            micro_batches: tuple[int, ...] = (1,), attention: Iterable[int] | None = None):
    """Every split of ``devices`` into attention replicas and expert actors (those with
    ``attention`` replicas when given; and, ``colocated``, the layout with a worker per device), with
    each redundant-slot count and micro-batch count (the colocated layout's at most 2)."""
    counts = range(1, devices) if attention is None else sorted(a for a in set(attention) if 1 <= a < devices)
    splits = [(a, devices - a, False) for a in counts if devices - a <= model_cfg.n_routed_experts]
    if colocated and devices <= model_cfg.n_routed_experts:
        splits.append((devices, devices, True))
    for attention_, experts, together in splits:
        for r in redundant_slots:
            if r and r > experts * model_cfg.n_routed_experts:
                continue
            for m in micro_batches:
                if not (together and m > 2):
                    yield Shape(attention_, experts, r, colocated=together, micro_batches=m)


def split_grid(candidates: list[int], max_splits: int) -> list[int]:
    """``max_splits`` of the ``candidates`` (sorted attention counts) spread evenly over them, the
    first and the last included (all of them when that many or fewer)."""
    if max_splits < 2:
        raise ValueError(f"max_splits must be at least 2, got {max_splits}")
    if len(candidates) <= max_splits:
        return list(candidates)
    n = len(candidates) - 1
    return [candidates[i] for i in sorted({round(k * n / (max_splits - 1)) for k in range(max_splits)})]


def _mark_pareto(out: list[dict], eligible=lambda s: True) -> None:
    """``pareto``: no other eligible result has at least the tokens/s per GPU at no more ITL p50."""
    for s in out:
        s["pareto"] = eligible(s) and not any(
            o is not s and eligible(o) and o["tokens_per_s_per_gpu"] >= s["tokens_per_s_per_gpu"]
            and o["itl_p50_s"] <= s["itl_p50_s"]
            and (o["tokens_per_s_per_gpu"], -o["itl_p50_s"]) != (s["tokens_per_s_per_gpu"], -s["itl_p50_s"])
            for o in out)


def search(model_cfg: ModelConfig, devices: int, cost_for, workload: list[SimRequest], *, config,
           routing: Routing | None = None, redundant_slots: tuple[int, ...] = (0,), seed: int = 0,
           tpot_s: float | None = None, ttft_s: float | None = None, fits=None,
           colocated: bool = True) -> list[dict]:
    """Every split of ``devices`` into attention replicas and expert actors (with each redundant-slot
    count), simulated; each summary says whether it meets the targets (``ok``) and whether it is on
    the Pareto front of tokens/s per GPU against ITL p50 (``pareto``). ``cost_for(shape)`` builds
    the step cost of a shape (its links depend on it); ``config``, the engine config, or a function
    of the shape giving it (the room for sequences depends on the layout); ``fits(shape)``, if given,
    skips the shapes whose weights do not fit the devices. ``colocated`` adds the layout with an attention replica
    and an expert actor on every device."""
    out = []
    for shape in _shapes(model_cfg, devices, redundant_slots, colocated):
        if fits is not None and not fits(shape):
            continue
        conf = config(shape) if callable(config) else config
        s = Simulator(model_cfg, shape, cost_for(shape), config=conf, routing=routing, seed=seed).run(workload).summary()
        s["ok"] = (tpot_s is None or s["itl_p50_s"] <= tpot_s) and (ttft_s is None or s["ttft_p50_s"] <= ttft_s)
        out.append(s)
    if not out:
        raise ValueError(f"no split of {devices} devices fits this model")
    _mark_pareto(out)
    return out


def shape_capacity(model_cfg: ModelConfig, shape: Shape, cost: StepCost, *, room: int, tpot_s: float | None,
                   context: int, output_tokens: int, routing: Routing | None = None, seed: int = 0, steps: int = 40,
                   warmup: int = 8) -> dict:
    """One shape's capacity: the largest batch per attention replica, 1..``room`` (its room for
    sequences), whose decode step meets ``tpot_s`` (bisected on :meth:`Simulator.decode_step` at
    the mean context; ``None``: the room itself), then a steady-state run at that batch
    (:meth:`Simulator.run_steady`, one replica scheduled), 5 % less if its tail misses. ``context``:
    the prompt, made elsewhere; ``output_tokens`` decoded after it. ``meets``: ITL p50 and p99 within
    the target."""
    cap = max(1, room)
    # the scheduler holds each sequence's own tokens only (its prompt is priced, not stored)
    config = EngineConfig.of(model="simulated", block_size=64, num_blocks=cap * (output_tokens // 64 + 2),
                             max_num_seqs=cap, max_tokens_per_step=1 << 20)
    sim = Simulator(model_cfg, shape, cost, config=config, routing=routing, seed=seed)
    batch = room if tpot_s is None else sim.capacity(tpot_s, context + output_tokens // 2, room)
    for attempt in range(2):  # the steady run's routing draws may make the tail a little slower
        s = sim.run_steady(max(batch, 1), context=context, output_tokens=output_tokens, steps=steps, warmup=warmup,
                           one_replica=True).summary()
        s["meets"] = s["ok"] = batch > 0 and (tpot_s is None or (s["itl_p50_s"] <= tpot_s and s["itl_p99_s"] <= tpot_s))
        if s["meets"] or batch <= 1 or attempt:
            break
        batch = max(1, int(batch * 0.95))
    s["kv_sequences"], s["capacity_batch"] = room, batch
    s["tokens_per_s_per_gpu_at_slo"] = s["tokens_per_s_per_gpu"] if s["meets"] else 0.0
    return s


def capacity_search(model_cfg: ModelConfig, devices: int, cost_for, *, plan_for, tpot_s: float, context: int,
                    output_tokens: int, routing: Routing | None = None, redundant_slots: tuple[int, ...] = (0,),
                    micro_batches: tuple[int, ...] = (1, 2, 3), seed: int = 0, steps: int = 40,
                    warmup: int = 8, max_splits: int = 32) -> list[dict]:
    """Capacity at the latency target (:func:`shape_capacity`), for every deployable shape of
    ``devices``: the attention:expert splits whose experts fit (``plan_for(shape)``, the planner in
    the shape's layout; its ``concurrent_sequences`` the room) and the colocated layout, each with
    every micro-batch count (colocated: 1 and 2) and redundant-slot count. Past ``max_splits``
    splits that fit, ``max_splits`` of them spread evenly, then every split between the best one's
    neighbours on that grid. Rows in the order of :func:`_shapes` (by attention count, the colocated
    layout last).
    The best of each split over micro-batches is marked ``best_m``; ``pareto`` as :func:`search`."""
    out = []

    def run(attention, colocated):
        for shape in _shapes(model_cfg, devices, redundant_slots, colocated, micro_batches, attention):
            plan = plan_for(shape)
            if not plan.fits:
                continue
            out.append(shape_capacity(model_cfg, shape, cost_for(shape), room=plan.concurrent_sequences,
                                      tpot_s=tpot_s, context=context, output_tokens=output_tokens, routing=routing,
                                      seed=seed, steps=steps, warmup=warmup))

    fitting = [a for a in range(1, devices) if devices - a <= model_cfg.n_routed_experts
               and plan_for(Shape(a, devices - a)).fits]  # the planner's memory, whatever m
    grid = split_grid(fitting, max_splits)
    run(grid, True)
    disaggregated = [s for s in out if not s["colocated"]]
    if len(grid) < len(fitting) and disaggregated:
        a = max(disaggregated, key=lambda s: (s["tokens_per_s_per_gpu_at_slo"], s["tokens_per_s_per_gpu"]))["attention"]
        k = grid.index(a)
        lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
        run([x for x in fitting if lo < x < hi and x not in grid], False)
    if not out:
        raise ValueError(f"no shape of {devices} devices fits this model")
    out.sort(key=lambda s: (s["colocated"], s["attention"], s["redundant_slots"], s["micro_batches"]))
    best: dict[tuple, dict] = {}
    for s in out:
        key = (s["attention"], s["experts"], s["colocated"], s["redundant_slots"])
        if key not in best or s["tokens_per_s_per_gpu_at_slo"] > best[key]["tokens_per_s_per_gpu_at_slo"]:
            best[key] = s
    for s in out:
        s["best_m"] = s is best[(s["attention"], s["experts"], s["colocated"], s["redundant_slots"])]
    _mark_pareto(out, lambda s: s["meets"])
    return out
