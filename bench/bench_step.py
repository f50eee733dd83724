"""Where a decode step's time goes (issue 54's per-token profile), per layout, at 1 and 16 streams.

    python bench/bench_step.py [--streams 1,16] [--new-tokens 48] [--prompt-len 32] [--repeats 3]
                               [--layouts disaggregated,colocated] [--compile off,decode]
                               [--transports socket,auto] [--json FILE]

The checkpoint is issue 54's (bench_overhead.py's): a DeepSeek-V3 of 6 layers, 32 routed experts,
hidden 256, fp32, written in the real format. The engine runs on a one-node local Ray cluster, driven
in this process (no Serve: the HTTP path's own share is bench_overhead.py's), as 1 attention × 1 expert
actor (disaggregated) and as 2 colocated workers, with async scheduling off so that every step has one
timeline; each category (cluster/stats.py:step_profile) is measured on its own — the engine's clock
for scheduling and applying, the attention actor's for its parts, both (one host's monotonic clock)
for the control plane — and ``unaccounted`` is the step measured whole less their sum. A last row
per layout gives the step with async scheduling on (the default), measured whole. ``--compile off,decode``
runs each layout eager and with the compiled decode step (model/compiled.py) in the same run: the
columns "disag+c", "coloc+c" are compiled (their attention kinds' time is in ``compiled``).
``--transports socket,auto`` runs each layout over both exchange transports in the same run: the
columns marked "/s" exchange over the links' sockets, the others as ``auto`` does (colocated workers of
one node through mailboxes, actors/board.py).

Beside each category its floor at that batch: the larger of its FLOPs at this machine's measured
GEMM rate (one thread, as an actor runs) and the bytes it must touch (weights read once per step,
the exchange's rows there and back) at the measured copy bandwidth. Medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import SHAPE, prompts  # noqa: E402  (the issue's checkpoint and prompts)

from cluster.stats import PROFILE  # noqa: E402
from model.presets import build_preset  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

LAYOUTS = {"disaggregated": lambda ClusterSpec: ClusterSpec(attention=1, experts=1),
           "colocated": lambda ClusterSpec: ClusterSpec.of_workers(2)}


def machine_rates() -> tuple[float, float]:
    """(GEMM FLOP/s on one thread, copy bytes/s) on this machine, each the best of a few tries."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        best = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(8):
                a @ b
            best = max(best, 8 * 2 * 512 ** 3 / (time.perf_counter() - t0))
        src = torch.randn(32 << 20)  # 128 MiB
        dst = torch.empty_like(src)
        bw = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            bw = max(bw, 2 * src.numel() * 4 / (time.perf_counter() - t0))  # read and write
    finally:
        torch.set_num_threads(threads)
    return best, bw


def weight_bytes(path: Path) -> tuple[dict[str, int], int, int, object]:
    """(bytes per layer kind, one routed expert's bytes, MoE layers, config) of the checkpoint, loaded once."""
    from model.decoder import DecoderLayer
    from model.loader import load_model
    from model.moe import MoE

    model = load_model(path, dtype=torch.float32, progress=False)
    nbytes = lambda mod, skip=(): sum(p.numel() * p.element_size() for n, p in mod.named_parameters()  # noqa: E731
                                      if not n.startswith(skip))
    kinds = {k: 0 for k in ("mla", "kda", "dense_mlp", "moe_local")}
    expert_bytes, moe_layers = 0, 0
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        kinds["kda" if layer.is_kda else "mla"] += nbytes(layer.self_attn) + nbytes(layer.input_layernorm)
        if isinstance(layer.ffn, MoE):
            kinds["moe_local"] += nbytes(layer.ffn, ("experts",)) + nbytes(layer.post_attention_layernorm)
            expert_bytes = nbytes(layer.ffn.experts) // max(1, len(layer.ffn.experts.expert_ids))
            moe_layers += 1
        else:
            kinds["dense_mlp"] += nbytes(layer.ffn) + nbytes(layer.post_attention_layernorm)
    return kinds, expert_bytes, moe_layers, model.cfg


def floors(sizes, batch: int, workers: int, gemm: float, bw: float) -> dict[str, float]:
    """Each category's floor in seconds for one decode step of ``batch`` tokens on the critical
    attention replica (``workers`` colocated workers share the experts' rows); ``sizes``: :func:`weight_bytes`."""
    kinds, expert_bytes, moe_layers, cfg = sizes
    out = {}
    for kind, b in kinds.items():  # decode: each weight read once per step, 2 FLOPs per weight and token
        out[kind] = max(b / bw, 2 * (b / 4) * batch / gemm) if b else 0.0
    touched = min(cfg.n_routed_experts, batch * cfg.num_experts_per_tok * workers)  # distinct experts, per layer
    out["experts"] = moe_layers * max(touched * expert_bytes / workers / bw,
                                      2 * (expert_bytes / 4) * batch * cfg.num_experts_per_tok / gemm)
    head = cfg.hidden_size * cfg.vocab_size * 4
    out["sample"] = max(head / bw, 2 * (head / 4) * batch / gemm)
    out["exchange"] = moe_layers * 2 * batch * cfg.hidden_size * 4 / bw  # a token's row there and back, per MoE layer
    return out


