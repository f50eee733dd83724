"""Dispatch / combine: the data half of the router (docs/architecture.md).

Inside an attention worker every MoE layer hands ``(x, topk_idx, topk_w)`` to a dispatcher, which
exchanges the tokens with the expert actors by the epoch's placement table (:class:`Routing`:
replicas of a hot expert share its pairs) and combines the weighted results. Two implementations:

* :class:`LocalDispatcher` — all shards in this process; the oracle for the distributed path.
* :class:`DistDispatcher` — ``torch.distributed`` over the epoch's process group (gloo on CPU,
  nccl on GPU); :class:`ExpertExchange` is its expert-side peer. Two wire formats, chosen per
  table (:func:`exchange_mode`):

  - ``dense`` (when there are no more expert actors than experts per token): every attention rank
    sends its T token rows, with their top-k ids and weights packed in the same bytes, to every
    expert actor; each expert actor routes them and runs its pairs. Back comes, per token, its
    pairs' unweighted rows (one per pair, from the actor that ran it), or one row — the token's
    sum — from an actor that ran all k of its pairs; the attention rank sums each token's rows
    (:func:`model.moe.weighted_sum`). Both sides know every size from the top-k ids they hold (no
    counts exchange; a host sync on each side for the combine's sizes), and the dispatch moves no
    more bytes than the sparse format while expert actors ≤ k.
  - ``sparse``: the (token, expert) pairs go only where their expert lives — a counts exchange,
    the rows, and the unweighted rows back. For many expert actors (> k), where the dense format
    would send every token to every actor.

  Either way a token's routed output is the one sum of :func:`model.moe.weighted_sum`, made by
  whoever holds all of its k rows: the single process's bits for the same expert rows, whatever the
  format, the number of expert actors or the placement. (A per-actor partial sum cannot be: fp32
  addition is not associative, so the partials' grouping would change the bits.)

  Each exchange is ``all_to_all_single``-shaped (rows to and from each rank by split sizes). On
  NCCL it is that call; on gloo it is point-to-point sends and receives with just the ranks that
  have rows (gloo's all-to-all runs on a worker thread and visits every rank: twice the latency of a
  send and a receive on this machine), each tagged with its call number in the step.

  The attention side is asynchronous (:meth:`DistDispatcher.issue` posts a micro-batch's exchange,
  :meth:`DistDispatcher.collect` waits for it), so an attention worker can compute one micro-batch
  while the expert actors compute another (ping-pong). Every attention rank and expert actor runs
  the same (MoE layer, micro-batch) sequence of exchanges, layer-major.

Every collective runs under the group's timeout; a failure raises :class:`ExchangeError` naming the
actor, the step, the layer and the phase.
"""

from __future__ import annotations

import time
from datetime import timedelta
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from model.moe import RoutedExperts, weighted_sum

from . import board
from .board import board_of
from .dense import dense_returns, serve_dense, whole_few
from .group import collective_timeout, current_mesh
from .messages import PlacementTable


def _view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (bytes) as ``dtype``: a view when its strides allow one, else a copy."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return t.contiguous().view(dtype)


class ExchangeError(RuntimeError):
    """A collective of the expert exchange failed or timed out (a peer is gone or stuck)."""


def exchange_mode(table: PlacementTable, top_k: int, setting: str = "auto") -> str:
    """``dense`` or ``sparse`` (see the module docstring); ``setting`` forces one."""
    if setting not in ("auto", "dense", "sparse"):
        raise ValueError(f"exchange must be auto, dense or sparse, got {setting!r}")
    if setting != "auto":
        return setting
    return "dense" if table.num_actors <= top_k else "sparse"


