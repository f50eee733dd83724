"""The engine: one per model deployment. Turns a :class:`ClusterSpec` into running actors, then
runs the step loop — scheduler plan → one Ray call per actor → sampled tokens → stop checks.

Owns: the actors, the placement reservation, the scheduler, per-request state and the step
statistics. It is the only component the Serve ingress talks to (through :mod:`cluster.aengine`).
Never: computes a layer or moves a token between actors (the attention workers' process group
does), or waits on an actor without a timeout.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from actors.messages import GroupInfo, PlacementTable, SampledToken, StepRequest
from actors.remote import RemoteAttention, RemoteExpert, RemoteRouter
from model.config import ModelConfig, load_config
from model.runner import check_stop
from model.sampling import SamplingParams

from .preflight import preflight
from .scheduler import Scheduler, Seq
from .startup import default_load_timeout_s
from .stats import EngineStats
from .topology import ClusterSpec, reserve


class EngineError(RuntimeError):
    """The cluster failed: an actor died, a collective timed out, or a step got no answer."""


@dataclass(frozen=True)
class EngineConfig:
    """Runtime knobs of one deployment (the architecture comes from the checkpoint)."""

    model: str
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 256  # per attention replica
    num_slots: int = 64  # KDA slots per attention replica (hybrid models)
    max_num_seqs: int = 64
    max_tokens_per_step: int = 256
    impl: str = "absorbed"
    backend: str | None = None  # None: nccl when actors have GPUs, else gloo
    collective_timeout_s: float = 60.0
    step_timeout_s: float = 120.0
    start_timeout_s: float = 300.0  # reserving the placement group
    load_timeout_s: float | None = None  # actors loading weights; None: scales with the bytes to read

    def __post_init__(self):
        for name in ("block_size", "num_blocks", "num_slots", "max_num_seqs", "max_tokens_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine setting {name!r} must be >= 1, got {getattr(self, name)}")


@dataclass
class Request:
    seq: Seq
    stop_ids: frozenset[int]
    logprobs: list[SampledToken] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request after a step."""

    seq_id: int
    token_ids: tuple[int, ...]
    sampled: tuple[SampledToken, ...]
    finish_reason: str | None


