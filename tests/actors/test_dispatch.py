"""The torch.distributed dispatcher over a real gloo process group == the in-process dispatcher and
the single process bit for bit (1, 2 and 4 expert actors, both formats, bf16 and fp32), and a
collective whose peer is gone or stuck raises a clear error instead of hanging: over the group's
direct sockets (actors/wire.py, the default transport), over shared memory (its rings, and where every
rank shares a node the mailboxes of actors/board.py, asserted taken) and over gloo's own sends."""

import queue
import time
import traceback

import pytest
import torch

from actors.dispatch import DistDispatcher, ExchangeError, ExpertExchange, LocalDispatcher, Routing
from actors.framing import TOKEN_BYTES
from actors.group import current_mesh, join_group
from actors.messages import GroupInfo, PlacementTable
from actors.shm import ShmStream
from actors.router import balanced_layer
from model.layers import silu_glu
from model.moe import RoutedExperts
from tests.actors import exact
from tests.actors.procs import context as mp_context
from tests.ports import free_port

H, I, E, K = 16, 8, 10, 3
TOKEN = b"e" * TOKEN_BYTES  # the epoch's token, the same in every process


def _shards(table: PlacementTable, layers=(1, 2)):
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in layers:
        out[layer] = []
        w13 = torch.randn(E, 2 * I, H, generator=g) * 0.3  # logical expert e's weights, wherever it lives
        w2 = torch.randn(E, H, I, generator=g) * 0.3
        for ids in table.slots[table.layer_index(layer)]:
            ex = RoutedExperts(H, I, ids, silu_glu)
            with torch.no_grad():
                ex.w13.copy_(w13[list(ids)])
                ex.w2.copy_(w2[list(ids)])
            out[layer].append(ex)
    return out


def _table(slots_per_layer, A) -> PlacementTable:
    return PlacementTable(0, E, A, (1, 2), tuple(tuple(map(tuple, s)) for s in slots_per_layer))


def _inputs(rank: int, layer: int):
    g = torch.Generator().manual_seed(100 * rank + layer)
    T = [7, 0, 13][rank % 3]  # one attention rank has no tokens at all
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.long)
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _micro(rank: int, layer: int, m: int):
    """Micro-batch m (of 2) of an attention rank's tokens: the first 3 rows, then the rest."""
    x, idx, w = _inputs(rank, layer)
    cut = min(3, len(x))
    return (x[:cut], idx[:cut], w[:cut]) if m == 0 else (x[cut:], idx[cut:], w[cut:])


def _exchange_ok(rank, A, key, slots, exchange_format, q):
    """One placement and wire format: one exchange per layer, then two micro-batches per layer posted
    before collecting; answers (key, rank, "ok", max |diff|) or (key, rank, "rows", per-slot rows)."""
    table = _table(slots, A)
    shards = _shards(table)
    whole = (tuple(len(_inputs(r, 1)[0]) for r in range(A)),)  # every attention rank's tokens, as the step has them
    micro = tuple(tuple(len(_micro(r, 1, m)[0]) for r in range(A)) for m in (0, 1))
    if rank < A:
        d = DistDispatcher(f"attention[{rank}]", table, H, torch.float32, K, exchange_format)
        d.begin_step(5, whole)
        local = LocalDispatcher(table, shards)
        diffs = []
        for layer in (1, 2):
            x, idx, w = _inputs(rank, layer)
            got = d.exchange(layer, x, idx, w)
            ref = local.for_layer(layer)(x, idx, w)
            diffs.append(float((got - ref).abs().max()) if len(x) else 0.0)
        experts, per_slot = d.take_stats()  # this step's pair counts, per expert and per actor's slot
        for layer in (1, 2):
            li = table.layer_index(layer)
            want = torch.bincount(_inputs(rank, layer)[1].reshape(-1), minlength=E)
            assert torch.equal(experts[li], want), (layer, experts[li], want)
            by_expert = torch.zeros(E, dtype=torch.long)  # each slot's count, back on the expert it holds
            for j, ids in enumerate(table.slots[li]):
                by_expert.index_add_(0, torch.tensor(ids, dtype=torch.long), per_slot[li, j, :len(ids)].long())
                assert int(per_slot[li, j, len(ids):].sum()) == 0  # a padding slot holds nothing
            assert torch.equal(by_expert, want), (layer, by_expert, want)
        d.begin_step(6, micro)
        for layer in (1, 2):  # ping-pong order: both micro-batches posted, then collected
            parts = [_micro(rank, layer, m) for m in (0, 1)]
            pending = [d.issue(layer, *p) for p in parts]
            for p, part in zip(pending, parts):
                got = d.collect(p)
                ref = local.for_layer(layer)(*part)
                diffs.append(float((got - ref).abs().max()) if len(part[0]) else 0.0)
        # through the mailboxes where every rank shares a node (shm), each exchange of an unreplicated layer
        boxed = d.board.exchanges if d.board is not None else 0
        assert boxed == (6 if current_mesh() is not None and current_mesh().board and "uneven" in key else 0), boxed
        q.put((key, rank, "ok", max(diffs)))
    else:
        ex = ExpertExchange(f"expert[{rank - A}]", rank - A, table, K, exchange_format)
        ex.reset_timers(5)  # (the expert actor's step begins so)
        rows = [ex.serve(layer, shards[layer][rank - A], H, torch.float32, whole[0]).tolist() for layer in (1, 2)]
        ex.drain()
        ex.reset_timers(6)
        for layer in (1, 2):
            for m in (0, 1):
                ex.serve(layer, shards[layer][rank - A], H, torch.float32, micro[m])
        ex.drain()  # the last combine has left
        q.put((key, rank, "rows", rows))


