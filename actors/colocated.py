"""The exchange of the colocated layout: every worker is both an attention replica and an expert shard.

Per MoE layer and micro-batch, worker r sends its tokens to the workers that hold their experts, serves
the rows every worker (itself included) sent for its own experts, and gets its tokens' results back.
Rows for its own experts never leave the process. Two wire formats, as in :mod:`actors.dispatch`:

- ``dense`` (workers ≤ experts per token): every worker's token rows, with their top-k ids and
  weights, go to every other worker; each runs the pairs of its own experts and sends back, per
  token, its pairs' unweighted rows, or the token's sum where it ran all k of them; the token's
  worker sums each token's rows. The rows each worker sends and gets back are known from the step
  (``tokens``) and the top-k ids: no counts exchange.
- ``sparse``: the (token, expert) pairs go only where their expert lives — a counts exchange, the
  rows, the unweighted rows back.

Either way each token's routed output is :func:`model.moe.weighted_sum` of its k rows, the single
process's sum: for the same expert rows, the same bits whatever W, the format or the placement
(docs/architecture.md, "Exactness").

:meth:`ColocatedExchange.issue` posts what can be posted (the dense dispatch, the sparse counts) and
returns; :meth:`ColocatedExchange.collect` serves and combines. So a worker computes one
micro-batch's attention while another's rows are on the wire (two-batch overlap), and every worker
makes the same exchanges in the same order: layer-major, micro-batch minor.

Owns: one epoch's exchange state of one worker (the step's token counts per micro-batch, the pairs
counted for the statistics, the rows its experts computed). Never: decides placement (the epoch's
table does), waits without the group's timeout (errors name the worker, step, layer and phase), or
guesses a peer's token count (a step without them is refused before anything is sent).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from model.moe import RoutedExperts

from . import dense as dense_format
from .board import accounted, board_of
from .dense import serve_dense, serve_dense_few
from .dispatch import _Collectives, _DenseBack, _PairCounts, _per_sender, _sum_pairs, _view
from .group import current_mesh
from .messages import PlacementTable


@dataclass
class _Posted:
    """One micro-batch's exchange in flight on a worker."""

    layer: int
    x: torch.Tensor  # [T, hidden]
    idx: torch.Tensor  # [T, k]
    w: torch.Tensor  # [T, k]
    tokens: list[int]  # every worker's tokens in this micro-batch
    works: list
    keep: tuple
    recv: torch.Tensor | None = None  # dense: the other workers' packed rows, in rank order
    payload: torch.Tensor | None = None  # dense: this worker's packed rows
    counts_in: torch.Tensor | None = None  # sparse: [workers, local slots] pairs each worker sends here
    order: torch.Tensor | None = None  # sparse: this worker's pairs (token · k + slot) sorted by (worker, local slot)
    send_counts: torch.Tensor | None = None  # sparse: [workers, local slots] pairs this worker sends
    board: tuple[int, int] | None = None  # through the mailboxes (actors/board.py): its dispatch's message numbers