class Engine:
    def __init__(self, config: EngineConfig, spec: ClusterSpec, *, stop_ids: frozenset[int] = frozenset()):
        self.config, self.spec = config, spec
        self.cfg: ModelConfig = load_config(config.model)
        if self.cfg.n_routed_experts == 0:
            raise ValueError(f"{config.model}: the model has no routed experts to place on expert actors")
        self.model_stop_ids = frozenset(stop_ids) | frozenset(self.cfg.eos_token_ids)
        self.scheduler = Scheduler(
            num_replicas=spec.attention, num_blocks=config.num_blocks, block_size=config.block_size,
            num_slots=config.num_slots if self.cfg.kda_layers else None,
            max_num_seqs=config.max_num_seqs, max_tokens_per_step=config.max_tokens_per_step)
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats(self.cfg.moe_layers, self.cfg.n_routed_experts)
        self._ids = itertools.count()
        self.step_no = 0
        self.table = PlacementTable.even(self.cfg.n_routed_experts, spec.experts)
        self.reservation = None
        self.attention, self.experts, self.router = [], [], None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self.attention:
            raise RuntimeError("engine already started")
        c, spec = self.config, self.spec
        path = str(Path(c.model).resolve())
        preflight(self.cfg, spec, c.dtype)  # refuse a shape this cluster cannot hold, before reserving
        self.reservation = reserve(spec, timeout_s=c.start_timeout_s)
        try:
            self.router = RemoteRouter.remote(self.cfg.n_routed_experts, spec.experts, self.cfg.moe_layers)
            self.attention = [
                RemoteAttention.options(**self.reservation.attention_options(i)).remote(
                    path, index=i, table=self.table, num_blocks=c.num_blocks, block_size=c.block_size,
                    num_slots=c.num_slots, dtype=c.dtype, impl=c.impl)
                for i in range(spec.attention)]
            self.experts = [
                RemoteExpert.options(**self.reservation.expert_options(j)).remote(
                    path, index=j, table=self.table, dtype=c.dtype)
                for j in range(spec.experts)]
            load_s = c.load_timeout_s or default_load_timeout_s(self.cfg, spec.attention)
            addr, port = self._get(self.attention[0].rendezvous.remote(), load_s, "starting attention[0]")
            backend = c.backend or ("nccl" if spec.gpus else "gloo")
            info = GroupInfo(epoch=0, world_size=spec.attention + spec.experts, address=addr, port=port,
                             backend=backend, timeout_s=c.collective_timeout_s, num_attention=spec.attention)
            self._get([a.init_group.remote(info) for a in self.attention + self.experts], load_s,
                      "joining the process group")
        except BaseException:
            self.shutdown()
            raise
        return self

    def shutdown(self) -> None:
        for a in self.attention + self.experts + ([self.router] if self.router else []):
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        self.attention, self.experts, self.router = [], [], None
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None

    def expert_weight_bytes(self, timeout_s: float = 15.0) -> list[int]:
        """Resident weight bytes of each expert actor (checkpoint bytes + scales when quantised)."""
        return self._get([e.weight_bytes.remote() for e in self.experts], timeout_s, "weight bytes")

    def __enter__(self) -> "Engine":
        return self if self.attention else self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        V, ctx = self.cfg.vocab_size, self.cfg.max_position_embeddings
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < V)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary (0..{V - 1})")
        if len(prompt_ids) + params.max_tokens > ctx:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context ({ctx})")
        cap = self.config.num_blocks * self.config.block_size
        if len(prompt_ids) + params.max_tokens > cap:
            raise ValueError(f"prompt + max_tokens ({len(prompt_ids) + params.max_tokens}) exceeds one replica's "
                             f"cache ({cap} tokens)")

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        self.validate(prompt_ids, params)
        seq = Seq(next(self._ids), list(prompt_ids), len(prompt_ids), params)
        self.scheduler.add(seq)
        self.requests[seq.seq_id] = Request(seq, self.model_stop_ids)
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """Drop a request (e.g. its client went away); its cache is freed at once."""
        req = self.requests.pop(seq_id, None)
        if req is not None and req.seq.finish_reason is None:
            self.scheduler.finish(req.seq, "abort")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if plan.empty:
            return []
        self.step_no += 1
        t0 = time.perf_counter()
        reqs = [StepRequest(self.step_no, self.table.epoch, tuple(chunks)) for chunks in plan.chunks]
        refs = [a.step.remote(r) for a, r in zip(self.attention, reqs)]
        refs += [e.step.remote(self.step_no) for e in self.experts]
        results = self._get(refs, self.config.step_timeout_s, f"step {self.step_no}")
        attn, expert = results[: len(self.attention)], results[len(self.attention):]
        self.stats.record_step(plan.num_tokens, attn, expert, time.perf_counter() - t0, self.table)
        counts = self.stats.last_expert_tokens
        if counts is not None:
            self.router.report.remote(counts)  # fire and forget: off the hot path
        return self._apply([t for r in attn for t in r.tokens])

    def _apply(self, sampled: list[SampledToken]) -> list[TokenEvent]:
        events = []
        max_ctx = self.cfg.max_position_embeddings
        for tok in sampled:
            req = self.requests.get(tok.seq_id)
            if req is None or req.seq.finish_reason is not None:  # aborted meanwhile
                continue
            seq = req.seq
            seq.token_ids.append(tok.token_id)
            now = time.monotonic()
            if req.first_token is None:
                req.first_token = now
                self.stats.observe_ttft(now - req.arrival)
            else:
                self.stats.observe_itl(now - req.last_token)
            req.last_token = now
            if seq.params.logprobs is not None:
                req.logprobs.append(tok)
            reason = check_stop(seq, req.stop_ids, max_ctx)
            if reason:
                self.scheduler.finish(seq, reason)
                self.stats.observe_finished(time.monotonic() - req.arrival, seq)
            events.append(TokenEvent(seq.seq_id, (tok.token_id,), (tok,), reason))
        return events

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Seq]:
        """Run requests to completion (offline use and tests)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work:
            self.step()
        return [self.requests.pop(i).seq for i in ids]

    def _get(self, refs, timeout: float, what: str):
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            refs_list = refs if isinstance(refs, list) else [refs]
            _, pending = ray.wait(refs_list, num_returns=len(refs_list), timeout=0)
            names = self._names(refs_list, pending)
            raise EngineError(f"{what}: no answer within {timeout:.0f}s from {', '.join(names)}") from None
        except ray.exceptions.RayTaskError as e:
            raise EngineError(f"{what}: {e.cause if e.cause is not None else e}") from None
        except ray.exceptions.RayActorError as e:
            raise EngineError(f"{what}: an actor died: {e}") from None

    def _names(self, refs, pending) -> list[str]:
        actors = [f"attention[{i}]" for i in range(len(self.attention))] + \
                 [f"expert[{j}]" for j in range(len(self.experts))]
        if len(refs) != len(actors):
            return [f"{len(pending)} of {len(refs)} actors"]
        return [name for name, r in zip(actors, refs) if r in pending]
