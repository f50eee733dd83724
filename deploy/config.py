"""The serving configuration: read once at the edge (YAML, CLI flags, Serve args) into a pydantic
model with ``extra="forbid"``, then handed down as frozen dataclasses (EngineConfig, ClusterSpec)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


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
    prefix_caching: bool = Field(True, description="Share the cached blocks of equal prompt prefixes between "
                                                   "requests (and, on hybrid models, KDA state snapshots); a "
                                                   "request goes to the attention replica holding most of its "
                                                   "prompt, weighed against load (prefix_load_weight).")
    prefix_load_weight: float = Field(256.0, ge=0, description="Placement: a replica running one more sequence "
                                                               "must hold this many more cached tokens of a new "
                                                               "request to be chosen (0: always follow the cache; "
                                                               "large: least loaded).")
    snapshot_bytes: int = Field(1 << 30, ge=0, description="Hybrid models with prefix caching: bytes of KDA state "
                                                           "snapshots per attention replica (prefix hits need one "
                                                           "at their boundary); `moeray plan` counts them.")
    max_queue: int = Field(256, ge=1, description="Requests waiting for a slot before new ones get 503.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest accepted request body.")
    max_model_len: int | None = Field(None, ge=2, description="Context length served (prompt plus output), at "
                                                              "most the model's; default: the model's.")
    host: str = Field("127.0.0.1", description="Address the HTTP ingress listens on (0.0.0.0 for a cluster of "
                                                "several machines).")
    port: int = Field(8000, ge=1, le=65535, description="Port the HTTP ingress listens on.")
    api_key: str | None = Field(None, description="An inference key: if any inference key is set (here, in api_keys "
                                                  "or in api_keys_file), every route but /health, the OpenAPI pages "
                                                  "and /admin/* needs 'Authorization: Bearer <key>' with one of them.")
    api_keys: list[str] | None = Field(None, description="More inference keys, each accepted as api_key is (one per "
                                                         "client, so that one can be revoked alone).")
    api_keys_file: str | None = Field(None, description="A file of inference keys, one per line (blank lines and "
                                                        "lines starting with # are skipped), read by each ingress "
                                                        "replica when it starts, on its node.")
    admin_api_key: str | None = Field(None, description="The key the /admin/* routes (scale, rebalance, experts, "
                                                        "chaos) need, as 'Authorization: Bearer <key>'; never an "
                                                        "inference key. With no admin key (here, in "
                                                        "admin_api_key_file or $MOERAY_ADMIN_KEY on the Ray nodes) "
                                                        "they answer 403, except that `moeray up` on a loopback "
                                                        "host makes a random one itself (admin_token in its cache "
                                                        "directory, mode 0600, which the `moeray` commands read).")
    admin_api_key_file: str | None = Field(None, description="A file whose first line is the admin key, read by "
                                                             "each ingress replica when it starts, on its node "
                                                             "(instead of admin_api_key).")
    max_expert_actors: int | None = Field(None, ge=1, description="The most expert actors `moeray scale experts` "
                                                                  "(POST /admin/scale/experts) may ask for: a "
                                                                  "larger count is refused with 400 before "
                                                                  "anything changes. Default: no limit but the "
                                                                  "model's routed experts and the cluster's room.")
    max_attention: int | None = Field(None, ge=1, description="The most attention replicas `moeray scale "
                                                              "attention` (POST /admin/scale/attention) may ask "
                                                              "for, as max_expert_actors.")
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
    capacity_wait_s: float = Field(0.0, ge=0, le=86400,
                                   description="A scale whose new actors the cluster's free resources cannot place "
                                               "now is refused at once (0), or, on a cluster that grows by itself "
                                               "(an autoscaler), asked for and waited for this long while requests "
                                               "stream (`moeray status` shows it waiting). One the cluster could "
                                               "never hold is refused at once either way.")
    step_timeout_s: float = Field(120.0, gt=0, le=3600, description="The longest one step may take, whatever the "
                                                                    "hang watchdog says.")
    hang_floor_s: float = Field(3.0, gt=0, le=3600,
                                description="The hang watchdog asks the actors still silent in a step for a "
                                            "heartbeat after max(this, hang_factor × the p99 of their kind's "
                                            "recent steps); one that does not answer is hung: killed and "
                                            "replaced through recovery.")
    hang_factor: float = Field(4.0, gt=0, le=1000, description="See hang_floor_s.")
    heartbeat_timeout_s: float = Field(1.5, gt=0, le=600, description="How long a silent actor has to answer the "
                                                                      "watchdog's heartbeat (on Ray's thread, not "
                                                                      "the step's) before it counts as hung.")
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

    @field_validator("api_key", "admin_api_key")
    @classmethod
    def _key_is_a_token(cls, key: str | None) -> str | None:
        return None if key is None else check_key(key)

    @field_validator("api_keys")
    @classmethod
    def _keys_are_tokens(cls, keys: list[str] | None) -> list[str] | None:
        return None if keys is None else [check_key(k) for k in keys]

    @model_validator(mode="after")
    def _consistent(self) -> "ServeConfig":
        if self.admin_api_key is not None and self.admin_api_key_file is not None:
            raise ValueError("give admin_api_key or admin_api_key_file, not both")
        if self.admin_api_key is not None and self.admin_api_key in {self.api_key, *(self.api_keys or ())}:
            raise ValueError("admin_api_key must differ from every inference key (api_key, api_keys)")
        if self.max_expert_actors is not None and self.experts > self.max_expert_actors:
            raise ValueError(f"experts ({self.experts}) is over max_expert_actors ({self.max_expert_actors})")
        if self.max_attention is not None and self.attention > self.max_attention:
            raise ValueError(f"attention ({self.attention}) is over max_attention ({self.max_attention})")
        return self

    def inference_keys(self) -> list[str]:
        """Every inference key: api_key, api_keys and api_keys_file's lines (read now). ValueError
        naming the file when it cannot be read or holds something that is not a key."""
        keys = [k for k in (self.api_key, *(self.api_keys or ())) if k is not None]
        if self.api_keys_file is not None:
            lines = _read_key_file(self.api_keys_file, "api_keys_file")
            keys += [check_key(line, f"api_keys_file {self.api_keys_file}") for line in lines]
            if not lines:
                raise ValueError(f"api_keys_file {self.api_keys_file}: holds no key")
        return keys

    def admin_key(self, from_env: str | None = None) -> str | None:
        """The admin key: admin_api_key, else admin_api_key_file's first line (read now), else
        ``from_env`` ($MOERAY_ADMIN_KEY, which deploy/settings.py reads); None when there is none."""
        if self.admin_api_key is not None:
            return self.admin_api_key
        if self.admin_api_key_file is not None:
            lines = _read_key_file(self.admin_api_key_file, "admin_api_key_file")
            if not lines:
                raise ValueError(f"admin_api_key_file {self.admin_api_key_file}: holds no key")
            return check_key(lines[0], f"admin_api_key_file {self.admin_api_key_file}")
        return check_key(from_env, "$MOERAY_ADMIN_KEY") if from_env else None

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
            raise ValueError(f"{where}: {'; '.join(map(_problem, e.errors()))}") from None

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
                            standby_attention=self.standby_attention, standby_experts=self.standby_experts,
                            step_timeout_s=self.step_timeout_s, hang_floor_s=self.hang_floor_s,
                            capacity_wait_s=self.capacity_wait_s, prefix_caching=self.prefix_caching,
                            prefix_load_weight=self.prefix_load_weight, snapshot_bytes=self.snapshot_bytes,
                            hang_factor=self.hang_factor, heartbeat_timeout_s=self.heartbeat_timeout_s)

    def cluster_spec(self):
        from cluster.spec import ClusterSpec

        res = {"CPU": 1, **({"GPU": self.gpus_per_actor} if self.gpus_per_actor else {})}
        return ClusterSpec(attention=self.attention, experts=self.experts, attention_resources=res,
                           expert_resources=dict(res),
                           expert_nodes=tuple(self.expert_nodes) if self.expert_nodes else None,
                           attention_nodes=tuple(self.attention_nodes) if self.attention_nodes else None)

    def name_for(self, model_path: Path) -> str:
        return self.served_model_name or (self.model if "/" not in self.model else model_path.name)


def check_key(key: str, where: str | None = None) -> str:
    """A key must be one HTTP header token: 1 to 512 visible ASCII characters (what `openssl rand
    -hex` or ``secrets.token_urlsafe`` make). ValueError naming ``where`` (never the key itself)."""
    if not 1 <= len(key) <= 512 or not all("!" <= c <= "~" for c in key):
        why = "a key must be 1 to 512 visible ASCII characters (no spaces)"
        raise ValueError(f"{where}: {why}" if where else why)
    return key


def _problem(err: dict) -> str:
    """One pydantic error as ``key: what is wrong`` (a check across keys names them in its message)."""
    loc, msg = ".".join(str(x) for x in err["loc"]), err["msg"].removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def _read_key_file(path: str, key: str) -> list[str]:
    """The non-blank lines of a key file that do not start with #."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise ValueError(f"{key} {path}: cannot read it: {e.strerror}") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
