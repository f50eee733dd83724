"""Dispatch / combine: the data half of the router (ARCHITECTURE.md).

Inside an attention worker every MoE layer calls ``routed(x, topk_idx, topk_w)``; a dispatcher
groups the (token, expert) pairs by the physical slot the epoch's placement table assigns
(:class:`Routing`: replicas of a hot expert share its pairs), exchanges them, and combines the
weighted results. Two implementations of one interface:

* :class:`LocalDispatcher` — all shards in this process; the oracle for the distributed path.
* :class:`DistDispatcher` — ``torch.distributed`` over the epoch's process group (gloo on CPU,
  nccl on GPU). Per MoE layer, three ``all_to_all_single`` calls: per-(actor, local expert)
  counts, the token rows, and the result rows back. :class:`ExpertExchange` is its expert-side
  peer. The weights never leave the attention worker; expert actors return unweighted rows.

Every collective runs under the group's timeout; a failure raises :class:`ExchangeError`
naming the actor, the step, the layer and the phase.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from model.moe import RoutedExperts

from .messages import PlacementTable


class ExchangeError(RuntimeError):
    """A collective of the expert exchange failed or timed out (a peer is gone or stuck)."""


class Routing:
    """One dispatcher's view of an epoch's table as tensors, built once per table (never shared
    between dispatchers): per MoE layer, logical expert → its copies as (expert actor, local slot).

    A (token, expert) pair of a replicated expert goes to copy ``r % copies`` where r is the pair's
    rank among this batch's pairs for that expert (batch order): a deterministic, even split."""

    def __init__(self, table: PlacementTable, device: torch.device | str = "cpu"):
        self.table, self.max_local = table, table.max_local
        self.num_copies, self.where = {}, {}
        for i, layer in enumerate(table.moe_layers):
            copies = table.copies(i)
            C = max(len(c) for c in copies)
            where = torch.zeros(table.num_experts, C, 2, dtype=torch.long)
            for e, c in enumerate(copies):
                where[e, : len(c)] = torch.tensor(c)
            self.where[layer] = where.to(device)  # [E, C, 2]
            self.num_copies[layer] = torch.tensor([len(c) for c in copies], device=device)  # [E]

    def route(self, layer: int, topk_idx: torch.Tensor):
        """(token, slot) pairs sorted by (expert actor, local slot): order, actor, local (unsorted)."""
        flat = topk_idx.reshape(-1)
        where, n_copies = self.where[layer].to(flat.device), self.num_copies[layer].to(flat.device)
        if where.shape[1] == 1:
            copy = torch.zeros_like(flat)
        else:  # rank of each pair among the pairs of its expert, in batch order
            by_expert = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=n_copies.numel())
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.empty_like(flat)
            rank[by_expert] = torch.arange(flat.numel(), device=flat.device) - starts[flat[by_expert]]
            copy = rank % n_copies[flat]
        actor, local = where[flat, copy, 0], where[flat, copy, 1]
        order = torch.argsort(actor * self.max_local + local, stable=True)
        return order, actor, local


class LocalDispatcher:
    """All expert shards in one process, routed exactly as the distributed path routes them.

    ``shards[layer][j]`` is expert actor j's :class:`RoutedExperts` for that MoE layer."""

    def __init__(self, table: PlacementTable, shards: dict[int, list[RoutedExperts]]):
        self.routing, self.shards = Routing(table), shards

    def for_layer(self, layer: int) -> Callable:
        def routed(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
            k = topk_idx.shape[1]
            order, actor, local = self.routing.route(layer, topk_idx)
            tok = (torch.arange(x.shape[0]).repeat_interleave(k))[order]
            rows = torch.empty(order.numel(), x.shape[1], dtype=x.dtype)
            for j, shard in enumerate(self.shards[layer]):
                sel = actor[order] == j
                rows[sel] = shard.grouped(x[tok[sel]], local[order][sel])
            out = torch.zeros_like(x)
            out.index_add_(0, tok, rows * topk_w.reshape(-1)[order, None].to(rows.dtype))
            return out

        return routed


class _Collectives:
    """The three exchanges of one MoE layer, shared by both sides, with timing and clear errors."""

    def __init__(self, actor: str, table: PlacementTable, group=None, device: str | torch.device = "cpu"):
        self.actor, self.table, self.group = actor, table, group
        self.num_attention = table.num_attention
        self.device = torch.device(device)  # nccl needs the exchanged tensors on the GPU
        self.world = table.world_size
        self.step, self.exchange_s = -1, 0.0
        self.phase_s = {"counts": 0.0, "dispatch": 0.0, "combine": 0.0}

    def a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, layer: int, phase: str):
        t0 = time.perf_counter()
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except Exception as e:  # gloo raises RuntimeError on timeout or a closed peer
            raise ExchangeError(
                f"{self.actor}: expert exchange failed at step {self.step}, MoE layer {layer}, phase {phase!r} "
                f"(a peer actor is gone or stuck; collective timeout applies): {e}") from e
        finally:
            dt = time.perf_counter() - t0
            self.exchange_s += dt
            self.phase_s[phase] += dt

    def reset_timers(self, step: int) -> None:
        self.step, self.exchange_s = step, 0.0
        self.phase_s = dict.fromkeys(self.phase_s, 0.0)

    def counts(self, send: torch.Tensor, layer: int) -> torch.Tensor:
        """send [world, L] int64 → received [world, L] (what each source sends me per local expert)."""
        recv = torch.empty_like(send)
        self.a2a(recv.view(-1), send.reshape(-1), None, None, layer, "counts")
        return recv