def _run(rank, world, port, A, configs, mode, transport, q):
    """configs: (key, slots, exchange_format) for each case, run one after another over the same gloo group
    (mode "ok": each rank, in the same order), or the one case of a failure mode ("stuck", "gone");
    the exchange over shared memory (transport "shm": every rank is on this machine), the group's direct
    sockets ("socket") or gloo's own ops ("group")."""
    key = None
    try:
        # a failure mode's waits are short (2 s); its rendezvous is not: spawned under load, a rank can
        # start seconds after the other (a 2 s join failed in CI with the store not yet up)
        info = GroupInfo(0, "127.0.0.1", port, TOKEN, timeout_s=2 if mode != "ok" else 60, transport=transport,
                         join_timeout_s=60)
        join_group(info, rank, world, num_attention=A)
        assert (current_mesh() is not None) == (transport != "group")
        if transport != "group":  # shm: one node here, so every link shared memory; socket: none
            assert {isinstance(link.sock, ShmStream) for link in current_mesh().links.values()} == {transport == "shm"}
        if mode == "ok":
            for key, slots, exchange_format in configs:
                _exchange_ok(rank, A, key, slots, exchange_format, q)
            return
        ((key, slots, exchange_format),) = configs
        table = _table(slots, A)
        if rank == 0:  # "stuck" / "gone": the attention rank must fail clearly
            d = DistDispatcher("attention[0]", table, H, torch.float32, K, exchange_format)
            d.begin_step(42)
            x, idx, w = _inputs(0, 1)
            t0 = time.monotonic()
            try:
                d.exchange(1, x, idx, w)
                q.put((key, rank, "no error", 0))
            except ExchangeError as e:
                q.put((key, rank, str(e), time.monotonic() - t0))
        elif mode == "stuck":
            time.sleep(15)
        # mode == "gone": the expert rank simply exits
    except Exception:
        q.put((key, rank, "crash", traceback.format_exc()))


