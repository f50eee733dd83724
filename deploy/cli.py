"""The ``moeray`` command line. Parses flags, resolves models, prints results; the work is elsewhere.

User errors (bad flags, configs, checkpoints, prompts) print one line ``error: ...`` and exit 2.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.text import Text

app = typer.Typer(
    name="moeray",
    help="Serve Mixture-of-Experts models with Multi-head Latent Attention (Kimi K2, DeepSeek-V3) on Ray.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True)


def user_errors(fn):
    """Turn ValueError (our user-input errors) into one clear line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            err.print(Text.assemble(("error:", "bold red"), " ", str(e)), soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


MODEL_HELP = ("A Hugging Face checkpoint directory or a preset name (kimi-k2-tiny, kimi-k2-thinking-tiny, "
              "deepseek-v3-tiny, kimi-linear-tiny, kimi-k3-tiny, kimi-k2-small).")


def _resolve(model: str) -> Path:
    from model.presets import resolve_model

    from .settings import cache_root

    return resolve_model(model, cache_root())


@app.command("make-checkpoint")
@user_errors
def make_checkpoint(
    preset: str = typer.Option(..., help="Preset to write: kimi-k2-tiny, kimi-k2-thinking-tiny, deepseek-v3-tiny, "
                                         "kimi-linear-tiny, kimi-k3-tiny, kimi-k2-small."),
    out: Path = typer.Option(..., help="Output directory (created)."),
    quant: Optional[str] = typer.Option(None, help="Weight format: fp8 (128x128 blocks; DeepSeek/K2 presets), "
                                                   "int4 or mxfp4 (routed experts only)."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    dtype: str = typer.Option("bfloat16", help="Storage dtype of unquantised tensors: bfloat16 or float32."),
):
    """Write a complete Hugging Face checkpoint (config, safetensors, tokenizer) with seeded random weights."""
    from model.presets import build_preset

    if quant not in (None, "fp8", "int4", "mxfp4"):
        raise ValueError(f"--quant must be fp8, int4 or mxfp4, got {quant!r}")
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype must be bfloat16 or float32, got {dtype!r}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty; choose a new directory")
    build_preset(preset, out, seed=seed, quant=quant, dtype=dtype)
    err.print(f"wrote {preset} ({quant or dtype}) to {out}")


@app.command()
@user_errors
def params(
    model: str = typer.Option(..., help=MODEL_HELP + " A directory holding only config.json works."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    cache: bool = typer.Option(False, "--cache", help="Also print MLA cache bytes per token and KDA state "
                                                      "bytes per sequence."),
):
    """Per-module and total parameter counts, from the config alone."""
    from model.config import load_config, parse_config
    from model.params import cache_bytes_per_token, count_params, format_report, state_bytes_per_sequence
    from model.presets import PRESETS, preset_config

    model_cfg = parse_config(preset_config(model), where=f"preset {model}") if model in PRESETS else load_config(model)
    report = count_params(model_cfg)
    if as_json:
        out = report.to_dict()
        if cache:
            out["cache"] = cache_bytes_per_token(model_cfg)
            out["kda_state"] = state_bytes_per_sequence(model_cfg)
        print(json.dumps(out, indent=2))
        return
    print(format_report(report))
    if cache:
        c = cache_bytes_per_token(model_cfg)
        print(f"MLA latent cache per token (bf16): {c['latent']:,} B over {c['mla_layers']} MLA layers; "
              f"naive per-head K/V would be {c['naive']:,} B ({c['naive'] / c['latent']:.1f}x)")
        k = state_bytes_per_sequence(model_cfg)
        if k["kda_layers"]:
            print(f"KDA state per sequence: {k['total']:,} B over {k['kda_layers']} KDA layers "
                  f"(recurrent fp32 {k['recurrent_per_layer']:,} B + conv bf16 {k['conv_per_layer']:,} B per layer), "
                  "independent of length")


@app.command()
@user_errors
def plan(
    model: str = typer.Option(..., help=MODEL_HELP + " Or a config.json file: only the config is read."),
    gpu: str = typer.Option("h200", help="Device kind (a file in cluster/gpus: a100, b200, h100, h200, h800) or cpu."),
    nodes: int = typer.Option(1, help="Nodes."),
    gpus_per_node: int = typer.Option(8, help="Devices per node."),
    attention: Optional[int] = typer.Option(None, help="Attention replicas (with --experts; default: propose)."),
    experts: Optional[int] = typer.Option(None, help="Expert actors (with --attention; default: propose)."),
    context: Optional[int] = typer.Option(None, help="Tokens per sequence (default: the model's context, "
                                                     "at most 131072)."),
    dtype: str = typer.Option("bfloat16", help="Serving dtype of unquantised weights and caches."),
    utilization: float = typer.Option(0.9, help="Fraction of each device's memory to use."),
    link_gbps: float = typer.Option(400.0, help="All-to-all link bandwidth per attention replica, Gb/s."),
    snapshot_bytes: int = typer.Option(1 << 30, help="Hybrid models: bytes of KDA state snapshots per attention "
                                                     "replica for prefix caching (the serving config's "
                                                     "snapshot_bytes; 0 without prefix caching)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Will the model fit this cluster? Weight and cache bytes per actor kind, concurrent sequences,
    expert actors per device, a decode roofline, and the smallest shape that fits."""
    from cluster.planner import DEVICES, format_plan, plan_shape, propose
    from model.config import load_config, parse_config
    from model.presets import PRESETS, preset_config

    if gpu not in DEVICES:
        raise ValueError(f"--gpu must be one of {', '.join(DEVICES)}, got {gpu!r}")
    if (attention is None) != (experts is None):
        raise ValueError("give both --attention and --experts, or neither (then a shape is proposed)")
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"--dtype must be bfloat16, float16 or float32, got {dtype!r}")
    model_cfg = parse_config(preset_config(model), where=f"preset {model}") if model in PRESETS else load_config(model)
    kw = dict(model=Path(model).name if model not in PRESETS else model, device=DEVICES[gpu],
              context=context or min(model_cfg.max_position_embeddings, 131072), dtype_bytes=4 if dtype == "float32" else 2,
              utilization=utilization, link_gbps=link_gbps, snapshot_bytes=snapshot_bytes)
    proposal = propose(model_cfg, nodes=nodes, gpus_per_node=gpus_per_node, **kw)
    if attention is None:
        shown = proposal or plan_shape(model_cfg, nodes=nodes, gpus_per_node=gpus_per_node, attention=1,
                                       experts=max(nodes * gpus_per_node - 1, 1), **kw)
    else:
        shown = plan_shape(model_cfg, nodes=nodes, gpus_per_node=gpus_per_node, attention=attention, experts=experts, **kw)
    if as_json:
        out = shown.to_dict()
        out["proposal"] = None if proposal is None else {"attention": proposal.attention, "experts": proposal.experts}
        print(json.dumps(out, indent=2))
        return
    print(format_plan(shown, proposal))


@app.command()
@user_errors
def simulate(
    model: str = typer.Option(..., help=MODEL_HELP + " Or a config.json file: only the config is read."),
    gpu: str = typer.Option("h200", help="Device kind (a file in cluster/gpus: a100, b200, h100, h200, h800), or cpu: "
                                         "this machine, from its profile (--profile makes one)."),
    gpus: Optional[int] = typer.Option(None, help="Devices to split (with --search)."),
    attention: Optional[int] = typer.Option(None, help="Attention replicas of the shape to simulate."),
    experts: Optional[int] = typer.Option(None, help="Expert actors of the shape to simulate."),
    redundant_slots: str = typer.Option("0", help="Redundant expert slots per MoE layer; a comma list tries each."),
    standbys: int = typer.Option(0, help="Warm standby actors (each takes a device)."),
    ping_pong: bool = typer.Option(False, help="Overlap attention and experts in two micro-batches."),
    colocated: bool = typer.Option(False, help="Put one attention replica and one expert actor on every device "
                                               "(fractional gpus_per_actor; --attention = --experts)."),
    search: bool = typer.Option(False, help="Try every attention/expert split of --gpus devices."),
    tpot_ms: Optional[float] = typer.Option(None, help="Target ITL p50 (ms) a searched shape must meet."),
    ttft_ms: Optional[float] = typer.Option(None, help="Target TTFT p50 (ms) a searched shape must meet."),
    rate: float = typer.Option(4.0, help="Poisson arrivals, requests/s (0: all at once)."),
    requests: int = typer.Option(200, help="Requests simulated."),
    prompt_tokens: str = typer.Option("2000", help="Prompt tokens per request: N, or LO:HI drawn uniformly."),
    output_tokens: str = typer.Option("200", help="Output tokens per request: N, or LO:HI drawn uniformly."),
    failures_per_hour: float = typer.Option(0.0, help="Actors lost at random (Poisson), each recovered with "
                                                      "--standbys warm standbys or a cold start."),
    trace: Optional[Path] = typer.Option(None, help="A trace instead: JSON lines of arrival_s, prompt_tokens, "
                                                    "output_tokens."),
    routing: Optional[Path] = typer.Option(None, help="Measured routing: `moeray experts --json` of a real run."),
    skew: float = typer.Option(0.0, help="Synthetic routing skew: expert of rank r gets r^-skew (0: uniform)."),
    seed: int = typer.Option(0, help="Seed of the arrivals and the routing draws."),
    max_num_seqs: int = typer.Option(256, help="Sequences per step (the serving config's max_num_seqs)."),
    max_tokens_per_step: int = typer.Option(8192, help="Token budget of a step."),
    block_size: int = typer.Option(64, help="Tokens per cache block (GPU deployments)."),
    profile: bool = typer.Option(False, "--profile", help="Profile this machine for --gpu cpu: run the real "
                                                          "engine and actors on --model and save the table."),
    cpu_profile: Optional[Path] = typer.Option(None, help="The CPU profile to read or write (default: "
                                                          "cpu_profile.json in the cache directory)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: one summary per shape."),
    plot: Optional[Path] = typer.Option(None, help="Draw tokens/s per GPU against ITL p50 to this PNG."),
):
    """What would a shape serve? Simulates moeray's own scheduler and placement with step costs from
    a GPU roofline (or this machine's profile) for a workload, per shape: tokens/s (per GPU), TTFT
    and ITL percentiles, expert imbalance. --search tries every split of --gpus devices."""
    from cluster.costmodel import gpu_names
    from model.config import load_config, parse_config
    from model.presets import PRESETS, preset_config

    from . import simulate as sim
    from .settings import cache_root

    profile_path = cpu_profile or cache_root() / "cpu_profile.json"
    if profile:
        from cluster.profile import profile as run_profile

        table = run_profile(str(_resolve(model)), progress=lambda m: err.print(m))
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        profile_path.write_text(json.dumps(table, indent=2))
        err.print(f"profiled {table['steps']} steps of {table['model']}; wrote {profile_path}")
        return
    if gpu != "cpu" and gpu not in gpu_names():
        raise ValueError(f"--gpu must be cpu or one of {', '.join(gpu_names())}, got {gpu!r}")
    try:
        slots = tuple(int(x) for x in redundant_slots.split(","))
    except ValueError:
        raise ValueError(f"--redundant-slots must be integers separated by commas, got {redundant_slots!r}") from None
    model_cfg = parse_config(preset_config(model), where=f"preset {model}") if model in PRESETS else load_config(model)
    args = sim.SimArgs(gpu, gpus, attention, experts, slots, standbys, ping_pong, colocated, search, tpot_ms, ttft_ms,
                       rate, requests, sim.lengths(prompt_tokens, "--prompt-tokens"),
                       sim.lengths(output_tokens, "--output-tokens"), trace, routing, skew, seed, max_num_seqs,
                       max_tokens_per_step, block_size, profile_path, failures_per_hour)
    with err.status("simulating"):
        rows = sim.run(model_cfg, args)
    if plot is not None:
        sim.plot(rows, plot, f"{Path(model).name} on {gpus or rows[0]['gpus']} × {gpu}")
    if as_json:
        print(sim.dump(rows))
        return
    Console().print(sim.table(rows))


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


@app.command()
@user_errors
def generate(
    model: str = typer.Option("kimi-k2-tiny", help=MODEL_HELP),
    prompt: Optional[str] = typer.Option(None, help="Prompt text."),
    prompt_ids: Optional[str] = typer.Option(None, help="Prompt as token ids, e.g. 1,2,3."),
    chat: bool = typer.Option(False, help="Wrap --prompt as a user message with the model's chat template."),
    max_tokens: int = typer.Option(32, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0, help="0 disables top-k."),
    seed: Optional[int] = typer.Option(None, help="Per-request sampling seed."),
    ignore_eos: bool = typer.Option(False, help="Do not stop at the model's end-of-turn tokens."),
    dtype: str = typer.Option("float32", help="Compute dtype: float32 or bfloat16."),
    biased_gate: bool = typer.Option(False, "--kimi-linear-biased-gate",
                                     help="Reproduce the original Kimi Linear HF code's biased gate weights."),
    attention: Optional[int] = typer.Option(None, help="Run on a Ray cluster with N attention replicas."),
    experts: Optional[int] = typer.Option(None, help="Run on a Ray cluster with M expert actors."),
    nodes: Optional[int] = typer.Option(None, help="Start K Ray nodes on this machine for the run."),
    address: Optional[str] = typer.Option(None, help="Use an existing Ray cluster at ADDR instead of starting one."),
    as_json: bool = typer.Option(False, "--json", help='Print one line {"token_ids": [...], "text": "..."}.'),
):
    """Offline generation: in this process, or on a Ray cluster of attention and expert actors
    (--attention/--experts, on --nodes local nodes or the cluster at --address)."""
    from model.config import load_config
    from model.loader import load_model, parse_dtype
    from model.runner import ModelRunner
    from model.runner import generate as run_generate
    from model.sampling import SamplingParams
    from model.tokenizer import Tokenizer

    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of --prompt or --prompt-ids")
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        ignore_eos=ignore_eos)
    path = _resolve(model)
    model_cfg = load_config(path, gate_bias_in_weights=biased_gate)
    tok = Tokenizer.from_dir(path)
    if prompt_ids is not None:
        ids = _parse_ids(prompt_ids)
    elif chat:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
    else:
        ids = tok.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < model_cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{model_cfg.vocab_size - 1})")
    if len(ids) + max_tokens > model_cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-tokens ({max_tokens}) exceeds the context "
                         f"({model_cfg.max_position_embeddings})")
    stop_ids = tok.stop_token_ids | set(model_cfg.eos_token_ids)
    if any(v is not None for v in (attention, experts, nodes, address)):
        output_ids = _cluster_generate(path, ids, sp, stop_ids, dtype, attention or 1, experts or 1, nodes, address)
    else:
        net = load_model(path, dtype=parse_dtype(dtype), cfg=model_cfg, progress=sys.stderr.isatty())
        block = 16
        runner = ModelRunner(net, num_blocks=-(-(len(ids) + max_tokens) // block) + 1, block_size=block)
        output_ids = run_generate(runner, [ids], sp, stop_ids=stop_ids)[0].output_ids
    text = tok.decode(output_ids, skip_special_tokens=True)  # as the server decodes by default
    if as_json:
        print(json.dumps({"token_ids": output_ids, "text": text}))
    else:
        print(text)


def _cluster_generate(path, ids, sp, stop_ids, dtype, attention, experts, nodes, address) -> list[int]:
    from cluster.engine import Engine, EngineConfig
    from cluster.launch import connected
    from cluster.spec import ClusterSpec

    spec = ClusterSpec(attention=attention, experts=experts)
    blocks = -(-(len(ids) + sp.max_tokens) // 16) + 1
    with err.status(f"starting {spec.describe()}") as status, connected(spec, nodes=nodes, address=address):
        status.update(f"loading {path.name} onto {spec.describe()}")
        with Engine(EngineConfig(model=str(path), dtype=dtype, num_blocks=blocks), spec, stop_ids=stop_ids) as eng:
            status.update("generating")
            return eng.generate([ids], sp)[0].output_ids


@app.command()
@user_errors
def up(
    model: Optional[str] = typer.Option(None, help=MODEL_HELP + " [default: kimi-k2-tiny]"),
    attention: Optional[int] = typer.Option(None, help="Attention data-parallel replicas. [default: 1]"),
    experts: Optional[int] = typer.Option(None, help="Expert actors. [default: 1]"),
    gpus_per_actor: Optional[float] = typer.Option(None, help="GPUs each attention and expert actor reserves; "
                                                              "fractions let expert actors share a GPU (NCCL then)."),
    nodes: Optional[int] = typer.Option(None, help="Start K Ray nodes on this machine (default: 1)."),
    address: Optional[str] = typer.Option(None, help="Serve on the existing Ray cluster at ADDR."),
    host: Optional[str] = typer.Option(None, help="HTTP host. [default: 127.0.0.1]"),
    port: Optional[int] = typer.Option(None, help="HTTP port. [default: 8000]"),
    api_key: Optional[str] = typer.Option(None, help="Require 'Authorization: Bearer KEY' on every route but "
                                                     "/health and /admin/*."),
    admin_api_key: Optional[str] = typer.Option(None, "--admin-key",
                                                help="The key the /admin/* routes need (scale, rebalance, experts, "
                                                     "chaos); not an API key. Default: on a loopback host, a random "
                                                     "token in the cache directory that the moeray commands read; "
                                                     "elsewhere none, and the admin routes answer 403."),
    config: Optional[Path] = typer.Option(None, help="A YAML serving config (flags given here override it)."),
    metrics_prefix: Optional[str] = typer.Option(None, help="moeray (default) or vllm: serve the serving series "
                                                            "under vLLM's names, for vLLM's dashboards."),
    expert_metrics: Optional[str] = typer.Option(None, help="summary (default) or full: also export the "
                                                            "per-(layer, expert) token counter."),
    ingress: Optional[str] = typer.Option(None, help="haproxy (default): Serve's direct ingress behind HAProxy; "
                                                     "proxy: Serve's proxy actor (nodes started here only)."),
    prefix_caching: Optional[bool] = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                                  help="Share cached prompt prefixes between requests. "
                                                       "[default: on]"),
    detach: bool = typer.Option(False, help="Run in the background; return once the server is healthy."),
):
    """Serve a model with an OpenAI-compatible API. With no arguments: the built-in kimi-k2-tiny on
    a local Ray, at http://127.0.0.1:8000."""
    from .config import ServeConfig
    from .server import serve_foreground, start_detached
    from .settings import cache_root

    given = dict(model=model, attention=attention, experts=experts, host=host, port=port, api_key=api_key,
                 admin_api_key=admin_api_key, metrics_prefix=metrics_prefix, expert_metrics=expert_metrics,
                 gpus_per_actor=gpus_per_actor, ingress=ingress, prefix_caching=prefix_caching)
    flags = {k: v for k, v in given.items() if v is not None}  # only flags given override the config file
    serve_cfg = ServeConfig.from_yaml(config, **flags) if config else ServeConfig.parse(flags, where="moeray up")
    root = cache_root()
    if detach:
        argv = [a for a in sys.argv[2:] if a != "--detach"]
        with err.status("starting moeray in the background"):
            info = start_detached(argv, root, serve_cfg.host, serve_cfg.port)
        err.print(f"moeray is serving at http://{serve_cfg.host}:{serve_cfg.port}/v1 (pid {info['pid']}, log {info['log']}); "
                  "stop it with: moeray down")
        return
    with err.status("starting Ray") as status:
        serve_foreground(serve_cfg, root, nodes=nodes, address=address, status=status)


@app.command()
@user_errors
def down():
    """Stop what `moeray up` started (its Serve application and the local Ray nodes), nothing else."""
    from .server import stop_running
    from .settings import cache_root

    state = stop_running(cache_root())
    err.print("nothing to stop: no server started by `moeray up` is running" if state is None
              else f"stopped moeray at {state['url']} (pid {state['pid']})")


URL_HELP = "Base URL of the app (default: the one `moeray up` started)."
KEY_HELP = "API key, if the server needs one."
ADMIN_KEY_HELP = ("The server's admin key (default: for the app `moeray up` started, the token it wrote; else "
                  "$MOERAY_ADMIN_KEY).")


@app.command()
@user_errors
def status(
    api_key: Optional[str] = typer.Option(None, help=KEY_HELP),
    url: Optional[str] = typer.Option(None, help=URL_HELP),
    as_json: bool = typer.Option(False, "--json"),
):
    """Actors, nodes, expert placement (epoch, physical slots, replicas), cache use and the last pause."""
    from rich.table import Table

    from .server import fetch_status
    from .settings import cache_root

    st = fetch_status(cache_root(), api_key, url)
    if as_json:
        print(json.dumps(st, indent=2))
        return
    out = Console()
    if "loading" in st:
        out.print(f"{st['model']} at {st['url']}: loading the weights")
        for actor, p in sorted(st["loading"].items()):
            out.print(f"  {actor}: {p['bytes_read'] / 2**30:,.2f} / {p['bytes_total'] / 2**30:,.2f} GiB")
        return
    last = st.get("last_change")
    pause = f"; last change: {last['kind']} to epoch {last['epoch']}, paused {last['pause_s']:.2f}s" if last else ""
    out.print(f"{st['model']} at {st['url']}: {st['shape']}; running {st['running']}, waiting {st['waiting']}, "
              f"steps {st['steps']}, epoch {st['epoch']}{pause}")
    change = st.get("change")
    if change:
        out.print(f"changing: {change['kind']} to epoch {change['epoch']}, {change.get('state', 'preparing')} "
                  f"for {change.get('for_s', 0):.0f}s")
    hang = st.get("last_hang")
    if hang:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(hang["at"]))
        out.print(f"last hang: {hang['kind']}[{hang['index']}] at step {hang['step']} ({when}): killed and replaced; "
                  f"hangs so far {st.get('hangs', {})}")
    b = st.get("breakdown") or {}
    if b.get("steps"):
        parts = ", ".join(f"{k} {1000 * v / b['steps']:.2f}" for k, v in b.items() if k != "steps")
        out.print(f"mean per step, ms: {parts}")
    t = Table("actor", "node", "placement / cache")
    for a in st["attention"]:
        pc = a.get("prefix_cache") or {}
        cached = (f", {pc['blocks_cached']} cached" + (f", {pc['snapshots_cached'] + pc['snapshots_held']}/"
                  f"{pc['snapshots']} KDA snapshots" if pc["snapshots"] else "") +
                  f"; prefix hits {pc['hit_tokens']:,}/{pc['queries_tokens']:,} prompt tokens") if pc else ""
        t.add_row(f"attention[{a['index']}]", a["node"],
                  f"cache {a['cache_blocks_used']}/{a['cache_blocks']} blocks held{cached}")
    for e in st["experts"]:
        weights = e.get("weight_bytes")  # None: the actor did not answer (down until the next step recovers it)
        held = f"{weights / 2**20:,.1f} MiB of weights" if weights is not None else "weights unknown (no answer)"
        t.add_row(f"expert[{e['index']}]", e["node"], f"{_slots_text(e['slots'], e['replicas'])}; {e['tokens']:,} tokens; "
                                                       f"{held}")
    out.print(t)


def _slots_text(slots: dict[str, list[int]], replicas: dict[str, list[int]]) -> str:
    """Physical slots of one expert actor: one line when every MoE layer is alike, `*` marks a replica."""
    def ids(layer: str) -> str:
        return ",".join(f"{e}*" if e in replicas.get(layer, []) else str(e) for e in slots[layer])

    layers = list(slots)
    if all(slots[l] == slots[layers[0]] and replicas.get(l) == replicas.get(layers[0]) for l in layers):
        return f"experts {ids(layers[0])} (every MoE layer)"
    return "; ".join(f"L{l}: {ids(l)}" for l in layers)


scale_app = typer.Typer(help="Change the number of expert actors or attention replicas of the running app, "
                             "live: in-flight requests keep streaming.", no_args_is_help=True)
app.add_typer(scale_app, name="scale")


def _print_change(c: dict) -> None:
    err.print(f"epoch {c['epoch']} ({c['kind']}): {c['old_shape']} → {c['new_shape']}; paused {c['pause_s']:.2f}s "
              f"(prepared in {c['prepare_s']:.2f}s while serving, {c['experts_loaded']} expert weights read"
              + (f", {c['moved_sequences']} sequences moved" if c["moved_sequences"] else "") + ")")
    if c["imbalance_before"]:
        before, after = c["imbalance_before"], c["imbalance_after"]
        err.print(f"imbalance (max/mean tokens per expert actor, mean over MoE layers): "
                  f"{sum(before) / len(before):.3f} → {sum(after) / len(after):.3f}")
        for i, (b, a) in enumerate(zip(before, after)):
            err.print(f"  MoE layer #{i}: {b:.3f} → {a:.3f}")


def _change(route: str, body: dict, url: str | None, admin_key: str | None, as_json: bool) -> None:
    from .server import call_admin
    from .settings import cache_root

    with err.status("changing the shape (new actors load while requests keep streaming)"):
        c = call_admin(cache_root(), "POST", route, url=url, admin_key_given=admin_key, body=body, timeout_s=900)
    c.pop("url", None)
    if as_json:
        print(json.dumps(c, indent=2))
    else:
        _print_change(c)


@scale_app.command("experts")
@user_errors
def scale_experts(
    n: int = typer.Argument(..., help="Expert actors after the change."),
    url: Optional[str] = typer.Option(None, help=URL_HELP),
    admin_key: Optional[str] = typer.Option(None, help=ADMIN_KEY_HELP),
    as_json: bool = typer.Option(False, "--json"),
):
    """Re-shard the routed experts over N expert actors (up or down)."""
    _change("/admin/scale/experts", {"n": n}, url, admin_key, as_json)


@scale_app.command("attention")
@user_errors
def scale_attention(
    n: int = typer.Argument(..., help="Attention replicas after the change."),
    url: Optional[str] = typer.Option(None, help=URL_HELP),
    admin_key: Optional[str] = typer.Option(None, help=ADMIN_KEY_HELP),
    as_json: bool = typer.Option(False, "--json"),
):
    """Add attention replicas (they take new sequences at once) or remove some (their sequences move)."""
    _change("/admin/scale/attention", {"n": n}, url, admin_key, as_json)


chaos_app = typer.Typer(help="Fault injection against your own running app: a real `ray.kill` of one actor. "
                             "The app recovers by itself; watch `moeray status` and /metrics.", no_args_is_help=True)
app.add_typer(chaos_app, name="chaos")


def _kill(kind: str, index: int, url: str | None, admin_key: str | None) -> None:
    from .server import call_admin
    from .settings import cache_root

    out = call_admin(cache_root(), "POST", "/admin/chaos", url=url, admin_key_given=admin_key,
                     body={"kind": kind, "index": index}, timeout_s=30)
    err.print(f"killed {out['killed']} at {out['url']}; the app recovers by itself (see `moeray status`)")


@chaos_app.command("kill-expert")
@user_errors
def chaos_kill_expert(
    index: int = typer.Argument(..., help="Which expert actor (as `moeray status` numbers them)."),
    url: Optional[str] = typer.Option(None, help=URL_HELP),
    admin_key: Optional[str] = typer.Option(None, help=ADMIN_KEY_HELP),
):
    """Kill expert actor INDEX."""
    _kill("expert", index, url, admin_key)


@chaos_app.command("kill-attention")
@user_errors
def chaos_kill_attention(
    index: int = typer.Argument(..., help="Which attention replica (as `moeray status` numbers them)."),
    url: Optional[str] = typer.Option(None, help=URL_HELP),
    admin_key: Optional[str] = typer.Option(None, help=ADMIN_KEY_HELP),
):
    """Kill attention replica INDEX."""
    _kill("attention", index, url, admin_key)


@app.command()
@user_errors
def rebalance(
    redundant_slots: Optional[int] = typer.Option(None, help="Spare physical slots per MoE layer for copies "
                                                             "of hot experts (default: the serving config's)."),
    url: Optional[str] = typer.Option(None, help=URL_HELP),
    admin_key: Optional[str] = typer.Option(None, help=ADMIN_KEY_HELP),
    as_json: bool = typer.Option(False, "--json"),
):
    """Re-place experts by their recent load (EPLB-style), replicating hot ones; prints the imbalance."""
    _change("/admin/rebalance", {"redundant_slots": redundant_slots}, url, admin_key, as_json)


@app.command()
@user_errors
def experts(
    url: Optional[str] = typer.Option(None, help=URL_HELP),
    admin_key: Optional[str] = typer.Option(None, help=ADMIN_KEY_HELP),
    top: int = typer.Option(4, min=1, help="Hottest experts shown per MoE layer."),
    as_json: bool = typer.Option(False, "--json", help="Print the full distribution (every layer and expert)."),
):
    """Tokens routed to each expert of each MoE layer (GET /admin/experts of the running server)."""
    from rich.table import Table

    from .server import call_admin
    from .settings import cache_root

    d = call_admin(cache_root(), "GET", "/admin/experts", url=url, admin_key_given=admin_key, timeout_s=30)
    if as_json:
        print(json.dumps(d))
        return
    out = Console()
    out.print(f"{d['model']} at {d['url']}: epoch {d['epoch']}, {d['steps_in_window']} of the last "
              f"{d['window_steps']} steps in the window; tokens per expert actor {d['expert_actor_tokens_total']}")
    t = Table("layer", "imbalance (max/mean)", f"hottest {top} (expert: tokens in window)", "tokens total")
    for layer, row, imb, total in zip(d["moe_layers"], d["tokens_window"], d["imbalance_window"], d["tokens_total"]):
        hot = sorted(range(len(row)), key=lambda e: (-row[e], e))[:top]
        t.add_row(str(layer), f"{imb:.2f}", ", ".join(f"{e}: {row[e]:,}" for e in hot if row[e]), f"{sum(total):,}")
    out.print(t)


bench_app = typer.Typer(help="Benchmarks against a running server.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("serve")
@user_errors
def bench_serve(
    url: Optional[str] = typer.Option(None, help="Base URL of any OpenAI-compatible server (ours, vLLM, "
                                                 "llama.cpp's server), e.g. http://127.0.0.1:8000 "
                                                 "(default: the one `moeray up` started)."),
    concurrency: str = typer.Option("1,8,16,32", help="Requests in flight: one run per level, in order."),
    prompt_len: int = typer.Option(128, help="Prompt tokens (sent as token ids; as words if the server "
                                             "refuses ids)."),
    max_tokens: int = typer.Option(128, help="Output tokens per request."),
    requests: Optional[int] = typer.Option(None, help="Requests per level (default: 4 × its concurrency)."),
    model: Optional[str] = typer.Option(None, help="Model name (default: the first id of GET /v1/models)."),
    api_key: Optional[str] = typer.Option(None, help=KEY_HELP),
    ignore_eos: bool = typer.Option(True, help="Send ignore_eos so every request runs to --max-tokens "
                                               "(dropped, with a note, if the server refuses it)."),
    temperature: float = typer.Option(0.0, help="Sampling temperature (0: greedy)."),
    timeout: float = typer.Option(300.0, help="Seconds one request may take, end to end."),
    token_range: str = typer.Option("100:700", help="LO:HI, the range prompt token ids are drawn from "
                                                    "(seeded, distinct per request)."),
    seed: int = typer.Option(0, help="Seed of the prompts."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
    save: Optional[Path] = typer.Option(None, help="Also write the JSON report to this file."),
):
    """Load-test an OpenAI-compatible server: streaming /v1/completions at each --concurrency level.
    Reports requests/s, output tokens/s, and TTFT, inter-token (ITL), per-output-token (TPOT) and
    end-to-end latency at p50/p90/p99, with errors and tokens received vs requested. Output tokens
    are the server's stream usage (stream_options.include_usage), else SSE chunks. Exit code 1 when
    a request failed, 2 when the server cannot be used at all."""
    from .loadgen import LoadSpec, parse_concurrency, parse_token_range, run_bench
    from .loadstats import render_table
    from .server import find_app
    from .settings import cache_root

    spec = LoadSpec(url=find_app(cache_root(), url), concurrency=parse_concurrency(concurrency),
                    prompt_len=prompt_len, max_tokens=max_tokens, requests=requests, model=model, api_key=api_key,
                    ignore_eos=ignore_eos, temperature=temperature, timeout_s=timeout,
                    token_range=parse_token_range(token_range), seed=seed)
    result = run_bench(spec, progress=err.print)
    report = result.to_dict()
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        Console().print(render_table(report))
    if save is not None:
        try:
            save.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as e:
            raise ValueError(f"--save {save}: cannot write the report: {e.strerror}") from None
    if result.errors:
        samples = [s for lv in report["levels"] for s in lv["error_samples"]]
        err.print(f"{result.errors} request(s) failed; first errors: {'; '.join(samples[:3])}", soft_wrap=True)
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
