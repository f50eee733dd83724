"""The torch.distributed dispatcher over a real gloo process group == the in-process dispatcher,
and a collective whose peer is gone or stuck raises a clear error instead of hanging."""

import multiprocessing as mp
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch

from actors.dispatch import DistDispatcher, ExchangeError, ExpertExchange, LocalDispatcher
from actors.messages import PlacementTable
from model.layers import silu_glu
from model.moe import RoutedExperts

H, I, E, K = 16, 8, 10, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shards(table: PlacementTable, layers=(1, 2)):
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in layers:
        out[layer] = []
        for lo, hi in table.ranges:
            ex = RoutedExperts(H, I, range(lo, hi), silu_glu)
            with torch.no_grad():
                ex.w13.copy_(torch.randn(ex.w13.shape, generator=g) * 0.3)
                ex.w2.copy_(torch.randn(ex.w2.shape, generator=g) * 0.3)
            out[layer].append(ex)
    return out


def _inputs(rank: int, layer: int):
    g = torch.Generator().manual_seed(100 * rank + layer)
    T = [7, 0, 13][rank % 3]  # one attention rank has no tokens at all
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.long)
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _run(rank, world, port, A, ranges, mode, q):
    try:
        import torch.distributed as dist

        table = PlacementTable(0, E, tuple(ranges))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=4 if mode != "ok" else 60))
        shards = _shards(table)
        if mode == "ok":
            if rank < A:
                d = DistDispatcher(f"attention[{rank}]", table, A, H, torch.float32)
                d.begin_step(5)
                local = LocalDispatcher(table, shards)
                diffs = []
                for layer in (1, 2):
                    x, idx, w = _inputs(rank, layer)
                    got = d.exchange(layer, x, idx, w)
                    ref = local.for_layer(layer)(x, idx, w)
                    diffs.append(float((got - ref).abs().max()) if len(x) else 0.0)
                    assert d.expert_tokens[layer].sum().item() == idx.numel()
                q.put((rank, "ok", max(diffs)))
            else:
                ex = ExpertExchange(f"expert[{rank - A}]", table, A)
                rows = [ex.serve(layer, shards[layer][rank - A]) for layer in (1, 2)]
                q.put((rank, "rows", rows))
        elif rank == 0:  # "stuck" / "gone": the attention rank must fail clearly
            d = DistDispatcher("attention[0]", table, A, H, torch.float32)
            d.begin_step(42)
            x, idx, w = _inputs(0, 1)
            t0 = time.monotonic()
            try:
                d.exchange(1, x, idx, w)
                q.put((rank, "no error", 0))
            except ExchangeError as e:
                q.put((rank, str(e), time.monotonic() - t0))
        elif mode == "stuck":
            time.sleep(15)
        # mode == "gone": the expert rank simply exits
    except Exception:
        q.put((rank, "crash", traceback.format_exc()))


def _spawn(world, A, ranges, mode, wait_for):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_run, args=(r, world, port, A, ranges, mode, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return [q.get(timeout=90) for _ in range(wait_for)]
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()


def test_gloo_exchange_equals_local_dispatch():
    ranges = [(0, 4), (4, 7), (7, 10)]  # uneven shards
    out = _spawn(world=2 + 3, A=2, ranges=ranges, mode="ok", wait_for=5)
    crashes = [o for o in out if o[1] == "crash"]
    assert not crashes, crashes[0][2]
    diffs = [o[2] for o in out if o[1] == "ok"]
    assert len(diffs) == 2 and max(diffs) < 1e-5
    rows = sum(sum(o[2]) for o in out if o[1] == "rows")
    assert rows == sum(_inputs(r, l)[1].numel() for r in range(2) for l in (1, 2))


@pytest.mark.parametrize("mode", ["stuck", "gone"])
def test_peer_gone_or_stuck_raises_clear_error(mode):
    (res,) = [o for o in _spawn(world=2, A=1, ranges=[(0, 10)], mode=mode, wait_for=1)]
    rank, msg, seconds = res
    assert rank == 0 and msg not in ("no error", "crash"), res
    assert "attention[0]" in msg and "step 42" in msg and "MoE layer 1" in msg, msg
    assert seconds < 30
