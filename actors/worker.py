"""ColocatedWorker: one process, one device, one rank of the colocated layout — an attention replica
(:class:`~actors.attention.AttentionWorker`: the embedding, attention, gates, shared experts, lm_head,
its sequences' latent cache and KDA state, sampling and grammars) and an expert shard of every MoE
layer (:class:`~actors.expert.ExpertShard`) in the same process.

Per MoE layer the workers exchange (token, expert) rows among themselves
(:class:`~actors.colocated.ColocatedExchange`); rows for a worker's own experts never leave it.

Owns: what both halves own (the attention replica's cache and histories; the shard's weights and
those staged for the next epoch). Never: decides which sequences run or where experts go (the
engine's scheduler and router do), or talks to Ray per layer.

An epoch change comes in two calls, as for an expert actor: :meth:`prepare` (in the ``control``
concurrency group, beside the steps) stages the shard's new slots, and :meth:`enter_epoch` (at a step
boundary) swaps them in and joins the epoch's group. A plain class: :mod:`actors.remote` makes it a
Ray actor.
"""

from __future__ import annotations

import time

import torch

from model.threads import release_openmp_pool, side_thread_torch_work

from .attention import AttentionWorker
from .colocated import ColocatedExchange
from .expert import ExpertShard
from .group import exchange_device, join_group, leave_group
from .messages import ExpertStepResult, GroupInfo, PlacementTable, StepRequest, WorkerStepResult


class ColocatedWorker(AttentionWorker):
    ROLE = "worker"

    def __init__(self, model_path: str, *, index: int | None, table: PlacementTable, num_blocks: int,
                 block_size: int = 16, num_slots: int = 64, dtype: str = "float32", impl: str = "absorbed",
                 threads: int | None = 1, exchange: str = "auto", num_snapshots: int = 0, expert_threads: int = 1,
                 mtp: bool = False, compile: str = "off", max_batch: int = 256, tier: dict | None = None):
        """``index`` None: a warm standby, holding the attention weights and no experts until
        :meth:`enter_epoch` gives it a shard."""
        super().__init__(model_path, index=index, table=table, num_blocks=num_blocks, block_size=block_size,
                         num_slots=num_slots, dtype=dtype, impl=impl, threads=threads, exchange=exchange,
                         num_snapshots=num_snapshots, mtp=mtp, compile=compile, max_batch=max_batch, tier=tier)
        self.shard = ExpertShard(model_path, self.cfg, {} if index is None else table.experts_of(index),
                                 dtype=self.dtype, device=self.device, expert_threads=expert_threads,
                                 on_progress=None)
        release_openmp_pool()  # (reading the shard may have made one on this thread again)

    # ---- control plane -------------------------------------------------------------------
    def held(self) -> dict[int, tuple[int, ...]]:
        return self.shard.held()

    def weight_bytes(self) -> int:
        """Bytes of the expert shard's weights (what the colocated planner adds to the attention's)."""
        return self.shard.weight_bytes()

    def prepare(self, table: PlacementTable, index: int) -> int:
        """Stage shard ``index`` of ``table`` beside the steps; returns the experts read."""
        with side_thread_torch_work():
            return self.shard.prepare(table, index)

    def enter_epoch(self, info: GroupInfo, table: PlacementTable, index: int) -> None:
        """Leave the old group, hold shard ``index`` of the epoch's table, join the epoch's group as
        worker ``index``. The cache and KDA state are untouched."""
        with self.busy:  # never beside a step
            leave_group()
            self.shard.enter(table, index)
            self.index, self.name, self.table = index, f"worker[{index}]", table
            store = self._store if index == 0 and self._store is not None and self._store.port == info.port else None
            join_group(info, index, table.world_size, store, num_attention=table.num_attention, colocated=True)
            self.dispatcher = ColocatedExchange(self.name, index, table, self.shard.experts,
                                                self.cfg.expert_hidden_size, self.dtype, self.cfg.num_experts_per_tok,
                                                self.exchange_format, device=exchange_device(info, self.device))

    # ---- data plane ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, req: StepRequest) -> WorkerStepResult:
        """Both halves of one engine step: the attention replica's chunks, and every MoE layer's rows
        for this worker's experts (``req.peer_tokens``: every worker's tokens per micro-batch)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        attention = super().step(req)
        d = self.dispatcher
        rows = d.rows_served
        total, cpu_s = time.perf_counter() - t0, time.thread_time() - c0
        experts = ExpertStepResult(step=req.step, actor=self.name, rows_per_layer=tuple(rows.sum(1).tolist()),
                                   rows_per_slot=tuple(tuple(r) for r in rows.tolist()),
                                   compute_s=total - d.exchange_s, exchange_s=d.exchange_s,
                                   dispatch_s=d.phase_s["counts"] + d.phase_s["dispatch"],
                                   combine_s=d.phase_s["combine"], cpu_s=cpu_s)
        return WorkerStepResult(attention, experts)
