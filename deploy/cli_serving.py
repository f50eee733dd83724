"""The serving ``moeray`` commands: ``up`` (start the OpenAI-compatible app, in the foreground or
detached), ``down`` (stop what ``up`` started) and ``status`` (what the running app is doing)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .cli_common import KEY_HELP, MODEL_HELP, URL_HELP, err, parse_json_option, user_errors


def register(app: typer.Typer) -> None:
    """Add the serving commands to ``app``, in the order ``moeray --help`` lists them."""
    app.command()(up)
    app.command()(down)
    app.command()(status)


@user_errors
def up(
    model: Optional[str] = typer.Option(None, help=MODEL_HELP + " [default: kimi-k2-mini]"),
    layout: Optional[str] = typer.Option(None, help="disaggregated (default: attention and expert actors apart) "
                                                    "or colocated (workers, each an attention replica and an "
                                                    "expert shard)."),
    attention: Optional[int] = typer.Option(None, help="Attention data-parallel replicas. [default: 1]"),
    experts: Optional[int] = typer.Option(None, help="Expert actors. [default: 1]"),
    workers: Optional[int] = typer.Option(None, help="Workers of the colocated layout. [default: 2]"),
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
    gcs_redis: Optional[str] = typer.Option(None, help="GCS fault tolerance on the nodes started here: HOST:PORT of "
                                                       "a Redis for the head's GCS, or local (a redis-server of "
                                                       "this command's own). The GCS or the head node is started "
                                                       "again when it stops; streams go on (docs/operations.md)."),
    kv_offloading_size: Optional[float] = typer.Option(
        None, help="GiB of host memory per node for the KV tier: full blocks are written through to it and "
                   "prefixes found there are loaded instead of prefilled (it outlives the actors). Off by default."),
    speculative_config: Optional[str] = typer.Option(
        None, help='Speculative decoding as JSON, vLLM\'s names: \'{"method": "suffix", "num_speculative_tokens": 4}\' '
                   "(method suffix or ngram). Off by default."),
    pd: bool = typer.Option(False, "--pd", help="Prefill/decode disaggregation: a second engine (1 attention × 1 "
                                                "expert actor) prefills prompts with at least 256 uncached tokens; "
                                                "their cached blocks cross to the serving engine, which decodes."),
    pd_config: Optional[str] = typer.Option(None, help='--pd with these settings, as JSON: \'{"min_uncached_tokens": '
                                                       '512, "layout": "colocated", "workers": 2}\' (the serving '
                                                       "config's disaggregation keys)."),
    compile_mode: Optional[str] = typer.Option(None, "--compile",
                                               help="decode: run the decode steps compiled (torch.compile; each "
                                                    "attention replica or worker compiles at start). [default: off]"),
    detach: bool = typer.Option(False, help="Run in the background; return once the server is healthy."),
):
    """Serve a model with an OpenAI-compatible API. With no arguments: the built-in kimi-k2-mini (trained:
    it calls tools) on a local Ray, at http://127.0.0.1:8000."""
    from .config import ServeConfig
    from .server import serve_foreground, start_detached
    from .settings import cache_root

    given = dict(model=model, layout=layout, attention=attention, experts=experts, workers=workers, host=host,
                 port=port, api_key=api_key,
                 admin_api_key=admin_api_key, metrics_prefix=metrics_prefix, expert_metrics=expert_metrics,
                 gpus_per_actor=gpus_per_actor, ingress=ingress, prefix_caching=prefix_caching,
                 kv_offloading_size=kv_offloading_size,
                 speculative=parse_json_option(speculative_config, "--speculative-config"), compile=compile_mode,
                 disaggregation=parse_json_option(pd_config, "--pd-config", '{"min_uncached_tokens": 512}') or ({} if pd else None))
    flags = {k: v for k, v in given.items() if v is not None}  # only flags given override the config file
    serve_cfg = ServeConfig.from_yaml(config, **flags) if config else ServeConfig.parse(flags, where="moeray up")
    if gcs_redis is not None:
        ft = serve_cfg.gcs_fault_tolerance.model_dump() if serve_cfg.gcs_fault_tolerance else {}
        serve_cfg = ServeConfig.parse({**serve_cfg.model_dump(), "gcs_fault_tolerance": {**ft, "redis_address": gcs_redis}},
                                      where="moeray up --gcs-redis")
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


@user_errors
def down():
    """Stop what `moeray up` started (its Serve application and the local Ray nodes), nothing else."""
    from .server import stop_running
    from .settings import cache_root

    state = stop_running(cache_root())
    if state is None:
        err.print("nothing to stop: no server started by `moeray up` is running")
        return
    left = state["leftovers"]
    err.print(f"stopped moeray at {state['url']} (pid {state['pid']})"
              + (f", and {len(left)} process(es) it had started that outlived it (pids {', '.join(map(str, left))})"
                 if left else ""))


@user_errors
def status(
    api_key: Optional[str] = typer.Option(None, help=KEY_HELP),
    url: Optional[str] = typer.Option(None, help=URL_HELP),
    as_json: bool = typer.Option(False, "--json"),
):
    """Actors, nodes, expert placement (epoch, physical slots, replicas), cache use and the last pause."""
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
    _print_serving(out, st)
    out.print(_actors_table(st))


