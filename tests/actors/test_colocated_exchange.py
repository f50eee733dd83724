"""The colocated exchange over a real gloo process group of W workers, each both an attention replica and
an expert shard, gives the single process's routed rows bit for bit (``RoutedExperts.forward`` of every
expert over the step's tokens, every worker's concatenated in rank order): W = 1, 2, 4, the dense and
the sparse format each forced, bf16 and fp32, even, uneven and replicated placements, one exchange per
layer and two micro-batches posted before collected (two-batch overlap), a worker with no tokens, over
the group's direct sockets (every worker connected to every other, ``transport: socket``) and through
the pairs' mailboxes (actors/board.py: every worker on one node, ``auto``; a micro-batch too large for a
slot, or a replicated layer's, still takes the sockets, asserted). A step without every worker's token
counts is refused."""

import queue
import socket
import traceback

import pytest
import torch

from actors.colocated import ColocatedExchange
from actors.framing import TOKEN_BYTES
from actors.group import current_mesh, join_group
from actors.messages import GroupInfo, PlacementTable
from tests.actors.procs import context as mp_context
from tests.actors.exact import DTYPES, FORMATS, E, H, K, Tally, experts, single

pytestmark = pytest.mark.operator

TOKEN = b"c" * TOKEN_BYTES
# per W: placements, uneven and with replicated hot experts (per MoE layer)
CASES = {
    1: {"whole": [[tuple(range(E))]] * 2},
    2: {"even": [[(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]] * 2,
        "replicated": [[(3, 0, 1, 2, 4, 5), (3, 5, 6, 7, 8, 9)], [(0, 1, 2, 9, 4), (0, 3, 5, 6, 7, 8)]]},
    4: {"uneven": [[(0, 1, 2), (3, 4), (5, 6, 7), (8, 9)]] * 2,
        "replicated": [[(3, 0, 1), (3, 2, 4), (5, 6, 7), (8, 9, 0)], [(0, 1, 9), (2, 3, 4), (5, 6, 9), (7, 8)]]},
}


def _table(slots, W) -> PlacementTable:
    return PlacementTable(0, E, W, (1, 2), tuple(tuple(map(tuple, s)) for s in slots), colocated=True)


def _inputs(rank, layer, dtype=torch.float32, cut=None):
    g = torch.Generator().manual_seed(100 * rank + layer)
    T = [7, 0, 13, 5][rank % 4]  # worker 1 has no tokens at all
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.long)
    w = torch.rand(T, K, generator=g)
    if cut is None:
        return x, idx, w
    c = min(3, T)
    return (x[:c], idx[:c], w[:c]) if cut == 0 else (x[c:], idx[c:], w[c:])


def _case(rank, W, name, slots, fmt, dtype, transport="socket") -> tuple:
    table = _table(slots, W)
    replicated = name == "replicated"  # its copies' GEMMs run a row at a time (see exact.row_by_row)
    mine = {layer: experts(table.slots[table.layer_index(layer)][rank], layer, dtype, replicated) for layer in (1, 2)}
    whole = {layer: experts(range(E), layer, dtype, replicated) for layer in (1, 2)}
    d = ColocatedExchange(f"worker[{rank}]", rank, table, mine, H, dtype, K, exchange_format=fmt)
    tally = Tally()

    d.begin_step(1, (tuple(len(_inputs(r, 1)[0]) for r in range(W)),))
    for layer in (1, 2):  # one micro-batch
        parts = [_inputs(r, layer, dtype) for r in range(W)]
        tally.check(d.collect(d.issue(layer, *parts[rank])), single(whole[layer], parts, rank))
    served = d.rows_served.clone()
    d.begin_step(2, tuple(tuple(len(_inputs(r, 1, cut=m)[0]) for r in range(W)) for m in (0, 1)))
    for layer in (1, 2):  # two micro-batches posted, then collected (the worker's ping-pong order)
        parts = [[_inputs(r, layer, dtype, m) for r in range(W)] for m in (0, 1)]
        posted = [d.issue(layer, *parts[m][rank]) for m in (0, 1)]
        for m, p in enumerate(posted):
            tally.check(d.collect(p), single(whole[layer], parts[m], rank))
    # through the mailboxes: every exchange of an unreplicated layer (4 a layer: 2 steps' micro-batches)
    boxed = 0 if d.board is None else d.board.exchanges
    if transport == "auto" and W > 1:
        assert d.board is not None and d.board.max_tokens >= 13, "every worker is on one node: mailboxes"
        assert boxed == (0 if name == "replicated" else 6), (name, boxed)  # a replicated table: the links
    else:
        assert boxed == 0
    return (d.mode,) + tally.answer() + (served.tolist(),)