class Routing:
    """One dispatcher's view of an epoch's table as tensors, built once per table (never shared
    between dispatchers): per MoE layer, logical expert → its copies as (expert actor, local slot).

    A (token, expert) pair of a replicated expert goes to copy ``r % copies`` where r is the pair's
    rank among the pairs for that expert from the same sender (batch order): a deterministic, even
    split that the sender and the expert actors compute alike."""

    def __init__(self, table: PlacementTable, device: torch.device | str = "cpu"):
        self.table, self.max_local = table, table.max_local
        self.num_copies, self.where, self.single, self.identity = {}, {}, {}, set()
        self._lists: dict[int, tuple[list[int], list[int]]] = {}
        for i, layer in enumerate(table.moe_layers):
            copies = table.copies(i)
            max_copies = max(len(c) for c in copies)
            where = torch.zeros(table.num_experts, max_copies, 2, dtype=torch.long)
            for e, c in enumerate(copies):
                where[e, : len(c)] = torch.tensor(c)
            self.where[layer] = where.to(device)  # [logical experts, max copies, (expert actor, local slot)]
            self.num_copies[layer] = torch.tensor([len(c) for c in copies], device=device)  # [logical experts]
            if max_copies == 1:  # no replicas: (expert actor, local slot) of each logical expert, for direct lookup
                self.single[layer] = (where[:, 0, 0].contiguous().to(device), where[:, 0, 1].contiguous().to(device))
                if table.num_actors == 1 and table.slots[i][0] == tuple(range(table.num_experts)):
                    self.identity.add(layer)  # one actor holding every expert in order: local slot = expert

    def replicated(self, layer: int) -> bool:
        return layer not in self.single

    def lists(self, layer: int) -> tuple[list[int], list[int]]:
        """An unreplicated layer's expert → (expert actor, local slot) as host lists (made once): a decode
        step's few pairs are routed on the host."""
        if layer not in self._lists:
            actor_of, local_of = self.single[layer]
            self._lists[layer] = (actor_of.tolist(), local_of.tolist())
        return self._lists[layer]

    def assign(self, layer: int, topk_idx: torch.Tensor, sender: torch.Tensor | None = None, senders: int = 1):
        """(expert actor, local slot) of every pair, in batch order; ``sender`` [pairs] (optional)
        names each pair's sender (of ``senders``) when pairs of several senders are routed at once."""
        flat = topk_idx.reshape(-1)
        if layer in self.single:
            actor_of, local_of = self.single[layer]
            return actor_of[flat], local_of[flat]
        where, n_copies = self.where[layer].to(flat.device), self.num_copies[layer].to(flat.device)
        # rank of each pair among the pairs of its (sender, expert), in batch order
        n_experts = n_copies.numel()  # logical experts
        key = flat if sender is None else sender * n_experts + flat  # [pairs]
        by_key = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=n_experts * senders)  # [senders × logical experts]
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(flat)
        rank[by_key] = torch.arange(flat.numel(), device=flat.device) - starts[key[by_key]]
        copy = rank % n_copies[flat]
        return where[flat, copy, 0], where[flat, copy, 1]

    def route(self, layer: int, topk_idx: torch.Tensor):
        """(token, slot) pairs sorted by (expert actor, local slot): order, actor, local (unsorted)."""
        actor, local = self.assign(layer, topk_idx)
        order = torch.argsort(actor * self.max_local + local, stable=True)
        return order, actor, local