def _print_serving(out: Console, st: dict) -> None:
    """The lines above the actor table: shape, queue, epoch, a change under way, the last hang, step times."""
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
    d = st.get("disaggregation")
    if d:
        p = d["prefill"]
        out.print(f"prefill/decode: prefill engine {p['shape']} ({'healthy' if p['healthy'] else 'UNHEALTHY'}, "
                  f"running {p['running']}, waiting {p['waiting']}); routes {d['routes']}; "
                  f"{d['bytes_moved'] / 1e6:,.1f} MB moved in {d['transfer_s']:.2f}s; failed transfers {d['failures']}; "
                  f"leases {d['leases']} ({d['prefill_blocks_leased']} blocks), arriving {d['decode_blocks_arriving']} blocks"
                  + (f"; sequences recovered {d['recovered']}" if d.get("recovered") else ""))
    kt = st.get("kv_tier")
    if kt:
        out.print(f"KV tier: {kt['loaded_tokens']:,} of {kt['queried_tokens']:,} looked-up prompt tokens loaded "
                  f"({kt['lookups']:,} lookups, {kt.get('remote_blocks', 0):,} blocks from other nodes' tiers, "
                  f"{kt['missed']} failed loads, {kt['load_s']:.2f}s)")
        for actor, a in kt["actors"].items():
            tiers = "; ".join(f"{t['tier']} {t['used_bytes'] / 2**20:,.1f}/{t['capacity_bytes'] / 2**20:,.0f} MiB, "
                              f"{t['hits']:,} hits, misses {t['misses'] or 0}, {t['evictions']:,} evicted"
                              for t in a["tiers"])
            out.print(f"  attention[{actor}]: {a['copied']:,} written through ({a['dropped']} dropped, "
                      f"{a['write_errors']} errors), {a['loaded']:,} loaded; {tiers}")
    spec = st.get("speculative")
    if spec:
        rate = spec["acceptance_rate"]
        out.print(f"speculative decoding: {spec['method']}, up to {spec['num_speculative_tokens']} drafts; "
                  + (f"{spec['accepted_tokens']:,} of {spec['draft_tokens']:,} draft tokens accepted ({rate:.0%}), "
                     f"mean accepted length {spec['mean_accepted_length']:.2f}" if rate is not None else "no drafts yet"))
    b = st.get("breakdown") or {}
    if b.get("steps"):
        parts = ", ".join(f"{k} {1000 * v / b['steps']:.2f}" for k, v in b.items() if k != "steps")
        out.print(f"mean per step, ms: {parts}")
    prof = st.get("profile") or {}
    if prof.get("steps"):  # the per-token profile (cluster/stats.py:step_profile), steps launched alone
        parts = ", ".join(f"{k} {1000 * v / prof['steps']:.2f}" for k, v in prof.items() if k != "steps" and v)
        out.print(f"where a step's time goes, ms ({prof['steps']:,} steps with a timeline): {parts}")


def _actors_table(st: dict):
    """One row per attention replica (cache blocks, prefix cache) and per expert actor (slots, tokens, weights)."""
    from rich.table import Table

    t = Table("actor", "node", "placement / cache")
    if st.get("workers"):  # colocated: one row per worker, both halves
        for w in st["workers"]:
            a, e = w["attention"], w["experts"]
            weights = e.get("weight_bytes")
            held = f"{weights / 2**20:,.1f} MiB of experts" if weights is not None else "experts unknown (no answer)"
            t.add_row(f"worker[{w['index']}]", w["node"],
                      f"attention: {a['sequences']} sequences, cache {a['cache_blocks_used']}/{a['cache_blocks']} "
                      f"blocks held; experts: "
                      f"{_slots_text(e['slots'], e['replicas'])}; {e['tokens']:,} tokens; {held}")
        return t
    for a in st["attention"]:
        pc = a.get("prefix_cache") or {}
        cached = (f", {pc['blocks_cached']} cached" + (f", {pc['snapshots_cached'] + pc['snapshots_held']}/"
                  f"{pc['snapshots']} KDA snapshots" if pc["snapshots"] else "") +
                  f"; prefix hits {pc['hit_tokens']:,}/{pc['queries_tokens']:,} prompt tokens") if pc else ""
        t.add_row(f"attention[{a['index']}]", a["node"],
                  f"{a['sequences']} sequences, cache {a['cache_blocks_used']}/{a['cache_blocks']} blocks held{cached}")
    for e in st["experts"]:
        weights = e.get("weight_bytes")  # None: the actor did not answer (down until the next step recovers it)
        held = f"{weights / 2**20:,.1f} MiB of weights" if weights is not None else "weights unknown (no answer)"
        t.add_row(f"expert[{e['index']}]", e["node"], f"{_slots_text(e['slots'], e['replicas'])}; {e['tokens']:,} tokens; "
                                                       f"{held}")
    return t


def _slots_text(slots: dict[str, list[int]], replicas: dict[str, list[int]]) -> str:
    """Physical slots of one expert actor: one line when every MoE layer is alike, `*` marks a replica."""
    def ids(layer: str) -> str:
        return ",".join(f"{e}*" if e in replicas.get(layer, []) else str(e) for e in slots[layer])

    layers = list(slots)
    if all(slots[l] == slots[layers[0]] and replicas.get(l) == replicas.get(layers[0]) for l in layers):
        return f"experts {ids(layers[0])} (every MoE layer)"
    return "; ".join(f"L{l}: {ids(l)}" for l in layers)

