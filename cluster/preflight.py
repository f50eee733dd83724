"""Preflight: refuse, before reserving anything, a cluster shape the live cluster cannot hold.

Owns: the check of a :class:`ClusterSpec` against the cluster's *total* resources (an empty
cluster's view: what could ever be placed) — bundle counts per node (the same planning
:func:`~cluster.spec.plan_bundles` does) and memory (each node's weights: RAM for CPU
actors, HBM of the GPU kind for GPU actors, with :mod:`cluster.planner`'s bytes; given the
engine's config, an attention replica's KDA verify buffers too, :func:`~cluster.planner.verify_buffer`)
— and a suggested shape that fits. Never: reserves, creates or kills anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from model.config import ModelConfig

from .planner import ATTENTION_WORKSPACE, DEVICES, EXPERT_WORKSPACE, GB, verify_buffer, weight_bytes
from .spec import ClusterSpec, NodeInfo, plan_bundles

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GPU_UTILIZATION = 0.9


class PreflightError(ValueError):
    """The shape cannot fit this cluster; the message has the numbers and a shape that fits."""


def _verify(cfg: ModelConfig, config, dtype_bytes: int) -> dict:
    """An attention replica's KDA verify buffers at their largest under ``config`` (an
    :class:`~cluster.config.EngineConfig`, or None: not known, not counted). A replica runs at most
    ``max_num_seqs`` sequences, and on a hybrid model at most ``num_slots`` (each holds a KDA slot)."""
    if config is None:
        return verify_buffer(cfg, None, 1, dtype_bytes)
    running = min(config.scheduler.max_num_seqs, config.cache.num_slots)
    return verify_buffer(cfg, config.speculative, running, dtype_bytes)


def _actor_bytes(cfg: ModelConfig, spec: ClusterSpec, dtype_bytes: int, verify: int = 0) -> tuple[int, int]:
    """Resident weight bytes of one attention replica (+ ``verify``: its KDA verify buffers) and of
    the most loaded expert actor; in the colocated layout, of one worker (both, and both
    workspaces) and 0."""
    w = weight_bytes(cfg, dtype_bytes)
    shards = spec.workers if spec.colocated else spec.experts
    per_actor = math.ceil(w.n_experts / shards) * w.per_expert
    attention = w.attention + ATTENTION_WORKSPACE * spec.gpus + verify
    if spec.colocated:
        return attention + per_actor + EXPERT_WORKSPACE * spec.gpus, 0
    return attention, per_actor + EXPERT_WORKSPACE * spec.gpus


def _device_memory(node: NodeInfo) -> int | None:
    """HBM per GPU of a node whose Ray ``accelerator_type:<KIND>`` resource names a known kind."""
    for key in node.available:
        if key.startswith("accelerator_type:"):
            kind = key.split(":", 1)[1].lower()
            for name, dev in DEVICES.items():
                if name in kind:
                    return dev.memory_bytes
    return None


def problems(cfg: ModelConfig, spec: ClusterSpec, nodes: Sequence[NodeInfo], dtype_bytes: int,
             verify: int = 0, tier: int = 0) -> list[str]:
    """Why ``spec`` cannot fit ``nodes`` (their total resources); empty when it can. ``verify``: each
    attention replica's KDA verify buffers (bytes); ``tier``: the KV tier's host memory on each node that holds
    an attention replica (kv_offloading_size, bytes)."""
    plan = plan_bundles(spec, nodes)
    if None in plan:
        need = {k: sum(b.get(k, 0.0) for b in spec.bundles) for k in set().union(*spec.bundles)}
        have = {k: sum(n.available.get(k, 0.0) for n in nodes) for k in need}
        return [f"{plan.count(None)} of {len(plan)} actors cannot be placed: the shape needs "
                + ", ".join(f"{k} {need[k]:g}" for k in sorted(need)) + f" ({spec.describe()}); "
                + "the cluster has " + ", ".join(f"{k} {have[k]:g}" for k in sorted(have))
                + f" over {len(nodes)} node(s)"]
    attn, expert = _actor_bytes(cfg, spec, dtype_bytes, verify)
    by_id = {n.node_id: n for n in nodes}
    load: dict[str, int] = {}
    out = []
    for i, node_id in enumerate(plan):
        kind, res = ("attention", spec.attention_resources) if i < spec.attention else ("expert", spec.expert_resources)
        need = attn if kind == "attention" else expert
        gpus = res.get("GPU", 0.0)
        hbm = _device_memory(by_id[node_id]) if gpus else None
        if gpus and hbm is not None:
            usable = int(gpus * hbm * GPU_UTILIZATION)
            if need > usable:
                what = "worker (attention + expert shard)" if spec.colocated else f"{kind} actor"
                with_verify = " and KDA verify buffers" if verify and kind == "attention" else ""
                out.append(f"a {what} needs {need / GB:.2f} GB of weights{',' if with_verify else ' and'} workspace"
                           f"{with_verify} but {gpus:g} GPU holds {usable / GB:.2f} GB usable")
        elif not gpus:
            load[node_id] = load.get(node_id, 0) + need
    tiered = set(plan[:spec.attention]) if tier else set()
    for node_id in sorted(set(load) | tiered):
        used = load.get(node_id, 0) + (tier if node_id in tiered else 0)
        mem = by_id[node_id].available.get("memory", 0.0)
        if mem and used > mem:
            what = (f"{load.get(node_id, 0) / GB:.2f} GB of weights and a {tier / 2**30:g} GiB KV tier "
                    "(kv_offloading_size)" if node_id in tiered else f"{used / GB:.2f} GB of weights")
            out.append(f"node {by_id[node_id].ip} would hold {what} but has {mem / GB:.2f} GB of memory")
    return out


def suggest(cfg: ModelConfig, spec: ClusterSpec, nodes: Sequence[NodeInfo], dtype_bytes: int,
            verify: int = 0) -> ClusterSpec | None:
    """The largest shape no bigger than ``spec`` (attention first, then experts) that fits; colocated:
    the most workers up to ``spec``'s, from the most down (fewer workers each hold more experts)."""
    if spec.colocated:
        for workers in range(spec.workers, 0, -1):
            candidate = ClusterSpec(**{**_fields(spec), "attention": workers})
            if not problems(cfg, candidate, nodes, dtype_bytes, verify):
                return candidate
        return None
    for attention in range(spec.attention, 0, -1):
        for experts in range(spec.experts, 0, -1):
            candidate = ClusterSpec(**{**_fields(spec), "attention": attention, "experts": experts})
            if not problems(cfg, candidate, nodes, dtype_bytes, verify):
                return candidate
    return None


