"""The serving configuration: read once at the edge (YAML, CLI flags, Serve args) into a pydantic
model with ``extra="forbid"``, then handed down as frozen dataclasses (EngineConfig, ClusterSpec)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator


class GcsFaultTolerance(BaseModel):
    """Ray's GCS fault tolerance for a cluster `moeray up` starts: the head's GCS keeps its tables in a
    Redis, so that a GCS (or a whole head node) started again on it finds the cluster as it was."""

    model_config = ConfigDict(extra="forbid")

    redis_address: str = Field(..., description="HOST:PORT of the Redis, or local: `moeray up` starts a "
                                                "redis-server of its own on a free loopback port and stops it "
                                                "at `moeray down` (a demo: the Redis then dies with this machine).")
    redis_password_file: str | None = Field(None, description="A file whose first line is the Redis password "
                                                              "(read by `moeray up` when it starts).")
    namespace: str | None = Field(None, description="Keeps clusters that share one Redis apart (Ray's "
                                                    "external_storage_namespace); default: Ray's.")

    @field_validator("redis_address")
    @classmethod
    def _host_port(cls, address: str) -> str:
        if address == "local":
            return address
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{address!r} is not HOST:PORT (or local)")
        return address

    def password(self) -> str:
        """The Redis password ('' for none): redis_password_file's first line, read now."""
        if self.redis_password_file is None:
            return ""
        lines = _read_key_file(self.redis_password_file, "gcs_fault_tolerance.redis_password_file")
        if not lines:
            raise ValueError(f"gcs_fault_tolerance.redis_password_file {self.redis_password_file}: holds no password")
        return lines[0]


class _ParsedSection(dict):
    """A section's mapping as given (what the config dumps and documents: ``speculative``,
    ``disaggregation``), with its record (:class:`~cluster.config.SpeculativeConfig`,
    :class:`~cluster.config.DisaggregationConfig`) parsed from it once, at validation (``record``)."""

    def __init__(self, raw: dict, record):
        super().__init__(raw)
        self.record = record


