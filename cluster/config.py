"""Runtime knobs of one deployment (the architecture comes from the checkpoint). Built once at the
edge (deploy/ or the CLI) and handed down; read by the engine, its epoch owner and its fleet."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
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
    step_timeout_s: float = 120.0  # the upper bound of one step's wait, whatever the hang watchdog says
    # the hang watchdog (cluster/executor.py): an actor kind's step is expected within
    # clamp(hang_factor × p99 of its recent steps, hang_floor_s, step_timeout_s); past that every actor
    # still silent is asked for a heartbeat on Ray's thread, and one that does not answer within
    # heartbeat_timeout_s is hung: killed and replaced through recovery
    hang_floor_s: float = 3.0
    hang_factor: float = 4.0
    heartbeat_timeout_s: float = 1.5
    # a step that fails this many more times in a row, each failure recovered, drops its sequences
    # (RequestsFailed) rather than retrying for ever
    max_step_retries: int = 2
    start_timeout_s: float = 300.0  # reserving placement groups, starting actors
    # a change whose new actors the cluster's free resources cannot place now: refused at once (0), or, on a
    # cluster that grows by itself (an autoscaler), asked for and waited for this long while steps go on
    # (one the cluster could never hold is refused at once either way)
    capacity_wait_s: float = 0.0

    load_timeout_s: float | None = None  # actors loading weights; None: scales with the bytes to read
    # elastic plane: the router's sliding window of token counts (steps), which rebalancing, the measured
    # imbalance and the metrics read, and the automatic rebalancing policy (off by default)
    window_steps: int = 256
    auto_rebalance: bool = False
    rebalance_threshold: float = 1.5  # mean over MoE layers of max/mean tokens per expert actor
    rebalance_interval_s: float = 300.0  # at least this long between two automatic rebalances
    redundant_slots: int = 0  # spare physical slots per MoE layer for copies of hot experts
    # names this deployment's placement groups "<owner>/..."; an engine with an owner removes the ones an
    # earlier incarnation left behind (a Serve replica that died) before reserving
    owner: str | None = None
    # data plane: ping-pong splits each step into micro-batches so attention and expert actors compute at
    # once; the exchange's wire format (actors/dispatch.py: dense, sparse, or auto by the table's shape)
    ping_pong: bool = False
    actor_threads: int = 1  # torch threads per attention / expert actor (intra-op parallelism of each)
    # threads of an expert actor's routed-expert GEMMs on CPU, each over its own range of experts
    # (model.moe.ExpertThreads); torch's intra-op threads stay actor_threads
    expert_threads: int = 1
    micro_batches: int = 2
    exchange: str = "auto"
    # how the exchange travels on gloo (CPU) groups: auto, direct sockets between the calling threads
    # (actors/wire.py); group, gloo's own sends and receives. NCCL groups use all_to_all_single either way
    transport: str = "auto"
    # async scheduling: a decode step goes out before the last step's results are back (the engine's and
    # Ray's per-step work then overlaps the actors' compute; the same tokens)
    async_scheduling: bool = True
    # warm standby actors, started ahead in their own bundles and joined to no process group: a dead
    # actor's index is taken by a standby (failover without starting a process), then a new standby starts
    standby_attention: int = 0  # each holds the attention weights and a cache, like a replica
    standby_experts: int = 0  # each holds nothing until it takes a dead actor's experts
    # prefix caching (cluster/scheduler.py): cached blocks shared between sequences; a new sequence goes
    # to the replica with the most of it cached minus prefix_load_weight cached tokens per running sequence
    # there; on hybrid models at most snapshot_bytes of KDA state snapshots per attention replica
    prefix_caching: bool = True
    prefix_load_weight: float = 256.0
    snapshot_bytes: int = 1 << 30

    def __post_init__(self):
        for name in ("block_size", "num_blocks", "num_slots", "max_num_seqs", "max_tokens_per_step", "window_steps",
                     "actor_threads", "expert_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine setting {name!r} must be >= 1, got {getattr(self, name)}")
        if self.micro_batches < 2:
            raise ValueError(f"engine setting 'micro_batches' must be >= 2 (ping-pong needs two), got {self.micro_batches}")
        if self.exchange not in ("auto", "dense", "sparse"):
            raise ValueError(f"engine setting 'exchange' must be auto, dense or sparse, got {self.exchange!r}")
        if self.transport not in ("auto", "group"):
            raise ValueError(f"engine setting 'transport' must be auto or group, got {self.transport!r}")
        for name in ("redundant_slots", "standby_attention", "standby_experts", "max_step_retries", "capacity_wait_s",
                     "prefix_load_weight", "snapshot_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"engine setting {name!r} must be >= 0, got {getattr(self, name)}")
        for name in ("hang_floor_s", "hang_factor", "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine setting {name!r} must be > 0, got {getattr(self, name)}")
        if self.rebalance_threshold < 1:
            raise ValueError(f"engine setting 'rebalance_threshold' must be >= 1 (1 = balanced), "
                             f"got {self.rebalance_threshold}")


def snapshot_plan(config: EngineConfig, model_cfg) -> tuple[int | None, int, int]:
    """(grid, count, bytes each) of an attention replica's KDA state snapshots: None, 0, 0 unless
    the model has KDA layers and prefix caching is on. The grid is the least common multiple of
    the block size and the KDA chunk, so that a prefill split on it computes what an unsplit one
    does; the count is what ``snapshot_bytes`` holds, and no more than the grid boundaries the
    cache has blocks for."""
    from model.kda import KDA_CHUNK
    from model.loader import parse_dtype
    from model.params import state_bytes_per_sequence

    if not (config.prefix_caching and model_cfg.kda_layers):
        return None, 0, 0
    grid = math.lcm(config.block_size, KDA_CHUNK)
    each = state_bytes_per_sequence(model_cfg, parse_dtype(config.dtype).itemsize)["total"]
    return grid, min(config.snapshot_bytes // each, config.num_blocks * config.block_size // grid), each
