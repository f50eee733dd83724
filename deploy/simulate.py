"""`moeray simulate`: the simulator (cluster/capacity/simulator.py) from the command line — one shape, or a
search over the splits of N devices for a latency target — printed as a table, as JSON, or drawn
(tokens/s per GPU against ITL, the Pareto front marked). On ``--gpu cpu`` the step costs come from
this machine's profile (``--profile`` makes it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

COLUMNS = ("attention", "experts", "redundant_slots", "standbys", "gpus", "tokens_per_s", "tokens_per_s_per_gpu",
           "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "imbalance")


@dataclass(frozen=True)
class SimArgs:
    gpu: str
    gpus: int | None
    attention: int | None
    experts: int | None
    redundant_slots: tuple[int, ...]
    standbys: int
    ping_pong: bool
    colocated: bool
    search: bool
    tpot_ms: float | None
    ttft_ms: float | None
    rate: float | None  # None: capacity at --tpot-ms on a search, 4 requests/s otherwise
    requests: int
    prompt_tokens: int | tuple[int, int]
    output_tokens: int | tuple[int, int]
    trace: Path | None
    routing: Path | None
    skew: float
    seed: int
    max_num_seqs: int
    max_tokens_per_step: int
    block_size: int
    cpu_profile: Path
    failures_per_hour: float = 0.0
    micro_batches: int = 1
    exchange: str = "moeray"
    pd_prefill: str | None = None  # prefill/decode disaggregation: the prefill pool's shape (`N` or `AxE`)
    pd: bool = False  # with --search: size the prefill and decode pools of --gpus
    min_uncached_tokens: int = 256
    link_gbps: float = 400.0


def plan_for(model_cfg, gpu: str, shape, context: int):
    """The planner's arithmetic for ``shape`` in its own layout, on exactly its devices: colocated,
    ``plan_colocated`` (each device an attention replica and its expert shard); disaggregated,
    ``plan_shape`` (attention devices, and the expert actors and standbys on the rest)."""
    from cluster.planner import DEVICES, plan_colocated, plan_shape

    device = DEVICES[gpu]
    if shape.colocated:
        return plan_colocated(model_cfg, model="simulated", device=device, nodes=1, gpus_per_node=shape.devices,
                              workers=shape.attention, context=context)
    return plan_shape(model_cfg, model="simulated", device=device, nodes=1, gpus_per_node=shape.devices,
                      attention=shape.attention, experts=shape.experts + shape.standbys, context=context)


def engine_config(model_cfg, a: SimArgs, cpu: bool, shape=None):
    """The engine settings a deployment of this model would run with: on GPUs the cache blocks that
    fit one attention device of ``shape``'s layout after what it holds (the planner's arithmetic:
    a colocated device also holds its expert shard)."""
    from cluster.config import EngineConfig
    from model.params import cache_bytes_per_token

    if cpu:
        return EngineConfig.of(model="simulated", max_num_seqs=a.max_num_seqs, max_tokens_per_step=a.max_tokens_per_step)
    plan = plan_for(model_cfg, a.gpu, shape, _top(a.prompt_tokens) + _top(a.output_tokens))
    per_block = cache_bytes_per_token(model_cfg)["latent"] * a.block_size
    blocks = max(1, plan.cache_bytes // max(per_block, 1))
    return EngineConfig.of(model="simulated", block_size=a.block_size, num_blocks=int(min(blocks, 10_000_000)),
                           max_num_seqs=a.max_num_seqs, max_tokens_per_step=a.max_tokens_per_step)


def fits(model_cfg, gpu: str, shape, context: int = 4096) -> bool:
    """The planner's verdict on the shape in its layout (weights, workspace, one sequence of ``context``)."""
    return plan_for(model_cfg, gpu, shape, context).fits


def _top(n: int | tuple[int, int]) -> int:
    return n if isinstance(n, int) else n[1]


def expert_actor_bytes(model_cfg, shape) -> float:
    """One expert actor's weights (what a cold replacement loads)."""
    from cluster.planner import weight_bytes

    return weight_bytes(model_cfg).routed_experts / shape.experts


def lengths(text: str, flag: str) -> int | tuple[int, int]:
    """``N`` or ``LO:HI`` (uniform)."""
    try:
        lo, _, hi = text.partition(":")
        return (int(lo), int(hi)) if hi else int(lo)
    except ValueError:
        raise ValueError(f"{flag} must be N or LO:HI (tokens), got {text!r}") from None


