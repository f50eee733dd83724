"""A discrete-event simulator of moeray's engine: what a shape would serve, before anyone buys it.

It drives the real :class:`~cluster.scheduler.Scheduler` (built as the engine builds it:
continuous batching, chunked prefill, preemption, prefix caching) and the router's real placement
(:func:`~actors.router.even_table`, :func:`~actors.router.balanced_layer` for redundant slots),
so the simulated steps are the steps the engine would take. Only the actors are simulated: a step
costs what a :class:`StepCost` says for its batch (attention per replica, the exchange and expert
compute per MoE layer, overlapped as ping-pong would overlap them) plus the engine's per-step
overhead; its sampled tokens are placeholders, and requests end by length (their output tokens).

Owns: the clock, the requests' timings, the routing model's draws, the failures' pauses.
Never: talks to Ray or torch models (the CPU profile that feeds :class:`CpuCost` is
:mod:`cluster.capacity.profile`'s job), or tunes itself to a measurement.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from actors.messages import PlacementTable, SampledToken
from actors.router import Router, actor_imbalance
from model.config import ModelConfig
from model.sampling import SamplingParams

from ..config import EngineConfig
from ..scheduler import Plan, Scheduler
from ..seq import Seq
from .stepcost import Shape, StepCost, StepTime
from .workload import Failure, SimRequest


# ---- routing ----------------------------------------------------------------------------------
class Routing:
    """Which experts a step's tokens choose, per MoE layer: probabilities ``[layers, E]``, resampled
    every step (each token's k choices, as a multinomial over its layer's probabilities)."""

    def __init__(self, weights: torch.Tensor, k: int):
        """``weights`` [layers, E]: relative load per expert (counts, or any scale)."""
        w = torch.as_tensor(weights, dtype=torch.float64)
        if w.dim() != 2 or (w < 0).any() or (w.sum(1) <= 0).any():
            raise ValueError("routing probabilities must be [layers, experts], >= 0, each row with mass")
        self.weights, self.probs, self.k = w, w / w.sum(1, keepdim=True), k

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int, k: int) -> "Routing":
        return cls(torch.ones(num_layers, num_experts), k)

    @classmethod
    def power_law(cls, num_layers: int, num_experts: int, k: int, skew: float, seed: int = 0) -> "Routing":
        """Expert of popularity rank r (from 1) gets weight r^-skew (0: uniform); a seeded random
        order per layer."""
        g = torch.Generator().manual_seed(seed)
        weights = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -skew
        return cls(torch.stack([weights[torch.randperm(num_experts, generator=g)] for _ in range(num_layers)]), k)

    @classmethod
    def measured(cls, counts, k: int) -> "Routing":
        """From a real run's token counts per (MoE layer, expert): ``moeray experts --json``'s
        ``tokens_total`` (or ``tokens_window``)."""
        return cls(torch.as_tensor(counts, dtype=torch.float64), k)

    @classmethod
    def from_json(cls, path: str | Path, k: int) -> "Routing":
        d = json.loads(Path(path).read_text())
        return cls.measured(d.get("tokens_total") or d["tokens_window"], k)

    def counts(self) -> torch.Tensor:
        """The loads as token counts (what a router is told): the weights themselves when they are
        counts, else scaled to 10^9 tokens per layer."""
        w = self.weights
        if bool((w == w.round()).all()):
            return w.long()
        return (self.probs * 1e9).round().long()

    def sample(self, tokens: int, rng: np.random.Generator) -> np.ndarray:
        """[layers, E] rows per expert for ``tokens`` tokens (a multinomial of tokens·k per layer:
        O(layers·E), whatever the tokens)."""
        if tokens == 0:
            return np.zeros(tuple(self.probs.shape), dtype=np.int64)
        return rng.multinomial(tokens * self.k, self._p)

    @property
    def _p(self) -> np.ndarray:
        if not hasattr(self, "_np"):
            p = self.probs.numpy()
            self._np = p / p.sum(1, keepdims=True)
        return self._np


def placement(cfg: ModelConfig, shape: "Shape", routing: Routing) -> PlacementTable:
    """The table the engine would run, asked of a router as the engine asks its own: its first
    table (contiguous shards), or, rebalanced (always with redundant slots), what it proposes once
    it has seen the routing model's loads as token counts."""
    router = Router(cfg.n_routed_experts, list(cfg.moe_layers))
    table = router.initial(shape.attention, shape.experts)
    if not (shape.redundant_slots or shape.rebalanced):
        return table
    router.report(routing.counts())
    return router.rebalanced(shape.redundant_slots).table


