"""The expert exchange through mailboxes: a decode step's MoE layer between actors of one node.

When every actor of the epoch is on one node (each pair's segment made: ``SocketMesh.board``, agreed
by all at the group's join, actors/group.py), a micro-batch small enough for a mailbox slot, of an
unreplicated MoE layer, is exchanged through the pairs' mailboxes (actors/mailbox.py) instead of the
links' frames. Two messages on every pair per exchange, always sent (an empty one too: the message
order is what keeps a slot from being rewritten before it is read):

1. **dispatch**: a sender's token rows, their top-k ids (int32) and weights (fp32) — colocated, every
   worker to every other; disaggregated, every attention actor to every expert actor;
2. **combine**: for each sender's tokens, the unweighted rows of the pairs the receiver's experts ran,
   in the sender's pair order (token-major, then top-k slot) — the sender knows which pairs those are
   from its own top-k ids and the epoch's table, so no counts go with them.

Each expert shard runs its pairs over every sender's rows (rank order: the rows
:meth:`RoutedExperts.forward <model.moe.RoutedExperts.forward>` sees in one process, through the same
expert GEMMs), and each sender sums its tokens' k rows with :func:`model.moe.weighted_sum` as every
path does: the same bits as the link exchange and the single process (docs/architecture.md,
"Exactness"). :class:`Board` is the colocated worker's (actors/colocated.py); :func:`issue`,
:func:`collect` and :func:`serve` are the attention and expert actors' (actors/dispatch.py).

Whether an exchange takes the mailboxes is decided from what every worker knows alike (the step's
token counts, the layer, the table, the slot size), so all take the same path; messages are numbered
per step in the order the exchanges are made. Owns: the numbering of one worker's mailbox messages in
a step. Never: chooses placement, or waits without the link's timeout (errors go to the caller, which
names the worker, step, layer and phase).
"""

from __future__ import annotations

import time

import torch

from contextlib import contextmanager
from dataclasses import dataclass

from model.moe import RoutedExperts, _few, weighted_sum

from .mailbox import Mailbox, message_bytes

# The disaggregated layout takes the mailboxes up to this many pairs a micro-batch: past it (bench_step.py,
# 16 streams on one expert actor: 128 pairs) the links' dense format, which sends one summed row per token
# back where the mailboxes send one row per pair, was as fast. Colocated workers take them at any size that
# fits (faster at 16 streams too).
DISAGGREGATED_PAIRS = 64


def board_of(mesh, device: torch.device, hidden: int, dtype: torch.dtype, top_k: int) -> "Board | None":
    """The mailbox exchange of this process in ``mesh`` (the epoch's links), where every pair of the epoch
    has mailboxes (``mesh.board``) and the exchange is on the host; else None (the links)."""
    if mesh is None or not mesh.board or not mesh.links or torch.device(device).type != "cpu":
        return None
    return Board(mesh.rank, {p: link.box for p, link in mesh.links.items()}, hidden, dtype, top_k)