def run_layout(path: Path, layout: str, streams: list[int], prompt_len: int, new: int, reps: int,
               compile_mode: str = "off", transport: str = "auto") -> dict:
    """Per stream count: the profile's median ms per step (async scheduling off), the step with async
    scheduling on, tokens/s both ways."""
    import ray

    from cluster.config import EngineConfig
    from cluster.engine import Engine
    from cluster.local import LocalCluster
    from cluster.spec import ClusterSpec

    out: dict = {}
    with LocalCluster(nodes=1, num_cpus=4, first_ip=62) as cluster:
        ray.init(address=cluster.address, logging_level="WARNING")
        try:
            for asynchronous in (False, True):
                cfg = EngineConfig.of(model=str(path), dtype="float32", max_num_seqs=64,
                                      async_scheduling=asynchronous, prefix_caching=False, compile=compile_mode,
                                      transport=transport)
                with Engine(cfg, LAYOUTS[layout](ClusterSpec)) as eng:
                    eng.generate(prompts(2, prompt_len), SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
                    for n in streams:
                        runs, c0 = [], dict(eng.stats.compiled)
                        for _ in range(reps):
                            p0, s0, t0 = dict(eng.stats.profile), eng.stats.steps, time.perf_counter()
                            seqs = eng.generate(prompts(n, prompt_len), SamplingParams(max_tokens=new, ignore_eos=True))
                            dt = time.perf_counter() - t0
                            assert all(len(s.output_ids) == new for s in seqs)
                            p1 = eng.stats.profile
                            steps = p1["steps"] - p0.get("steps", 0)
                            ms = {k: 1e3 * (v - p0.get(k, 0.0)) / steps for k, v in p1.items() if k != "steps"} \
                                if steps else {}
                            runs.append((ms, 1e3 * dt / (eng.stats.steps - s0), n * new / dt))
                        row = out.setdefault(n, {})
                        key = "async" if asynchronous else "profile"
                        row[key] = {k: statistics.median(r[0].get(k, 0.0) for r in runs) for k in runs[0][0]}
                        row[f"{key}_step_ms"] = statistics.median(r[1] for r in runs)
                        row[f"{key}_tokens_per_s"] = statistics.median(r[2] for r in runs)
                        # the replicas' decode forwards: compiled, or eager by reason (compile: decode)
                        row[f"{key}_compiled"] = {k: v - c0.get(k, 0) for k, v in eng.stats.compiled.items()
                                                  if v > c0.get(k, 0)}
        finally:
            ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default="disaggregated,colocated")
    ap.add_argument("--compile", default="off", help="off, decode, or both (off,decode): each layout both ways")
    ap.add_argument("--transports", default="auto",
                    help="the exchange's transports, each layout with each (e.g. socket,auto: colocated workers "
                         "through the links' sockets, then through mailboxes; columns of socket marked /s)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    modes = args.compile.split(",")
    layouts = [lay + ("+c" if m == "decode" else "") + ("/s" if t == "socket" else "" if t == "auto" else f"/{t}")
               for lay in args.layouts.split(",") for m in modes for t in args.transports.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_preset("deepseek-v3-tiny", Path(tmp) / "ckpt", seed=0, dtype="float32", progress=False,
                            overrides=SHAPE)
        gemm, bw = machine_rates()
        print(f"this machine: GEMM {gemm / 1e9:.1f} GFLOP/s on one thread, copy {bw / 1e9:.1f} GB/s", flush=True)
        sizes = weight_bytes(path)
        floor = {(lay, n): floors(sizes, n, 2 if lay.startswith("colocated") else 1, gemm, bw)
                 for lay in layouts for n in streams}
        results = {}
        for lay in layouts:
            name, _, transport = lay.partition("/")
            results[lay] = run_layout(path, name.removesuffix("+c"), streams, args.prompt_len, args.new_tokens,
                                      args.repeats, "decode" if name.endswith("+c") else "off",
                                      {"s": "socket", "": "auto"}.get(transport, transport))
    cols = [(lay, n) for lay in layouts for n in streams]
    print("\nper decode step, ms (async scheduling off: every step one timeline); floor beside each")
    heads = [lay[:5] + lay[lay.index("+") if "+" in lay else lay.find("/") if "/" in lay else len(lay):]
             + f" {n} stream(s)" for lay, n in cols]
    print(f"{'category':<14}" + "".join(f"{h:>26}" for h in heads))
    for k in (*PROFILE, "unaccounted", "step"):
        cells = []
        for lay, n in cols:
            v = results[lay][n]["profile"].get(k, 0.0)
            f = floor[(lay, n)].get(k)
            cells.append(f"{v:12.3f}" + (f" (≥{1e3 * f:8.3f})" if f is not None else " " * 12))
        print(f"{k:<14}" + "".join(f"{c:>26}" for c in cells))
    total = {c: sum(1e3 * v for v in floor[c].values()) for c in cols}
    print(f"{'floor, summed':<14}" + "".join(f"{total[c]:>26.3f}" for c in cols))
    print(f"{'async on: step':<14}" + "".join(f"{results[lay][n]['async_step_ms']:>26.3f}" for lay, n in cols))
    print(f"{'tokens/s off':<14}" + "".join(f"{results[lay][n]['profile_tokens_per_s']:>26.0f}" for lay, n in cols))
    print(f"{'tokens/s on':<14}" + "".join(f"{results[lay][n]['async_tokens_per_s']:>26.0f}" for lay, n in cols))
    for lay, n in cols:
        p = results[lay][n]["profile"]
        covered = 1 - abs(p.get("unaccounted", 0.0)) / p["step"] if p.get("step") else 0.0
        print(f"{lay} {n}: the categories cover {100 * covered:.1f} % of the step")
        if results[lay][n].get("profile_compiled"):
            print(f"{lay} {n}: decode forwards (compiled, or eager by reason): {results[lay][n]['profile_compiled']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gemm_flops": gemm, "copy_bytes_per_s": bw,
                                               "results": {lay: {str(n): r for n, r in v.items()} for lay, v in results.items()},
                                               "floors_s": {f"{lay}/{n}": f for (lay, n), f in floor.items()}}, indent=1))


if __name__ == "__main__":
    main()