@dataclass(frozen=True)
class Recovery:
    """The pause of one recovery, in parts (moeray's measured components; see docs/simulate.md):
    ``detect_s`` (a dead actor: its step fails; a hung one: the watchdog), a replacement's start
    (``standby_s`` when a warm standby takes the index, else ``start_s`` + its weights at
    ``load_bytes_per_s``), ``regroup_s`` (the new process group) and the failed step done again."""

    detect_s: float = 1.0
    standby_s: float = 0.5
    start_s: float = 30.0
    load_bytes_per_s: float = 2e9
    regroup_s: float = 2.0



def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---- the simulation -----------------------------------------------------------------------------
@dataclass
class SimResult:
    shape: Shape
    devices: int
    duration_s: float
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]
    steps: list[list[list[tuple[int, int]]]] = field(default_factory=list)  # per step, per replica: (seq, tokens)
    imbalance: float = 0.0
    paused_s: float = 0.0
    decode_s: float = 0.0  # time in steps where every sequence decodes (no prefill chunk)
    decode_tokens: int = 0  # tokens those steps produced
    decode_steps: int = 0
    failures: int = 0  # failures that happened (and were recovered) while work remained
    batches: list[int] = field(default_factory=list)  # per step and attention replica: sequences that sampled
    first_s: dict[int, float] = field(default_factory=dict)  # per request (its workload index): its first token's time
    hit_tokens: dict[int, int] = field(default_factory=dict)  # per request: prompt tokens found cached at admission

    def summary(self) -> dict:
        pct = _pct
        tps = self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0
        return {"attention": self.shape.attention, "experts": self.shape.experts,
                "redundant_slots": self.shape.redundant_slots, "standbys": self.shape.standbys,
                "colocated": self.shape.colocated, "layout": self.shape.layout,
                "micro_batches": self.shape.micro_batches,
                "gpus": self.devices, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / self.devices,
                "ttft_p50_s": pct(self.ttft_s, 0.5), "ttft_p99_s": pct(self.ttft_s, 0.99),
                "itl_p50_s": pct(self.itl_s, 0.5), "itl_p99_s": pct(self.itl_s, 0.99),
                "imbalance": self.imbalance, "paused_s": self.paused_s, "failures": self.failures,
                # a decode node's figure (prefill elsewhere): output tokens/s over the decode-only steps
                "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
                "decode_step_s": self.decode_s / self.decode_steps if self.decode_steps else 0.0,
                # the batch actually decoded: sequences that sampled a token, per attention replica per step
                "batch_mean": float(np.mean(self.batches)) if self.batches else 0.0,
                "batch_p50": pct(self.batches, 0.5)}


