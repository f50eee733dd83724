"""The offline ``moeray`` commands, which need no running server: ``make-checkpoint``, ``params``,
``plan``, ``simulate`` and ``generate`` (in this process or on a Ray cluster it starts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .cli_common import MODEL_HELP, err, parse_json_option, resolve_model, user_errors


def register(app: typer.Typer) -> None:
    """Add the offline commands to ``app``, in the order ``moeray --help`` lists them."""
    app.command("make-checkpoint")(make_checkpoint)
    app.command()(params)
    app.command()(plan)
    app.command()(simulate)
    app.command()(generate)


def _model_config(model: str):
    """The ModelConfig of a preset name, a checkpoint directory or a config.json file (the config alone)."""
    from model.config import load_config, parse_config
    from model.presets import PRESETS, preset_config

    return parse_config(preset_config(model), where=f"preset {model}") if model in PRESETS else load_config(model)


@user_errors
def make_checkpoint(
    preset: str = typer.Option(..., help="Preset to write: kimi-k2-tiny, kimi-k2-thinking-tiny, deepseek-v3-tiny, "
                                         "kimi-linear-tiny, kimi-k3-tiny, kimi-k2-small, kimi-k2-mini (trained)."),
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


@user_errors
def params(
    model: str = typer.Option(..., help=MODEL_HELP + " A directory holding only config.json works."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    cache: bool = typer.Option(False, "--cache", help="Also print MLA cache bytes per token and KDA state "
                                                      "bytes per sequence."),
):
    """Per-module and total parameter counts, from the config alone."""
    from model.params import cache_bytes_per_token, count_params, format_report, state_bytes_per_sequence

    model_cfg = _model_config(model)
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


@user_errors
def plan(
    model: str = typer.Option(..., help=MODEL_HELP + " Or a config.json file: only the config is read."),
    gpu: str = typer.Option("h200", help="Device kind (a file in cluster/gpus: a100, b200, h100, h200, h800) or cpu."),
    nodes: int = typer.Option(1, help="Nodes."),
    gpus_per_node: int = typer.Option(8, help="Devices per node."),
    layout: str = typer.Option("disaggregated", help="disaggregated (attention and expert actors apart) or "
                                                     "colocated (a worker per device: attention + expert shard)."),
    attention: Optional[int] = typer.Option(None, help="Attention replicas (with --experts; default: propose)."),
    experts: Optional[int] = typer.Option(None, help="Expert actors (with --attention; default: propose)."),
    workers: Optional[int] = typer.Option(None, help="Colocated workers (default: one per device)."),
    context: Optional[int] = typer.Option(None, help="Tokens per sequence (default: the model's context, "
                                                     "at most 131072)."),
    dtype: str = typer.Option("bfloat16", help="Serving dtype of unquantised weights and caches."),
    utilization: float = typer.Option(0.9, help="Fraction of each device's memory to use."),
    link_gbps: float = typer.Option(400.0, help="All-to-all link bandwidth per attention replica, Gb/s."),
    snapshot_bytes: int = typer.Option(1 << 30, help="Hybrid models: bytes of KDA state snapshots per attention "
                                                     "replica for prefix caching (the serving config's "
                                                     "snapshot_bytes; 0 without prefix caching)."),
    speculative_config: Optional[str] = typer.Option(
        None, help="Speculative decoding as JSON (the serving config's speculative): on hybrid models, each "
                   "attention replica's KDA verify buffers are counted."),
    max_num_seqs: int = typer.Option(256, help="Sequences running at once (the serving config's max_num_seqs): the "
                                               "roofline's batch, and how many may verify drafts together."),
    pd_prefill: Optional[str] = typer.Option(
        None, help="Prefill/decode disaggregation: the prefill pool's devices, N (colocated workers) or AxE; the "
                   "decode pool is the rest of the cluster in --layout. Both are planned, and the blocks a prompt "
                   "of --prompt-tokens sends from one to the other priced."),
    prompt_tokens: int = typer.Option(2000, help="With --pd-prefill: the prompt whose transfer is priced."),
    kv_offloading_size: float = typer.Option(0.0, help="GiB of host memory per node for the KV tier (the serving "
                                                       "config's kv_offloading_size): what it holds is shown."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Will the model fit this cluster? Weight and cache bytes per actor kind (or per colocated worker),
    concurrent sequences, expert actors per device, a decode roofline, and the smallest shape that fits."""
    from cluster.planner import DEVICES, format_plan, plan_colocated, plan_shape, propose
    from model.presets import PRESETS

    if gpu not in DEVICES:
        raise ValueError(f"--gpu must be one of {', '.join(DEVICES)}, got {gpu!r}")
    if layout not in ("disaggregated", "colocated"):
        raise ValueError(f"--layout must be disaggregated or colocated, got {layout!r}")
    if layout == "colocated" and (attention is not None or experts is not None):
        raise ValueError("--layout colocated takes --workers, not --attention/--experts")
    if layout == "disaggregated" and workers is not None:
        raise ValueError("--workers is for --layout colocated")
    if (attention is None) != (experts is None):
        raise ValueError("give both --attention and --experts, or neither (then a shape is proposed)")
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"--dtype must be bfloat16, float16 or float32, got {dtype!r}")
    speculative = parse_json_option(speculative_config, "--speculative-config")
    if speculative is not None:
        from cluster.config import SpeculativeConfig

        speculative = SpeculativeConfig.parse(speculative)
    model_cfg = _model_config(model)
    kw = dict(model=Path(model).name if model not in PRESETS else model, device=DEVICES[gpu],
              context=context or min(model_cfg.max_position_embeddings, 131072), dtype_bytes=4 if dtype == "float32" else 2,
              utilization=utilization, link_gbps=link_gbps, snapshot_bytes=snapshot_bytes, speculative=speculative,
              max_num_seqs=max_num_seqs)
    if pd_prefill is not None:
        from .plan_pd import plan_pools

        out, text, ok = plan_pools(model_cfg, pd_prefill, layout=layout, nodes=nodes, gpus_per_node=gpus_per_node,
                                   attention=attention, experts=experts, workers=workers,
                                   prompt_tokens=prompt_tokens, **kw)
        print(json.dumps(out, indent=2) if as_json else text)
        if not ok:
            raise typer.Exit(1)
        return
    if kv_offloading_size < 0:
        raise ValueError(f"--kv-offloading-size must be >= 0 GiB, got {kv_offloading_size:g}")
    if layout == "colocated":
        shown = plan_colocated(model_cfg, nodes=nodes, gpus_per_node=gpus_per_node,
                               workers=workers or nodes * gpus_per_node, **kw)
        tier = _kv_tier(shown, kv_offloading_size)
        if as_json:
            print(json.dumps(shown.to_dict() | {"workers": shown.attention, "proposal": None, "kv_tier": tier}, indent=2))
        else:
            print(format_plan(shown, None) + _kv_tier_text(tier))
        if not shown.fits:
            raise typer.Exit(1)
        return
    proposal = propose(model_cfg, nodes=nodes, gpus_per_node=gpus_per_node, **kw)
    if attention is None:
        shown = proposal or plan_shape(model_cfg, nodes=nodes, gpus_per_node=gpus_per_node, attention=1,
                                       experts=max(nodes * gpus_per_node - 1, 1), **kw)
    else:
        shown = plan_shape(model_cfg, nodes=nodes, gpus_per_node=gpus_per_node, attention=attention, experts=experts, **kw)
    tier = _kv_tier(shown, kv_offloading_size)
    if as_json:
        out = shown.to_dict()
        out["proposal"] = None if proposal is None else {"attention": proposal.attention, "experts": proposal.experts}
        print(json.dumps(out | {"kv_tier": tier}, indent=2))
        return
    print(format_plan(shown, proposal) + _kv_tier_text(tier))


