"""Recovery benchmark: dead actors, and hung ones.

    python bench/bench_recovery.py [--preset kimi-k2-tiny] [--runs 3] [--streams 6] [--standby 0 1]

On 3 local Ray nodes, a 2 attention x 3 expert engine with ``--streams`` greedy requests in flight:
an expert actor is killed (``ray.kill``, as `moeray chaos kill-expert 1` does), then an attention
actor; then an expert actor is hung (``kill -STOP`` on its process: alive, answering nothing), then
an attention actor, for the hang watchdog to find (cluster/watchdog.py). Once per ``--standby`` value N (N warm standby actors of each kind; 0 = a new actor is started
for the dead one), in the same run, so the ratios compare like with like. Per kill:
- recovery: failed step → dead actor replaced → cluster serving again in a recovery epoch;
  of which ``replace`` (the replacement started: a standby taken, or a new actor up) and ``regroup``
  (every actor in the new process group, the replacement loading the dead one's experts);
- detect: from the failing step's start until the failure was known (the step's wall time less the
  recovery);
- redo: the first step after the recovery (it redoes the failed step; re-prefills a dead attention
  replica's sequences), against a median decode step before the kill;
- hangs: ``stop_to_serving_s``, from the SIGSTOP until the first step after the recovery completed
  (the watchdog's budget, the heartbeat round, the kill, the recovery epoch, the redone step);
- whether every request still ended with exactly the tokens of a fault-free run.
Medians of ``--runs``; a JSON line at the end."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time

import ray
import torch

from cluster.engine import Engine, EngineConfig
from cluster.local import LocalCluster
from cluster.spec import ClusterSpec
from model.presets import build_preset
from model.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=48, ignore_eos=True)
KEYS = ("recovery_s", "replace_s", "regroup_s", "detect_s", "redo_s", "decode_step_s")
HANG_KEYS = KEYS + ("stop_to_serving_s",)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, 700, (10 + 3 * i,), generator=g).tolist() for i in range(n)]


def _timed_step(eng: Engine) -> float:
    t0 = time.perf_counter()
    eng.step()
    return time.perf_counter() - t0


def _standbys_up(eng: Engine) -> None:
    ray.get([m.actor.node_id.remote() for m in eng.executor.fleet.standby], timeout=300)


def run_with_kill(eng: Engine, prompts, kind: str, index: int) -> tuple[list[list[int]], dict]:
    _standbys_up(eng)  # a standby started by the previous recovery is warm before the next kill
    ids = [eng.add_request(p, PARAMS) for p in prompts]
    decode = [_timed_step(eng) for _ in range(4)][1:]  # the first one prefills
    members = eng.executor.fleet.experts if kind == "expert" else eng.executor.fleet.attention
    ray.kill(members[index].actor, no_restart=True)
    n = len(eng.epochs.changes)
    failing = _timed_step(eng)
    redo = _timed_step(eng)
    while eng.has_work:
        eng.step()
    change, recovery = eng.epochs.changes[n], eng.stats.recoveries[-1]
    return [eng.release(i).seq.output_ids for i in ids], {
        "recovery_s": recovery, "replace_s": change.replace_s, "regroup_s": change.regroup_s,
        "detect_s": failing - recovery, "redo_s": redo, "decode_step_s": statistics.median(decode)}


def run_with_stop(eng: Engine, prompts, kind: str, index: int) -> tuple[list[list[int]], dict]:
    """As run_with_kill, but the actor's process is stopped (SIGSTOP) instead of killed."""
    _standbys_up(eng)
    ids = [eng.add_request(p, PARAMS) for p in prompts]
    decode = [_timed_step(eng) for _ in range(4)][1:]
    members = eng.executor.fleet.experts if kind == "expert" else eng.executor.fleet.attention
    pid = ray.get(members[index].actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    n = len(eng.epochs.changes)
    t_stop = time.perf_counter()
    os.kill(pid, signal.SIGSTOP)
    try:
        failing = _timed_step(eng)
        redo = _timed_step(eng)
        serving = time.perf_counter() - t_stop
        while eng.has_work:
            eng.step()
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):  # Ray killed it; if not, this bench started the stop
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
    assert eng.stats.last_hang is not None and len(eng.epochs.changes) == n + 1, "the hang was not found"
    change, recovery = eng.epochs.changes[n], eng.stats.recoveries[-1]
    return [eng.release(i).seq.output_ids for i in ids], {
        "recovery_s": recovery, "replace_s": change.replace_s, "regroup_s": change.regroup_s,
        "detect_s": failing - recovery, "redo_s": redo, "decode_step_s": statistics.median(decode),
        "stop_to_serving_s": serving}


def one_run(path: str, prompts, standby: int) -> dict:
    cfg = EngineConfig.of(model=path, collective_timeout_s=10, max_tokens_per_step=128,
                       standby_attention=standby, standby_experts=standby)
    with Engine(cfg, ClusterSpec(attention=2, experts=3)) as eng:
        reference = [s.output_ids for s in eng.generate(prompts, PARAMS)]
        out_e, expert = run_with_kill(eng, prompts, "expert", 1)
        out_a, attention = run_with_kill(eng, prompts, "attention", 0)
        out_he, hung_e = run_with_stop(eng, prompts, "expert", 1)
        out_ha, hung_a = run_with_stop(eng, prompts, "attention", 1)
    return {"expert": {**expert, "exact": out_e == reference}, "attention": {**attention, "exact": out_a == reference},
            "hung expert": {**hung_e, "exact": out_he == reference},
            "hung attention": {**hung_a, "exact": out_ha == reference}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k2-tiny")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--standby", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    results: dict[int, list[dict]] = {n: [] for n in args.standby}
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(nodes=3, num_cpus=4) as cluster:
        path = str(build_preset(args.preset, f"{tmp}/m", seed=0, dtype="float32", progress=False))
        ray.init(address=cluster.address, logging_level="WARNING")
        prompts = _prompts(args.streams)
        for _ in range(args.runs):
            for n in args.standby:
                results[n].append(one_run(path, prompts, n))
        ray.shutdown()
    cases = ("expert", "attention", "hung expert", "hung attention")
    med = {n: {k: {**{key: statistics.median(r[k][key] for r in rs) for key in (HANG_KEYS if "hung" in k else KEYS)},
                   "all_exact": all(r[k]["exact"] for r in rs)} for k in cases}
           for n, rs in results.items()}
    print(f"{args.preset}, 2 attention x 3 experts, {args.streams} streams in flight, median of {args.runs} runs")
    for n, m in med.items():
        for k, v in m.items():
            hang = f"; SIGSTOP to serving {v['stop_to_serving_s']:.2f}s" if "stop_to_serving_s" in v else ""
            print(f"  standby {n}, {'kill ' if 'hung' not in k else ''}{k:14s}: recovery {v['recovery_s']:.2f}s "
                  f"(replace {v['replace_s']:.2f}s, regroup {v['regroup_s']:.2f}s); detect {v['detect_s']:.2f}s; "
                  f"redo step {v['redo_s']:.2f}s (decode step {v['decode_step_s']:.3f}s){hang}; "
                  f"outputs exact: {v['all_exact']}")
    if 0 in med and len(med) > 1:
        for n in [n for n in med if n]:
            for k in cases:
                ratios = [a[k]["recovery_s"] / b[k]["recovery_s"] for a, b in zip(results[n], results[0])]
                print(f"  recovery with {n} standby / without, kill {k}: median ratio {statistics.median(ratios):.2f}")
    print(json.dumps({"preset": args.preset, "median": med, "runs": results}))


if __name__ == "__main__":
    main()
