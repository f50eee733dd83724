"""The in-process executor: the engine's seam (:class:`~cluster.executor.Executor`) carried out in
the engine's own process, without Ray, actors or sockets.

Each attention replica is a real :class:`~actors.attention.AttentionWorker` holding every routed
expert too (:meth:`~actors.attention.AttentionWorker.use_local_experts`), so a step runs the same
attention, cache, sampling and logits-processing code as on the cluster, and each MoE layer computes
its pairs in place (what the single-process model computes; the pairs are counted by the epoch's
table as the exchange counts them). A step runs when it is launched, replica by replica, so steps
sent ahead read the samples of the step before, as on the actors.

What it is for: the serving app's HTTP semantics in one process (deploy/inprocess.py and the
tests/**/test_*inproc*.py tests), and any caller that wants the engine without Ray. Never: changes
its shape (scale and rebalance are refused: they need actors), or stands in for the cluster's
oracle tests — the step channels, the exchange and recovery are tested on real Ray clusters.
"""

from __future__ import annotations

import time

from actors.attention import AttentionWorker
from actors.messages import ExpertStep, PlacementTable, StepRequest
from model.config import ModelConfig

from .config import EngineConfig, compiled, snapshot_plan
from .kv_transfer import tier_spec
from .errors import EngineError, NoCapacity, StepFailed
from .executor import MemberId
from .spec import ClusterSpec


class InProcessExecutor:
    def __init__(self, config: EngineConfig, spec: ClusterSpec, model_cfg: ModelConfig):
        self.config, self.spec, self.model_cfg = config, spec, model_cfg
        self.table: PlacementTable | None = None
        self.workers: list[AttentionWorker] = []
        self._done: dict[int, tuple[list, BaseException | None]] = {}  # step → (results, error)

    @property
    def started(self) -> bool:
        return self.table is not None

    def start(self, table: PlacementTable) -> None:
        c = self.config
        for i in range(table.num_attention):
            w = AttentionWorker(c.model, index=i, table=table, num_blocks=c.cache.num_blocks, block_size=c.cache.block_size,
                                num_slots=c.cache.num_slots, dtype=c.dtype, impl=c.data_plane.impl, threads=None,
                                exchange=c.data_plane.exchange, num_snapshots=snapshot_plan(c, self.model_cfg).count,
                                local_experts=True, mtp=c.mtp, tier=tier_spec(c, self.model_cfg), **compiled(c))
            w.use_local_experts(table)
            self.workers.append(w)
        self.table = table

    def shutdown(self) -> None:
        self.workers, self.table = [], None

    # ---- the step --------------------------------------------------------------------------
    def launch(self, reqs: list[StepRequest], expert_req: ExpertStep) -> list[tuple[str, int]]:
        """Run the step now, replica by replica; :meth:`collect` hands back what it gave."""
        results, error = [], None
        for w, req in zip(self.workers, reqs):
            try:
                w.received_at = time.perf_counter()  # (on the actors: when the step's frame was read)
                results.append(w.step(req))
            except Exception as e:  # noqa: BLE001 — the step's failure, reported by collect
                error = e
                break
        self._done[expert_req.step] = (results, error)
        return [(w.name, i) for i, w in enumerate(self.workers)]

    def collect(self, step_no: int, sent) -> tuple[list, list]:
        results, error = self._done.pop(step_no)
        if error is not None:
            raise StepFailed(f"step {step_no} failed in this process: {type(error).__name__}: {error}", [], [], [])
        return results, []

    # ---- cached blocks (prefill/decode disaggregation: cluster/pd.py) -------------------------------
    def read_blocks(self, replica: int, blocks: list[int], snapshot: int | None = None, via: str = "channel") -> dict:
        return self.workers[replica].read_blocks(blocks, snapshot)  # (in process: nothing to choose)

    def node_of(self, replica: int) -> str:
        return "local"  # (one process: one node)

    def tier(self, replica: int, op: str, *args):
        return self.workers[replica]._serve_blocks((op, *args))

    def peer(self, replica: int):
        return self.workers[replica]

    def write_blocks(self, replica: int, blocks: list[int], snapshot: int | None, parts: dict,
                     via: str = "channel") -> None:
        self.workers[replica].write_blocks(blocks, snapshot, parts)

    # ---- shape changes: refused --------------------------------------------------------------
    def prepare(self, kind: str, table: PlacementTable):
        raise EngineError(f"the in-process executor cannot change its shape ({kind}): serve on Ray to scale or "
                          "rebalance")

    def ready(self, prepared) -> bool:
        return True

    def commit(self, prepared) -> tuple[float, int]:
        raise EngineError("the in-process executor has no change to commit")

    def abort(self, prepared) -> None:
        pass

    def progress(self, prepared) -> dict:
        return {}

    def lost(self, suspects: list[MemberId]) -> list[MemberId]:
        return []

    def failed_members(self) -> list[MemberId]:
        return []

    def replace(self, dead: list[MemberId], table: PlacementTable) -> tuple[float, float, int]:
        if dead:
            raise NoCapacity("the in-process executor cannot replace a worker")
        self.table = table
        for w in self.workers:
            w.use_local_experts(table)
        return 0.0, 0.0, 0

    # ---- operations ------------------------------------------------------------------------
    def kill(self, kind: str, index: int) -> str:
        raise ValueError("the in-process executor has no actors to kill: chaos needs a cluster on Ray")

    def describe(self) -> dict:
        return {"attention": [{"node": "this process"} for _ in self.workers],
                "experts": [{"node": "this process"} for _ in range(self.table.num_actors if self.table else 0)],
                "standby": 0, "weight_bytes": []}
