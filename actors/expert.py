"""ExpertWorker: the routed experts ``[lo, hi)`` of every MoE layer (expert parallelism).

Owns: those experts' weights, read lazily from the checkpoint — only their bytes.
Never: holds attention, caches or any per-sequence state (stateless across steps: it can be
restarted or moved and only reloads weights), or takes Ray calls per layer — one ``step`` call
serves every MoE layer's exchange through the process group.

A plain class: :mod:`actors.remote` makes it a Ray actor.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from model.checkpoint import DEFAULT_READ_THREADS
from model.config import load_config
from model.loader import load_routed_experts, parse_dtype

from .device import Placement, choose_device
from .dispatch import ExpertExchange
from .messages import ExpertStepResult, GroupInfo, PlacementTable
from .progress import LoadProgress


class ExpertWorker:
    def __init__(self, model_path: str, *, index: int, table: PlacementTable, dtype: str = "float32",
                 threads: int | None = 1, dequantize: bool = False, read_threads: int = DEFAULT_READ_THREADS):
        if threads:
            torch.set_num_threads(threads)
        self.index, self.name, self.table = index, f"expert[{index}]", table
        cfg = load_config(model_path)
        self.cfg, self.lo, self.hi = cfg, *table.ranges[index]
        self.placement = choose_device(self.name)  # the GPU Ray assigned, if any
        self.device = torch.device(self.placement.device)
        self.progress = LoadProgress(self.name)
        self.experts = load_routed_experts(model_path, cfg, {l: list(range(self.lo, self.hi)) for l in cfg.moe_layers},
                                           dtype=parse_dtype(dtype), device=self.device, dequantize=dequantize,
                                           threads=read_threads, on_progress=self.progress.update)
        self.exchange: ExpertExchange | None = None

    # ---- control plane -------------------------------------------------------------------
    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def shard(self) -> tuple[int, int]:
        return self.lo, self.hi

    def weight_bytes(self) -> int:
        """Bytes of the expert weights held: checkpoint bytes (+ scales) when they stay quantised."""
        return sum(ex.weight_bytes() for ex in self.experts.values())

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

    def init_group(self, info: GroupInfo) -> None:
        rank = info.num_attention + self.index
        dist.init_process_group(info.backend, init_method=f"tcp://{info.address}:{info.port}", rank=rank,
                                world_size=info.world_size, timeout=timedelta(seconds=info.timeout_s))
        self.exchange = ExpertExchange(self.name, self.table, info.num_attention)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- data plane -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, step: int) -> ExpertStepResult:
        """Serve every MoE layer's exchange of one engine step, in layer order."""
        assert self.exchange is not None, f"{self.name}: step before init_group"
        self.exchange.reset_timers(step)
        t0 = time.perf_counter()
        rows = tuple(self.exchange.serve(layer, ex) for layer, ex in self.experts.items())
        total = time.perf_counter() - t0
        ph = self.exchange.phase_s
        return ExpertStepResult(step=step, actor=self.name, rows_per_layer=rows,
                                compute_s=total - self.exchange.exchange_s, exchange_s=self.exchange.exchange_s,
                                dispatch_s=ph["counts"] + ph["dispatch"], combine_s=ph["combine"])
