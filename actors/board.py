"""The colocated exchange through mailboxes: a decode step's MoE layer between workers of one node.

When every worker of the epoch is on one node (each pair's segment made: ``SocketMesh.board``, agreed
by all at the group's join, actors/group.py), a micro-batch small enough for a mailbox slot, of an
unreplicated MoE layer, is exchanged through the pairs' mailboxes (actors/mailbox.py) instead of the
links' frames. Two messages each way per exchange, every worker to every other, always sent (an empty
one too: the message order is what keeps a slot from being rewritten before it is read):

1. **dispatch**: the worker's token rows, their top-k ids (int32) and weights (fp32);
2. **combine**: for each peer's tokens, the unweighted rows of the pairs this worker's experts ran,
   in the peer's pair order (token-major, then top-k slot) — the peer knows which pairs those are
   from its own top-k ids and the epoch's table, so no counts go with them.

Each worker runs the pairs of its own experts over every worker's rows (rank order: the rows
:meth:`RoutedExperts.forward <model.moe.RoutedExperts.forward>` sees in one process, through the same
expert GEMMs), and sums each of its tokens' k rows with :func:`model.moe.weighted_sum` as every path
does: the same bits as the link exchange and the single process (docs/architecture.md, "Exactness").

Whether an exchange takes the mailboxes is decided from what every worker knows alike (the step's
token counts, the layer, the table, the slot size), so all take the same path; messages are numbered
per step in the order the exchanges are made. Owns: the numbering of one worker's mailbox messages in
a step. Never: chooses placement, or waits without the link's timeout (errors go to the caller, which
names the worker, step, layer and phase).
"""

from __future__ import annotations

import time

import torch

from model.moe import RoutedExperts, _few, weighted_sum

from .mailbox import Mailbox, message_bytes


