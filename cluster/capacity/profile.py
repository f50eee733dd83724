"""The CPU profile behind the simulator's :class:`~cluster.capacity.stepcost.CpuCost`: the real engine and
actors (1 attention × 1 expert actor on a throwaway local Ray cluster) run batches of the shapes
the model meets — decodes of 1 to 16 sequences and prefill chunks — and their own per-step timings
are fitted (least squares) into a table:

- attention (one replica, every layer): ``base_s + per_token_s·T + per_pair_s·S`` (T new tokens, S
  attended (query, cache entry) pairs), from the attention actor's compute time;
- experts (one actor, one MoE layer): ``base_s + per_row_s·rows + per_expert_s·experts touched``,
  from the expert actor's compute time and its rows per slot;
- exchange (one MoE layer): ``per_peer_s·max(A, X) + per_token_s·T``, the attention actor's wait for
  the combine beyond the expert compute;
- ``overhead_s``: the rest of a step (sampling, the engine's own work, the messages);
- ``exchange.per_process_s``, ``per_process_token_s`` and ``colocated`` (from a 2 × 2 engine and 2
  colocated workers, after the rest): the cost of more processes than a 1 × 1 engine's sharing the
  cores, and the colocated exchange's own, per MoE layer;
- ``cores``: this machine's, which every actor shares.

Owns: running those batches and the fits. Never: guesses a number it did not measure.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import numpy as np

from model.sampling import SamplingParams

from ..config import EngineConfig
from ..stats import StepRecord


def _fit(rows: list[list[float]], y: list[float], names: tuple[str, ...], *, relative: bool = False) -> dict[str, float]:
    """:func:`_nnls`, then again without the steps it explains worst (residual over 3 median absolute
    residuals: a step stalled by another process on a busy machine), which otherwise pull the fit.

    ``relative``: fit each point's error relative to its time (for times spanning orders of magnitude,
    a 3 ms decode and a 15 ms prefill chunk): fitted absolutely, the few long steps, the noisiest,
    decide the fit and are the ones trimmed, and a stall on one of them zeroed a term (seen in CI; in
    simulated stalls on three real profiles, 67-170 fits in 2,000 against 1-11 relatively)."""
    a, b = np.array(rows, dtype=float), np.array(y, dtype=float)
    if relative:
        w = 1.0 / np.maximum(np.abs(b), 1e-9)
        a, b = a * w[:, None], b * w
    coef = _nnls(a, b)
    resid = np.abs(a @ coef - b)
    keep = resid <= 3 * np.median(resid)
    if np.median(resid) > 0 and a.shape[1] < keep.sum() < len(b):
        coef = _nnls(a[keep], b[keep])
    return dict(zip(names, map(float, coef)))


def _medians(rows: list[list[float]], y: list[float], keys: list) -> tuple[list[list[float]], list[float]]:
    """One point per key (a step's token count: one batch or chunk size): the median of its steps'
    features and of their times. A step slowed by another process on a busy machine then moves
    nothing, where fitted one by one a few such steps pulled a term to 0 (seen in CI)."""
    groups: dict = {}
    for r, v, k in zip(rows, y, keys):
        groups.setdefault(k, ([], []))[0].append(r)
        groups[k][1].append(v)
    out_x = [list(np.median(np.array(rs, dtype=float), axis=0)) for rs, _ in groups.values()]
    return out_x, [float(np.median(vs)) for _, vs in groups.values()]


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares (a cost never falls with more work): the best fit over every subset of
    the terms whose unconstrained least squares is non-negative (a handful of terms: 2^n small fits).
    Clipping an unconstrained fit at 0 instead leaves the other terms fitted to a negative one."""
    best, best_err = np.zeros(a.shape[1]), float(b @ b)
    for mask in range(1, 2 ** a.shape[1]):
        cols = [j for j in range(a.shape[1]) if mask >> j & 1]
        sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (sub < 0).any():
            continue
        coef = np.zeros(a.shape[1])
        coef[cols] = sub
        err = float(((a @ coef) - b) @ ((a @ coef) - b))
        if err < best_err - 1e-18:
            best, best_err = coef, err
    return best


# The profile's own one-node Ray cluster sits at 127.0.0.<PROFILE_IP>, apart from `moeray up`'s nodes
# and the tests' (from 127.0.0.2 up).
PROFILE_IP = 240
# the decode batches of the 2 × 2 engine and the 2 colocated workers
WIDE_BATCHES = (1, 4, 16)
# each prefill chunk size is run this many times (fitted as the median of its steps)
PREFILL_REPEATS = 3


def _run(Engine, ClusterSpec, model_path: str, attention: int, experts: int, batches, prefill_chunks, tokens: int,
         progress) -> tuple[list[tuple[tuple[int, int, int], StepRecord]], int]:
    """(plan (T, S, sequences), step record) of every step after a warm-up, on an ``attention × experts`` engine
    (``experts`` 0: ``attention`` colocated workers)."""
    samples: list = []
    plans: list[tuple[int, int]] = []
    config = EngineConfig.of(model=model_path, max_tokens_per_step=max(prefill_chunks, default=0) + 32, num_blocks=512)
    spec = ClusterSpec(attention=attention, experts=experts) if experts else ClusterSpec.of_workers(attention)
    with Engine(config, spec) as eng:
        send = eng._send

        def recording(plan, **kw):
            chunks = [c for per in plan.chunks for c in per]
            n = [len(c.token_ids) for c in chunks]
            plans.append((sum(n), sum(k * (c.num_cached + k) - k * (k - 1) // 2 for k, c in zip(n, chunks)), len(n)))
            return send(plan, **kw)

        eng._send = recording
        eng.stats.listeners.append(lambda rec: samples.append(rec) if isinstance(rec, StepRecord) else None)
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        rng = np.random.default_rng(0)
        vocab = eng.model_cfg.vocab_size
        eng.generate([[1, 2, 3]], params)  # warm-up, dropped below
        warm = len(samples)
        for b in batches:
            progress(f"profile: {spec.describe()}, {b} sequence(s) decoding")
            eng.generate([rng.integers(1, vocab, 24).tolist() for _ in range(b)], params)
        for t in prefill_chunks:
            progress(f"profile: {spec.describe()}, prefill chunks of {t} tokens")
            for _ in range(PREFILL_REPEATS):  # a prefill is a step or two: its median needs several
                eng.generate([rng.integers(1, vocab, t).tolist() for _ in range(2)],
                             SamplingParams(max_tokens=2, ignore_eos=True))
        num_moe = len(eng.model_cfg.moe_layers)
    return list(zip(plans, samples))[warm:], num_moe


def profile(model_path: str, *, decode_batches=(1, 2, 4, 8, 16), prefill_chunks=(32, 128, 256),
            tokens: int = 24, progress=print, first_ip: int = PROFILE_IP) -> dict:
    """Run the batches on a local 1 × 1 cluster and fit the table (the module docstring); then a
    2 × 2 one, whose steps beyond the 1 × 1 fits give the cost of each more actor process sharing
    the cores (``exchange.per_process_s + per_process_token_s·T``, per MoE layer, T a replica's
    tokens); then 2 colocated workers, whose steps beyond those give the colocated exchange's own
    cost (``colocated.base_s + per_token_s·T`` per MoE layer: each worker also serves the other's
    rows)."""
    import ray

    from ..engine import Engine
    from ..local import LocalCluster
    from ..spec import ClusterSpec

    with LocalCluster(nodes=1, num_cpus=4, object_store_mb=80, memory_mb=2048, first_ip=first_ip) as cluster:
        ray.init(address=cluster.address, logging_level="ERROR")
        try:
            steps, num_moe = _run(Engine, ClusterSpec, model_path, 1, 1, decode_batches, prefill_chunks, tokens, progress)
            wide, _ = _run(Engine, ClusterSpec, model_path, 2, 2, WIDE_BATCHES, (), tokens, progress)
            together, _ = _run(Engine, ClusterSpec, model_path, 2, 0, WIDE_BATCHES, (), tokens, progress)
        finally:
            ray.shutdown()
    if len(steps) < 8:
        raise RuntimeError(f"the profile ran only {len(steps)} steps")
    attn_x, attn_y, exp_x, exp_y, xch_x, xch_y, over = [], [], [], [], [], [], []
    tokens, exp_tokens = [], []
    for (T, S, _), rec in steps:
        tokens.append(T)
        parts = dict(rec.parts)
        attn_x.append([1.0, T, S])
        attn_y.append(parts["attention_compute"])
        if rec.slot_rows is not None:
            rows = rec.slot_rows.sum(2).double()  # [layers, actors]
            touched = (rec.slot_rows > 0).sum(2).double()
            exp_x.append([float((rows > 0).sum()), float(rows.sum()), float(touched.sum())])
            exp_y.append(parts.get("expert_compute", 0.0))
            exp_tokens.append(T)
        xch_x.append([num_moe, num_moe * T])
        xch_y.append(max(0.0, parts["attention_wait"] - parts.get("expert_compute", 0.0)))
        over.append(max(0.0, parts["step"] - parts["attention_compute"] - parts["attention_wait"]
                        - parts["attention_post"]))
    table = {
        "model": Path(model_path).name, "cores": os.cpu_count() or 1, "num_moe_layers": num_moe,
        "steps": len(steps) + len(wide) + len(together),
        "attention": _fit(*_medians(attn_x, attn_y, tokens), ("base_s", "per_token_s", "per_pair_s"), relative=True),
        "experts": _fit(*_medians(exp_x, exp_y, exp_tokens), ("base_s", "per_row_s", "per_expert_s"), relative=True),
        "exchange": _fit(*_medians(xch_x, xch_y, tokens), ("per_peer_s", "per_token_s")) | {"per_process_s": 0.0},
        "overhead_s": statistics.median(over),
    }
    # the 2 × 2 steps: what the 1 × 1 fits leave unexplained, per MoE layer and per process beyond two;
    # then the colocated workers' steps: what that leaves unexplained, per MoE layer
    from .stepcost import CpuCost, Shape

    def residuals(records, shape):
        """(features, residual) per batch profiled: the median over its decode steps with every
        sequence in (one slow step, a heartbeat or a collection beside it, must not move the fit)."""
        cost = CpuCost(table)
        by_batch: dict[int, list[float]] = {}
        for (T, S, n), rec in records:
            if T != n or T not in WIDE_BATCHES:
                continue  # a prefill step (the fits above price those), or a batch's ragged edge
            per = (T + 1) // 2  # the busier replica's sequences
            decode = [(1, max(1, int(S / max(T, 1))))] * per
            rows = rec.slot_rows.sum(2).numpy() if rec.slot_rows is not None else np.zeros((num_moe, 2))
            touched = (rec.slot_rows > 0).sum(2).numpy() if rec.slot_rows is not None else np.zeros((num_moe, 2))
            predicted = cost.step([decode, decode], rows, touched, shape, num_moe).seconds
            by_batch.setdefault(per, []).append(dict(rec.parts)["step"] - predicted)
        pers = sorted(by_batch)
        return [[num_moe, num_moe * per] for per in pers], [statistics.median(by_batch[per]) for per in pers]

    x, y = residuals(wide, Shape(2, 2))
    fit = _fit([[2 * a, 2 * b] for a, b in x], y, ("per_process_s", "per_process_token_s"))
    table["exchange"] |= fit
    table["colocated"] = _fit(*residuals(together, Shape(2, 2, colocated=True)), ("base_s", "per_token_s"))
    return table