"""Runtime knobs of one deployment (the architecture comes from the checkpoint), grouped by the part
of the engine that reads them: the scheduler, the cache, faults, the elastic plane and the data
plane. Each knob is declared once, here, with its bound and its description (:func:`knob`): the
serving config (deploy/config.py) derives its keys from these records, the generated reference
(docs/configuration.md) documents them, and each part of the engine takes its own record.

Built once at the edge (deploy/ or the CLI) and handed down, frozen. Never: read by the model
(``ModelConfig`` carries no runtime knob), or read from the environment.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Literal


def knob(default, doc: str, *, serve: bool = True, **bounds):
    """A knob: its default, what it does (the serving config's description), its bounds (``ge``,
    ``gt``, ``le``, ``lt``, checked when the record is built) and whether the serving config has a
    key for it (``serve``; engine-only knobs are set by code)."""
    return field(default=default, metadata={"doc": doc, "serve": serve, **bounds})


_CHECKS = {"ge": (lambda v, b: v >= b, ">="), "gt": (lambda v, b: v > b, ">"), "le": (lambda v, b: v <= b, "<="),
           "lt": (lambda v, b: v < b, "<")}


class _Checked:
    """Every knob within its bounds and of its Literal's values, checked at construction
    (ValueError naming the setting)."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            for key, (ok, sign) in _CHECKS.items():
                if key in f.metadata and not ok(value, f.metadata[key]):
                    raise ValueError(f"engine setting {f.name!r} must be {sign} {f.metadata[key]}, got {value!r}")
            allowed = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else None
            if allowed and value not in allowed:
                raise ValueError(f"engine setting {f.name!r} must be one of {', '.join(map(str, allowed))}, "
                                 f"got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig(_Checked):
    """What the scheduler decides with (cluster/scheduler.py), and the engine's step loop."""

    max_num_seqs: int = knob(64, "Sequences running at once.", ge=1)
    max_tokens_per_step: int = knob(256, "Token budget of one engine step.", ge=1)
    async_scheduling: bool = knob(True, "Send a decode step before the last step's results are back (the engine's "
                                        "and Ray's per-step work overlaps the actors'; the same tokens).")


@dataclass(frozen=True)
class CacheConfig(_Checked):
    """Where sequences' cache lives and what is shared (cluster/prefix_cache.py; the attention actors'
    cache tensors)."""

    num_blocks: int = knob(256, "Latent-cache blocks per attention replica.", ge=1)
    block_size: int = knob(16, "Tokens per latent-cache block.", ge=1)
    num_slots: int = knob(64, "KDA state slots per attention replica (hybrid models).", ge=1)
    prefix_caching: bool = knob(True, "Share the cached blocks of equal prompt prefixes between requests (and, on "
                                      "hybrid models, KDA state snapshots); a request goes to the attention replica "
                                      "holding most of its prompt, weighed against load (prefix_load_weight).")
    prefix_load_weight: float = knob(256.0, "Placement: a replica running one more sequence must hold this many more "
                                            "cached tokens of a new request to be chosen (0: always follow the cache; "
                                            "large: least loaded).", ge=0)
    snapshot_bytes: int = knob(1 << 30, "Hybrid models with prefix caching: bytes of KDA state snapshots per attention "
                                        "replica (prefix hits need one at their boundary); `moeray plan` counts them.",
                               ge=0)
    kv_offloading_size: float = knob(0.0, "GiB of host memory per node for the KV tier (actors/kv_tier.py): every "
                                          "full block (and KDA snapshot) is written through to it, and a request's "
                                          "prefix found there is loaded instead of prefilled; shared by the node's "
                                          "actors and outliving them. 0: off. Needs prefix_caching.", ge=0)
    kv_offloading_path: str = knob("/dev/shm/moeray-kv", "The KV tier's directory on each node (in host memory: "
                                                         "tmpfs); a folder per model layout under it. `{node}` in "
                                                         "it is the node's address (a directory per node where "
                                                         "nodes share a file system).")
    kv_offloading_disk: str | None = knob(None, "A directory on each node for the KV tier's disk level: what the "
                                                "host-memory tier evicts moves there; `{node}` as in "
                                                "kv_offloading_path. Off unless given.")
    kv_offloading_disk_size: float = knob(0.0, "GiB the KV tier's disk level may hold (with kv_offloading_disk).",
                                          ge=0)

    def __post_init__(self):
        super().__post_init__()
        if self.kv_offloading_size and not self.prefix_caching:
            raise ValueError("engine setting 'kv_offloading_size' needs 'prefix_caching': the tier keeps blocks by "
                             "their prefix hashes")
        if bool(self.kv_offloading_disk) != bool(self.kv_offloading_disk_size):
            raise ValueError("engine settings 'kv_offloading_disk' and 'kv_offloading_disk_size' go together: give "
                             "both (a directory and its GiB) or neither")
        if self.kv_offloading_disk and not self.kv_offloading_size:
            raise ValueError("engine setting 'kv_offloading_disk' needs 'kv_offloading_size' (the host-memory tier "
                             "above it)")

    def tier(self) -> dict | None:
        """The KV tier an attention actor opens (cluster/kv_tier.py ``open_tiers``): plain data; None when off."""
        if not self.kv_offloading_size:
            return None
        gib = 1 << 30
        return {"path": self.kv_offloading_path, "bytes": int(self.kv_offloading_size * gib),
                "disk": self.kv_offloading_disk, "disk_bytes": int(self.kv_offloading_disk_size * gib)}


# The environment every Ray node that moeray starts or documents runs with (LocalCluster, `moeray
# up`, the `ray up` YAMLs, the KubeRay manifest). A hung actor is killed with ray.kill; Ray's raylet
# sends its process SIGTERM and SIGKILL only after kill_worker_timeout_milliseconds (5 s by default),
# and the actor's bundle, where its replacement goes, stays held until then. A stopped process never
# acts on SIGTERM, so the 5 s were 5 s more of every stream's stall (measured: replacement in a
# stopped actor's bundle ready after 5.8 s, after 1.6 s with 1000 ms). Ray starts its workers, every
# actor of ours among them, at niceness 15 (worker_niceness): beside any process of normal priority on
# the node (a Serve driver, a co-located job, a second test worker) an actor then gets a few percent of
# a core. Measured on 2 cores beside a 2-thread job: `import torch` in a new actor took 46 s (3 s in a
# normal process), a hung actor's replacement 30 s to start; with niceness 0, as Ray's own job
# supervisor starts its drivers, actors share the cores as equals.
RAY_NODE_ENV = {"RAY_kill_worker_timeout_milliseconds": "1000", "RAY_worker_niceness": "0"}


@dataclass(frozen=True)
class FaultConfig(_Checked):
    """Timeouts, the hang watchdog, retries and standbys (cluster/executor.py, cluster/epochs.py, the fleet)."""

    load_timeout_s: float | None = knob(None, "How long the actors may take to load the weights; default: scales "
                                              "with the bytes to read.", gt=0)
    max_step_retries: int = knob(2, "Times a failed step is redone after its failure was recovered (actors replaced "
                                    "or regrouped) before its requests end with the error instead: work that fails "
                                    "every time is not retried for ever.", ge=0, le=100)
    capacity_wait_s: float = knob(0.0, "A scale whose new actors the cluster's free resources cannot place now is "
                                       "refused at once (0), or, on a cluster that grows by itself (an autoscaler), "
                                       "asked for and waited for this long while requests stream (`moeray status` "
                                       "shows it waiting). One the cluster could never hold is refused at once "
                                       "either way.", ge=0, le=86400)
    step_timeout_s: float = knob(120.0, "The longest one step may take, whatever the hang watchdog says.",
                                 gt=0, le=3600)
    hang_floor_s: float = knob(3.0, "The hang watchdog asks the actors still silent in a step for a heartbeat after "
                                    "max(this, hang_factor × the p99 of their kind's recent steps); one that does not "
                                    "answer is hung: killed and replaced through recovery.", gt=0, le=3600)
    hang_factor: float = knob(4.0, "See hang_floor_s.", gt=0, le=1000)
    heartbeat_timeout_s: float = knob(1.5, "How long a silent actor has to answer the watchdog's heartbeat (on Ray's "
                                           "thread, not the step's) before it counts as hung.", gt=0, le=600)
    standby_attention: int = knob(0, "Warm standby attention actors (each holds the attention weights and a "
                                     "bundle): a dead replica is replaced in about the regroup's time instead of an "
                                     "actor's start.", ge=0)
    standby_experts: int = knob(0, "Warm standby expert actors (each holds a bundle, no weights until it takes a "
                                   "dead actor's experts).", ge=0)
    collective_timeout_s: float = knob(60.0, "The exchange's collective timeout.", serve=False, gt=0)
    start_timeout_s: float = knob(300.0, "Reserving placement groups and starting actors.", serve=False, gt=0)


@dataclass(frozen=True)
class ElasticConfig(_Checked):
    """Token counts and rebalancing (the router's window, cluster/epochs.py's automatic policy)."""

    redundant_slots: int = knob(0, "Spare physical expert slots per MoE layer for copies of hot experts (used by "
                                   "`moeray rebalance` and the automatic policy).", ge=0)
    auto_rebalance: bool = knob(False, "Rebalance by itself when the measured imbalance passes rebalance_threshold "
                                       "(at most once per rebalance_interval_s).")
    rebalance_window_steps: int = knob(256, "Steps of token counts the router keeps.", ge=1)
    rebalance_threshold: float = knob(1.5, "Max/mean tokens per expert actor that triggers an automatic rebalance.",
                                      ge=1.0)
    rebalance_interval_s: float = knob(300.0, "Least time between two automatic rebalances.", ge=0)


@dataclass(frozen=True)
class DataPlaneConfig(_Checked):
    """How the actors compute and exchange (actors/, the fleet's actor options)."""

    ping_pong: bool = knob(False, "Split each step into micro-batches so attention and expert actors compute at the "
                                  "same time (MegaScale-Infer's ping-pong).")
    micro_batches: int = knob(2, "Micro-batches per step with ping_pong.", ge=2)
    actor_threads: int = knob(1, "Torch threads of each attention and expert actor (CPU intra-op parallelism; on "
                                 "GPUs 1 is enough).", ge=1)
    expert_threads: int = knob(1, "Threads of each expert actor's routed-expert GEMMs on CPU, each over its own range "
                                  "of experts (decode reads every expert's weights: bound by memory, so a second core "
                                  "helps where it is idle; the same results bit for bit). Ignored on GPUs.",
                               ge=1, le=256)
    exchange: Literal["auto", "dense", "sparse"] = knob(
        "auto", "The expert exchange's wire format: dense (every token to every expert actor, no counts exchange) "
                "or sparse (pairs only where their expert lives); auto: dense while there are no more expert actors "
                "than experts per token.")
    transport: Literal["auto", "socket", "shm", "group"] = knob(
        "auto", "How the expert exchange travels between CPU actors (gloo process groups): socket, a direct socket "
                "per pair of actors that exchange, written and read by the actors' own threads; shm, the same but "
                "through shared memory between two actors on one node; group, gloo's own sends and receives "
                "(through its I/O thread: slower); auto, the fastest measured at decode sizes: socket, and actors all on one "
                "node (either layout) exchange a decode step's rows through shared-memory mailboxes (shm too). GPU "
                "actors on NCCL use all_to_all_single either way.")
    impl: Literal["absorbed", "naive"] = knob("absorbed", "The MLA implementation (naive: the oracle).", serve=False)
    compile: Literal["off", "decode"] = knob(
        "off", "decode: every attention replica (worker) runs its decode steps compiled (torch.compile, inductor's C++ "
               "on CPU; model/compiled.py), compiling at start (tens of seconds on 2 CPU cores the first time, a few "
               "once inductor's on-disk cache holds the graphs; a replacement actor compiles too). Steps verifying "
               "drafts run compiled too (each query token a row); prefill runs eager, and a hybrid model's drafts and "
               "a batch above max_num_seqs rows run eager, counted (moeray_compile_fallbacks). The same tokens; "
               "logits within floating-point tolerance (docs/architecture.md, \"Compiled decode\"). off: eager.")
    backend: Literal["gloo", "nccl"] | None = knob(None, "The process groups' backend; None: nccl when actors "
                                                         "have GPUs, else gloo.", serve=False)


@dataclass(frozen=True)
class SpeculativeConfig(_Checked):
    """Speculative decoding (vLLM's ``speculative_config`` names): the scheduler proposes up to
    ``num_speculative_tokens`` draft tokens per decoding sequence and the attention actors verify
    them in the same forward (docs/architecture.md "Speculative decoding"). Off unless given."""

    method: Literal["ngram", "suffix", "mtp"] = knob(
        "suffix", "ngram: prompt lookup over the sequence's own tokens; suffix: SuffixDecoding over the sequence "
                  "and recent outputs; mtp: the checkpoint's multi-token-prediction layer (DeepSeek-V3's).")
    num_speculative_tokens: int | None = knob(None, "The most draft tokens per sequence per step; default 4 (mtp: 1, "
                                                    "one per MTP layer).", ge=1, le=16)
    prompt_lookup_min: int = knob(2, "ngram: the shortest n-gram looked up.", ge=1)
    prompt_lookup_max: int = knob(5, "ngram: the longest n-gram looked up.", ge=1)
    suffix_decoding_max_tree_depth: int = knob(24, "suffix: the longest suffix matched and continued.", ge=2)
    suffix_decoding_max_cached_requests: int = knob(1000, "suffix: recent outputs kept for other requests' drafts "
                                                          "(of the same cache_salt; this many over all salts).",
                                                    ge=0)
    suffix_decoding_min_token_prob: float = knob(0.1, "suffix: a draft stops where its path's estimated probability "
                                                      "falls below this (the confidence cut).", ge=0, le=1)
    full_draft_batch: int = knob(2, "Adaptive length: up to this many decoding sequences each draft the full "
                                    "length; beyond, each drafts num_speculative_tokens × this / sequences "
                                    "(rounded down: none at all once that is under 1).", ge=0)

    def __post_init__(self):
        super().__post_init__()
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", 1 if self.method == "mtp" else 4)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative: prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    def draft_length(self, decoding: int) -> int:
        """The adaptive length's batch half: the most drafts one sequence may carry in a step where
        ``decoding`` sequences decode (the scheduler's ``draft_length``; the planner's bound on
        what verification holds at once walks it)."""
        if decoding <= 0:
            return 0
        K, full = self.num_speculative_tokens, self.full_draft_batch
        return K if decoding <= full else K * full // decoding

    @classmethod
    def parse(cls, raw) -> "SpeculativeConfig":
        """From a mapping (the serving config's ``speculative``, ``--speculative-config``'s JSON);
        ValueError naming an unknown key."""
        return _parse_section(cls, raw, "speculative", "{'method': 'suffix', 'num_speculative_tokens': 4}")


def _parse_section(cls, raw, name: str, example: str):
    """A config section's record from its mapping; ValueError naming the section and an unknown key."""
    if not isinstance(raw, dict):
        raise ValueError(f"{name} must be a mapping such as {example}, got {raw!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"{name}: unknown key {unknown[0]!r} (known: {', '.join(sorted(names))})")
    return cls(**raw)


@dataclass(frozen=True)
class DisaggregationConfig(_Checked):
    """Prefill/decode disaggregation (cluster/pd.py, cluster/apd.py): a second engine of the same model
    prefills the prompts whose uncached part is long, and their cached blocks cross to the decode
    engine — the deployment's own shape. Off unless given."""

    min_uncached_tokens: int = knob(256, "A request's prompt less what the decode engine caches of it: at least this "
                                         "many tokens and it is prefilled on the prefill engine (selective PD); "
                                         "shorter ones are prefilled on decode.", ge=1)
    lease_s: float = knob(30.0, "How long the prefill engine holds a transfer's blocks for the decode engine at "
                                "most.", gt=0)
    transport: Literal["channel", "object_store"] = knob(
        "channel", "How a transfer's blocks leave the prefill engine's actor and reach the decode engine's: each "
                   "actor's blocks channel (a direct connection beside its step channel) or Ray calls through the "
                   "object store (bench/bench_pd.py --transports measures both).")
    layout: Literal["disaggregated", "colocated"] = knob("disaggregated", "The prefill engine's layout.")
    attention: int = knob(1, "The prefill engine's attention replicas (disaggregated).", ge=1)
    experts: int = knob(1, "The prefill engine's expert actors (disaggregated).", ge=1)
    workers: int = knob(2, "The prefill engine's workers (colocated).", ge=1)
    max_tokens_per_step: int = knob(2048, "The prefill engine's token budget per step (long chunks: it runs no "
                                          "decode streams to keep flowing).", ge=1)

    @classmethod
    def parse(cls, raw) -> "DisaggregationConfig":
        """From the serving config's ``disaggregation`` mapping; ValueError naming the key at fault."""
        try:
            return _parse_section(cls, raw, "disaggregation", "{'min_uncached_tokens': 256}")
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith("disaggregation") else f"disaggregation: {msg}") from None

    def prefill_engine(self, config: "EngineConfig", resources: dict | None = None):
        """(the prefill engine's EngineConfig, its ClusterSpec), from the decode engine's ``config``: the same
        model, dtype and cache, its own step budget and owner name (its own placement groups)."""
        owner = None if config.owner is None else f"{config.owner}-prefill"
        budget = dataclasses.replace(config.scheduler, max_tokens_per_step=self.max_tokens_per_step)
        return dataclasses.replace(config, owner=owner, scheduler=budget), self.spec(resources)

    def spec(self, resources: dict | None = None):
        """The prefill engine's ClusterSpec, each actor reserving ``resources`` (default one CPU)."""
        from .spec import ClusterSpec

        res = dict(resources or {"CPU": 1})
        if self.layout == "colocated":
            return ClusterSpec.of_workers(self.workers, res)
        return ClusterSpec(attention=self.attention, experts=self.experts, attention_resources=res,
                           expert_resources=dict(res))


GROUPS = {"scheduler": SchedulerConfig, "cache": CacheConfig, "faults": FaultConfig, "elastic": ElasticConfig,
          "data_plane": DataPlaneConfig}


@dataclass(frozen=True)
class EngineConfig(_Checked):
    """One engine's knobs: the checkpoint, the compute dtype, the owner of its placement groups (an
    engine with an owner removes the ones an earlier incarnation left, e.g. a Serve replica that
    died), and one record per part of the engine. Build one from flat keys with :meth:`of`."""

    model: str
    dtype: Literal["float32", "bfloat16"] = "float32"
    owner: str | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    data_plane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    speculative: SpeculativeConfig | None = None  # off unless given

    @property
    def mtp(self) -> bool:
        """Speculative decoding drafts with the checkpoint's MTP layer (the actors hold it)."""
        return self.speculative is not None and self.speculative.method == "mtp"

    @classmethod
    def of(cls, model: str, *, dtype: str = "float32", owner: str | None = None,
           speculative: "SpeculativeConfig | dict | None" = None, **knobs) -> "EngineConfig":
        """An engine config from flat knob names (``max_num_seqs=8, prefix_caching=False``), each
        sent to its group; an unknown name is a ValueError naming it. ``speculative``: a
        :class:`SpeculativeConfig` or its mapping."""
        if isinstance(speculative, dict):
            speculative = SpeculativeConfig.parse(speculative)
        groups: dict[str, dict] = {name: {} for name in GROUPS}
        where = {f.name: name for name, rec in GROUPS.items() for f in dataclasses.fields(rec)}
        for key, value in knobs.items():
            if key not in where:
                raise ValueError(f"unknown engine setting {key!r}")
            groups[where[key]][key] = value
        return cls(model=model, dtype=dtype, owner=owner, speculative=speculative,
                   **{n: GROUPS[n](**kw) for n, kw in groups.items()})


def serve_knobs() -> list[tuple[str, dataclasses.Field, type]]:
    """(group, field, type) of every knob the serving config has a key for, in declaration order."""
    out = []
    for name, rec in GROUPS.items():
        hints = typing.get_type_hints(rec)
        out += [(name, f, hints[f.name]) for f in dataclasses.fields(rec) if f.metadata.get("serve", True)]
    return out


@dataclass(frozen=True)
class SnapshotPlan:
    """An attention replica's KDA state snapshots (:func:`snapshot_plan`): the token grid they sit
    on, how many, and the bytes of each; none without KDA layers or prefix caching."""

    grid: int | None = None
    count: int = 0
    bytes_each: int = 0


def compiled(config: EngineConfig) -> dict:
    """An attention replica's (a worker's) compile options: the compiled decode step's mode and its
    largest batch in rows (a replica never decodes more than max_num_seqs at once, each with at most
    num_speculative_tokens drafts)."""
    drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    return {"compile": config.data_plane.compile, "max_batch": config.scheduler.max_num_seqs * (1 + drafts)}


def snapshot_plan(config: EngineConfig, model_cfg) -> SnapshotPlan:
    """An attention replica's KDA state snapshots: none unless the model has KDA layers and prefix
    caching is on. The grid is the least common multiple of
    the block size and the KDA chunk, so that a prefill split on it computes what an unsplit one
    does; the count is what ``snapshot_bytes`` holds, and no more than the grid boundaries the
    cache has blocks for."""
    from model.kda import KDA_CHUNK
    from model.loader import parse_dtype
    from model.params import state_bytes_per_sequence

    cache = config.cache
    if not (cache.prefix_caching and model_cfg.kda_layers):
        return SnapshotPlan()
    grid = math.lcm(cache.block_size, KDA_CHUNK)
    each = state_bytes_per_sequence(model_cfg, parse_dtype(config.dtype).itemsize)["total"]
    return SnapshotPlan(grid, min(cache.snapshot_bytes // each, cache.num_blocks * cache.block_size // grid), each)
