"""ExpertWorker: some routed experts of every MoE layer (expert parallelism), as its epoch's
placement table assigns them — a contiguous shard, or any set with replicas of hot experts.

Owns: those experts' weights, read lazily from the checkpoint (only their bytes), and the weights
staged for the next epoch. Never: holds attention, caches or any per-sequence state (stateless
across steps: it can be restarted or moved and only reloads weights), or takes calls per layer
— one ``step`` call serves every MoE layer's exchange through the epoch's process group.

An epoch change comes in two calls: :meth:`prepare` (in the actor's ``control`` concurrency group,
so steps go on meanwhile) stages the experts of the new slots — kept ones are reused, missing
ones read from the checkpoint — and :meth:`enter_epoch` (at the engine's step boundary) swaps them
in and joins the new process group. A plain class: :mod:`actors.remote` makes it a Ray actor.
"""

from __future__ import annotations

import time

import torch

from model.checkpoint import DEFAULT_READ_THREADS
from model.config import load_config
from model.loader import load_routed_experts, parse_dtype
from model.moe import ExpertThreads, RoutedExperts, attach_threads, gather_experts
from model.threads import release_openmp_pool, side_thread_torch_work

from .device import Placement, choose_device
from .channel import ServesSteps
from .group import exchange_device, join_group, leave_group
from .dispatch import ExpertExchange
from .messages import ExpertStep, ExpertStepResult, GroupInfo, PlacementTable, refuse_ahead
from .progress import LoadProgress


class ExpertShard:
    """The routed experts of one expert actor or colocated worker, in every MoE layer, and those staged
    for the next epoch. Owns their weights (read lazily: only this shard's bytes; quantised ones stay
    in checkpoint format). Never: computes a step or joins a group (its holder does)."""

    def __init__(self, model_path: str, cfg, shard: dict[int, tuple[int, ...]], *, dtype: torch.dtype,
                 device: torch.device, dequantize: bool = False, read_threads: int = DEFAULT_READ_THREADS,
                 expert_threads: int = 1, on_progress=None):
        self.path, self.cfg, self.dtype, self.device = model_path, cfg, dtype, device
        self.dequantize, self.read_threads = dequantize, read_threads
        self.gemm_threads = ExpertThreads(expert_threads) if expert_threads > 1 and device.type == "cpu" else None
        self.experts = self._run_on_threads(load_routed_experts(
            model_path, cfg, shard, dtype=dtype, device=device, dequantize=dequantize, threads=read_threads,
            on_progress=on_progress))
        self.staged: tuple[int, int, dict[int, RoutedExperts]] | None = None  # (epoch, index, experts)

    def held(self) -> dict[int, tuple[int, ...]]:
        """MoE layer → the logical experts in this shard's physical slots."""
        return {layer: ex.expert_ids for layer, ex in self.experts.items()}

    def weight_bytes(self) -> int:
        """Bytes of the expert weights held: checkpoint bytes (+ scales) when they stay quantised."""
        return sum(ex.weight_bytes() for ex in self.experts.values())

    def prepare(self, table: PlacementTable, index: int) -> int:
        """Stage the experts of slot set ``index`` of ``table``; returns how many were read from the
        checkpoint (the rest are reused from what this shard holds)."""
        want = table.experts_of(index)
        held = self.held()
        missing = {layer: [e for e in ids if e not in held.get(layer, ())] for layer, ids in want.items()}
        missing = {layer: ids for layer, ids in missing.items() if ids}
        fresh = load_routed_experts(self.path, self.cfg, missing, dtype=self.dtype, device=self.device,
                                    dequantize=self.dequantize, threads=self.read_threads)
        staged = {}
        for layer, ids in want.items():
            old, new = self.experts.get(layer), fresh.get(layer)
            parts = [(old, old.expert_ids.index(e)) if e in held.get(layer, ()) else (new, new.expert_ids.index(e))
                     for e in ids]
            staged[layer] = gather_experts(parts)
        self.staged = (table.epoch, index, staged)
        return sum(len(ids) for ids in missing.values())

    def enter(self, table: PlacementTable, index: int) -> None:
        """Hold slot set ``index`` of ``table`` (staged by :meth:`prepare`, or staged now)."""
        if table.experts_of(index) != self.held():
            if self.staged is None or self.staged[:2] != (table.epoch, index):
                self.prepare(table, index)
            self.experts = self._run_on_threads(self.staged[2])
        self.staged = None

    def _run_on_threads(self, experts: dict[int, RoutedExperts]) -> dict[int, RoutedExperts]:
        """``experts`` with this shard's GEMM threads attached (:func:`~model.moe.attach_threads`)."""
        attach_threads(experts.values(), self.gemm_threads)
        return experts


