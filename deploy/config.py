"""The serving configuration: read once at the edge (YAML, CLI flags, Serve args) into a pydantic
model with ``extra="forbid"``, then handed down as frozen dataclasses (EngineConfig, ClusterSpec)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ServeConfig(BaseModel):
    """One deployment's settings: the serving config YAML (``moeray up --config``, ``serve deploy``),
    the flags of ``moeray up``, or a Serve application's args. Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("kimi-k2-tiny", description="Checkpoint directory or preset name.")
    served_model_name: str | None = Field(None, description="Name clients use; default: the preset or directory name.")
    attention: int = Field(1, ge=1, description="Attention data-parallel replicas.")
    experts: int = Field(1, ge=1, description="Expert actors.")
    gpus_per_actor: float = Field(0, ge=0, description="GPUs each attention and expert actor reserves (NCCL then); "
                                                       "a fraction lets several actors share one GPU.")
    load_timeout_s: float | None = Field(None, gt=0, description="How long the actors may take to load the "
                                                                 "weights; default: scales with the bytes to read.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Compute dtype of the actors' weights "
                                                                         "and caches (quantised experts stay resident "
                                                                         "in their checkpoint format).")
    max_num_seqs: int = Field(64, ge=1, description="Sequences running at once.")
    max_tokens_per_step: int = Field(256, ge=1, description="Token budget of one engine step.")
    num_blocks: int = Field(256, ge=1, description="Latent-cache blocks per attention replica.")
    block_size: int = Field(16, ge=1, description="Tokens per latent-cache block.")
    num_slots: int = Field(64, ge=1, description="KDA state slots per attention replica (hybrid models).")
    max_queue: int = Field(256, ge=1, description="Requests waiting for a slot before new ones get 503.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest accepted request body.")
    max_model_len: int | None = Field(None, ge=2, description="Context length served (prompt plus output), at "
                                                              "most the model's; default: the model's.")
    host: str = Field("127.0.0.1", description="Address the HTTP ingress listens on (0.0.0.0 for a cluster of "
                                                "several machines).")
    port: int = Field(8000, ge=1, le=65535, description="Port the HTTP ingress listens on.")
    api_key: str | None = Field(None, description="If set, every route but /health needs 'Authorization: Bearer <key>'.")
    expert_nodes: list[str] | None = Field(None, description="Pin expert actors to these Ray nodes (IPs or node "
                                                             "ids), round-robin; default: spread over nodes with room.")
    attention_nodes: list[str] | None = Field(None, description="Pin attention replicas to these Ray nodes.")
    redundant_slots: int = Field(0, ge=0, description="Spare physical expert slots per MoE layer for copies of hot "
                                                      "experts (used by `moeray rebalance` and the automatic policy).")
    standby_attention: int = Field(0, ge=0, description="Warm standby attention actors (each holds the attention "
                                                        "weights and a bundle): a dead replica is replaced in "
                                                        "about the regroup's time instead of an actor's start.")
    standby_experts: int = Field(0, ge=0, description="Warm standby expert actors (each holds a bundle, no weights "
                                                      "until it takes a dead actor's experts).")
    auto_rebalance: bool = Field(False, description="Rebalance by itself when the measured imbalance passes "
                                                    "rebalance_threshold (at most once per rebalance_interval_s).")
    rebalance_window_steps: int = Field(256, ge=1, description="Steps of token counts the router keeps.")
    rebalance_threshold: float = Field(1.5, ge=1.0, description="Max/mean tokens per expert actor that triggers "
                                                                "an automatic rebalance.")
    rebalance_interval_s: float = Field(300.0, ge=0, description="Least time between two automatic rebalances.")
    ping_pong: bool = Field(False, description="Split each step into micro-batches so attention and expert actors "
                                               "compute at the same time (MegaScale-Infer's ping-pong).")
    micro_batches: int = Field(2, ge=2, description="Micro-batches per step with ping_pong.")
    actor_threads: int = Field(1, ge=1, description="Torch threads of each attention and expert actor (CPU "
                                                    "intra-op parallelism; on GPUs 1 is enough).")
    max_step_retries: int = Field(2, ge=0, le=100,
                                  description="Times a failed step is redone after its failure was recovered "
                                              "(actors replaced or regrouped) before its requests end with the "
                                              "error instead: work that fails every time is not retried for ever.")
    expert_threads: int = Field(1, ge=1, le=256,
                                description="Threads of each expert actor's routed-expert GEMMs on CPU, each over "
                                            "its own range of experts (decode reads every expert's weights: "
                                            "bound by memory, so a second core helps where it is idle; the same "
                                            "results bit for bit). Ignored on GPUs.")
    exchange: Literal["auto", "dense", "sparse"] = Field(
        "auto", description="The expert exchange's wire format: dense (every token to every expert actor, no counts "
                            "exchange) or sparse (pairs only where their expert lives); auto: dense while there are "
                            "no more expert actors than experts per token.")
    transport: Literal["auto", "group"] = Field(
        "auto", description="How the expert exchange travels between CPU actors (gloo process groups): auto, "
                            "a direct socket per attention and expert actor pair, written and read by the "
                            "actors' own threads; group, gloo's own sends and receives (through its I/O "
                            "thread: slower). GPU actors on NCCL use all_to_all_single either way.")
    async_scheduling: bool = Field(True, description="Send a decode step before the last step's results are back "
                                                     "(the engine's and Ray's per-step work overlaps the actors'; "
                                                     "the same tokens).")
    ingress: Literal["haproxy", "proxy"] = Field(
        "haproxy", description="HTTP in front of the Ingress replicas on a cluster `moeray up` starts: haproxy "
                               "(Serve's direct ingress behind one HAProxy per node: no Python proxy and no Ray "
                               "call per request or streamed chunk) or proxy (Serve's proxy actor). A cluster given "
                               "by --address or started by `ray up` runs what its `ray start` environment says.")
    metrics_prefix: Literal["moeray", "vllm"] = Field(
        "moeray", description="vllm: the serving series under vLLM's names and labels (its dashboards work).")
    expert_metrics: Literal["summary", "full"] = Field(
        "summary", description="full: also the per-(layer, expert) token counter (~23k series for K2).")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "ServeConfig":
        p = Path(path)
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"{p}: cannot read the serving config: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: the serving config must be a mapping of settings")
        return cls.parse({**raw, **{k: v for k, v in overrides.items() if v is not None}}, where=str(p))

    @classmethod
    def parse(cls, raw: dict, where: str = "serving config") -> "ServeConfig":
        try:
            return cls(**raw)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
            raise ValueError(f"{where}: {problems}") from None

    def engine_config(self, model_path: str, owner: str | None = None):
        from cluster.config import EngineConfig

        return EngineConfig(model=model_path, owner=owner, dtype=self.dtype, block_size=self.block_size,
                            num_blocks=self.num_blocks, num_slots=self.num_slots, max_num_seqs=self.max_num_seqs,
                            max_tokens_per_step=self.max_tokens_per_step, window_steps=self.rebalance_window_steps,
                            auto_rebalance=self.auto_rebalance, rebalance_threshold=self.rebalance_threshold,
                            rebalance_interval_s=self.rebalance_interval_s, redundant_slots=self.redundant_slots,
                            load_timeout_s=self.load_timeout_s, ping_pong=self.ping_pong,
                            micro_batches=self.micro_batches, exchange=self.exchange, transport=self.transport,
                            actor_threads=self.actor_threads,
                            expert_threads=self.expert_threads, max_step_retries=self.max_step_retries,
                            async_scheduling=self.async_scheduling,
                            standby_attention=self.standby_attention, standby_experts=self.standby_experts)

    def cluster_spec(self):
        from cluster.spec import ClusterSpec

        res = {"CPU": 1, **({"GPU": self.gpus_per_actor} if self.gpus_per_actor else {})}
        return ClusterSpec(attention=self.attention, experts=self.experts, attention_resources=res,
                           expert_resources=dict(res),
                           expert_nodes=tuple(self.expert_nodes) if self.expert_nodes else None,
                           attention_nodes=tuple(self.attention_nodes) if self.attention_nodes else None)

    def name_for(self, model_path: Path) -> str:
        return self.served_model_name or (self.model if "/" not in self.model else model_path.name)