def _kv_tier(plan, gib: float) -> dict | None:
    """What a node's KV tier of ``gib`` GiB holds for ``plan``'s model: tokens of cached prefix (the MLA latent's
    bytes per token; a hybrid model's KDA snapshots take some of it too) and sequences at the plan's context."""
    if not gib:
        return None
    per_token = plan.sequence_bytes["latent_per_token"]
    tokens = int(gib * 2**30 // per_token) if per_token else 0
    return {"gib_per_node": gib, "bytes_per_token": per_token, "tokens": tokens,
            "sequences_at_context": tokens // plan.context if plan.context else 0}


def _kv_tier_text(tier: dict | None) -> str:
    if tier is None:
        return ""
    return (f"\n  KV tier: {tier['gib_per_node']:g} GiB of host memory per node holds {tier['tokens']:,} tokens of "
            f"cached prefix ({tier['bytes_per_token']:,} B/token): {tier['sequences_at_context']:,} sequences at the "
            "context above, beside what the devices cache")


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
    ping_pong: bool = typer.Option(False, help="The engine's ping-pong: two micro-batches (--micro-batches 2)."),
    micro_batches: int = typer.Option(1, help="A step's batch in this many micro-batches, pipelined through "
                                              "attention, dispatch, experts and combine (GPU costs)."),
    exchange: str = typer.Option("moeray", help="The exchange priced on GPUs: moeray (what the engine sends: bf16, "
                                                "a copy per token and expert), fp8-ll (DeepEP's low-latency decode "
                                                "kernels: FP8 out, bf16 back, a copy per token and expert) or "
                                                "fp8-dedup (DeepEP/StepMesh-class transports: FP8, a copy per node); "
                                                "the last two are not what moeray sends."),
    colocated: bool = typer.Option(False, help="The colocated layout (`moeray up --layout colocated --workers N`): "
                                               "N workers, each an attention replica and an expert shard on one "
                                               "device (--attention = --experts = N)."),
    search: bool = typer.Option(False, help="Try every attention/expert split of --gpus devices."),
    tpot_ms: Optional[float] = typer.Option(None, help="Target ITL p50 (ms) a searched shape must meet."),
    ttft_ms: Optional[float] = typer.Option(None, help="Target TTFT p50 (ms) a searched shape must meet."),
    rate: Optional[float] = typer.Option(None, help="An offered load instead: Poisson arrivals, requests/s (0: all "
                                                     "at once). Default: with --search on GPUs, the capacity at "
                                                     "--tpot-ms (each shape at steady state at the largest batch "
                                                     "that meets it); otherwise 4."),
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
    pd_prefill: Optional[str] = typer.Option(
        None, help="Prefill/decode disaggregation: the prefill pool, N (colocated workers) or AxE; the decode pool "
                   "is --attention/--experts (--colocated). Compared with one engine on all the devices."),
    pd: bool = typer.Option(False, "--pd", help="With --search --gpus N: size the prefill and decode pools (every "
                                                "split into two colocated pools that fit, at most 8) against one "
                                                "engine on the N devices, under the offered load (--rate). With PD "
                                                "(and the one engine it is compared with) --max-num-seqs and "
                                                "--max-tokens-per-step are per attention replica."),
    min_uncached_tokens: int = typer.Option(256, help="PD: prompts at least this long go to the prefill pool "
                                                      "(the serving config's disaggregation.min_uncached_tokens)."),
    link_gbps: float = typer.Option(400.0, help="PD: the link a request's blocks cross to its decode replica, Gb/s."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: one summary per shape."),
    plot: Optional[Path] = typer.Option(None, help="Draw tokens/s per GPU against ITL p50 to this PNG."),
):
    """What would a shape serve? Simulates moeray's own scheduler and placement with step costs from
    a GPU roofline (or this machine's profile) for a workload, per shape: tokens/s (per GPU), TTFT
    and ITL percentiles, expert imbalance. --search tries every split of --gpus devices."""
    from cluster.costmodel import gpu_names

    from . import simulate as sim
    from .settings import cache_root

    profile_path = cpu_profile or cache_root() / "cpu_profile.json"
    if profile:
        _profile_cpu(model, profile_path)
        return
    if gpu != "cpu" and gpu not in gpu_names():
        raise ValueError(f"--gpu must be cpu or one of {', '.join(gpu_names())}, got {gpu!r}")
    try:
        slots = tuple(int(x) for x in redundant_slots.split(","))
    except ValueError:
        raise ValueError(f"--redundant-slots must be integers separated by commas, got {redundant_slots!r}") from None
    from cluster.capacity.stepcost import EXCHANGES

    if exchange not in EXCHANGES:
        raise ValueError(f"--exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
    if micro_batches < 1:
        raise ValueError(f"--micro-batches must be >= 1, got {micro_batches}")
    model_cfg = _model_config(model)
    args = sim.SimArgs(
        gpu=gpu, gpus=gpus, attention=attention, experts=experts, redundant_slots=slots, standbys=standbys,
        ping_pong=ping_pong, micro_batches=micro_batches, exchange=exchange, colocated=colocated, search=search, tpot_ms=tpot_ms, ttft_ms=ttft_ms, rate=rate,
        requests=requests, prompt_tokens=sim.lengths(prompt_tokens, "--prompt-tokens"),
        output_tokens=sim.lengths(output_tokens, "--output-tokens"), trace=trace, routing=routing, skew=skew,
        seed=seed, max_num_seqs=max_num_seqs, max_tokens_per_step=max_tokens_per_step, block_size=block_size,
        cpu_profile=profile_path, failures_per_hour=failures_per_hour, pd_prefill=pd_prefill, pd=pd,
        min_uncached_tokens=min_uncached_tokens, link_gbps=link_gbps)
    if pd or pd_prefill is not None:
        if plot is not None:
            raise ValueError("--plot draws a search of one engine's shapes; with --pd, use --json")
        if min_uncached_tokens < 1 or link_gbps <= 0:
            raise ValueError("--min-uncached-tokens must be >= 1 and --link-gbps > 0")
        if pd and not search:
            raise ValueError("--pd sizes the pools of --gpus with --search; for given pools use --pd-prefill")
        if pd_prefill is not None:
            sim.pool_shape(pd_prefill)  # its error first
        with err.status("simulating prefill/decode disaggregation"):
            rows = sim.run_pd(model_cfg, args)
        if as_json:
            print(sim.dump(rows))
        else:
            Console().print(sim.pd_table(rows))
        return
    with err.status("simulating"):
        rows = sim.run(model_cfg, args)
    if plot is not None:
        sim.plot(rows, plot, f"{Path(model).name} on {gpus or rows[0]['gpus']} × {gpu}")
    if as_json:
        print(sim.dump(rows))
        return
    Console().print(sim.table(rows))


def _profile_cpu(model: str, profile_path: Path) -> None:
    """``simulate --profile``: time the real engine and actors on ``model`` here; save the table."""
    from cluster.capacity.profile import profile as run_profile

    table = run_profile(str(resolve_model(model)), progress=lambda m: err.print(m))
    profile_path.parent.mkdir(parents=True, exist_ok=True)
    profile_path.write_text(json.dumps(table, indent=2))
    err.print(f"profiled {table['steps']} steps of {table['model']}; wrote {profile_path}")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


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
    speculative_config: Optional[str] = typer.Option(
        None, help='Speculative decoding as JSON, as `moeray up` takes it: \'{"method": "suffix", '
                   '"num_speculative_tokens": 4}\'. Runs the engine (in this process without --attention); the '
                   "acceptance goes to stderr."),
):
    """Offline generation: in this process, or on a Ray cluster of attention and expert actors
    (--attention/--experts, on --nodes local nodes or the cluster at --address)."""
    from model.config import load_config
    from model.sampling import SamplingParams
    from model.tokenizer import Tokenizer

    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of --prompt or --prompt-ids")
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        ignore_eos=ignore_eos)
    path = resolve_model(model)
    model_cfg = load_config(path, gate_bias_in_weights=biased_gate)
    tok = Tokenizer.from_dir(path)
    ids = _prompt_ids(tok, model_cfg, prompt, prompt_ids, chat, max_tokens)
    stop_ids = tok.stop_token_ids | set(model_cfg.eos_token_ids)
    speculative = parse_json_option(speculative_config, "--speculative-config")
    if speculative is not None:
        from cluster.config import SpeculativeConfig

        speculative = SpeculativeConfig.parse(speculative)
    if any(v is not None for v in (attention, experts, nodes, address)):
        output_ids = _cluster_generate(path, model_cfg, ids, sp, stop_ids, dtype, attention or 1, experts or 1, nodes,
                                       address, speculative)
    elif speculative is not None:
        output_ids = _engine_generate(path, model_cfg, ids, sp, stop_ids, dtype, speculative)
    else:
        output_ids = _local_generate(path, model_cfg, ids, sp, stop_ids, dtype)
    text = tok.decode(output_ids, skip_special_tokens=True)  # as the server decodes by default
    if as_json:
        print(json.dumps({"token_ids": output_ids, "text": text}))
    else:
        print(text)


def _prompt_ids(tok, model_cfg, prompt: str | None, prompt_ids: str | None, chat: bool, max_tokens: int) -> list[int]:
    """The prompt's token ids (given, or encoded, in the chat template with --chat), checked against
    the vocabulary and the context."""
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
    return ids


def _local_generate(path, model_cfg, ids, sp, stop_ids, dtype) -> list[int]:
    from model.loader import load_model, parse_dtype
    from model.runner import ModelRunner
    from model.runner import generate as run_generate

    net = load_model(path, dtype=parse_dtype(dtype), cfg=model_cfg, progress=sys.stderr.isatty())
    block = 16
    runner = ModelRunner(net, num_blocks=-(-(len(ids) + sp.max_tokens) // block) + 1, block_size=block)
    return run_generate(runner, [ids], sp, stop_ids=stop_ids)[0].output_ids


def _engine_generate(path, model_cfg, ids, sp, stop_ids, dtype, speculative) -> list[int]:
    """The engine in this process (the in-process executor: one attention worker holding every
    expert), for what the single-process runner does not do (speculative decoding)."""
    from cluster.engine import Engine, EngineConfig
    from cluster.inprocess import InProcessExecutor
    from cluster.spec import ClusterSpec

    spec = ClusterSpec(attention=1, experts=1)
    cfg = EngineConfig.of(model=str(path), dtype=dtype, num_blocks=-(-(len(ids) + sp.max_tokens) // 16) + 2,
                          speculative=speculative)
    with err.status(f"loading {path.name}"), Engine(cfg, spec, stop_ids=stop_ids,
                                                    executor=InProcessExecutor(cfg, spec, model_cfg)) as eng:
        out = eng.generate([ids], sp)[0].output_ids
        _report_drafts(eng.stats)
        return out


def _report_drafts(stats) -> None:
    if stats.spec_drafts:
        err.print(f"speculative decoding: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} draft tokens "
                  f"accepted; mean accepted length {stats.mean_accepted_length:.2f}")
    else:
        err.print("speculative decoding: no drafts were proposed")


def _cluster_generate(path, model_cfg, ids, sp, stop_ids, dtype, attention, experts, nodes, address,
                      speculative=None) -> list[int]:
    from cluster.engine import Engine, EngineConfig, check_shape
    from cluster.launch import connected
    from cluster.spec import ClusterSpec

    spec = ClusterSpec(attention=attention, experts=experts)
    check_shape(model_cfg, spec, str(path))  # before any Ray node starts
    blocks = -(-(len(ids) + sp.max_tokens) // 16) + 1
    with err.status(f"starting {spec.describe()}") as status, connected(spec, nodes=nodes, address=address):
        status.update(f"loading {path.name} onto {spec.describe()}")
        with Engine(EngineConfig.of(model=str(path), dtype=dtype, num_blocks=blocks, speculative=speculative), spec,
                    stop_ids=stop_ids) as eng:
            status.update("generating")
            out = eng.generate([ids], sp)[0].output_ids
            if speculative is not None:
                _report_drafts(eng.stats)
            return out