class ExpertWorker(ServesSteps):
    def __init__(self, model_path: str, *, index: int | None, table: PlacementTable, dtype: str = "float32",
                 threads: int | None = 1, dequantize: bool = False, read_threads: int = DEFAULT_READ_THREADS,
                 exchange: str = "auto", expert_threads: int = 1):
        """``index`` None: a warm standby, holding no experts until :meth:`enter_epoch` gives it slots.
        ``expert_threads`` > 1: the dense experts' GEMMs on CPU run over that many threads
        (:class:`~model.moe.ExpertThreads`)."""
        super().__init__()
        if threads:
            torch.set_num_threads(threads)
        self.path, self.index, self.table = model_path, index, table
        self.name = "expert[standby]" if index is None else f"expert[{index}]"
        self.cfg = load_config(model_path)
        self.dtype = parse_dtype(dtype)
        self.placement = choose_device(self.name)  # the GPU Ray assigned, if any
        self.device = torch.device(self.placement.device)
        self.exchange_format = exchange  # the exchange's wire format: auto, dense or sparse (actors/dispatch.py)
        self.progress = LoadProgress(self.name)
        self.shard = ExpertShard(model_path, self.cfg, {} if index is None else table.experts_of(index),
                                 dtype=self.dtype, device=self.device, dequantize=dequantize,
                                 read_threads=read_threads, expert_threads=expert_threads,
                                 on_progress=self.progress.update)
        self.exchange: ExpertExchange | None = None  # this epoch's side of the exchange, set by enter_epoch
        self.completed = -1  # the last step that completed here
        release_openmp_pool()  # the steps run on another thread: leave it the only OpenMP pool (model/threads.py)

    # ---- control plane -------------------------------------------------------------------
    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    @property
    def experts(self) -> dict[int, RoutedExperts]:
        return self.shard.experts

    @property
    def gemm_threads(self):
        return self.shard.gemm_threads

    def held(self) -> dict[int, tuple[int, ...]]:
        """MoE layer → the logical experts in this actor's physical slots."""
        return self.shard.held()

    def weight_bytes(self) -> int:
        return self.shard.weight_bytes()

    param_bytes = weight_bytes

    def device_placement(self) -> Placement:
        return self.placement

    def load_progress(self) -> tuple[int, int]:
        """(bytes read, bytes to read) of this actor's weights."""
        return self.progress.done, self.progress.total

    def resident_bytes(self) -> int:
        """This process's resident set size (VmRSS)."""
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def prepare(self, table: PlacementTable, index: int) -> int:
        """Stage the experts of slot set ``index`` of ``table``; returns how many were read from the
        checkpoint. Runs on the control thread, beside the steps."""
        with side_thread_torch_work():
            return self.shard.prepare(table, index)

    def enter_epoch(self, info: GroupInfo, table: PlacementTable, index: int) -> None:
        """Leave the old process group, hold the new slots, join the epoch's group."""
        with self.busy:  # never beside a step (a step runs on the step channel's thread)
            leave_group()
            self.shard.enter(table, index)
            self.index, self.name, self.table = index, f"expert[{index}]", table
            join_group(info, table.num_attention + index, table.world_size, num_attention=table.num_attention)
            self.exchange = ExpertExchange(self.name, index, table, self.cfg.num_experts_per_tok,
                                           self.exchange_format, device=exchange_device(info, self.device))

    def shutdown(self) -> None:
        self.close_channel()
        leave_group()

    # ---- data plane -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, req: ExpertStep) -> ExpertStepResult:
        """Serve every (MoE layer, micro-batch) exchange of one engine step, layer-major."""
        assert self.exchange is not None, f"{self.name}: step before enter_epoch"
        if req.epoch != self.table.epoch:
            raise RuntimeError(f"{self.name}: step {req.step} is for epoch {req.epoch}, this actor is in "
                               f"epoch {self.table.epoch}")
        refuse_ahead(self.name, req.step, req.ahead, self.completed)
        self.exchange.reset_timers(req.step)
        t0, c0 = time.perf_counter(), time.thread_time()
        hidden = self.cfg.expert_hidden_size
        per_slot = [sum(self.exchange.serve(layer, self.experts[layer], hidden, self.dtype, tokens)
                        for tokens in req.tokens)
                    if layer not in req.skip else torch.zeros(self.table.max_local, dtype=torch.long)
                    for layer in self.table.moe_layers]
        self.exchange.drain()
        total, cpu_s = time.perf_counter() - t0, time.thread_time() - c0
        ph = self.exchange.phase_s
        slots = torch.stack(per_slot).tolist() if per_slot else []
        self.completed = req.step
        return ExpertStepResult(step=req.step, actor=self.name, rows_per_layer=tuple(sum(r) for r in slots),
                                rows_per_slot=tuple(tuple(r) for r in slots),
                                compute_s=total - self.exchange.exchange_s, exchange_s=self.exchange.exchange_s,
                                dispatch_s=ph["counts"] + ph["dispatch"], combine_s=ph["combine"],
                                cpu_s=cpu_s)
