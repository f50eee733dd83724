"""The operations ``moeray`` commands, against a running app: ``scale experts|attention|workers`` and
``rebalance`` (live changes of shape and placement), ``chaos kill-expert|kill-attention|kill-worker``
(fault injection), ``experts`` (routed tokens per expert) and ``bench serve`` (a load test of any
OpenAI-compatible server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .cli_common import ADMIN_KEY_HELP, KEY_HELP, URL_HELP, err, user_errors


def register(app: typer.Typer) -> None:
    """Add the operations commands and command groups to ``app``, in the order ``moeray --help`` lists them."""
    app.command()(rebalance)
    app.command()(experts)
    app.add_typer(scale_app, name="scale")
    app.add_typer(chaos_app, name="chaos")
    app.add_typer(bench_app, name="bench")


scale_app = typer.Typer(help="Change the number of expert actors or attention replicas (or, in the colocated "
                             "layout, workers) of the running app, live: in-flight requests keep streaming. "
                             "`moeray scale prefill ...` changes a prefill/decode deployment's prefill engine.",
                        no_args_is_help=True)


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


def _scale_commands(app: typer.Typer, engine: str) -> None:
    """``experts``, ``attention`` and ``workers`` on ``app``, each changing ``engine``'s shape."""
    which = "" if engine == "decode" else f" of the {engine} engine"

    def send(kind: str, n: int, url, admin_key, as_json) -> None:
        _change(f"/admin/scale/{kind}", {"n": n} | ({"engine": engine} if engine != "decode" else {}), url,
                admin_key, as_json)

    @app.command("experts", help=f"Re-shard the routed experts{which} over N expert actors (up or down).")
    @user_errors
    def scale_experts(
        n: int = typer.Argument(..., help="Expert actors after the change."),
        url: Optional[str] = typer.Option(None, help=URL_HELP),
        admin_key: Optional[str] = typer.Option(None, help=ADMIN_KEY_HELP),
        as_json: bool = typer.Option(False, "--json"),
    ):
        send("experts", n, url, admin_key, as_json)

    @app.command("attention", help=f"Add attention replicas{which} (they take new sequences at once) or remove "
                                   "some (their sequences move).")
    @user_errors
    def scale_attention(
        n: int = typer.Argument(..., help="Attention replicas after the change."),
        url: Optional[str] = typer.Option(None, help=URL_HELP),
        admin_key: Optional[str] = typer.Option(None, help=ADMIN_KEY_HELP),
        as_json: bool = typer.Option(False, "--json"),
    ):
        send("attention", n, url, admin_key, as_json)

    @app.command("workers", help=f"Colocated layout: move{which} to N workers, each an attention replica and an "
                                 "expert shard (a removed worker's sequences are re-prefilled on the others, its "
                                 "experts move to the rest).")
    @user_errors
    def scale_workers(
        n: int = typer.Argument(..., help="Workers after the change (the colocated layout)."),
        url: Optional[str] = typer.Option(None, help=URL_HELP),
        admin_key: Optional[str] = typer.Option(None, help=ADMIN_KEY_HELP),
        as_json: bool = typer.Option(False, "--json"),
    ):
        send("workers", n, url, admin_key, as_json)


_scale_commands(scale_app, "decode")  # the serving engine: `moeray scale experts N`
for _engine in ("prefill", "decode"):  # a prefill/decode deployment's engines: `moeray scale prefill experts N`
    _group = typer.Typer(help=f"Change the {_engine} engine's shape (a prefill/decode deployment"
                              + ("; the same as `moeray scale ...`)." if _engine == "decode" else ")."),
                         no_args_is_help=True)
    _scale_commands(_group, _engine)
    scale_app.add_typer(_group, name=_engine)


chaos_app = typer.Typer(help="Fault injection against your own running app: a real `ray.kill` of one actor. "
                             "The app recovers by itself; watch `moeray status` and /metrics.", no_args_is_help=True)


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


@chaos_app.command("kill-worker")
@user_errors
def chaos_kill_worker(
    index: int = typer.Argument(..., help="Which worker (as `moeray status` numbers them)."),
    url: Optional[str] = typer.Option(None, help=URL_HELP),
    admin_key: Optional[str] = typer.Option(None, help=ADMIN_KEY_HELP),
):
    """Colocated layout: kill worker INDEX (its attention replica and expert shard)."""
    _kill("worker", index, url, admin_key)


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