@torch.no_grad()
def _worker(rank, W, port, q, transport):
    try:
        join_group(GroupInfo(0, "127.0.0.1", port, TOKEN, timeout_s=60, transport=transport), rank, W,
                   num_attention=W, colocated=True)
        assert current_mesh() is not None and sorted(current_mesh().links) == [r for r in range(W) if r != rank]
        for name, slots in CASES[W].items():
            for fmt in FORMATS:
                for dtype in DTYPES:
                    q.put(((name, fmt, str(dtype)), rank) + _case(rank, W, name, slots, fmt, dtype, transport))
    except Exception:
        q.put(("crash", rank, traceback.format_exc()))


@torch.no_grad()
def _refusal(rank, W, port, q):
    """A step begun without every worker's token counts, and one whose counts disagree with the rows:
    each refused before anything is sent."""
    try:
        join_group(GroupInfo(0, "127.0.0.1", port, TOKEN, timeout_s=5), rank, W, num_attention=W, colocated=True)
        table = _table(CASES[W]["even"], W)
        mine = {layer: experts(table.slots[table.layer_index(layer)][rank], layer, torch.float32)
                for layer in (1, 2)}
        answers = []
        for tokens in ((), ((3, 4),), ((7, 7, 7),)):
            d = ColocatedExchange(f"worker[{rank}]", rank, table, mine, H, torch.float32, K, exchange_format="dense")
            d.begin_step(9, tokens)
            x, idx, w = _inputs(0, 1)
            try:
                d.collect(d.issue(1, x, idx, w))
                answers.append("no error")
            except ValueError as e:
                answers.append(str(e))
            assert d.calls == 0, "something was sent"
        q.put(("refusal", rank, answers))
    except Exception:
        q.put(("crash", rank, traceback.format_exc()))


def _spawn(W, target, answers, *extra):
    ctx = mp_context()
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, W, port, q, *extra), daemon=True) for r in range(W)]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in range(answers):
            out.append(q.get(timeout=120))
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return out


@pytest.mark.parametrize("transport", ["socket", "auto"])
def test_the_colocated_exchange_equals_the_single_process_bit_for_bit(transport):
    failed = []
    for W in CASES:
        keys = [(name, fmt, str(dtype)) for name in CASES[W] for fmt in FORMATS for dtype in DTYPES]
        out = _spawn(W, _worker, W * len(keys), transport)
        crashes = [o for o in out if o[0] == "crash"]
        assert not crashes, crashes[0][2]
        assert len(out) == W * len(keys), out
        for key in keys:
            name, fmt, dtype = key
            answers = [o for o in out if o[0] == key]
            assert sorted(a[1] for a in answers) == list(range(W)) and all(a[2] == fmt for a in answers), answers
            unequal, rows = sum(a[3] for a in answers), sum(a[4] for a in answers)
            assert rows > 0
            if unequal:
                failed.append(f"W={W} {name} {fmt} {dtype}: {unequal}/{rows} rows differ, max "
                              f"{max(a[5] for a in answers):.3g}")
            # every pair of every worker was served exactly once, by a worker holding its expert
            pairs = sum(_inputs(r, layer)[1].numel() for r in range(W) for layer in (1, 2))
            assert sum(sum(map(sum, a[6])) for a in answers) == pairs, (W, key)
    assert not failed, "\n".join(failed)


def test_a_step_without_every_workers_token_counts_is_refused():
    W = 2
    out = _spawn(W, _refusal, W)
    crashes = [o for o in out if o[0] == "crash"]
    assert not crashes, crashes[0][2]
    assert sorted(o[1] for o in out) == [0, 1], out
    for _, rank, (forgot, wrong_count, wrong_workers) in out:
        assert "every worker's token count" in forgot and "peer_tokens" in forgot, forgot
        assert f"worker[{rank}]" in wrong_count and "the step said" in wrong_count, wrong_count
        assert "3 workers" in wrong_workers and "2 in this epoch" in wrong_workers, wrong_workers