class Board:
    """Worker ``rank``'s mailboxes to each peer (``boxes``: peer → :class:`~actors.mailbox.Mailbox`)."""

    def __init__(self, rank: int, world: int, boxes: dict[int, Mailbox], hidden: int, dtype: torch.dtype, top_k: int):
        self.rank, self.world, self.boxes = rank, world, boxes
        self.hidden, self.dtype, self.top_k = hidden, dtype, top_k
        slot = min(b.slot_bytes for b in boxes.values())
        # the most tokens a worker may send in one micro-batch: its dispatch, and a combine of all its pairs
        per = max(message_bytes([((1, hidden), dtype), ((1, top_k), torch.int32), ((1, top_k), torch.float32)]),
                  message_bytes([((top_k, hidden), dtype)]))
        self.max_tokens = max(0, (slot - 3 * 64) // per)
        self.step, self.sent = -1, 0
        self.exchanges = 0  # exchanges made through the mailboxes, ever (tests, the profile)
        self.waited = {"dispatch": 0.0, "combine": 0.0}  # seconds waiting for each phase's messages, this step

    def begin_step(self, step: int) -> None:
        self.step, self.sent = step, 0
        self.waited = dict.fromkeys(self.waited, 0.0)

    def _get(self, s: int, n: int, i: int, shapes: list, phase: str) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        try:
            return self.boxes[s].get(n, self.step, i, shapes)
        finally:
            self.waited[phase] += time.perf_counter() - t0

    def takes(self, tokens: list[int]) -> bool:
        """Whether a micro-batch of these token counts (every worker's) fits the mailboxes."""
        return max(tokens) <= self.max_tokens

    def _put(self, i: int, parts: list[torch.Tensor]) -> int:
        """Message ``i`` of the step to every peer; its number n over the pairs' life, the same on every
        pair and at both ends of each (every message goes to every peer, the same ones in the same order)."""
        ns = {box.put(self.step, i, parts) for box in self.boxes.values()}
        if len(ns) != 1:
            raise RuntimeError(f"worker {self.rank}'s mailboxes disagree on the message count: {sorted(ns)}")
        return ns.pop()

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
        """Send this worker's rows to every peer; returns the exchange's (message number in the step,
        number over the pairs' life)."""
        i, self.sent = self.sent, self.sent + 2
        self.exchanges += 1
        return i, self._put(i, [x.to(self.dtype), idx.to(torch.int32), w.to(torch.float32)])

    def rows(self, sent: tuple[int, int], tokens: list[int], own: tuple) -> tuple[torch.Tensor, list[list[int]]]:
        """Every worker's rows of the exchange ``sent`` (:meth:`dispatch`'s answer) in rank order (this worker's ``own`` (x, idx, w) in
        place): (x [N, H], top-k ids as lists)."""
        xs, ids, k = [], [], self.top_k
        for s, n in enumerate(tokens):
            if s == self.rank:
                x, idx = own[0], own[1]
            else:
                x, idx, _ = self._get(s, sent[1], sent[0], [((n, self.hidden), self.dtype), ((n, k), torch.int32),
                                             ((n, k), torch.float32)], "dispatch")
            if n:
                xs.append(x)
                ids.extend(idx.tolist())
        # (read before this worker's combine lets a peer write the slot again: serve's GEMMs come first)
        return (torch.cat(xs) if len(xs) > 1 else xs[0] if xs else own[0]), ids

    def serve(self, sent: tuple[int, int], experts: RoutedExperts, x: torch.Tensor, ids: list[list[int]],
              tokens: list[int], actor_of: list[int], local_of: list[int]) -> tuple:
        """Run this worker's experts' pairs of every worker's rows and send each peer its tokens' rows.
        → (this worker's own tokens' rows [P, H], the local slot of every pair run, this worker's own
        pairs (token · k + slot, of its tokens), seconds in the experts, the combine's message numbers)."""
        r, k = self.rank, self.top_k
        src, slots, mine_at, cut = [], [], [], [0]
        t0 = 0
        for s, n in enumerate(tokens):  # pairs in rank order, token-major: each peer's a contiguous run
            for t in range(t0, t0 + n):
                for j, e in enumerate(ids[t]):
                    if actor_of[e] == r:
                        src.append(t)
                        slots.append(local_of[e])
                        if s == r:
                            mine_at.append((t - t0) * k + j)
            t0 += n
            cut.append(len(src))
        started = time.perf_counter()
        P = len(src)
        if P and _few(experts, x, P):
            y = experts._expert_rows(x, src, slots, list(range(P)), P)
        elif P:
            y = experts.grouped(x[torch.tensor(src, dtype=torch.long)], torch.tensor(slots, dtype=torch.long))
        else:
            y = x.new_empty(0, self.hidden)
        spent = time.perf_counter() - started
        i = sent[0] + 1
        ns = {box.put(self.step, i, [y[cut[s]:cut[s + 1]]]) for s, box in self.boxes.items()}
        if len(ns) != 1:
            raise RuntimeError(f"worker {self.rank}'s mailboxes disagree on the message count: {sorted(ns)}")
        return y[cut[r]:cut[r + 1]], slots, mine_at, spent, (i, ns.pop())

    def combine(self, sent: tuple[int, int], own_rows: torch.Tensor, mine_at: list[int], idx: torch.Tensor, w: torch.Tensor,
                actor_of: list[int]) -> torch.Tensor:
        """This worker's tokens' routed rows [T, H]: each pair's row from the worker that ran it (its own
        ``own_rows`` at ``mine_at``), summed per token with its weights ``w``."""
        T, k = idx.shape
        ids = idx.tolist()
        at: dict[int, list[int]] = {s: [] for s in self.boxes}
        for t in range(T):
            for j, e in enumerate(ids[t]):
                a = actor_of[e]
                if a != self.rank:
                    at[a].append(t * k + j)
        rows = own_rows.new_empty(T * k, self.hidden)
        if mine_at:
            rows[mine_at] = own_rows
        for s in self.boxes:
            got = self._get(s, sent[1], sent[0], [((len(at[s]), self.hidden), self.dtype)], "combine")[0]
            if at[s]:
                rows[at[s]] = got
        return weighted_sum(rows.view(T, k, self.hidden), w.to(torch.float32))
