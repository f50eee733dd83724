"""Capacity planner: will a model fit a cluster shape, and what would? Pure arithmetic on the config.

Owns: per-tensor weight bytes in the checkpoint's real format (``quantization_config``) and as
resident on each actor kind (quantised weights stay in checkpoint format, :mod:`model.qweights`;
everything else in the serving dtype; ``kv_b_proj`` dequantised for the absorbed path), the
per-sequence cache/state bytes, the KDA verify buffers of speculative decoding (:func:`verify_buffer`),
the device layout of a shape, and a decode roofline.
Never: talks to Ray, reads files other than a config, or decides anything at run time —
:mod:`cluster.preflight` applies it to a live cluster.

Layout of a shape on ``nodes × gpus_per_node`` devices: each attention replica takes one whole
device; the expert actors share the remaining devices evenly (``experts_per_device`` actors each
reserving ``1 / experts_per_device`` of a GPU). A device can use ``utilization`` of its memory;
an attention device's rest after weights, workspace, KDA snapshots and KDA verify buffers is its
latent cache / KDA state.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from model.config import ModelConfig
from model.names import is_fp32, is_quantized, is_routed_expert, tensor_specs
from model.params import cache_bytes_per_token, state_bytes_per_sequence, verify_state_bytes

from .config import SpeculativeConfig

GB = 10**9


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int  # HBM (or RAM for "cpu") per device
    bandwidth: float  # bytes/s


def _devices() -> dict[str, Device]:
    """The GPUs of cluster/gpus/*.json (the cost model's data: one source for both), and a CPU node."""
    from .costmodel import gpu_names, load_gpu

    out = {}
    for name in gpu_names():
        g = load_gpu(name)
        out[name] = Device(g.name, int(g.hbm_bytes), g.hbm_bytes_per_s)
    return out | {"cpu": Device("CPU node", 512 * GB, 0.2e12)}


DEVICES = _devices()
DENSE_RESIDENT = ("kv_b_proj.weight",)  # kept dequantised on the attention side (MODEL_SPEC §1.9)
ATTENTION_WORKSPACE = 4 * 2**30  # activations, logits, NCCL buffers of one attention replica
EXPERT_WORKSPACE = 2**30  # activations and a dequantised tile of one expert actor


def stored_bytes(name: str, shape: tuple[int, ...], cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of one logical tensor in the checkpoint: quantised parts (+ scales) or ``dtype_bytes``
    per element (fp32 for the router bias and KDA's A_log/dt_bias)."""
    method = cfg.quant.method if cfg.quant else None
    if not is_quantized(name, method):
        return math.prod(shape) * (4 if is_fp32(name) else dtype_bytes)
    out, inp = shape
    if method == "fp8":
        bo, bi = cfg.quant.block_size
        return out * inp + 4 * math.ceil(out / bo) * math.ceil(inp / bi)
    g = cfg.quant.group_size
    if method == "int4":  # int32 words of 8 nibbles + bf16 group scales
        return 4 * out * math.ceil(inp / 8) + 2 * out * math.ceil(inp / g)
    return out * (inp // 2) + out * math.ceil(inp / g)  # mxfp4: byte pairs + E8M0 scales


@dataclass(frozen=True)
class WeightBytes:
    """``total``: the checkpoint's weight bytes. ``routed_experts``/``per_expert``: all routed experts /
    one logical expert over every MoE layer, as stored and as resident. ``attention``: what one
    attention replica holds (everything but routed experts), resident in the serving dtype."""

    total: int
    routed_experts: int
    per_expert: int
    attention: int
    n_experts: int


@functools.lru_cache(maxsize=64)
def weight_bytes(cfg: ModelConfig, dtype_bytes: int = 2) -> WeightBytes:
    """The model's weight bytes by part (a walk over every tensor name: K2 has 630k; remembered per
    config, since planning a shape asks for them once per candidate)."""
    total = routed = attention = 0
    for name, shape in tensor_specs(cfg).items():
        stored = stored_bytes(name, shape, cfg)
        total += stored
        if is_routed_expert(name) is not None:
            routed += stored
            continue
        quant = is_quantized(name, cfg.quant.method if cfg.quant else None)
        dense = not quant or name.endswith(DENSE_RESIDENT)
        attention += math.prod(shape) * (4 if is_fp32(name) else dtype_bytes) if dense else stored
    n = cfg.n_routed_experts
    return WeightBytes(total, routed, routed // n if n else 0, attention, n)


def sequence_bytes(cfg: ModelConfig, context: int, dtype_bytes: int = 2) -> dict:
    """Cache/state bytes of one sequence at ``context`` tokens: the MLA latent cache grows with it,
    the KDA state (K3, Kimi Linear) does not."""
    latent = cache_bytes_per_token(cfg, dtype_bytes)["latent"]
    kda = state_bytes_per_sequence(cfg, dtype_bytes)["total"]
    return {"latent_per_token": latent, "kda_state": kda, "total": context * latent + kda}


def verify_buffer(cfg: ModelConfig, speculative: SpeculativeConfig | None, max_num_seqs: int,
                  dtype_bytes: int = 2) -> dict:
    """The most KDA state one attention replica holds at once while verifying drafts
    (:func:`model.params.verify_state_bytes`; all 0 without KDA layers or drafts). How many
    sequences draft together and how far is the scheduler's adaptive length
    (:meth:`SpeculativeConfig.draft_length`): with n sequences decoding each may carry that many
    drafts, all of them on one replica at worst, so the bound is the largest verification over
    n = 1 … ``max_num_seqs``. Not n = 1: with K = 4 and ``full_draft_batch`` 2, 8 sequences with one
    draft each (16 positions) hold more than 2 with four (10)."""
    best = verify_state_bytes(cfg, 0, 0, dtype_bytes)
    if speculative is None or not cfg.kda_layers:
        return best
    most = speculative.num_speculative_tokens * speculative.full_draft_batch  # beyond, no sequence drafts
    for n in range(1, min(max_num_seqs, most) + 1):
        drafts = speculative.draft_length(n)
        if drafts > 0:
            v = verify_state_bytes(cfg, n, 1 + drafts, dtype_bytes)
            if v["total"] > best["total"]:
                best = v
    return best


def _verify_hint(speculative: SpeculativeConfig | None, verify: dict) -> str:
    """What a 'does not fit' says of the verify buffers, with the knobs that shrink them."""
    if not verify["total"]:
        return ""
    return (f" and {verify['total'] / GB:.1f} GB of KDA verify buffers ({verify['sequences']} sequences × "
            f"{verify['positions']} positions at speculative num_speculative_tokens="
            f"{speculative.num_speculative_tokens}, full_draft_batch={speculative.full_draft_batch}; lower them)")


def _room(cfg: ModelConfig, left: int, context: int, dtype_bytes: int, max_num_seqs: int,
          speculative: SpeculativeConfig | None, device: str, after: str) -> tuple[dict, str | None, int]:
    """A device's room for sequences out of the ``left`` bytes its weights (``after``), workspace and
    snapshots leave: (the :class:`Plan`'s fields for it, the problem when not one sequence fits — the
    ``device`` named —, the decode batch the roofline takes)."""
    verify = verify_buffer(cfg, speculative, max_num_seqs, dtype_bytes)
    cache = left - verify["total"]
    seq = sequence_bytes(cfg, context, dtype_bytes)
    concurrent = max(cache, 0) // seq["total"]
    problem = None if concurrent >= 1 else (
        f"{device} has {max(cache, 0) / GB:.1f} GB for caches after {after}{_verify_hint(speculative, verify)}: "
        f"not one sequence of {context:,} tokens ({seq['total'] / GB:.2f} GB)")
    fields = dict(verify=verify, cache_bytes=max(cache, 0), sequence_bytes=seq, concurrent_sequences=int(concurrent))
    return fields, problem, max(1, min(concurrent, max_num_seqs))


@dataclass(frozen=True)
class Plan:
    model: str
    quant: str
    device: str
    nodes: int
    gpus_per_node: int
    attention: int
    experts: int
    experts_per_device: int
    gpus_per_expert_actor: float
    context: int
    total_weight_bytes: int
    routed_expert_bytes: int
    attention_weight_bytes: int  # per attention replica, resident
    expert_actor_weight_bytes: int  # the most loaded expert actor, resident
    expert_device_bytes: int  # weights + workspace on the fullest expert device
    usable_device_bytes: int
    cache_bytes: int  # per attention replica, left for sequences
    snapshot_bytes: int  # per attention replica, KDA state snapshots for prefix caching (hybrid models)
    sequence_bytes: dict
    concurrent_sequences: int
    decode: dict
    fits: bool
    problems: tuple[str, ...]
    layout: str = "disaggregated"  # or "colocated": `attention` = `experts` = the workers, one per device
    # per attention replica (worker), transient: speculative decoding's KDA verify buffers at their
    # largest (verify_buffer; all 0 without drafts or KDA layers), taken from the room for sequences
    verify: dict = field(default_factory=lambda: dict.fromkeys(("sequences", "positions", "kept", "stacking",
                                                                "total"), 0))

    def to_dict(self) -> dict:
        return asdict(self)


def _plan_inputs(cfg: ModelConfig, device: Device, dtype_bytes: int, utilization: float,
                 **counts: int) -> tuple[WeightBytes, int, int]:
    """Both layouts' plans: every count >= 1 and the utilization in (0, 1] (else ValueError naming it);
    the weight bytes, the devices (nodes × GPUs per node) and each device's usable bytes."""
    for name, v in counts.items():
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    return (weight_bytes(cfg, dtype_bytes), counts["nodes"] * counts["gpus_per_node"],
            int(device.memory_bytes * utilization))


def plan_shape(cfg: ModelConfig, *, model: str, device: Device, nodes: int, gpus_per_node: int, attention: int,
               experts: int, context: int, dtype_bytes: int = 2, utilization: float = 0.9,
               link_gbps: float = 400.0, max_num_seqs: int = 256, snapshot_bytes: int = 0,
               speculative: SpeculativeConfig | None = None) -> Plan:
    """The arithmetic of one shape; ``problems`` says why it does not fit (empty when it does).
    ``snapshot_bytes``: KDA state snapshots per attention replica (prefix caching on a hybrid
    model; ignored without KDA layers), taken from the room for sequences. ``speculative``: drafts
    are verified, whose KDA verify buffers (:func:`verify_buffer`, hybrid models) are taken from it too."""
    w, devices, usable = _plan_inputs(cfg, device, dtype_bytes, utilization, nodes=nodes, gpus_per_node=gpus_per_node,
                                      attention=attention, experts=experts, context=context)
    problems = []
    expert_devices = devices - attention
    if expert_devices < 1:
        problems.append(f"{attention} attention replicas take all {devices} devices, none is left for experts")
        expert_devices = 1
    per_device = math.ceil(experts / expert_devices)
    per_actor = math.ceil(w.n_experts / experts) * w.per_expert
    expert_device = per_device * (per_actor + EXPERT_WORKSPACE)
    if expert_device > usable:
        problems.append(f"an expert device would hold {per_device} actor(s) × {per_actor / GB:.1f} GB of experts "
                        f"+ workspace = {expert_device / GB:.1f} GB > {usable / GB:.1f} GB usable")
    snapshots = snapshot_bytes if cfg.kda_layers else 0
    room, problem, batch = _room(cfg, usable - w.attention - ATTENTION_WORKSPACE - snapshots, context, dtype_bytes,
                                 max_num_seqs, speculative, "an attention device", f"{w.attention / GB:.1f} GB of weights")
    problems += [problem] if problem else []
    return Plan(
        model=model, quant=cfg.quant.method if cfg.quant else "none", device=device.name, nodes=nodes,
        gpus_per_node=gpus_per_node, attention=attention, experts=experts, experts_per_device=per_device,
        gpus_per_expert_actor=round(1 / per_device, 6), context=context, total_weight_bytes=w.total,
        routed_expert_bytes=w.routed_experts, attention_weight_bytes=w.attention, expert_actor_weight_bytes=per_actor,
        expert_device_bytes=expert_device, usable_device_bytes=usable, snapshot_bytes=snapshots, **room,
        decode=decode_roofline(cfg, w, device, attention, expert_devices, batch, context, dtype_bytes, link_gbps),
        fits=not problems, problems=tuple(problems))


def plan_colocated(cfg: ModelConfig, *, model: str, device: Device, nodes: int, gpus_per_node: int, workers: int,
                   context: int, dtype_bytes: int = 2, utilization: float = 0.9, link_gbps: float = 400.0,
                   max_num_seqs: int = 256, snapshot_bytes: int = 0,
                   speculative: SpeculativeConfig | None = None) -> Plan:
    """The colocated layout: ``workers`` devices, each holding an attention replica (its weights, its
    sequences' caches) and 1/workers of the routed experts. Per device: attention weights + the expert
    shard + both workspaces (+ KDA snapshots, + KDA verify buffers with ``speculative``); what is left
    holds the latent cache. ``problems`` says
    why it does not fit (a shard that does not fit a device, more workers than devices, no room for
    one sequence)."""
    w, devices, usable = _plan_inputs(cfg, device, dtype_bytes, utilization, nodes=nodes, gpus_per_node=gpus_per_node,
                                      workers=workers, context=context)
    problems = []
    if workers > devices:
        problems.append(f"{workers} workers need {workers} devices; the cluster has {devices}")
    if workers > max(w.n_experts, 1):
        problems.append(f"{workers} workers for {w.n_experts} routed experts: a worker would hold none")
    shard = math.ceil(w.n_experts / workers) * w.per_expert
    snapshots = snapshot_bytes if cfg.kda_layers else 0
    resident = w.attention + shard + ATTENTION_WORKSPACE + EXPERT_WORKSPACE
    if resident > usable:
        problems.append(f"a worker device would hold {w.attention / GB:.1f} GB of attention weights + "
                        f"{shard / GB:.1f} GB of experts (its 1/{workers} shard) + workspace = {resident / GB:.1f} GB "
                        f"> {usable / GB:.1f} GB usable: use more workers")
    room, problem, batch = _room(cfg, usable - resident - snapshots, context, dtype_bytes, max_num_seqs, speculative,
                                 "a worker device", "its weights")
    problems += [problem] if problem and resident <= usable else []
    return Plan(
        model=model, quant=cfg.quant.method if cfg.quant else "none", device=device.name, nodes=nodes,
        gpus_per_node=gpus_per_node, attention=workers, experts=workers, experts_per_device=1,
        gpus_per_expert_actor=1.0, context=context, total_weight_bytes=w.total, routed_expert_bytes=w.routed_experts,
        attention_weight_bytes=w.attention, expert_actor_weight_bytes=shard, expert_device_bytes=resident,
        usable_device_bytes=usable, snapshot_bytes=snapshots, **room,
        decode=decode_roofline(cfg, w, device, workers, workers, batch, context, dtype_bytes, link_gbps),
        fits=not problems, problems=tuple(problems), layout="colocated")


def decode_roofline(cfg: ModelConfig, w: WeightBytes, device: Device, attention: int, expert_devices: int,
                    batch: int, context: int, dtype_bytes: int, link_gbps: float) -> dict:
    """One decode step with ``batch`` sequences per attention replica at ``context`` tokens: bytes each
    device must read (attention: weights + caches; experts: the distinct experts the step's tokens
    touch, expected value under uniform routing) ÷ HBM bandwidth, and the all-to-all bytes each
    attention replica sends and receives (dispatch + combine of k rows per token per MoE layer)
    ÷ the link bandwidth."""
    tokens = batch * attention
    n, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    moe_layers = len(cfg.moe_layers)
    touched = n * (1 - (1 - k / n) ** tokens) if n else 0  # distinct experts per layer
    expert_bytes = touched * w.per_expert / expert_devices  # per_expert spans every MoE layer
    attn_bytes = w.attention + batch * sequence_bytes(cfg, context, dtype_bytes)["total"]
    hbm_s = max(attn_bytes, expert_bytes) / device.bandwidth
    a2a_bytes = batch * k * cfg.expert_hidden_size * dtype_bytes * 2 * moe_layers
    link_s = a2a_bytes / (link_gbps * 1e9 / 8)
    step_s = hbm_s + link_s
    return {"batch_per_replica": batch, "attention_bytes_per_step": int(attn_bytes),
            "expert_bytes_per_step_per_device": int(expert_bytes), "hbm_s": hbm_s,
            "all_to_all_bytes_per_step_per_replica": int(a2a_bytes), "link_gbps": link_gbps, "link_s": link_s,
            "step_s": step_s, "tokens_per_s": tokens / step_s}


def propose(cfg: ModelConfig, *, nodes: int, gpus_per_node: int, **kw) -> Plan | None:
    """The smallest shape that fits: one attention replica and the fewest expert actors (one per
    remaining device) whose experts fit; None when none does."""
    for experts in range(1, nodes * gpus_per_node):
        plan = plan_shape(cfg, nodes=nodes, gpus_per_node=gpus_per_node, attention=1, experts=experts, **kw)
        if plan.fits:
            return plan
    return None


def _after(plan: Plan) -> str:
    """What came out of a device's room for sequences besides weights and workspace."""
    v = plan.verify
    parts = [f"{plan.snapshot_bytes / GB:.1f} GB of KDA snapshots"] if plan.snapshot_bytes else []
    if v["total"]:
        parts.append(f"{v['total'] / GB:.1f} GB of KDA verify buffers, transient: {v['sequences']} sequences × "
                     f"{v['positions']} positions with drafts")
    return f" (after {' and '.join(parts)})" if parts else ""


def format_plan(plan: Plan, proposal: Plan | None) -> str:
    if plan.layout == "colocated":
        return _format_colocated(plan)
    d = plan.decode
    lines = [
        f"{plan.model} ({plan.quant}) on {plan.nodes} × {plan.gpus_per_node} {plan.device}: "
        f"{plan.attention} attention + {plan.experts} expert actors "
        f"({plan.experts_per_device} per device, {plan.gpus_per_expert_actor:g} GPU each)",
        f"  weights: {plan.total_weight_bytes:,} B in the checkpoint, routed experts {plan.routed_expert_bytes:,} B",
        f"  attention replica: {plan.attention_weight_bytes / GB:.1f} GB weights, {plan.cache_bytes / GB:.1f} GB "
        f"for sequences{_after(plan)}; "
        f"{plan.sequence_bytes['total'] / 2**20:,.1f} MiB per sequence at {plan.context:,} tokens "
        f"(latent {plan.sequence_bytes['latent_per_token']:,} B/token, KDA state {plan.sequence_bytes['kda_state']:,} B)"
        f" → {plan.concurrent_sequences:,} concurrent sequences",
        f"  expert actor: {plan.expert_actor_weight_bytes / GB:.1f} GB weights; fullest expert device "
        f"{plan.expert_device_bytes / GB:.1f} of {plan.usable_device_bytes / GB:.1f} GB usable",
        f"  decode roofline (batch {d['batch_per_replica']} per replica): HBM {d['hbm_s'] * 1e3:.2f} ms + "
        f"all-to-all {d['link_s'] * 1e3:.2f} ms at {d['link_gbps']:g} Gb/s → ~{d['tokens_per_s']:,.0f} tok/s",
        "  fits: yes" if plan.fits else "  fits: NO — " + "; ".join(plan.problems),
    ]
    if proposal is not None:
        lines.append(f"  smallest shape that fits: --attention {proposal.attention} --experts {proposal.experts} "
                     f"({proposal.attention + proposal.experts} devices)")
    elif not plan.fits:
        lines.append("  no shape fits these devices")
    return "\n".join(lines)


def _format_colocated(plan: Plan) -> str:
    d = plan.decode
    return "\n".join([
        f"{plan.model} ({plan.quant}) on {plan.nodes} × {plan.gpus_per_node} {plan.device}: colocated, "
        f"{plan.attention} workers (one per device, each an attention replica and 1/{plan.attention} of the experts)",
        f"  weights: {plan.total_weight_bytes:,} B in the checkpoint, routed experts {plan.routed_expert_bytes:,} B",
        f"  per device: {plan.attention_weight_bytes / GB:.1f} GB attention + {plan.expert_actor_weight_bytes / GB:.1f} GB "
        f"experts + workspace = {plan.expert_device_bytes / GB:.1f} of {plan.usable_device_bytes / GB:.1f} GB usable; "
        f"{plan.cache_bytes / GB:.1f} GB for sequences{_after(plan)}; "
        f"{plan.sequence_bytes['total'] / 2**20:,.1f} MiB per sequence at {plan.context:,} tokens → "
        f"{plan.concurrent_sequences:,} concurrent sequences per worker",
        f"  decode roofline (batch {d['batch_per_replica']} per worker): HBM {d['hbm_s'] * 1e3:.2f} ms + "
        f"all-to-all {d['link_s'] * 1e3:.2f} ms at {d['link_gbps']:g} Gb/s → ~{d['tokens_per_s']:,.0f} tok/s",
        "  fits: yes" if plan.fits else "  fits: NO — " + "; ".join(plan.problems),
    ])