def run(model_cfg, a: SimArgs) -> list[dict]:
    """Simulate what the arguments ask; one summary per shape (with ``ok`` and ``pareto`` on a search)."""
    from cluster.costmodel import load_gpu
    from cluster.capacity.search import capacity_search, search
    from cluster.capacity.simulator import Routing, Simulator
    from cluster.capacity.stepcost import CpuCost, GpuCost, Shape
    from cluster.capacity.workload import poisson_failures, poisson_workload, trace_workload

    cpu = a.gpu == "cpu"
    if cpu:
        cost = CpuCost.load(a.cpu_profile)
        cost_for = lambda shape: cost  # noqa: E731
    else:
        gpu = load_gpu(a.gpu)
        cost_for = lambda shape: GpuCost(model_cfg, gpu, shape, exchange=a.exchange)  # noqa: E731
    context = _top(a.prompt_tokens) + _top(a.output_tokens)
    k, E, L = model_cfg.num_experts_per_tok, model_cfg.n_routed_experts, len(model_cfg.moe_layers)
    routing = (Routing.from_json(a.routing, k) if a.routing else
               Routing.power_law(L, E, k, a.skew, seed=a.seed) if a.skew else Routing.uniform(L, E, k))
    if a.search and (not a.gpus or a.gpus < 2):
        raise ValueError("--search needs --gpus N (at least 2): it tries every split of N devices")
    if a.search and a.rate is None and a.trace is None and not cpu:
        if a.tpot_ms is None:
            raise ValueError("--search measures capacity at a latency target: give --tpot-ms (or --rate for an "
                             "offered load instead)")
        rows = capacity_search(model_cfg, a.gpus, cost_for, plan_for=lambda shape: plan_for(model_cfg, a.gpu, shape, context),
                               tpot_s=a.tpot_ms / 1e3, context=_top(a.prompt_tokens), output_tokens=_top(a.output_tokens),
                               routing=routing, redundant_slots=a.redundant_slots, seed=a.seed)
        return [r | {"exchange": a.exchange} for r in rows]
    rate = 4.0 if a.rate is None else a.rate
    workload = (trace_workload(a.trace) if a.trace else
                poisson_workload(rate, a.requests, a.prompt_tokens, a.output_tokens, seed=a.seed))
    span = max(r.arrival_s for r in workload)  # failures drawn over the arrivals' span
    if a.search:
        return search(model_cfg, a.gpus, cost_for, workload, config=lambda shape: engine_config(model_cfg, a, cpu, shape),
                      routing=routing, redundant_slots=a.redundant_slots, seed=a.seed,
                      tpot_s=None if a.tpot_ms is None else a.tpot_ms / 1e3,
                      ttft_s=None if a.ttft_ms is None else a.ttft_ms / 1e3,
                      fits=None if cpu else lambda shape: fits(model_cfg, a.gpu, shape, context))
    if a.attention is None or a.experts is None:
        raise ValueError("give a shape (--attention and --experts), or --search with --gpus")
    out = []
    for r in a.redundant_slots:
        shape = Shape(a.attention, a.experts, r, a.standbys, a.ping_pong, colocated=a.colocated,
                      micro_batches=a.micro_batches)
        config = engine_config(model_cfg, a, cpu, shape)
        failures = poisson_failures(a.failures_per_hour, span, shape, seed=a.seed)
        out.append(Simulator(model_cfg, shape, cost_for(shape), config=config, routing=routing, seed=a.seed,
                             failures=failures, weight_bytes_per_actor=expert_actor_bytes(model_cfg, shape)
                             ).run(workload).summary() | {"exchange": "profiled" if cpu else a.exchange})
    return out