class ColocatedExchange(_Collectives, _PairCounts):
    def __init__(self, actor: str, rank: int, table: PlacementTable, experts: dict[int, RoutedExperts], hidden: int,
                 dtype: torch.dtype, top_k: int, exchange_format: str = "auto", group=None,
                 device: str | torch.device = "cpu"):
        if not table.colocated:
            raise ValueError("ColocatedExchange needs a colocated placement table")
        _Collectives.__init__(self, actor, table, top_k, exchange_format, group, device)
        _PairCounts.__init__(self, table, hidden, dtype, top_k, self.device)
        self.rank, self.experts = rank, experts  # MoE layer → this worker's shard
        self.tokens: tuple[tuple[int, ...], ...] = ()  # [micro-batch][worker] tokens, this step
        self._issued = 0  # exchanges posted this step: micro-batch = issued % micro-batches
        self._rows_served: torch.Tensor = torch.zeros(0)  # [MoE layers, local slots] rows this step
        self._served_few: list[tuple[int, list[int]]] = []
        # every worker on one node, each pair's mailboxes made: a decode step's exchanges go through them
        self.board = board_of(current_mesh() if self.p2p and group is None else None, self.device, hidden, dtype, top_k)

    def begin_step(self, step: int, tokens: tuple[tuple[int, ...], ...] = ()) -> None:
        self.reset_timers(step)
        self.routed, self.tokens, self._issued, self.expert_s = [], tokens, 0, 0.0
        self._rows_served = torch.zeros(len(self.table.moe_layers), self.table.max_local, dtype=torch.long)
        self._served_few: list[tuple[int, list[int]]] = []  # the mailbox exchanges' (layer index, slots run)

    @property
    def rows_served(self) -> torch.Tensor:
        """[MoE layers, local slots] rows this worker's experts ran this step."""
        if self._served_few:
            few, self._served_few = self._served_few, []
            counts = [[0] * self.table.max_local for _ in range(self._rows_served.shape[0])]
            for layer, slots in few:  # counted on the host at the step's end: a decode step's few pairs
                for s in slots:
                    counts[layer][s] += 1
            self._rows_served += torch.tensor(counts, dtype=torch.long)
        return self._rows_served

    # ---- attention side ----------------------------------------------------------------------
    def issue(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> _Posted:
        micro = self._issued % max(1, len(self.tokens))
        tokens = self._tokens(micro, x.shape[0])
        self._issued += 1
        idx = topk_idx.to(self.device)
        if self.board is not None and not self.routing.replicated(layer) and self.board.takes(tokens):
            self.count(layer, idx, None)
            with accounted(self, layer) as b:
                return _Posted(layer, x, idx, topk_w, tokens, [], (), board=b.dispatch(x, idx, topk_w))
        if self.mode == "dense":
            slots = None if layer in self.slot_of else self._slot(*self.routing.assign(layer, idx))
            self.count(layer, idx, slots)
            return self._issue_dense(layer, x, idx, topk_w, tokens)
        actor, local = self.routing.assign(layer, idx)
        self.count(layer, idx, self._slot(actor, local))
        return self._issue_sparse(layer, x, idx, topk_w, tokens, actor, local)

    def _tokens(self, micro: int, mine: int) -> list[int]:
        """Every worker's token count in micro-batch ``micro`` (``mine`` this worker's rows), from the
        step: a peer's count cannot be guessed, and a wrong one would mis-size the exchange."""
        if not self.tokens:
            if self.world == 1:
                return [mine]
            raise ValueError(f"{self.actor}: step {self.step} began without every worker's token counts "
                             f"(begin_step(step, tokens), from StepRequest.peer_tokens); a colocated exchange of "
                             f"{self.world} workers needs them to size what it sends and receives")
        tokens = list(self.tokens[micro])
        if len(tokens) != self.world:
            raise ValueError(f"{self.actor}: step {self.step}'s token counts name {len(tokens)} workers, "
                             f"{self.world} in this epoch")
        if tokens[self.rank] != mine:
            raise ValueError(f"{self.actor}: {mine} tokens in micro-batch {micro} of step {self.step}, "
                             f"the step said {tokens[self.rank]}")
        return tokens

    def collect(self, p: _Posted) -> torch.Tensor:
        """Serve the rows sent here for this worker's experts, send their results back, and return this
        worker's routed rows [T, hidden], weighted and summed per token."""
        if p.board is not None:
            out = self._collect_board(p)
        else:
            out = self._collect_dense(p) if self.mode == "dense" else self._collect_sparse(p)
        return out.to(p.x.device, p.x.dtype)

    def _collect_board(self, p: _Posted) -> torch.Tensor:
        """:meth:`collect` through the mailboxes (actors/board.py), the same bits as the links' formats."""
        with accounted(self, p.layer) as b:
            actor_of, local_of = self.routing.lists(p.layer)
            x, ids = b.rows(p.board, p.tokens, (p.x.to(self.device, self.dtype), p.idx))
            own, slots, mine_at, spent, back = b.serve(p.board, self.experts[p.layer], x, ids, p.tokens, actor_of,
                                                       local_of)
            self.expert_s += spent
            self._served_few.append((self.table.layer_index(p.layer), slots))
            return b.combine(back, own, mine_at, p.idx, p.w, actor_of)

    # ---- dense ---------------------------------------------------------------------------------
    def _pack(self, x, idx, w) -> torch.Tensor:
        return torch.cat([x.to(self.device, self.dtype).contiguous().view(torch.uint8),
                          idx.to(torch.int32).contiguous().view(torch.uint8),
                          w.to(self.device, torch.float32).contiguous().view(torch.uint8)], 1)  # [T, row bytes]

    def _others(self, counts: list[int]) -> list[int]:
        return [n if s != self.rank else 0 for s, n in enumerate(counts)]

    def _issue_dense(self, layer, x, idx, w, tokens) -> _Posted:
        T, W = x.shape[0], self.world
        payload = self._pack(x, idx, w)
        send = payload.repeat(W - 1, 1) if W > 2 else payload  # the same rows to every other worker
        recv = torch.empty(sum(self._others(tokens)), payload.shape[1], dtype=torch.uint8, device=self.device)
        work = self.a2a(recv, send, self._others(tokens), self._others([T] * W), layer, "dispatch", async_op=True)
        return _Posted(layer, x, idx, w, tokens, [work], (send,), recv=recv, payload=payload)

    def _collect_dense(self, p: _Posted) -> torch.Tensor:
        for work in p.works:
            self.wait(work, p.layer, "dispatch")
        tokens, r, k = p.tokens, self.rank, self.top_k
        parts, start = [], 0
        for s, n in enumerate(tokens):  # every worker's rows in rank order, this worker's own in place
            if s == r:
                parts.append(p.payload)
            else:
                parts.append(p.recv[start: start + n])
                start += n
        rows = torch.cat(parts) if len(parts) > 1 else parts[0]
        hb = self.hidden * self.dtype.itemsize
        x, idx, w = _view(rows[:, :hb], self.dtype), _view(rows[:, hb: hb + 4 * k], torch.int32), \
            _view(rows[:, hb + 4 * k:], torch.float32)
        N = rows.shape[0]
        if N * k <= dense_format.FEW_PAIRS and self.device.type == "cpu" and not self.routing.replicated(p.layer):
            return self._collect_dense_few(p, x, idx, w)
        flat = idx.long().reshape(-1)
        if self.routing.replicated(p.layer):
            sender = torch.repeat_interleave(torch.arange(self.world, device=self.device),
                                             torch.tensor(tokens, device=self.device) * k)
            actor, local = self.routing.assign(p.layer, flat, sender, self.world)
        else:
            actor, local = self.routing.assign(p.layer, flat)
        actor = actor.view(N, k)
        t = time.perf_counter()
        y, per_token, served = serve_dense(self.experts[p.layer], x, w, actor, local.view(N, k), r, self.device)
        self.expert_s += time.perf_counter() - t
        served = torch.bincount(served, minlength=self.table.max_local)
        self.rows_served[self.table.layer_index(p.layer)] += served.cpu()
        # send each worker the rows of its tokens; get this worker's tokens' rows from each
        to = _per_sender(per_token, tokens)  # rows for each worker's tokens, in y's order
        bounds = [sum(tokens[:s]) for s in range(len(tokens) + 1)]
        dense = _DenseBack.expect(actor[bounds[r]: bounds[r + 1]], self.world)  # what comes back, from whom
        return self._send_back(p, y, to, dense)

    def _collect_dense_few(self, p: _Posted, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """:meth:`_collect_dense` for a decode step's few pairs (at most ``FEW_PAIRS``) of an unreplicated
        layer on CPU, the same bits: the same expert rows (:func:`~actors.dense.serve_dense_few`), sent
        and combined the same way, with the pairs' routing and bookkeeping on the host — each pair's
        expert actor and slot looked up in lists, what goes back to whom counted in Python over the
        step's few pairs — instead of ~25 small tensor ops a MoE layer."""
        tokens, r, k = p.tokens, self.rank, self.top_k
        actor_of, local_of = self.routing.lists(p.layer)
        ids = idx.tolist()
        actor = [[actor_of[e] for e in row] for row in ids]
        local = [[local_of[e] for e in row] for row in ids]
        t = time.perf_counter()
        y, per_token, served = serve_dense_few(self.experts[p.layer], x, w, actor, local, r, k)
        self.expert_s += time.perf_counter() - t
        self.rows_served[self.table.layer_index(p.layer)] += torch.bincount(served, minlength=self.table.max_local)
        bounds = [sum(tokens[:s]) for s in range(len(tokens) + 1)]
        to = [sum(per_token[bounds[s]: bounds[s + 1]]) for s in range(len(tokens))]
        return self._send_back(p, y, to, _DenseBack.expect_few(actor[bounds[r]: bounds[r + 1]], self.world))

    def _send_back(self, p: _Posted, y: torch.Tensor, to: list[int], dense: _DenseBack) -> torch.Tensor:
        """Send each worker the rows ``y`` of its tokens (``to``: how many, in rank order), get this
        worker's tokens' rows from each (``dense``: what comes back, from whom) and combine them."""
        r = self.rank
        starts = [sum(to[:s]) for s in range(len(to) + 1)]
        own = y[starts[r]: starts[r + 1]]
        others = torch.cat([y[starts[s]: starts[s + 1]] for s in range(self.world) if s != r]) \
            if self.world > 1 else y[:0]
        back = torch.empty(sum(self._others(dense.counts)), self.hidden, dtype=self.dtype, device=self.device)
        self.a2a(back, others.contiguous(), self._others(dense.counts), self._others(to), p.layer, "combine")
        arrived, at = [], 0
        for s, n in enumerate(dense.counts):  # in worker order, as _DenseBack expects; this worker's own in place
            if s == r:
                arrived.append(own)
            else:
                arrived.append(back[at: at + n])
                at += n
        return dense.combine(torch.cat(arrived) if len(arrived) > 1 else arrived[0], p.w.to(self.device, torch.float32))

    # ---- sparse --------------------------------------------------------------------------------
    def _issue_sparse(self, layer, x, idx, w, tokens, actor, local) -> _Posted:
        n_local = self.table.max_local
        order = torch.argsort(actor * n_local + local, stable=True)
        send = torch.zeros(self.world, n_local, dtype=torch.long, device=self.device)  # [workers, local slots]
        send.index_put_((actor, local), torch.ones_like(actor), accumulate=True)
        recv = torch.empty(self.world, n_local, dtype=torch.long, device=self.device)
        recv[self.rank] = send[self.rank]
        splits = self._others([n_local] * self.world)
        out = torch.cat([recv[s] for s in range(self.world) if s != self.rank]) if self.world > 1 else recv[:0, 0]
        inp = torch.cat([send[s] for s in range(self.world) if s != self.rank]) if self.world > 1 else send[:0, 0]
        work = self.a2a(out, inp.contiguous(), splits, splits, layer, "counts", async_op=True)
        p = _Posted(layer, x, idx, w, tokens, [work], (inp,), counts_in=recv, order=order, send_counts=send)
        p.recv = out  # the counts from the others, flat, in rank order
        return p

    def _collect_sparse(self, p: _Posted) -> torch.Tensor:
        for work in p.works:
            self.wait(work, p.layer, "counts")
        r, n_local, W = self.rank, self.table.max_local, self.world
        others = [s for s in range(W) if s != r]
        for i, s in enumerate(others):
            p.counts_in[s] = p.recv[i * n_local: (i + 1) * n_local]
        T, k = p.idx.shape
        rows_out = p.x.to(self.device, self.dtype)[p.order // k]  # this worker's pairs, sorted by (worker, local slot)
        to = p.send_counts.sum(1).tolist()  # pairs to each worker
        frm = p.counts_in.sum(1).tolist()  # pairs from each worker
        starts = [sum(to[:s]) for s in range(W + 1)]
        own = rows_out[starts[r]: starts[r + 1]]
        send = torch.cat([rows_out[starts[s]: starts[s + 1]] for s in others]) if others else rows_out[:0]
        recv = torch.empty(sum(frm[s] for s in others), self.hidden, dtype=self.dtype, device=self.device)
        self.a2a(recv, send.contiguous(), self._others(frm), self._others(to), p.layer, "dispatch")
        parts, at = [], 0
        for s in range(W):  # every worker's rows for this worker's experts, in rank order
            if s == r:
                parts.append(own)
            else:
                parts.append(recv[at: at + frm[s]])
                at += frm[s]
        x_in = torch.cat(parts)
        local = torch.arange(n_local, device=self.device).repeat(W).repeat_interleave(p.counts_in.reshape(-1))
        experts = self.experts[p.layer]
        t = time.perf_counter()
        y = experts.grouped(x_in.to(experts.device), local.to(experts.device)).to(self.device, self.dtype)
        self.expert_s += time.perf_counter() - t
        self.rows_served[self.table.layer_index(p.layer)] += p.counts_in.sum(0).cpu()
        fstarts = [sum(frm[:s]) for s in range(W + 1)]
        own_y = y[fstarts[r]: fstarts[r + 1]]
        back_send = torch.cat([y[fstarts[s]: fstarts[s + 1]] for s in others]) if others else y[:0]
        back = torch.empty(sum(to[s] for s in others), self.hidden, dtype=self.dtype, device=self.device)
        self.a2a(back, back_send.contiguous(), self._others(to), self._others(frm), p.layer, "combine")
        results, at = [], 0
        for s in range(W):  # this worker's pairs' results, in the sorted order they were sent in
            if s == r:
                results.append(own_y)
            else:
                results.append(back[at: at + to[s]])
                at += to[s]
        return _sum_pairs(torch.cat(results), p.order, p.w.to(self.device, torch.float32))