class _Deployment(BaseModel):
    """One deployment's settings: the serving config YAML (``moeray up --config``, ``serve deploy``),
    the flags of ``moeray up``, or a Serve application's args. Unknown keys are refused. The keys
    declared here are the deployment's own (model, shape, HTTP, keys); the engine's knobs follow,
    each declared once in cluster/config.py with its bound and description, grouped by the part of
    the engine that reads it."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("kimi-k2-mini", description="Checkpoint directory or preset name.")
    served_model_name: str | None = Field(None, description="Name clients use; default: the preset or directory name.")
    layout: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: attention actors on some devices, expert actors on others "
                                     "(`attention`, `experts`); colocated: `workers`, each one process on one "
                                     "device holding an attention replica and an expert shard (DP attention + "
                                     "expert parallelism). docs/operations.md says when each is the better choice.")
    attention: int = Field(1, ge=1, description="Attention data-parallel replicas (disaggregated layout).")
    experts: int = Field(1, ge=1, description="Expert actors (disaggregated layout).")
    workers: int = Field(2, ge=1, description="Workers of the colocated layout, each an attention replica and a "
                                              "shard of the routed experts.")
    gpus_per_actor: float = Field(0, ge=0, description="GPUs each attention and expert actor reserves (NCCL then); "
                                                       "a fraction lets several actors share one GPU.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Compute dtype of the actors' weights "
                                                                         "and caches (quantised experts stay resident "
                                                                         "in their checkpoint format).")
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
                                                                  "(POST /admin/scale/experts) may ask for (in the "
                                                                  "colocated layout, the most workers): a "
                                                                  "larger count is refused with 400 before "
                                                                  "anything changes. Default: no limit but the "
                                                                  "model's routed experts and the cluster's room.")
    max_attention: int | None = Field(None, ge=1, description="The most attention replicas `moeray scale "
                                                              "attention` (POST /admin/scale/attention) may ask "
                                                              "for, as max_expert_actors.")
    expert_nodes: list[str] | None = Field(None, description="Pin expert actors to these Ray nodes (IPs or node "
                                                             "ids), round-robin; default: spread over nodes with room.")
    attention_nodes: list[str] | None = Field(None, description="Pin attention replicas to these Ray nodes.")
    json_whitespace: Literal["none", "flexible"] = Field(
        "none", description="Whitespace between the JSON tokens of tool-call arguments and structured output: "
                            "none (json.dumps's ', ' and ': ' only, so a weak model cannot spend its max_tokens "
                            "on blanks) or flexible (up to 12 blank characters in each gap, newlines included).")
    ingress: Literal["haproxy", "proxy"] = Field(
        "haproxy", description="HTTP in front of the Ingress replicas on a cluster `moeray up` starts: haproxy "
                               "(Serve's direct ingress behind one HAProxy per node: no Python proxy and no Ray "
                               "call per request or streamed chunk) or proxy (Serve's proxy actor). A cluster given "
                               "by --address or started by `ray up` runs what its `ray start` environment says.")
    gcs_fault_tolerance: GcsFaultTolerance | None = Field(
        None, description="Survive the head node on a cluster `moeray up` starts (`--gcs-redis`): its GCS keeps "
                          "its state in Redis, and `moeray up` starts the GCS, or the whole head node, again when "
                          "it stops; streams in flight go on. A cluster given by --address or started by `ray up` "
                          "or KubeRay is made fault tolerant where it starts (docs/operations.md).")
    speculative: dict | None = Field(
        None, description="Speculative decoding, in vLLM's speculative_config names: {method: suffix | ngram, "
                          "num_speculative_tokens: K, ...} (`moeray up --speculative-config JSON`; the keys and "
                          "their defaults: docs/architecture.md \"Speculative decoding\"). Off unless given: it "
                          "pays at low concurrency on repetitive outputs (bench/bench_spec.py).")
    disaggregation: dict | None = Field(
        None, description="Prefill/decode disaggregation: a second engine of the model prefills prompts whose "
                          "uncached part is long and their cached blocks cross to this deployment's engine, which "
                          "decodes (`moeray up --pd`). Keys, each optional: min_uncached_tokens (256), lease_s "
                          "(30), the prefill engine's layout (disaggregated), attention (1), experts (1), workers "
                          "(2) and max_tokens_per_step (2048) (docs/architecture.md \"Prefill/decode "
                          "disaggregation\"). Off unless given.")
    metrics_prefix: Literal["moeray", "vllm"] = Field(
        "moeray", description="vllm: the serving series under vLLM's names and labels (its dashboards work).")
    expert_metrics: Literal["summary", "full"] = Field(
        "summary", description="full: also the per-(layer, expert) token counter (~23k series for K2).")

    @field_validator("api_key", "admin_api_key")
    @classmethod
    def _key_is_a_token(cls, key: str | None) -> str | None:
        return None if key is None else check_key(key)

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, raw: dict | None) -> dict | None:
        from cluster.config import SpeculativeConfig

        # parsed once, here (ValueError naming the key): the engine's record is kept beside the mapping
        return None if raw is None else _ParsedSection(raw, SpeculativeConfig.parse(raw))

    @field_validator("disaggregation")
    @classmethod
    def _disaggregation(cls, raw: dict | None) -> dict | None:
        from cluster.config import DisaggregationConfig

        return None if raw is None else _ParsedSection(raw, DisaggregationConfig.parse(raw))

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
        if self.layout == "colocated":
            if self.attention != 1 or self.experts != 1:
                raise ValueError("layout colocated: give workers (each an attention replica and an expert shard), "
                                 f"not attention ({self.attention}) and experts ({self.experts})")
            if self.standby_experts:
                raise ValueError("layout colocated: its standbys are workers: give standby_attention, not "
                                 "standby_experts")
            if self.max_expert_actors is not None and self.workers > self.max_expert_actors:
                raise ValueError(f"workers ({self.workers}) is over max_expert_actors ({self.max_expert_actors})")
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
        """The engine's frozen config: each group of knobs from the keys of the same names."""
        from cluster.config import GROUPS, EngineConfig

        groups = {name: rec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(rec)
                               if f.metadata.get("serve", True)})
                  for name, rec in GROUPS.items()}
        spec = self.speculative.record if self.speculative is not None else None
        return EngineConfig(model=model_path, owner=owner, dtype=self.dtype, speculative=spec, **groups)

    def cluster_spec(self):
        from cluster.spec import ClusterSpec

        res = {"CPU": 1, **({"GPU": self.gpus_per_actor} if self.gpus_per_actor else {})}
        if self.layout == "colocated":
            nodes = self.attention_nodes or self.expert_nodes
            return ClusterSpec.of_workers(self.workers, res, tuple(nodes) if nodes else None)
        return ClusterSpec(attention=self.attention, experts=self.experts, attention_resources=res,
                           expert_resources=dict(res),
                           expert_nodes=tuple(self.expert_nodes) if self.expert_nodes else None,
                           attention_nodes=tuple(self.attention_nodes) if self.attention_nodes else None)

    def actor_count(self) -> int:
        """Every actor the deployment runs: its engine's, and the prefill engine's with ``disaggregation``."""
        spec = self.cluster_spec()
        n = spec.attention + spec.experts
        if self.disaggregation is not None:
            prefill = self.disaggregation.record.spec()
            n += prefill.attention + prefill.experts
        return n

    def name_for(self, model_path: Path) -> str:
        return self.served_model_name or (self.model if "/" not in self.model else model_path.name)



def _engine_keys() -> dict:
    """A serving-config key per engine knob (cluster/config.py), with the knob's default, bound and
    description, and the part of the engine that reads it."""
    from cluster.config import serve_knobs

    keys = {}
    for group, f, tp in serve_knobs():
        bounds = {k: f.metadata[k] for k in ("ge", "gt", "le", "lt") if k in f.metadata}
        keys[f.name] = (tp, Field(f.default, description=f.metadata["doc"], json_schema_extra={"engine": group},
                                  **bounds))
    return keys


ServeConfig = create_model("ServeConfig", __base__=_Deployment, __module__=__name__, **_engine_keys())
ServeConfig.__doc__ = _Deployment.__doc__

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