class Board:
    """Rank ``rank``'s mailboxes to each peer (``boxes``: peer rank → :class:`~actors.mailbox.Mailbox`):
    a colocated worker's to every other worker; an attention actor's to every expert actor, an expert
    actor's to every attention actor (ranks: attention actors first, then expert actors)."""

    def __init__(self, rank: int, boxes: dict[int, Mailbox], hidden: int, dtype: torch.dtype, top_k: int):
        self.rank, self.boxes = rank, boxes
        self.top_k, self.hidden, self.dtype = top_k, 0, dtype
        self.width(hidden, dtype)
        self.step, self.sent, self.phase = -1, 0, "dispatch"
        self.exchanges = 0  # exchanges made through the mailboxes, ever (tests, the profile)
        self.waited = {"dispatch": 0.0, "combine": 0.0}  # seconds waiting for each phase's messages, this step

    def width(self, hidden: int, dtype: torch.dtype) -> "Board":
        """Rows of ``hidden`` values of ``dtype`` from now on (an expert actor learns it with each layer)."""
        if (hidden, dtype) != (self.hidden, self.dtype):
            self.hidden, self.dtype, k = hidden, dtype, self.top_k
            slot = min(b.slot_bytes for b in self.boxes.values())
            # the most tokens a sender may send in one micro-batch: its dispatch, and a combine of all its pairs
            per = max(message_bytes([((1, hidden), dtype), ((1, k), torch.int32), ((1, k), torch.float32)]),
                      message_bytes([((k, hidden), dtype)]))
            self.max_tokens = max(0, (slot - 3 * 64) // per)
        return self

    def begin_step(self, step: int) -> None:
        self.step, self.sent = step, 0
        self.waited = dict.fromkeys(self.waited, 0.0)

    def _get(self, s: int, n: int, i: int, shapes: list, phase: str) -> list[torch.Tensor]:
        self.phase = phase
        t0 = time.perf_counter()
        try:
            return self.boxes[s].get(n, self.step, i, shapes)
        finally:
            self.waited[phase] += time.perf_counter() - t0

    def takes(self, tokens, max_pairs: int | None = None) -> bool:
        """Whether a micro-batch of these token counts (every sender's) fits the mailboxes (and, given
        ``max_pairs``, has at most that many pairs)."""
        return bool(tokens) and max(tokens) <= self.max_tokens and \
            (max_pairs is None or sum(tokens) * self.top_k <= max_pairs)

    def expect(self) -> tuple[int, int]:
        """An expert actor's exchange, which sends no dispatch: its (message number in the step, number
        over the pairs' life) as the attention actors' :meth:`dispatch` gave them."""
        i, self.sent = self.sent, self.sent + 2
        self.exchanges += 1
        ns = {box.sent for box in self.boxes.values()}
        if len(ns) != 1:
            raise RuntimeError(f"rank {self.rank}'s mailboxes disagree on the message count: {sorted(ns)}")
        return i, ns.pop()

    def _put(self, i: int, parts) -> int:
        """Message ``i`` of the step to every peer (``parts``: its tensors, or a peer's of ``parts(peer)``);
        its number n over the pairs' life, the same on every pair and at both ends of each (every message
        goes to every peer, in the same order)."""
        ns = {box.put(self.step, i, parts(s) if callable(parts) else parts) for s, box in self.boxes.items()}
        if len(ns) != 1:
            raise RuntimeError(f"worker {self.rank}'s mailboxes disagree on the message count: {sorted(ns)}")
        return ns.pop()

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
        """Send this worker's rows to every peer; returns the exchange's (message number in the step,
        number over the pairs' life)."""
        i, self.sent, self.phase = self.sent, self.sent + 2, "dispatch"
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
        if not xs:
            return torch.empty(0, self.hidden, dtype=self.dtype), ids
        return (torch.cat(xs) if len(xs) > 1 else xs[0]), ids

    def serve(self, sent: tuple[int, int], experts: RoutedExperts, x: torch.Tensor, ids: list[list[int]],
              tokens, actor_of: list[int], local_of: list[int], me: int | None = None) -> tuple:
        """Run the pairs of this process's experts (expert actor ``me`` of the table; a colocated worker's
        is its rank) over every sender's rows and send each sender its tokens' rows.
        → (this worker's own tokens' rows [P, H], the local slot of every pair run, this worker's own
        pairs (token · k + slot, of its tokens), seconds in the experts, the combine's message numbers)."""
        r, k = self.rank, self.top_k
        me = r if me is None else me
        src, slots, mine_at, cut = [], [], [], [0]
        t0 = 0
        for s, n in enumerate(tokens):  # pairs in rank order, token-major: each peer's a contiguous run
            for t in range(t0, t0 + n):
                for j, e in enumerate(ids[t]):
                    if actor_of[e] == me:
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
        i, self.phase = sent[0] + 1, "combine"
        n = self._put(i, lambda s: [y[cut[s]:cut[s + 1]]])
        return y[cut[r]:cut[r + 1]] if r < len(tokens) else y[:0], slots, mine_at, spent, (i, n)

    def combine(self, sent: tuple[int, int], own_rows: torch.Tensor, mine_at: list[int], idx: torch.Tensor,
                w: torch.Tensor, actor_of: list[int], offset: int = 0) -> torch.Tensor:
        """This sender's tokens' routed rows [T, H]: each pair's row from the rank that ran it (expert actor
        a is rank a + ``offset``; this worker's own ``own_rows`` at ``mine_at``), summed per token with its
        weights ``w``."""
        T, k = idx.shape
        ids = idx.tolist()
        at: dict[int, list[int]] = {s: [] for s in self.boxes}
        for t in range(T):
            for j, e in enumerate(ids[t]):
                a = actor_of[e] + offset
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


@contextmanager
def accounted(d, layer: int):
    """Around one exchange through ``d.board`` (``d`` a :class:`~actors.dispatch._Collectives`): its
    waits go into ``d``'s exchange and phase times; a mailbox's failure (a peer gone or stuck) becomes
    the exchange's error naming the actor, step, layer and phase."""
    b = d.board
    before = dict(b.waited)
    try:
        yield b
    except OSError as e:
        raise d.error(layer, b.phase, e) from e
    finally:
        for phase, s in b.waited.items():
            d.exchange_s += s - before[phase]
            d.phase_s[phase] += s - before[phase]


@dataclass
class Posted:
    """An attention actor's exchange through the mailboxes, posted (the disaggregated layout)."""

    layer: int
    idx: torch.Tensor  # [T, k]
    w: torch.Tensor  # [T, k]
    x_dtype: torch.dtype
    x_device: torch.device
    sent: tuple[int, int]  # its dispatch's message numbers


def issue(d, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, tokens) -> Posted:
    """An attention actor (:class:`~actors.dispatch.DistDispatcher` ``d``) sends its rows to every expert
    actor; ``tokens``: every attention actor's count in this micro-batch, as the expert actors have it."""
    if tokens[d.board.rank] != x.shape[0]:
        raise ValueError(f"{d.actor}: {x.shape[0]} tokens in an exchange of step {d.step}, the step said "
                         f"{tokens[d.board.rank]}")
    d.count(layer, idx, None)
    with accounted(d, layer) as b:
        return Posted(layer, idx, w, x.dtype, x.device, b.dispatch(x, idx, w))


def collect(d, p: Posted) -> torch.Tensor:
    """The attention actor's routed rows [T, H] of ``p``: each pair's row from the expert actor that ran it."""
    with accounted(d, p.layer) as b:
        actor_of, _ = d.routing.lists(p.layer)
        empty = torch.empty(0, d.hidden, dtype=d.dtype)
        i, n = p.sent  # the expert actors' answer: message i + 1 of the step, their n-th to this actor
        out = b.combine((i + 1, n), empty, [], p.idx, p.w, actor_of, offset=d.num_attention)
    return out.to(p.x_device, p.x_dtype)


def serve(ex, layer: int, experts: RoutedExperts, tokens) -> torch.Tensor:
    """An expert actor's (:class:`~actors.dispatch.ExpertExchange` ``ex``) part: every attention actor's
    rows through its experts, each actor's pairs' rows sent back. Returns the rows run per local slot."""
    with accounted(ex, layer) as b:
        sent = b.expect()
        actor_of, local_of = ex.routing.lists(layer)
        x, ids = b.rows(sent, tokens, None)
        _, slots, _, spent, _ = b.serve(sent, experts, x, ids, tokens, actor_of, local_of, me=ex.index)
    return torch.bincount(torch.tensor(slots, dtype=torch.long), minlength=ex.table.max_local)