def table(rows: list[dict]) -> "object":
    from rich.table import Table

    t = Table("attention", "experts", "colocated", "micro-batches", "redundant", "standbys", "GPUs", "batch", "tok/s",
              "tok/s/GPU", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "imbalance",
              *(("meets", "Pareto") if "ok" in rows[0] else ()))
    for r in rows:
        batch = f"{r['batch_mean']:,.1f}" + (f" / {r['kv_sequences']:,}" if "kv_sequences" in r else "")
        t.add_row(str(r["attention"]), str(r["experts"]), "yes" if r["colocated"] else "", str(r["micro_batches"]),
                  str(r["redundant_slots"]), str(r["standbys"]), str(r["gpus"]), batch,
                  f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_per_gpu']:,.1f}", f"{r['ttft_p50_s'] * 1e3:,.1f} ms",
                  f"{r['ttft_p99_s'] * 1e3:,.1f} ms", f"{r['itl_p50_s'] * 1e3:,.2f} ms", f"{r['itl_p99_s'] * 1e3:,.2f} ms",
                  f"{r['imbalance']:.3f}", *(("yes" if r["ok"] else "no", "★" if r["pareto"] else "")
                                             if "ok" in r else ()))
    return t


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Tokens/s per GPU against ITL p50, one point per shape, the Pareto front joined."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'moeray[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["itl_p50_s"] * 1e3 for r in rows]
    ys = [r["tokens_per_s_per_gpu"] for r in rows]
    ax.scatter(xs, ys, color="tab:gray", label="shapes tried")
    for r, x, y in zip(rows, xs, ys):
        ax.annotate((f"{r['gpus']}×(A+E)" if r["colocated"] else f"{r['attention']}A×{r['experts']}E")
                    + (f"+{r['redundant_slots']}r" if r["redundant_slots"] else ""),
                    (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = sorted((x, y) for r, x, y in zip(rows, xs, ys) if r.get("pareto", True))
    if front:
        ax.plot(*zip(*front), color="tab:red", marker="o", label="Pareto front")
    ax.set_xlabel("ITL p50 (ms)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def dump(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2)


# ---- prefill/decode disaggregation (cluster/capacity/pd.py) ---------------------------------------
def pool_shape(text: str, flag: str = "--pd-prefill"):
    """``N`` (N colocated workers) or ``AxE`` (A attention replicas, E expert actors)."""
    from cluster.capacity.stepcost import Shape

    try:
        if "x" in text.lower():
            a, e = (int(x) for x in text.lower().split("x"))
            shape = Shape(a, e)
        else:
            n = int(text)
            shape = Shape(n, n, colocated=True)
    except ValueError:
        raise ValueError(f"{flag} must be N (colocated workers) or AxE (attention replicas x expert actors), "
                         f"got {text!r}") from None
    if shape.attention < 1 or shape.experts < 1:
        raise ValueError(f"{flag} needs at least one device per kind, got {text!r}")
    return shape


def run_pd(model_cfg, a: SimArgs) -> list[dict]:
    """Prefill/decode disaggregation against one engine on all the devices (the colocated layout), under one
    workload: the pools of ``--pd-prefill`` and the decode shape given, or with ``--search`` every split of
    ``--gpus`` into a colocated prefill pool and a colocated decode pool that both fit (at most 8, spread).
    Each engine's --max-num-seqs and --max-tokens-per-step are per attention replica here (times its replicas),
    so that pools of every size run at the same load per device. Each row says whether it meets --tpot-ms (ITL p50 and p99) and --ttft-ms (TTFT p50), ``best`` marks the
    most tokens/s per GPU among those that do, and ``pays`` on each PD row: it meets the targets and serves more
    per GPU than one engine (or meets them where one engine does not)."""
    from cluster.capacity.pd import Link, PDSimulator
    from cluster.capacity.search import split_grid
    from cluster.capacity.simulator import Simulator
    from cluster.capacity.stepcost import GpuCost, Shape
    from cluster.capacity.workload import poisson_workload, trace_workload
    from cluster.costmodel import load_gpu

    if a.gpu == "cpu":
        raise ValueError("prefill/decode disaggregation is simulated on GPUs (--gpu h200, ...), not from a CPU profile")
    gpu = load_gpu(a.gpu)
    context = _top(a.prompt_tokens) + _top(a.output_tokens)

    def sim(shape):
        # pools of every size at the same load per device: --max-num-seqs and --max-tokens-per-step per replica
        per = replace(a, max_num_seqs=a.max_num_seqs * shape.attention,
                      max_tokens_per_step=a.max_tokens_per_step * shape.attention)
        return Simulator(model_cfg, shape, GpuCost(model_cfg, gpu, shape, exchange=a.exchange),
                         config=engine_config(model_cfg, per, False, shape), seed=a.seed)

    def fit(shape) -> bool:
        return fits(model_cfg, a.gpu, shape, context)

    if a.search:
        if not a.gpus or a.gpus < 2:
            raise ValueError("--pd --search needs --gpus N (at least 2): it tries every split into two pools")
        sizes = [p for p in range(1, a.gpus) if fit(Shape(p, p, colocated=True))
                 and fit(Shape(a.gpus - p, a.gpus - p, colocated=True))]
        if not sizes:
            raise ValueError(f"no split of {a.gpus} devices into two colocated pools fits this model")
        pools = [(Shape(p, p, colocated=True), Shape(a.gpus - p, a.gpus - p, colocated=True))
                 for p in split_grid(sizes, 8)]
        total = a.gpus
    else:
        if a.pd_prefill is None or a.attention is None or a.experts is None:
            raise ValueError("give the prefill pool (--pd-prefill N or AxE) and the decode pool (--attention and "
                             "--experts, --colocated), or --pd --search with --gpus")
        decode = Shape(a.attention, a.experts, colocated=a.colocated)
        pools = [(pool_shape(a.pd_prefill), decode)]
        for name, shape in zip(("prefill", "decode"), pools[0]):
            if not fit(shape):
                raise ValueError(f"the {name} pool ({_label(shape)}) does not fit this model on {a.gpu}: "
                                 f"`moeray plan` says why")
        total = pools[0][0].devices + decode.devices
    rate = 4.0 if a.rate is None else a.rate
    workload = (trace_workload(a.trace) if a.trace else
                poisson_workload(rate, a.requests, a.prompt_tokens, a.output_tokens, seed=a.seed))
    link = Link(gbps=a.link_gbps)
    rows = [PDSimulator(sim(p), sim(d), min_uncached_tokens=a.min_uncached_tokens, link=link).run(workload)
            for p, d in pools]
    alone = Shape(total, total, colocated=True)
    if fit(alone):
        rows.append(sim(alone).run(workload).summary() | {"layout": "one engine", "prefill": "", "decode": f"{total} colocated"})
    for r in rows:
        r["exchange"] = a.exchange
        r["meets"] = ((a.tpot_ms is None or max(r["itl_p50_s"], r["itl_p99_s"]) * 1e3 <= a.tpot_ms)
                      and (a.ttft_ms is None or r["ttft_p50_s"] * 1e3 <= a.ttft_ms))
    meeting = [r for r in rows if r["meets"]]
    best = max(meeting, key=lambda r: r["tokens_per_s_per_gpu"]) if meeting else None
    one = rows[-1] if rows[-1]["layout"] == "one engine" else None
    for r in rows:
        r["best"] = r is best
        if r["layout"] == "pd":
            r["pays"] = r["meets"] and (one is None or not one["meets"]
                                        or r["tokens_per_s_per_gpu"] > one["tokens_per_s_per_gpu"])
    return rows


def _label(shape) -> str:
    return f"{shape.attention} colocated workers" if shape.colocated else f"{shape.attention}x{shape.experts}"


def pd_table(rows: list[dict]) -> "object":
    from rich.table import Table

    t = Table("layout", "prefill", "decode", "GPUs", "tok/s", "tok/s/GPU", "TTFT p50", "TTFT p99", "ITL p50",
              "ITL p99", "transfer p50", "routes", "meets", "best", "PD pays")
    for r in rows:
        routes = ", ".join(f"{k} {v}" for k, v in sorted(r.get("routes", {}).items()))
        t.add_row(r["layout"], r["prefill"], r["decode"], str(r["gpus"]), f"{r['tokens_per_s']:,.0f}",
                  f"{r['tokens_per_s_per_gpu']:,.1f}", f"{r['ttft_p50_s'] * 1e3:,.1f} ms",
                  f"{r['ttft_p99_s'] * 1e3:,.1f} ms", f"{r['itl_p50_s'] * 1e3:,.2f} ms",
                  f"{r['itl_p99_s'] * 1e3:,.2f} ms",
                  f"{r['transfer_p50_s'] * 1e3:,.2f} ms" if "transfer_p50_s" in r else "", routes,
                  "yes" if r["meets"] else "no", "★" if r["best"] else "",
                  ("yes" if r["pays"] else "no") if "pays" in r else "")
    return t