class Simulator:
    def __init__(self, model_cfg: ModelConfig, shape: Shape, cost: StepCost, *, config: EngineConfig,
                 routing: Routing | None = None, seed: int = 0, recovery: Recovery = Recovery(),
                 failures: tuple[Failure, ...] = (), weight_bytes_per_actor: float = 0.0):
        if shape.attention < 1 or not 1 <= shape.experts <= model_cfg.n_routed_experts:
            raise ValueError(f"a shape needs >= 1 attention replica and 1..{model_cfg.n_routed_experts} expert "
                             f"actors, got {shape.attention} × {shape.experts}")
        self.cfg, self.shape, self.cost, self.config = model_cfg, shape, cost, config
        self.routing = routing or Routing.uniform(len(model_cfg.moe_layers), model_cfg.n_routed_experts,
                                                  model_cfg.num_experts_per_tok)
        self.table = placement(model_cfg, shape, self.routing)
        self.seed, self.recovery, self.failures = seed, recovery, tuple(sorted(failures, key=lambda f: f.at_s))
        self.weight_bytes_per_actor = weight_bytes_per_actor
        # every physical slot, flat over layers: its layer, logical expert, copy rank, copies, actor
        X = self.table.num_actors
        slots = [(i, e, j) for i, per_actor in enumerate(self.table.slots) for j, ids in enumerate(per_actor)
                 for e in ids]
        n_copies: dict[tuple[int, int], int] = {}
        rank = []
        for i, e, _ in slots:
            rank.append(n_copies.get((i, e), 0))
            n_copies[(i, e)] = rank[-1] + 1
        self._slot_layer = np.array([i for i, _, _ in slots])
        self._slot_expert = np.array([e for _, e, _ in slots])
        self._slot_rank = np.array(rank)
        self._slot_copies = np.array([n_copies[(i, e)] for i, e, _ in slots])
        self._slot_bin = self._slot_layer * X + np.array([j for _, _, j in slots])
        self._bins = len(self.table.slots) * X

    def imbalance(self) -> float:
        """Mean over MoE layers of max/mean rows per expert actor, expected under the routing model
        (the router's own prediction, :func:`~actors.router.actor_imbalance`)."""
        values = actor_imbalance(self.table, self.routing.weights)
        return sum(values) / len(values)

    def _rows(self, tokens: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(rows, touched slots) [MoE layers, expert actors] of one step's ``tokens`` tokens: a
        logical expert's rows split as evenly as possible over its copies (the first copies take
        the remainder)."""
        counts = self.routing.sample(tokens, rng)[self._slot_layer, self._slot_expert]
        per_slot = counts // self._slot_copies + (self._slot_rank < counts % self._slot_copies)
        shape = (len(self.table.slots), self.table.num_actors)
        rows = np.bincount(self._slot_bin, weights=per_slot, minlength=self._bins).reshape(shape)
        touched = np.bincount(self._slot_bin, weights=per_slot > 0, minlength=self._bins).reshape(shape)
        return rows, touched

    def run(self, workload: list[SimRequest], *, record_steps: bool = False,
            max_steps: int = 10_000_000, admit=None) -> SimResult:
        """Serve ``workload`` (request ``i``'s prompt ids are drawn from ``i``); ``admit(scheduler, seq)``
        queues each arrival instead of ``scheduler.add`` (a PD decode pool registers its prompt's blocks
        first: :mod:`cluster.capacity.pd`)."""
        cfg = self.cfg
        admit = admit or (lambda sched, seq: sched.add(seq))
        sched = Scheduler.for_engine(self.config, cfg, self.shape.attention)
        gen = np.random.default_rng(self.seed)
        pending = sorted(range(len(workload)), key=lambda i: (workload[i].arrival_s, i))
        arrival, first, last, hits = {}, {}, {}, {}
        ttft, itl, steps, batches = [], [], [], []
        decode_s, decode_tokens, decode_steps, n_failures = 0.0, 0, 0, 0
        t, out_tokens, paused, nxt, n_steps = 0.0, 0, 0.0, 0, 0
        failures = list(self.failures)
        vocab_token = 0
        while nxt < len(pending) or sched.has_work:
            while nxt < len(pending) and workload[pending[nxt]].arrival_s <= t:
                i = pending[nxt]
                r = workload[i]
                params = SamplingParams(max_tokens=r.output_tokens, ignore_eos=True)
                # distinct prompts (no prefix shared by accident): ids from the request's index, 4 bytes each
                # (a 256-GPU decode simulation holds ~10^8 prompt tokens)
                ids = array("i", ((i * 7919 + j * 104729) % max(cfg.vocab_size - 1, 1) + 1
                                  for j in range(r.prompt_tokens)))
                admit(sched, Seq(i, ids, r.prompt_tokens, params))
                arrival[i] = r.arrival_s
                nxt += 1
            if not sched.has_work:
                t = workload[pending[nxt]].arrival_s
                continue
            if failures and failures[0].at_s <= t:
                f = failures.pop(0)
                pause = self._recover(sched, f)
                t += pause
                paused += pause
                n_failures += 1
                continue
            plan = sched.schedule()
            if plan.empty:
                if nxt < len(pending):
                    t = max(t, workload[pending[nxt]].arrival_s)
                    continue
                raise RuntimeError("the scheduler can place no waiting request on an idle cluster (a prompt larger "
                                   "than one replica's cache?)")
            step = self._step_time(plan, gen)
            t += step.seconds
            n_steps += 1
            batches.extend(sum(c.sample for c in per) for per in plan.chunks)
            if all(len(c.token_ids) == 1 for chunks in plan.chunks for c in chunks):
                decode_s += step.seconds
                decode_tokens += sum(map(len, plan.chunks))
                decode_steps += 1
            if record_steps:
                steps.append([[(c.seq_id, len(c.token_ids)) for c in chunks] for chunks in plan.chunks])
            sampled = [SampledToken(c.seq_id, vocab_token) for chunks in plan.chunks for c in chunks if c.sample]
            for applied in sched.update(plan, sampled).applied:
                out_tokens += 1
                sid = applied.seq.seq_id
                if sid not in first:
                    first[sid] = t
                    hits[sid] = applied.seq.num_hit or 0
                    ttft.append(t - arrival[sid])
                else:
                    itl.append(t - last[sid])
                last[sid] = t
            if n_steps >= max_steps:
                raise RuntimeError(f"no end after {max_steps} steps")
        start = min((r.arrival_s for r in workload), default=0.0)
        return SimResult(self.shape, self.shape.devices, t - start, out_tokens, ttft, itl, steps,
                         self.imbalance(), paused, decode_s, decode_tokens, decode_steps, n_failures, batches,
                         first, hits)

    def run_steady(self, batch: int, *, context: int, output_tokens: int, steps: int = 200,
                   warmup: int = 50, one_replica: bool = False) -> SimResult:
        """A decode node held at ``batch`` sequences per attention replica (a closed loop): each
        sequence arrives prefilled (its prompt made elsewhere; its attention spans ``context`` tokens
        from its first step on), decodes ``output_tokens`` and is replaced at once by a new one; the
        first ones' lengths are staggered (1 to ``output_tokens``) so that replacements spread over the
        steps. Measured over ``steps`` steps after ``warmup``: tokens/s, ITL, and the batch actually
        decoded per replica (``batch_mean``, ``batch_p50``). The engine config's ``max_num_seqs``
        and cache must admit the batch (the caller sizes them; the room for sequences is the
        planner's). ``one_replica``: the scheduler holds one replica's sequences and every replica
        decodes what it plans (the replicas of a closed-loop decode node are alike; a search at
        hundreds of replicas would otherwise schedule them all every step): the same batch, ITL and
        tokens/s up to the replicas' staggering."""
        if batch < 1 or context < 1 or output_tokens < 1 or steps < 1 or warmup < 0:
            raise ValueError(f"need batch, context, output_tokens, steps >= 1 and warmup >= 0; got {batch}, "
                             f"{context}, {output_tokens}, {steps}, {warmup}")
        cfg, A = self.cfg, self.shape.attention
        held = 1 if one_replica else A  # replicas the scheduler holds; each priced ``A // held`` times
        sched = Scheduler.for_engine(self.config, cfg, held)
        gen = np.random.default_rng(self.seed)
        n, next_id = batch * held, 0

        def arrive(out: int) -> None:
            nonlocal next_id
            ids = array("i", [next_id * 7919 % max(cfg.vocab_size - 1, 1) + 1])
            sched.add(Seq(next_id, ids, 1, SamplingParams(max_tokens=out, ignore_eos=True)))
            next_id += 1

        for i in range(n):
            arrive(1 + i * output_tokens // n)
        t, t0, last, itl, batches, tokens = 0.0, 0.0, {}, [], [], 0
        for k in range(warmup + steps):
            if k == warmup:
                t0 = t
            plan = sched.schedule()
            if plan.empty:
                raise RuntimeError("the scheduler placed none of the sequences: is max_num_seqs or the cache too small?")
            t += self._step_time(plan, gen, context_offset=context - 1, copies=A // held).seconds
            sampled = [SampledToken(c.seq_id, 0) for chunks in plan.chunks for c in chunks if c.sample]
            done = 0
            for applied in sched.update(plan, sampled).applied:
                sid, reason = applied.seq.seq_id, applied.reason
                if k >= warmup:
                    tokens += A // held
                    if sid in last:
                        itl.append(t - last[sid])
                last[sid] = t
                if reason is not None:
                    done += 1
                    last.pop(sid, None)
            for _ in range(done):
                arrive(output_tokens)
            if k >= warmup:
                batches.extend(sum(c.sample for c in per) for per in plan.chunks)
        return SimResult(self.shape, self.shape.devices, t - t0, tokens, [], itl, [], self.imbalance(),
                         batches=batches)

    def _step_time(self, plan: Plan, rng: np.random.Generator, context_offset: int = 0,
                   copies: int = 1) -> StepTime:
        """``context_offset``: tokens every sequence attends beyond its own (a prompt made elsewhere);
        ``copies``: the plan's replicas stand for this many each."""
        chunks = [[(len(c.token_ids), c.num_cached + len(c.token_ids) + context_offset) for c in per]
                  for per in plan.chunks] * copies
        return self._chunks_time(chunks, plan.num_tokens * copies, rng)

    def decode_step(self, batch: int, context: int, seed: int = 0) -> StepTime:
        """One decode step with ``batch`` sequences on every attention replica, each attending
        ``context`` tokens (the closed form a capacity search bisects on before confirming at steady
        state)."""
        chunks = [[(1, context)] * batch for _ in range(self.shape.attention)]
        return self._chunks_time(chunks, batch * self.shape.attention, np.random.default_rng(seed))

    def capacity(self, tpot_s: float, context: int, cap: int) -> int:
        """The largest batch per attention replica, 1..``cap``, whose decode step takes at most
        ``tpot_s`` (0 when even one sequence is slower)."""
        lo, hi = 0, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_step(mid, context).seconds <= tpot_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def price(self, chunks: list[list[tuple[int, int]]], rng: np.random.Generator) -> StepTime:
        """One step of ``chunks`` ((new tokens, context after the step) per sequence, per attention replica),
        its routing drawn from ``rng``: what a real engine's step would cost on this shape."""
        return self._chunks_time(chunks, sum(n for per in chunks for n, _ in per), rng)

    def _chunks_time(self, chunks: list[list[tuple[int, int]]], num_tokens: int, rng: np.random.Generator) -> StepTime:
        if self.cost.pipelined:
            # each replica's sequences dealt into the micro-batches; each micro-batch routed on its own
            # (its experts' weights are read once per micro-batch)
            m = self.shape.micro_batches
            parts = []
            for k in range(m):
                part = [per[k::m] for per in chunks]
                parts.append((part, *self._rows(sum(n for per in part for n, _ in per), rng)))
            return self.cost.step_parts(chunks, parts, self.shape, len(self.cfg.moe_layers))
        rows, touched = self._rows(num_tokens, rng)
        return self.cost.step(chunks, rows, touched, self.shape, len(self.cfg.moe_layers))

    def _recover(self, sched: Scheduler, f: Failure) -> float:
        """The pause of one failure; an attention replica's sequences are recomputed (the scheduler's
        own rewind: its cache is gone)."""
        rc = self.recovery
        if f.kind == "attention":
            sched.rewind([], {f.index % self.shape.attention}, recompute_state=bool(self.cfg.kda_layers))
        elif f.kind != "expert":
            raise ValueError(f"a failure's kind is attention or expert, got {f.kind!r}")
        if self.shape.standbys >= f.actors:
            start = rc.standby_s
        else:
            start = rc.start_s + (self.weight_bytes_per_actor / rc.load_bytes_per_s if rc.load_bytes_per_s else 0.0)
        return rc.detect_s + start + rc.regroup_s