class DistDispatcher(_Collectives):
    """Attention-worker side. Records per-layer token counts per logical expert for the stats."""

    def __init__(self, actor: str, table: PlacementTable, hidden: int, dtype: torch.dtype, group=None,
                 device: str | torch.device = "cpu"):
        super().__init__(actor, table, group, device)
        self.hidden, self.dtype = hidden, dtype
        self.routing = Routing(table, self.device)
        self.expert_tokens: dict[int, torch.Tensor] = {}  # layer → [E] pairs per logical expert
        self.slot_tokens: dict[int, torch.Tensor] = {}  # layer → [expert actors, max_local] rows sent

    def begin_step(self, step: int) -> None:
        self.reset_timers(step)
        self.expert_tokens, self.slot_tokens = {}, {}

    def for_layer(self, layer: int) -> Callable:
        def routed(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
            return self.exchange(layer, x, topk_idx, topk_w)

        return routed

    def exchange(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        T, k = topk_idx.shape
        self.expert_tokens[layer] = torch.bincount(topk_idx.reshape(-1), minlength=self.table.num_experts)
        order, actor, local = self.routing.route(layer, topk_idx)
        A, L = self.num_attention, self.table.max_local
        dev = self.device
        send = torch.zeros(self.world, L, dtype=torch.long, device=dev)
        send[A:].index_put_((actor.to(dev), local.to(dev)), torch.ones_like(actor, device=dev), accumulate=True)
        self.slot_tokens[layer] = send[A:]
        self.counts(send, layer)  # attention workers receive nothing; the call keeps ranks in step
        rows_to = send.sum(1).tolist()
        tok = torch.arange(T, device=x.device).repeat_interleave(k)[order]
        payload = x[tok].to(dev, self.dtype).contiguous()
        none = [0] * self.world
        empty = torch.empty(0, self.hidden, dtype=self.dtype, device=dev)
        self.a2a(empty, payload, none, rows_to, layer, "dispatch")
        back = torch.empty(len(tok), self.hidden, dtype=self.dtype, device=dev)
        self.a2a(back, empty, rows_to, none, layer, "combine")
        out = torch.zeros(T, x.shape[1], dtype=x.dtype, device=x.device)
        out.index_add_(0, tok, back.to(x.device, x.dtype) * topk_w.reshape(-1)[order, None].to(x.dtype))
        return out

    def idle(self, layer: int) -> None:
        """Take part in a layer's exchange with no tokens (a replica with nothing to run)."""
        dev = self.device
        self.exchange(layer, torch.empty(0, self.hidden, dtype=self.dtype, device=dev),
                      torch.empty(0, 1, dtype=torch.long, device=dev), torch.empty(0, 1, device=dev))


class ExpertExchange(_Collectives):
    """Expert-worker side of one MoE layer: receive rows, run the local experts, send rows back."""

    def serve(self, layer: int, experts: RoutedExperts, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Returns the rows received per local slot [max_local]."""
        dev = self.device
        L = self.table.max_local
        recv = self.counts(torch.zeros(self.world, L, dtype=torch.long, device=dev), layer)  # [source, local]
        rows_from = recv.sum(1).tolist()
        none = [0] * self.world
        x = torch.empty(sum(rows_from), hidden, dtype=dtype, device=dev)
        empty = torch.empty(0, hidden, dtype=dtype, device=dev)
        self.a2a(x, empty, rows_from, none, layer, "dispatch")
        local = torch.arange(L, device=dev).repeat(self.world).repeat_interleave(recv.reshape(-1))
        y = experts.grouped(x, local)
        self.a2a(empty, y.contiguous(), none, rows_from, layer, "combine")
        return recv.sum(0)