class LocalDispatcher:
    """All expert shards in one process, routed exactly as the distributed path routes them.

    ``shards[layer][j]`` is expert actor j's :class:`RoutedExperts` for that MoE layer."""

    def __init__(self, table: PlacementTable, shards: dict[int, list[RoutedExperts]]):
        self.routing, self.shards = Routing(table), shards

    def for_layer(self, layer: int) -> Callable:
        def routed(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
            T, k = topk_idx.shape
            actor, local = self.routing.assign(layer, topk_idx)
            rows = torch.empty(T * k, x.shape[1], dtype=x.dtype)  # [T·k, H]: each pair's unweighted row
            for j, shard in enumerate(self.shards[layer]):
                sel = (actor == j).nonzero().squeeze(1)  # shard j's pairs, in batch order
                rows[sel] = shard.grouped(x[sel // k], local[sel])
            return weighted_sum(rows.view(T, k, x.shape[1]), topk_w)

        return routed


def _per_sender(per_token: torch.Tensor, tokens) -> list[int]:
    """Rows per sender, from rows per token [N] and each sender's token count (in rank order)."""
    if not len(per_token):
        return [0] * len(tokens)
    return torch.stack([c.sum() for c in per_token.split(list(tokens))]).tolist()


@dataclass
class _DenseBack:
    """What a rank's tokens get back in the dense format: ``counts[s]`` rows from expert actor s,
    arriving in actor order and within each in batch order, the returned pairs in that order
    (``order`` [R], pair = token · k + slot), and ``whole`` [T], the tokens that come back summed."""

    counts: list[int]
    order: torch.Tensor | None = None  # None: one actor, every token summed there
    whole: torch.Tensor | None = None

    @classmethod
    def expect(cls, actor: torch.Tensor, n_actors: int) -> _DenseBack:
        """From the tokens' pairs' expert actors ``actor`` [T, k] (host sync: the counts)."""
        if n_actors == 1:
            return cls([actor.shape[0]])
        whole, returned = dense_returns(actor)
        pairs = returned.reshape(-1).nonzero().squeeze(1)  # [R], batch order
        by = actor.reshape(-1)[pairs]
        order = pairs[torch.argsort(by, stable=True)]
        return cls(torch.bincount(by, minlength=n_actors).tolist(), order, whole)

    @classmethod
    def expect_few(cls, actor: list[list[int]], n_actors: int) -> _DenseBack:
        """:meth:`expect` from ``actor`` as lists (a decode step's few pairs, on the host): the same
        counts, order and tokens summed."""
        if n_actors == 1:
            return cls([len(actor)])
        whole = whole_few(actor)
        k = len(actor[0]) if actor else 0
        pairs = [(row[j], t * k + j) for t, row in enumerate(actor) for j in range(k) if j == 0 or not whole[t]]
        counts = [0] * n_actors
        for a, _ in pairs:
            counts[a] += 1
        order = [pair for _, pair in sorted(pairs, key=lambda ap: ap[0])]  # stable: batch order within an actor
        return cls(counts, torch.tensor(order, dtype=torch.long), torch.tensor(whole, dtype=torch.bool))

    def combine(self, back: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The tokens' routed rows [T, H] from the rows that came back ``back`` [R, H] (in arrival
        order) and the weights ``w`` [T, k]: a whole token's row as it came, any other's summed here."""
        if self.order is None:
            return back
        T, k = w.shape
        rows = back.new_empty(T * k, back.shape[1])  # [T·k, H]; a whole token's slots past 0 stay unread
        rows[self.order] = back
        rows = rows.view(T, k, back.shape[1])
        split = (~self.whole).nonzero().squeeze(1)  # tokens summed here
        if split.numel() == T:
            return weighted_sum(rows, w)
        out = rows[:, 0].clone()  # [T, H]
        out[split] = weighted_sum(rows[split], w[split])
        return out


class _Collectives:
    """The exchanges of one MoE layer, shared by both sides, with timing and clear errors."""

    def __init__(self, actor: str, table: PlacementTable, top_k: int, exchange_format: str = "auto", group=None,
                 device: str | torch.device = "cpu"):
        self.actor, self.table, self.group = actor, table, group
        self.num_attention, self.num_expert_actors = table.num_attention, table.num_actors
        self.top_k = top_k
        self.mode = exchange_mode(table, top_k, exchange_format)  # the format in use: dense or sparse
        self.device = torch.device(device)  # nccl needs the exchanged tensors on the GPU
        self.world = table.world_size
        self.step, self.exchange_s, self.calls = -1, 0.0, 0
        self.phase_s = {"counts": 0.0, "dispatch": 0.0, "combine": 0.0}
        # gloo: point-to-point sends and receives with the peers that have rows, over the epoch's
        # direct sockets (actors/wire.py) unless its transport is "group" (then gloo's own isend /
        # irecv: half the latency of its all_to_all_single, which visits every rank from a worker
        # thread); nccl: all_to_all_single (one grouped kernel)
        self.p2p = dist.get_backend(group) == "gloo"
        mesh = current_mesh() if self.p2p and group is None else None
        self.send, self.recv = ((mesh.send, mesh.recv) if mesh is not None else
                                (partial(dist.isend, group=group), partial(dist.irecv, group=group)))
        # gloo's own sends and receives wait their context's join timeout unless told: the joined group's
        # collective timeout (actors/group.py), so that a stuck peer fails the step as on the sockets
        self.p2p_timeout = collective_timeout() if self.p2p and mesh is None and group is None else None
        self.board = None  # the mailbox exchange (actors/board.py), where the epoch's actors share a node
        self.mesh = mesh

    def a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], layer: int,
            phase: str, async_op: bool = False):
        """``all_to_all_single`` semantics (rows of ``inp`` to each rank by ``in_splits``, rows from
        each by ``out_splits`` into ``out``); on gloo as point-to-point ops with the ranks that have
        rows, tagged with this step's call number (both sides make the same calls in the same order)."""
        t0 = time.perf_counter()
        self.calls += 1
        try:
            if not self.p2p:
                return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=async_op)
            works = _P2P([], [], (out, inp), self.p2p_timeout)
            for tensor, splits, op, into in ((inp, in_splits, self.send, works.sends),
                                             (out, out_splits, self.recv, works.recvs)):
                start = 0
                for peer, n in enumerate(splits):
                    if n:
                        into.append(op(tensor[start: start + n], peer, tag=self.calls))
                    start += n
            if not async_op:
                works.wait()
            return works
        except Exception as e:  # gloo raises RuntimeError, the sockets OSError, on a timeout or a closed peer
            raise self.error(layer, phase, e) from e
        finally:
            self.clock(phase, t0)

    def wait(self, work, layer: int, phase: str) -> None:
        t0 = time.perf_counter()
        try:
            work.wait()
        except Exception as e:
            raise self.error(layer, phase, e) from e
        finally:
            self.clock(phase, t0)

    def error(self, layer: int, phase: str, e: Exception) -> ExchangeError:
        return ExchangeError(f"{self.actor}: expert exchange failed at step {self.step}, MoE layer {layer}, phase "
                             f"{phase!r} (a peer actor is gone or stuck; collective timeout applies): {e}")

    def clock(self, phase: str, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.exchange_s += dt
        self.phase_s[phase] += dt

    def reset_timers(self, step: int) -> None:
        self.step, self.exchange_s, self.calls = step, 0.0, 0
        self.phase_s = dict.fromkeys(self.phase_s, 0.0)
        if self.board is not None:
            self.board.begin_step(step)

    def row_bytes(self, hidden: int, dtype: torch.dtype) -> int:
        """Bytes of one dense-format row: the hidden vector, then top-k int32 ids and fp32 weights."""
        return hidden * dtype.itemsize + 8 * self.top_k


@dataclass
class _P2P:
    """The point-to-point ops of one :meth:`_Collectives.a2a` call on gloo, waited for together:
    receives first. A peer that sends here while this rank sends to it (every colocated exchange)
    is read while this rank's own large send is still leaving (its rest on the link's sender thread,
    :mod:`actors.wire`); waiting on the sends first would leave both peers blocked once a message
    outgrows the socket buffers."""

    sends: list
    recvs: list
    keep: tuple  # the tensors they read or write, alive until they finish
    timeout: timedelta | None = None  # gloo's own ops: the group's collective timeout

    def wait(self) -> None:
        for work in self.recvs + self.sends:
            work.wait() if self.timeout is None else work.wait(self.timeout)
        self.sends, self.recvs = [], []


@dataclass
class Pending:
    """One micro-batch's exchange in flight on an attention rank."""

    layer: int
    works: list
    back: torch.Tensor  # where the results arrive
    keep: tuple  # tensors the posted collectives read or write, alive until they finish
    x_dtype: torch.dtype
    x_device: torch.device
    weights: torch.Tensor  # [T, k] fp32, on the exchange's device
    order: torch.Tensor | None = None  # sparse: the pair (token · k + slot) of each row sent, in order
    dense: _DenseBack | None = None  # dense: what comes back


class _PairCounts:
    """An attention worker's per-step pair counts per logical expert and per physical slot (tensors on
    its device, read by :meth:`take_stats`): what every dispatcher on the attention side reports."""

    expert_s = 0.0  # seconds this step computing routed rows here (local experts; 0 where actors hold them)

    def __init__(self, table: PlacementTable, hidden: int, dtype: torch.dtype, top_k: int,
                 device: torch.device):
        self.table, self.hidden, self.dtype, self.top_k, self.device = table, hidden, dtype, top_k, device
        self.num_expert_actors = table.num_actors
        self.routing = Routing(table, self.device)
        self.layer_index = {layer: i for i, layer in enumerate(table.moe_layers)}
        # the exchanges since the last take_stats: (MoE layer index, top-k ids, physical slot of each
        # pair or None to look up); counted once per step, off the exchanges' path
        self.routed: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        # per unreplicated MoE layer: logical expert → its physical slot, [logical experts]
        self.slot_of = {layer: self._slot(a, l) for layer, (a, l) in self.routing.single.items()}

    def count(self, layer: int, idx: torch.Tensor, slots: torch.Tensor | None) -> None:
        """One exchange's pairs (``slots`` None: an unreplicated layer's, looked up at take_stats)."""
        self.routed.append((self.layer_index[layer], idx, slots))

    def empty(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, topk_idx, topk_w) of no tokens: a replica with nothing to run still takes part in every exchange."""
        dev = self.device
        return (torch.empty(0, self.hidden, dtype=self.dtype, device=dev),
                torch.empty(0, self.top_k, dtype=torch.long, device=dev), torch.empty(0, self.top_k, device=dev))

    def take_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Pair counts of this step's exchanges, on the host: [MoE layers, experts] and [MoE layers, expert
        actors, local slots] (a replicated expert's copies apart)."""
        routed, self.routed = self.routed, []
        n_layers, n_experts = len(self.layer_index), self.table.num_experts  # MoE layers, logical experts
        n_physical = self.num_expert_actors * self.table.max_local  # physical slots (padded per actor)
        if not routed:
            expert = torch.zeros(n_layers, n_experts, dtype=torch.long)
            slot = torch.zeros(n_layers, n_physical, dtype=torch.long)
        else:
            # [pairs]: each pair's MoE layer index (0 .. n_layers - 1, not the model's layer number)
            moe_index = torch.repeat_interleave(torch.tensor([i for i, _, _ in routed], device=self.device),
                                                torch.tensor([idx.numel() for _, idx, _ in routed], device=self.device))
            ids = torch.cat([idx.reshape(-1) for _, idx, _ in routed])
            slots = torch.cat([self.slot_of[self.table.moe_layers[i]][idx.reshape(-1)] if s is None else s
                               for i, idx, s in routed])
            expert = torch.bincount(moe_index * n_experts + ids, minlength=n_layers * n_experts)
            slot = torch.bincount(moe_index * n_physical + slots, minlength=n_layers * n_physical)
            expert, slot = expert.view(n_layers, n_experts).cpu(), slot.view(n_layers, n_physical).cpu()
        return expert, slot.view(n_layers, self.num_expert_actors, -1)  # [MoE layers, expert actors, local slots]

    def _slot(self, actor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The physical slot (expert actor × its local slot) of each pair, as the statistics count them."""
        return actor * self.table.max_local + local


class LocalExchange(_PairCounts):
    """An attention worker's dispatcher when its own process holds every routed expert (the in-process
    executor, cluster/inprocess.py): :class:`DistDispatcher`'s interface, each MoE layer computed in
    place by the block's own experts (what :class:`LocalDispatcher` computes: copies of an expert are
    the same weights), its pairs counted as the distributed path counts them."""

    def __init__(self, table: PlacementTable, moe_blocks: dict, hidden: int, dtype: torch.dtype, top_k: int,
                 device: str | torch.device = "cpu"):
        super().__init__(table, hidden, dtype, top_k, torch.device(device))
        self.moe = moe_blocks  # MoE layer → its MoE block, holding every routed expert
        self.exchange_s, self.phase_s = 0.0, {"counts": 0.0, "dispatch": 0.0, "combine": 0.0}

    def begin_step(self, step: int, tokens: tuple = ()) -> None:
        self.routed, self.expert_s = [], 0.0

    def issue(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        slots = None if layer in self.slot_of else self._slot(*self.routing.assign(layer, topk_idx))
        self.count(layer, topk_idx, slots)
        if x.shape[0] == 0:
            return x
        t = time.perf_counter()
        y = self.moe[layer].experts(x, topk_idx, topk_w)
        self.expert_s += time.perf_counter() - t
        return y

    def collect(self, pending: torch.Tensor) -> torch.Tensor:
        return pending


class DistDispatcher(_Collectives, _PairCounts):
    """Attention-worker side of the distributed exchange; its pair counts as :class:`_PairCounts`."""

    def __init__(self, actor: str, table: PlacementTable, hidden: int, dtype: torch.dtype, top_k: int,
                 exchange_format: str = "auto", group=None, device: str | torch.device = "cpu"):
        _Collectives.__init__(self, actor, table, top_k, exchange_format, group, device)
        _PairCounts.__init__(self, table, hidden, dtype, top_k, self.device)
        self.board, self.tokens, self._issued = board_of(self.mesh, self.device, hidden, dtype, top_k), (), 0

    def begin_step(self, step: int, tokens: tuple = ()) -> None:
        """``tokens``: every attention actor's token count per micro-batch (the mailboxes need them all)."""
        self.reset_timers(step)
        self.routed, self.tokens, self._issued = [], tokens, 0

    def exchange(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        return self.collect(self.issue(layer, x, topk_idx, topk_w))

    def issue(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> Pending:
        """Post this micro-batch's exchange for ``layer``; :meth:`collect` waits for its result."""
        idx = topk_idx.to(self.device)
        tokens = self.tokens[self._issued % len(self.tokens)] if self.tokens else ()
        self._issued += 1
        if self.board is not None and not self.routing.replicated(layer) and \
                self.board.takes(tokens, board.DISAGGREGATED_PAIRS):
            return board.issue(self, layer, x, idx, topk_w, tokens)
        actor, local = self.routing.assign(layer, idx)
        if self.mode == "dense":
            pending = self._issue_dense(layer, x, idx, topk_w, actor.view(idx.shape))
        else:
            pending = self._issue_sparse(layer, x, idx, topk_w, actor, local)
        self.count(layer, idx, None if layer in self.slot_of else self._slot(actor, local))
        return pending

    def _issue_dense(self, layer, x, idx, w, actor) -> Pending:
        T, A, n_actors, dev = x.shape[0], self.num_attention, self.num_expert_actors, self.device
        w = w.to(dev, torch.float32)
        payload = torch.cat([x.to(dev, self.dtype).contiguous().view(torch.uint8),
                             idx.to(torch.int32).contiguous().view(torch.uint8),
                             w.contiguous().view(torch.uint8)], 1)  # [T, row bytes]
        if n_actors > 1:
            payload = payload.repeat(n_actors, 1)  # the same rows to every expert actor: [n_actors × T, row bytes]
        none, each = [0] * self.world, [0] * A + [T] * n_actors
        dense = _DenseBack.expect(actor, n_actors)
        sent = torch.empty(0, payload.shape[1], dtype=torch.uint8, device=dev)
        back = torch.empty(sum(dense.counts), self.hidden, dtype=self.dtype, device=dev)  # by actor, then batch order
        empty = torch.empty(0, self.hidden, dtype=self.dtype, device=dev)
        works = [self.a2a(sent, payload, none, each, layer, "dispatch", async_op=True),
                 self.a2a(back, empty, [0] * A + dense.counts, none, layer, "dispatch", async_op=True)]
        return Pending(layer, works, back, (payload, sent, empty), x.dtype, x.device, w, dense=dense)

    def _issue_sparse(self, layer, x, idx, w, actor, local) -> Pending:
        T, k = idx.shape
        A, n_local, dev = self.num_attention, self.table.max_local, self.device
        order = torch.argsort(actor * n_local + local, stable=True)
        send = torch.zeros(self.world, n_local, dtype=torch.long, device=dev)  # [ranks, local slots] pair counts
        send[A:].index_put_((actor, local), torch.ones_like(actor), accumulate=True)
        rows_to = send.sum(1).tolist()
        payload = x.to(dev, self.dtype)[order // k].contiguous()
        none = [0] * self.world
        empty = torch.empty(0, self.hidden, dtype=self.dtype, device=dev)
        back = torch.empty(order.numel(), self.hidden, dtype=self.dtype, device=dev)
        counts = send[A:].reshape(-1)  # [expert actors × local slots] to the expert actors only
        works = [self.a2a(counts[:0], counts, none, [0] * A + [n_local] * self.num_expert_actors, layer, "counts",
                          async_op=True),
                 self.a2a(empty, payload, none, rows_to, layer, "dispatch", async_op=True),
                 self.a2a(back, empty, rows_to, none, layer, "dispatch", async_op=True)]
        return Pending(layer, works, back, (send, counts, payload, empty), x.dtype, x.device,
                       w.to(dev, torch.float32), order=order)

    def collect(self, p: Pending) -> torch.Tensor:
        """Wait for ``p``'s results; returns the routed rows [T, hidden], weighted and summed per token
        (:func:`model.moe.weighted_sum`)."""
        if isinstance(p, board.Posted):
            return board.collect(self, p)
        for work in p.works:
            self.wait(work, p.layer, "combine")
        if self.mode == "dense":
            out = p.dense.combine(p.back, p.weights)
        else:
            out = _sum_pairs(p.back, p.order, p.weights)
        return out.to(p.x_device, p.x_dtype)


def _sum_pairs(rows: torch.Tensor, order: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The sparse format's combine: ``rows`` [T·k, H], row i the result of pair ``order[i]``
    (token · k + slot), weights ``w`` [T, k] → the tokens' routed rows [T, H]."""
    T, k = w.shape
    by_pair = torch.empty_like(rows)
    by_pair[order] = rows
    return weighted_sum(by_pair.view(T, k, rows.shape[1]), w)


class ExpertExchange(_Collectives):
    """Expert-worker side of one MoE layer and micro-batch: receive, run the local experts, send back."""

    def __init__(self, actor: str, index: int, table: PlacementTable, top_k: int, exchange_format: str = "auto",
                 group=None, device: str | torch.device = "cpu"):
        super().__init__(actor, table, top_k, exchange_format, group, device)
        self.index = index  # this expert actor's index in the table
        self.routing = Routing(table, self.device)
        self.sending: tuple | None = None  # the last combine, still in flight: (layer, work, tensors)
        self._tok = torch.empty(0, dtype=torch.long, device=self.device)
        self.board = board_of(self.mesh, self.device, 1, torch.float32, top_k)  # (its width: set by each serve)

    def _pair_tokens(self, tokens: int, k: int) -> torch.Tensor:
        """The token of each of ``tokens`` × k pairs in batch order (a prefix of one cached index,
        regrown to the largest batch yet)."""
        if self._tok.numel() < tokens * k:
            self._tok = torch.arange(tokens * k, device=self.device) // k
        return self._tok[: tokens * k]

    def drain(self) -> None:
        """Wait for the last combine to leave (before the next exchange, and at the end of a step)."""
        if self.sending is not None:
            layer, work, _ = self.sending
            self.sending = None
            self.wait(work, layer, "combine")

    def _send_back(self, layer: int, y: torch.Tensor, splits: list[int]) -> None:
        """Post the combine (results to the attention ranks by ``splits``) without waiting for it."""
        none = [0] * self.world
        self.sending = (layer, self.a2a(y[:0], y, none, splits, layer, "combine", async_op=True), y)

    def serve(self, layer: int, experts: RoutedExperts, hidden: int, dtype: torch.dtype,
              tokens: tuple[int, ...] = ()) -> torch.Tensor:
        """One micro-batch's exchange; ``tokens[s]`` is attention rank s's token count (dense format).
        Returns the rows computed per local slot [max_local]."""
        self.drain()
        if self.board is not None and not self.routing.replicated(layer) and \
                self.board.width(hidden, dtype).takes(tokens, board.DISAGGREGATED_PAIRS):
            return board.serve(self, layer, experts, tokens)
        if self.mode == "dense":
            return self._serve_dense(layer, experts, hidden, dtype, tokens)
        return self._serve_sparse(layer, experts, hidden, dtype)

    def _serve_dense(self, layer, experts, hidden, dtype, tokens) -> torch.Tensor:
        A, dev, k, n_local = self.num_attention, self.device, self.top_k, self.table.max_local
        width, N = self.row_bytes(hidden, dtype), sum(tokens)
        rows = torch.empty(N, width, dtype=torch.uint8, device=dev)  # [N, row bytes]: every attention rank's tokens
        none, each = [0] * self.world, list(tokens) + [0] * self.num_expert_actors
        self.a2a(rows, torch.empty(0, width, dtype=torch.uint8, device=dev), each, none, layer, "dispatch")
        hb = hidden * dtype.itemsize
        x, idx, w = _view(rows[:, :hb], dtype), _view(rows[:, hb: hb + 4 * k], torch.int32), \
            _view(rows[:, hb + 4 * k:], torch.float32)  # views of the packed rows where strides allow
        flat = idx.long().reshape(-1)
        edev = experts.device  # the exchange may be staged in host memory (gloo)
        if self.num_expert_actors == 1:  # every pair is this actor's: each token's sum goes back, one row
            local = flat if layer in self.routing.identity else self.routing.assign(layer, flat)[1]
            y = experts.grouped(x[self._pair_tokens(N, k)].to(edev), local.to(edev)).to(dev)  # [N·k, H]
            back, splits = weighted_sum(y.view(N, k, hidden), w), list(tokens)
        else:
            if self.routing.replicated(layer):
                sender = torch.repeat_interleave(torch.arange(A, device=dev), torch.tensor(tokens, device=dev) * k)
                actor, local = self.routing.assign(layer, flat, sender, A)
            else:
                actor, local = self.routing.assign(layer, flat)
            back, per_token, local = serve_dense(experts, x, w, actor.view(N, k), local.view(N, k), self.index, dev)
            splits = _per_sender(per_token, tokens)
        self._send_back(layer, back.contiguous(), splits + [0] * self.num_expert_actors)
        return torch.bincount(local, minlength=n_local)

    def _serve_sparse(self, layer, experts, hidden, dtype) -> torch.Tensor:
        dev, n_local = self.device, self.table.max_local
        A, n_actors = self.num_attention, self.num_expert_actors
        recv = torch.empty(A, n_local, dtype=torch.long, device=dev)  # [attention rank, local slot] pair counts
        self.a2a(recv.view(-1), recv.view(-1)[:0], [n_local] * A + [0] * n_actors, [0] * self.world, layer, "counts")
        rows_from = recv.sum(1).tolist() + [0] * n_actors  # rows per source rank
        none = [0] * self.world
        x = torch.empty(sum(rows_from), hidden, dtype=dtype, device=dev)
        self.a2a(x, x[:0], rows_from, none, layer, "dispatch")
        local = torch.arange(n_local, device=dev).repeat(A).repeat_interleave(recv.reshape(-1))  # [pairs]
        y = experts.grouped(x.to(experts.device), local.to(experts.device)).to(dev)
        self._send_back(layer, y.contiguous(), rows_from)
        return recv.sum(0)