def _fields(spec: ClusterSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


def check(cfg: ModelConfig, spec: ClusterSpec, nodes: Sequence[NodeInfo], dtype: str = "bfloat16",
          config=None) -> None:
    """Raise :class:`PreflightError` with the numbers and a suggested shape when ``spec`` cannot fit.
    ``config``: the engine's :class:`~cluster.config.EngineConfig`; with speculative decoding on a
    hybrid model, each attention replica's KDA verify buffers count too (a shape that fits only
    without them is refused naming the knobs that shrink them)."""
    dtype_bytes = DTYPE_BYTES.get(dtype, 2)
    verify = _verify(cfg, config, dtype_bytes)
    tier = config.cache.tier() if config is not None else None
    found = problems(cfg, spec, nodes, dtype_bytes, verify["total"], tier["bytes"] if tier else 0)
    if not found:
        return
    if tier and not problems(cfg, spec, nodes, dtype_bytes, verify["total"]):
        raise PreflightError(f"the cluster cannot hold {spec.describe()} with its KV tier: " + "; ".join(found)
                             + ". The tier takes kv_offloading_size of host memory on every node with an attention "
                             "replica; lower it, or give those nodes more memory")
    attn, expert = _actor_bytes(cfg, spec, dtype_bytes, verify["total"])
    w = weight_bytes(cfg, dtype_bytes)
    if verify["total"] and not problems(cfg, spec, nodes, dtype_bytes):
        s = config.speculative
        raise PreflightError(
            f"the cluster cannot hold {spec.describe()} with speculative decoding: " + "; ".join(found)
            + f". Verifying drafts keeps {verify['total'] / GB:.2f} GB of KDA state per attention replica at once "
            f"({verify['sequences']} sequences × {verify['positions']} positions at num_speculative_tokens="
            f"{s.num_speculative_tokens}, full_draft_batch={s.full_draft_batch}, up to "
            f"{min(config.scheduler.max_num_seqs, config.cache.num_slots)} sequences per replica: max_num_seqs, "
            f"num_slots); without it the shape fits. Lower speculative num_speculative_tokens "
            f"or full_draft_batch (`moeray plan --speculative-config` shows the bytes), or turn speculative off")
    better = suggest(cfg, spec, nodes, dtype_bytes, verify["total"])
    if better is None:
        hint = "no smaller shape fits either; add nodes or memory (see `moeray plan`)"
    elif spec.colocated:
        hint = f"a shape that fits: --layout colocated --workers {better.workers}"
    else:
        hint = f"a shape that fits: --attention {better.attention} --experts {better.experts}"
    per = (f"{attn:,} B per worker (attention + expert shard)" if spec.colocated
           else f"{attn:,} B per attention replica, {expert:,} B per expert actor")
    raise PreflightError(
        f"the cluster cannot hold {spec.describe()}: " + "; ".join(found)
        + f". Planner: {w.total:,} B of weights in the checkpoint; {per}. {hint}")


def cluster_nodes() -> list[NodeInfo]:
    """Alive nodes of the connected Ray cluster with their *total* resources."""
    import ray

    return [NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"])) for n in ray.nodes() if n["Alive"]]


def preflight(cfg: ModelConfig, spec: ClusterSpec, dtype: str = "bfloat16", config=None) -> None:
    """:func:`check` against the connected cluster (what ``Engine.start`` and ``moeray up`` call first)."""
    check(cfg, spec, cluster_nodes(), dtype, config)
