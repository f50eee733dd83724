"""The colocated exchange over a real gloo process group of W workers, each both an attention replica and
an expert shard, equals the in-process dispatcher: dense and sparse formats, uneven and replicated
placements, one exchange per layer and two micro-batches posted before collected (two-batch overlap),
a worker with no tokens, over the group's direct sockets (every worker connected to every other)."""

import multiprocessing as mp
import queue
import socket
import traceback

import pytest
import torch

from actors.colocated import ColocatedExchange
from actors.dispatch import LocalDispatcher
from actors.framing import TOKEN_BYTES
from actors.group import current_mesh, join_group
from actors.messages import GroupInfo, PlacementTable
from model.layers import silu_glu
from model.moe import RoutedExperts

pytestmark = pytest.mark.operator

H, I, E, K = 16, 8, 10, 3
TOKEN = b"c" * TOKEN_BYTES
# W = 2 (dense: W <= K) and W = 4 (sparse); placements uneven and with replicated hot experts
CASES = {
    2: {"even": [[(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]] * 2,
        "replicated": [[(3, 0, 1, 2, 4, 5), (3, 5, 6, 7, 8, 9)], [(0, 1, 2, 9, 4), (0, 3, 5, 6, 7, 8)]]},
    4: {"uneven": [[(0, 1, 2), (3, 4), (5, 6, 7), (8, 9)]] * 2,
        "replicated": [[(3, 0, 1), (3, 2, 4), (5, 6, 7), (8, 9, 0)], [(0, 1, 9), (2, 3, 4), (5, 6, 9), (7, 8)]]},
}


def _table(slots, W) -> PlacementTable:
    return PlacementTable(0, E, W, (1, 2), tuple(tuple(map(tuple, s)) for s in slots), colocated=True)


def _shards(table):
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in (1, 2):
        w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3
        out[layer] = []
        for ids in table.slots[table.layer_index(layer)]:
            ex = RoutedExperts(H, I, ids, silu_glu)
            with torch.no_grad():
                ex.w13.copy_(w13[list(ids)])
                ex.w2.copy_(w2[list(ids)])
            out[layer].append(ex)
    return out


def _inputs(rank, layer, cut=None):
    g = torch.Generator().manual_seed(100 * rank + layer)
    T = [7, 0, 13, 5][rank % 4]  # worker 1 has no tokens at all
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.long)
    w = torch.rand(T, K, generator=g)
    if cut is None:
        return x, idx, w
    c = min(3, T)
    return (x[:c], idx[:c], w[:c]) if cut == 0 else (x[c:], idx[c:], w[c:])


def _worker(rank, W, port, q):
    try:
        join_group(GroupInfo(0, "127.0.0.1", port, TOKEN, timeout_s=60), rank, W, num_attention=W, colocated=True)
        assert current_mesh() is not None and sorted(current_mesh().links) == [r for r in range(W) if r != rank]
        for name, slots in CASES[W].items():
            table = _table(slots, W)
            shards = _shards(table)
            local = LocalDispatcher(table, shards)
            mine = {layer: shards[layer][rank] for layer in (1, 2)}
            d = ColocatedExchange(f"worker[{rank}]", rank, table, mine, H, torch.float32, K)
            diffs = []
            d.begin_step(1, (tuple(len(_inputs(r, 1)[0]) for r in range(W)),))
            for layer in (1, 2):  # one micro-batch
                x, idx, w = _inputs(rank, layer)
                got = d.collect(d.issue(layer, x, idx, w))
                diffs.append(float((got - local.for_layer(layer)(x, idx, w)).abs().max()) if len(x) else 0.0)
            served = d.rows_served.clone()
            d.begin_step(2, tuple(tuple(len(_inputs(r, 1, m)[0]) for r in range(W)) for m in (0, 1)))
            for layer in (1, 2):  # two micro-batches posted, then collected (the worker's ping-pong order)
                parts = [_inputs(rank, layer, m) for m in (0, 1)]
                posted = [d.issue(layer, *p) for p in parts]
                for p, part in zip(posted, parts):
                    got = d.collect(p)
                    diffs.append(float((got - local.for_layer(layer)(*part)).abs().max()) if len(part[0]) else 0.0)
            q.put((name, rank, d.mode, max(diffs), served.tolist()))
    except Exception:
        q.put(("crash", rank, traceback.format_exc(), 0, None))


def _spawn(W):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, W, port, q), daemon=True) for r in range(W)]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in range(W * len(CASES[W])):
            out.append(q.get(timeout=120))
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return out


def test_the_colocated_exchange_equals_local_dispatch():
    for W, mode in ((2, "dense"), (4, "sparse")):
        out = _spawn(W)
        crashes = [o for o in out if o[0] == "crash"]
        assert not crashes, crashes[0][2]
        assert len(out) == W * len(CASES[W]), out
        for name in CASES[W]:
            answers = [o for o in out if o[0] == name]
            assert sorted(a[1] for a in answers) == list(range(W)) and all(a[2] == mode for a in answers)
            assert max(a[3] for a in answers) < 1e-5, (W, name, answers)
            # every pair of every worker was served exactly once, by a worker holding its expert
            pairs = sum(_inputs(r, layer)[1].numel() for r in range(W) for layer in (1, 2))
            assert sum(sum(map(sum, a[4])) for a in answers) == pairs, (W, name)