def _spawn(world, A, configs, mode, wait_for, transport="auto") -> dict:
    """Answers per config key; waits for `wait_for` answers in all, or until none came for 90 s (a
    crashed rank leaves its peers to their collective timeout: the tests then name what is missing)."""
    ctx = mp_context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run, args=(r, world, port, A, configs, mode, transport, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out = {key: [] for key, _, _ in configs}
    try:
        for _ in range(wait_for):
            key, *answer = q.get(timeout=90)
            out.setdefault(key, []).append(tuple(answer))
    except queue.Empty:
        pass
    finally:  # a "stuck" or "gone" run's answer is in: its processes are killed, not waited for
        for p in procs:
            if mode != "ok":
                p.kill()
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return out


UNEVEN = [[(0, 1, 2, 3), (4, 5, 6), (7, 8, 9)]] * 2
# per layer: hot experts replicated (expert 3 twice in layer 1, experts 0 and 9 in layer 2), any order
REPLICATED = [[(3, 0, 1, 2), (3, 4, 5, 6), (7, 8, 9)], [(0, 1, 2, 9), (0, 3, 4, 5), (6, 7, 8, 9)]]


CASES = [(f"{name}-{exchange_format}", slots, exchange_format)
         for name, slots in (("uneven", UNEVEN), ("replicated", REPLICATED)) for exchange_format in ("dense", "sparse")]


@pytest.fixture(scope="module", params=["shm", "socket", "group"])
def gloo_answers(request):
    """Every case over one gloo group of 2 attention + 3 expert processes (one process start for all),
    per transport: shared memory, the direct sockets and gloo's own sends."""
    return _spawn(world=2 + 3, A=2, configs=CASES, mode="ok", wait_for=5 * len(CASES), transport=request.param)


@pytest.mark.operator
@pytest.mark.parametrize("exchange_format", ["dense", "sparse"])
@pytest.mark.parametrize("slots", [UNEVEN, REPLICATED], ids=["uneven", "replicated"])
def test_gloo_exchange_equals_local_dispatch(gloo_answers, slots, exchange_format):
    out = gloo_answers[f"{'uneven' if slots is UNEVEN else 'replicated'}-{exchange_format}"]
    crashes = [o for o in out if o[1] == "crash"]
    assert not crashes, crashes[0][2]
    assert sorted(o[0] for o in out) == list(range(5)), f"answers from ranks {sorted(o[0] for o in out)} of 0..4"
    diffs = [o[2] for o in out if o[1] == "ok"]
    assert len(diffs) == 2 and max(diffs) < 1e-5
    rows = {o[0] - 2: o[2] for o in out if o[1] == "rows"}  # expert actor → [layer][local slot] rows
    assert sum(sum(map(sum, r)) for r in rows.values()) == sum(_inputs(r, l)[1].numel() for r in range(2) for l in (1, 2))
    table = _table(slots, 2)
    split = []
    for i, layer in enumerate((1, 2)):
        for e in table.replicated(i):  # copy c computed the pairs ranked r ≡ c (mod copies) on each sender
            copies = table.copies(i)[e]
            pairs = [int((_inputs(r, layer)[1] == e).sum()) for r in range(2)]
            expect = [sum(len(range(c, m, len(copies))) for m in pairs) for c in range(len(copies))]
            assert [rows[j][i][local] for j, local in copies] == expect, (layer, e, rows)
            split.append(min(expect))
    assert (max(split, default=0) > 0) == (slots is REPLICATED)  # some replicated expert's rows really were split


@pytest.mark.parametrize("dtype", exact.DTYPES)
def test_local_dispatch_equals_the_single_process_bit_for_bit(dtype):
    """In one process: any placement (1, 2 or 4 shards, replicated hot experts) gives the single
    process's routed rows bit for bit; the replicated ones with one-row GEMMs (exact.row_by_row)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(40)])
    w = torch.rand(40, K, generator=g)
    for X, placements in EXACT.items():
        for name, slots in placements.items():
            table = _table(slots, 1)
            replicated = name == "replicated"
            shards = {layer: [exact.experts(ids, layer, dtype, replicated) for ids in table.slots[table.layer_index(layer)]]
                      for layer in (1, 2)}
            local = LocalDispatcher(table, shards)
            with torch.no_grad():
                for layer in (1, 2):
                    want = exact.experts(range(E), layer, dtype, replicated)(x, idx, w)
                    assert torch.equal(local.for_layer(layer)(x, idx, w), want), (X, name, layer)


@pytest.mark.parametrize("dtype", exact.DTYPES)
def test_the_dense_formats_few_pairs_path_equals_its_tensor_path_bit_for_bit(dtype, monkeypatch):
    """An expert actor's side of the dense format (actors/dense.py: serve_dense) at a decode step's
    few pairs does its bookkeeping on the host (serve_dense_few): the same rows back, bit for bit, the
    same rows per token and the same slots served as the tensor path, for tokens whose pairs are all
    here (summed here), some here, none here, and a step whose every pair is here."""
    import actors.dense as dense

    g = torch.Generator().manual_seed(5)
    experts = RoutedExperts(H, I, range(64), silu_glu).to(dtype)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=g) * 0.3)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=g) * 0.3)
    for N, actors in ((3, 3), (2, 2), (4, 1), (1, 2), (0, 2), (12, 2)):
        x = torch.randn(N, H, generator=g).to(dtype)
        w = torch.rand(N, 4, generator=g)
        actor = torch.randint(0, actors, (N, 4), generator=g)
        if N > 1:
            actor[0] = 0  # a token summed here
            actor[1] = actors - 1  # one summed elsewhere (or here, with one actor)
        local = torch.randint(0, 64, (N, 4), generator=g)
        with torch.no_grad():
            few = dense.serve_dense(experts, x, w, actor, local, 0, x.device)
            monkeypatch.setattr(dense, "FEW_PAIRS", -1)  # the tensor path
            want = dense.serve_dense(experts, x, w, actor, local, 0, x.device)
            monkeypatch.undo()
        for a, b in zip(few, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (N, actors)


def test_replica_split_is_even_and_follows_batch_order():
    table = _table(REPLICATED, 1)
    routing = Routing(table)
    idx = torch.tensor([[3, 5], [3, 7], [1, 3], [3, 0], [3, 8]])  # expert 3: five pairs, two copies
    order, actor, local = routing.route(1, idx)
    pairs_of_3 = [(int(a), int(l)) for e, a, l in zip(idx.reshape(-1), actor, local) if e == 3]
    assert pairs_of_3 == [(0, 0), (1, 0), (0, 0), (1, 0), (0, 0)]  # rank r → copy r % 2, in batch order
    sorted_keys = (actor * table.max_local + local)[order]
    assert torch.equal(sorted_keys, sorted_keys.sort().values)
    again = routing.route(1, idx)
    assert all(torch.equal(a, b) for a, b in zip((order, actor, local), again))


def test_balanced_placement_replicates_the_hottest_and_fills_every_slot():
    load = [100.0, 1, 1, 1, 50, 1, 1, 1, 1, 1]
    slots = balanced_layer(load, num_actors=3, redundant=2)
    held = [e for ids in slots for e in ids]
    assert sorted(len(ids) for ids in slots) == [4, 4, 4] and set(held) == set(range(10))
    assert held.count(0) == 2 and held.count(4) == 2  # the two hottest got the spare slots
    per_actor = [sum(load[e] / held.count(e) for e in ids) for ids in slots]
    contiguous = [sum(load[0:4]), sum(load[4:7]), sum(load[7:10])]  # the even shards: 103, 52, 3
    assert max(per_actor) / (sum(per_actor) / 3) < max(contiguous) / (sum(contiguous) / 3)


@pytest.mark.operator
@pytest.mark.parametrize("transport", ["shm", "socket", "group"])
@pytest.mark.parametrize("mode,exchange_format", [("stuck", "dense"), ("gone", "sparse")])  # one wait/error path
def test_peer_gone_or_stuck_raises_clear_error(mode, exchange_format, transport):
    (res,) = _spawn(world=2, A=1, configs=[(mode, [[tuple(range(10))]] * 2, exchange_format)], mode=mode, wait_for=1,
                    transport=transport)[mode]
    rank, msg, seconds = res
    assert rank == 0 and msg not in ("no error", "crash"), res
    assert "attention[0]" in msg and "step 42" in msg and "MoE layer 1" in msg, msg
    # the group's collective timeout (2 s), not the stuck peer's 15 s sleep nor the join timeout (60 s):
    # on gloo's own sends (transport "group") the waits pass it (they waited out the sleep before)
    assert seconds < 10, res


# per number of expert actors: placements, with replicated hot experts where there are two or more
EXACT = {
    1: {"whole": [[tuple(range(E))]] * 2},
    2: {"even": [[(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]] * 2, "replicated":
        [[(3, 0, 1, 2, 4, 5), (3, 5, 6, 7, 8, 9)], [(0, 1, 2, 9, 4), (0, 3, 5, 6, 7, 8)]]},
    4: {"uneven": [[(0, 1, 2), (3, 4), (5, 6, 7), (8, 9)]] * 2,
        "replicated": [[(3, 0, 1), (3, 2, 4), (5, 6, 7), (8, 9, 0)], [(0, 1, 9), (2, 3, 4), (5, 6, 9), (7, 8)]]},
}
EXACT_A = 3  # attention ranks: 7, 0 and 13 tokens


def _exact_inputs(rank: int, layer: int, dtype: torch.dtype, m: int | None = None):
    """An attention rank's tokens in ``dtype`` (fp32 weights), whole or micro-batch m of 2."""
    x, idx, w = _inputs(rank, layer)
    if m is not None:
        x, idx, w = _micro(rank, layer, m)
    return x.to(dtype), idx, w


@torch.no_grad()
def _exact(rank, X, port, q, transport):
    """Every placement, format and dtype of ``EXACT[X]``: the attention ranks compare their routed rows
    with the single process's over all attention ranks' tokens (one exchange per layer, then two
    micro-batches posted before collected) and answer (key, rank, rows that differ, rows, max diff)."""
    A = EXACT_A
    try:
        # over shared memory (every rank on this machine: the mailboxes, actors/board.py) and the sockets
        join_group(GroupInfo(0, "127.0.0.1", port, TOKEN, timeout_s=60, transport=transport), rank, A + X,
                   num_attention=A)
        for name, slots in EXACT[X].items():
            table = _table(slots, A)
            for fmt in exact.FORMATS:
                for dtype in exact.DTYPES:
                    row_gemms = name == "replicated"  # its copies' GEMMs a row at a time (exact.row_by_row)
                    key = (name, fmt, str(dtype))
                    if rank < A:
                        whole = {layer: exact.experts(range(E), layer, dtype, row_gemms) for layer in (1, 2)}
                        d = DistDispatcher(f"attention[{rank}]", table, H, dtype, K, fmt)
                        tally = exact.Tally()
                        d.begin_step(1, (tuple(len(_inputs(r, 1)[0]) for r in range(A)),))
                        for layer in (1, 2):
                            parts = [_exact_inputs(r, layer, dtype) for r in range(A)]
                            tally.check(d.exchange(layer, *parts[rank]), exact.single(whole[layer], parts, rank))
                        d.begin_step(2, tuple(tuple(len(_micro(r, 1, m)[0]) for r in range(A)) for m in (0, 1)))
                        for layer in (1, 2):
                            parts = [[_exact_inputs(r, layer, dtype, m) for r in range(A)] for m in (0, 1)]
                            pending = [d.issue(layer, *parts[m][rank]) for m in (0, 1)]
                            for m, p in enumerate(pending):
                                tally.check(d.collect(p), exact.single(whole[layer], parts[m], rank))
                        # every rank on this machine: the unreplicated layers' exchanges through the mailboxes
                        boxed = d.board.exchanges if d.board is not None else 0
                        assert boxed == (0 if name == "replicated" or transport == "socket" else 6), (key, boxed)
                        q.put((key, rank, d.mode) + tally.answer())
                    else:
                        j = rank - A
                        mine = {layer: exact.experts(table.slots[table.layer_index(layer)][j], layer, dtype,
                                                     row_gemms) for layer in (1, 2)}
                        ex = ExpertExchange(f"expert[{j}]", j, table, K, fmt)
                        ex.reset_timers(1)  # the step's calls counted from 0, as the attention side's
                        for layer in (1, 2):
                            ex.serve(layer, mine[layer], H, dtype, tuple(len(_inputs(r, layer)[0]) for r in range(A)))
                        ex.drain()
                        ex.reset_timers(2)
                        for layer in (1, 2):
                            for m in (0, 1):
                                tokens = tuple(len(_micro(r, layer, m)[0]) for r in range(A))
                                ex.serve(layer, mine[layer], H, dtype, tokens)
                        ex.drain()
    except Exception:
        q.put(("crash", rank, traceback.format_exc()))


@pytest.mark.operator
@pytest.mark.parametrize("transport", ["shm", "socket"])
@pytest.mark.parametrize("X", sorted(EXACT))
def test_the_exchange_equals_the_single_process_bit_for_bit(X, transport):
    """Each expert actor count, placement, format and dtype: every attention rank's routed rows are the
    single process's bit for bit, so they do not change with the number of expert actors, the format,
    a replicated placement or the transport (the mailboxes, ``shm`` here, or the links' sockets)."""
    ctx = mp_context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_exact, args=(r, X, port, q, transport), daemon=True) for r in range(EXACT_A + X)]
    for p in procs:
        p.start()
    keys = [(name, fmt, str(dtype)) for name in EXACT[X] for fmt in exact.FORMATS for dtype in exact.DTYPES]
    out = []
    try:
        for _ in range(EXACT_A * len(keys)):
            out.append(q.get(timeout=90))
            if out[-1][0] == "crash":
                break
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    crashes = [o for o in out if o[0] == "crash"]
    assert not crashes, crashes[0][2]
    assert len(out) == EXACT_A * len(keys), out
    failed = []
    for key in keys:
        answers = [o for o in out if o[0] == key]
        assert sorted(a[1] for a in answers) == list(range(EXACT_A)) and all(a[2] == key[1] for a in answers), answers
        unequal, rows = sum(a[3] for a in answers), sum(a[4] for a in answers)
        assert rows > 0
        if unequal:
            failed.append(f"X={X} {' '.join(key)}: {unequal}/{rows} rows differ, max {max(a[5] for a in answers):.3g}")
    assert not failed, "\n".join(failed)
