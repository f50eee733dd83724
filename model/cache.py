"""The per-sequence state of attention layers and the per-step attention metadata.

:class:`LatentCache` owns the MLA cache tensor: for every MLA layer, ``num_blocks`` blocks of
``block_size`` tokens, each token exactly ``kv_lora_rank + qk_rope_head_dim`` values (the normed
latent and the rotated rope key). :class:`KDAStateCache` owns the KDA slots (K3 / Kimi Linear):
per KDA layer and slot a fp32 recurrent state [heads, d_k, d_v] and the short-conv tail. Neither
decides which sequence gets which block or slot — that is the :class:`BlockAllocator`'s job
(owned by whoever schedules sequences).

:class:`AttnMeta` is built once per forward step from the sequences in the batch and shared by all
layers: flat token → slot mapping for writes, and, per attention group (sequences of similar query
length, see :func:`group_sequences`), padded [Bg, Qg] / [Bg, Lg] gather indices for reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .timing import StepTimes


class CacheFull(RuntimeError):
    """Raised by the allocator when no free block is left (the scheduler preempts on it)."""


class BlockAllocator:
    """Free list of cache block ids. Owns nothing but the ids."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFull(f"need {n} cache blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class LatentCache:
    """[num_layers, num_blocks * block_size, latent_dim] — one row per cached token slot."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.block_size, self.num_blocks, self.latent_dim = block_size, num_blocks, latent_dim
        self.data = torch.zeros(num_layers, num_blocks * block_size, latent_dim, dtype=dtype, device=device)

    def layer(self, i: int) -> torch.Tensor:
        return self.data[i]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all MLA layers."""
        return self.data.shape[0] * self.latent_dim * self.data.element_size()


class KDAStateCache:
    """conv [layers, slots, 3, W-1, P] (q/k/v conv inputs, oldest first) and recurrent
    [layers, slots, heads, d_k, d_v] fp32. A slot is zeroed when a sequence takes it, or loaded
    from a snapshot (prefix caching): ``num_snapshots`` more rows of both, copied whole, so a
    restored state is bit for bit the saved one."""

    def __init__(self, num_layers: int, num_slots: int, num_heads: int, head_dim: int, conv_kernel: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", num_snapshots: int = 0):
        P = num_heads * head_dim
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        rows = num_slots + num_snapshots  # slots first, then snapshots
        self.conv = torch.zeros(num_layers, rows, 3, conv_kernel - 1, P, dtype=dtype, device=device)
        self.recurrent = torch.zeros(num_layers, rows, num_heads, head_dim, head_dim, dtype=torch.float32,
                                     device=device)
        self.kept: dict[int, list] = {}  # speculative decoding: see keep()

    def _snapshot_row(self, snap: int) -> int:
        if not 0 <= snap < self.num_snapshots:
            raise ValueError(f"KDA snapshot {snap} out of range [0, {self.num_snapshots})")
        return self.num_slots + snap

    def save(self, slot: int, snap: int) -> None:
        """Snapshot ``snap`` := the state of ``slot``."""
        row = self._snapshot_row(snap)
        self.conv[:, row] = self.conv[:, slot]
        self.recurrent[:, row] = self.recurrent[:, slot]

    def restore(self, snap: int, slot: int) -> None:
        """The state of ``slot`` := snapshot ``snap``."""
        row = self._snapshot_row(snap)
        self.conv[:, slot] = self.conv[:, row]
        self.recurrent[:, slot] = self.recurrent[:, row]

    def snapshot(self, snap: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent) of snapshot ``snap``, every layer (views)."""
        row = self._snapshot_row(snap)
        return self.conv[:, row], self.recurrent[:, row]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[i], self.recurrent[i]

    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    # ---- speculative decoding: the state at the last accepted draft ------------------------------
    def keep(self, layer: int) -> list:
        """Where KDA layer row ``layer`` puts, for a group of sequences carrying drafts, its slots, its
        recurrent state after each query position [Bg, Q, H, K, V] and its conv inputs with the W−1
        before them [Bg, 3, W−1+Q, P] (emptied by :meth:`accept` and :meth:`drop_kept`)."""
        return self.kept.setdefault(layer, [])

    def drop_kept(self) -> None:
        self.kept = {}

    def accept(self, accepted: dict[int, int]) -> None:
        """Slot → the drafts accepted for it (a): its state becomes the one after query position a
        (its input token and a drafts), in every KDA layer; what the step kept is dropped."""
        W1 = self.conv.shape[3]
        for layer, groups in self.kept.items():
            for slots, states, hist in groups:
                B, Q = states.shape[:2]
                a = torch.tensor([accepted.get(s, Q - 1) for s in slots.tolist()], device=states.device)
                self.recurrent[layer, slots] = states[torch.arange(B, device=states.device), a]
                idx = a[:, None] + 1 + torch.arange(W1, device=states.device)  # the W−1 inputs ending at a
                tail = hist.gather(2, idx[:, None, :, None].expand(B, hist.shape[1], W1, hist.shape[3]))
                self.conv[layer, slots] = tail.to(self.conv.dtype)
        self.kept = {}

    @property
    def bytes_per_sequence(self) -> int:
        return (self.conv[:, 0].numel() * self.conv.element_size()
                + self.recurrent[:, 0].numel() * self.recurrent.element_size())


def write_rows(base: torch.Tensor, row: int, index: torch.Tensor, values: torch.Tensor) -> None:
    """``base[row][index] = values``, written on ``base`` itself (one ``index_put_``): the compiled decode
    step (model/compiled.py) writes its caches so, because a write into a view of a compiled graph's
    input makes torch copy the whole view (a layer's cache, every step: measured 2 ms against 0.07)."""
    base.index_put_((index.new_full(index.shape, row), index), values.to(base.dtype))


@dataclass
class ModelCache:
    """Everything one model instance caches, indexed by decoder layer."""

    latent: LatentCache | None
    kda: KDAStateCache | None
    mla_index: dict[int, int]  # decoder layer → row of latent
    kda_index: dict[int, int]  # decoder layer → row of kda
    times: StepTimes | None = None  # compute seconds per layer kind in the step (model/timing.py), when kept

    def mla_layer(self, layer: int) -> torch.Tensor:
        return self.latent.layer(self.mla_index[layer])

    def kda_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kda.layer(self.kda_index[layer])


def read_blocks(cache: ModelCache, blocks: list[int], snapshot: int | None = None) -> dict[str, torch.Tensor]:
    """Copies of what ``blocks`` hold: ``latent`` [MLA layers, len(blocks), block_size, latent_dim] (every MLA
    row, the MTP layer's too), and with ``snapshot`` (hybrid models) the KDA ``conv`` and ``recurrent`` state
    saved there, every layer — what prefill/decode disaggregation moves (cluster/kv_transfer.py). On the host:
    the copies cross processes, and the engine that receives them holds no GPU."""
    out = {}
    if cache.latent is not None:
        bs, data = cache.latent.block_size, cache.latent.data
        rows = data.view(data.shape[0], -1, bs, data.shape[2])  # [layers, num_blocks, block_size, width]
        out["latent"] = rows[:, torch.tensor(blocks, dtype=torch.long, device=data.device)].to("cpu").contiguous()
    if snapshot is not None:
        conv, recurrent = cache.kda.snapshot(snapshot)
        out["conv"], out["recurrent"] = conv.to("cpu", copy=True), recurrent.to("cpu", copy=True)
    return out


def write_blocks(cache: ModelCache, blocks: list[int], snapshot: int | None, parts: dict[str, torch.Tensor]) -> None:
    """:func:`read_blocks` backwards: ``parts``' latent rows into ``blocks``, its KDA state into ``snapshot``.
    The caller checked every shape and dtype (cluster/kv_transfer.py); a mismatch here still raises."""
    if cache.latent is not None:
        bs, data = cache.latent.block_size, cache.latent.data
        rows = data.view(data.shape[0], -1, bs, data.shape[2])
        rows[:, torch.tensor(blocks, dtype=torch.long, device=data.device)] = parts["latent"].to(data.device)
    if snapshot is not None:
        conv, recurrent = cache.kda.snapshot(snapshot)
        conv.copy_(parts["conv"].to(conv.device))
        recurrent.copy_(parts["recurrent"].to(recurrent.device))


# A group's padded query rows (sequences × its longest query) may reach this many times its real
# tokens before the next, longer query starts a new group (see :func:`group_sequences`).
MAX_QUERY_PAD = 1.5


@dataclass
class AttnGroup:
    """Sequences attended together as one padded block: ``Bg`` sequences, ``Qg`` = the longest
    query and ``Lg`` = the longest context among them. Built by :func:`build_attn_meta`. A step's
    only group is the whole batch in order: its ``seqs`` and ``tokens`` are None (the identity)."""

    seqs: torch.Tensor | None  # [Bg] batch index b of each sequence
    q_index: torch.Tensor   # [Bg, Qg] flat token index of each padded query (pads point at 0)
    q_valid: torch.Tensor   # [Bg, Qg] bool
    kv_slots: torch.Tensor  # [Bg, Lg] cache slot of each context position (pads point at 0)
    mask: torch.Tensor      # [Bg, Qg, Lg] bool, True where query may attend key
    q_rows: torch.Tensor    # [Tg] row of each real query in the flattened [Bg·Qg] padded queries
    tokens: torch.Tensor | None  # [Tg] flat token index of each real query, in q_rows order
    query_lens: list[int]   # [Bg]
    # its sequences' last query tokens after the first are drafts (speculative decoding): KDA runs them
    # one at a time, as decoding would, and keeps the state after each (KDAStateCache.kept)
    verify: bool = False


@dataclass
class AttnMeta:
    """Where this step's tokens live. Built by :func:`build_attn_meta`; read-only for layers.

    Flat query tokens are indexed t ∈ [0, T); sequences b ∈ [0, B). Attention runs per
    :class:`AttnGroup` and scatters each group's outputs back to ``groups[i].tokens``; a step of
    one group (pure decode, one prefill, similar chunks) is the whole batch in order and needs no
    gather of sequences nor scatter of outputs.
    """

    positions: torch.Tensor     # [T] absolute position of each query token
    slot_mapping: torch.Tensor  # [T] cache slot each new token is written to
    groups: list[AttnGroup]
    query_lens: list[int]
    context_lens: list[int]
    state_slots: torch.Tensor | None = None  # [B] KDA slot of each sequence (hybrid models)

    @property
    def verifying(self) -> bool:
        """Some sequences carry drafts (a group of them is marked ``verify``)."""
        return any(g.verify for g in self.groups)

    @property
    def last_token_index(self) -> torch.Tensor:
        """[B] flat index of each sequence's last query token (whose logits are sampled)."""
        ends = torch.tensor(self.query_lens).cumsum(0) - 1
        return ends


def group_sequences(query_lens: list[int], max_pad: float = MAX_QUERY_PAD) -> list[list[int]]:
    """Partition the batch into attention groups, so that one long chunk does not pad every decode.

    Sequences sorted by query length (stably) fill groups greedily: the next sequence starts a new
    group when adding it would make the group's padded query rows (sequences × longest query)
    exceed ``max_pad`` × its real tokens. So all decodes (Q = 1) share one group, a chunk joins
    queries of similar length, and the padded rows of all groups stay ≤ ``max_pad`` × T. Context
    lengths do not split groups (a group pads to its longest context). A batch that fits one group
    keeps its own order (``[list(range(B))]``)."""
    order = sorted(range(len(query_lens)), key=query_lens.__getitem__)
    groups: list[list[int]] = []
    real = 0
    for b in order:
        q = query_lens[b]  # the longest in its group so far: the order is ascending
        if groups and (len(groups[-1]) + 1) * q <= max_pad * (real + q):
            groups[-1].append(b)
            real += q
        else:
            groups.append([b])
            real = q
    return groups if len(groups) > 1 else [list(range(len(query_lens)))]


def _pad_group(seqs: list[int] | None, ql: torch.Tensor, cl: torch.Tensor, starts: torch.Tensor,
               table: torch.Tensor, block_size: int, device, verify: bool = False) -> AttnGroup:
    """The padded [Bg, Qg, Lg] block of the sequences ``seqs`` (None: the whole batch in order);
    host tensors in, ``device`` tensors out."""
    idx = None if seqs is None else torch.tensor(seqs, dtype=torch.long)
    if idx is not None:
        ql, cl, starts, table = ql[idx], cl[idx], starts[idx], table[idx]
    query_lens = ql.tolist()
    Bg, Q, L, max_blocks = len(query_lens), max(query_lens), int(cl.max()), table.shape[1]
    # context slots [Bg, L]
    j = torch.arange(L)
    kv_valid = j[None, :] < cl[:, None]
    blk = table.gather(1, (j // block_size).clamp(max=max_blocks - 1)[None, :].expand(Bg, -1))
    kv_slots = torch.where(kv_valid, blk * block_size + j % block_size, 0)
    # padded queries [Bg, Q]
    i = torch.arange(Q)
    q_valid = i[None, :] < ql[:, None]
    q_index = torch.where(q_valid, starts[:, None] + i[None, :], 0)
    q_pos = (cl - ql)[:, None] + i[None, :]  # [Bg, Q]
    mask = (j[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
    mask[:, :, 0] |= ~q_valid  # keep pad rows finite; their output is discarded
    q_rows = q_valid.flatten().nonzero().squeeze(1)
    to = dict(device=device)
    return AttnGroup(seqs=None if idx is None else idx.to(**to), q_index=q_index.to(**to),
                     q_valid=q_valid.to(**to), kv_slots=kv_slots.to(**to), mask=mask.to(**to),
                     q_rows=q_rows.to(**to), query_lens=query_lens,
                     tokens=None if idx is None else q_index.flatten()[q_rows].to(**to), verify=verify)


def _decode_meta(context_lens: list[int], block_tables: list[list[int]], block_size: int, device,
                 state_slots: list[int] | None) -> AttnMeta:
    """:func:`build_attn_meta` of a decode step (every sequence one new token, no drafts): the same
    tensors, its one group the whole batch in order, from ~10 tensor ops instead of ~40 (the per-token
    positions and slots computed on the host: a loop over the batch's sequences, one token each)."""
    B = len(context_lens)
    assert B > 0 and min(context_lens) > 0, f"bad lens {[1] * B} {context_lens}"
    max_blocks = max(1, max(len(t) for t in block_tables))
    rows = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
    positions = [c - 1 for c in context_lens]
    slots = [rows[b][min(p // block_size, max_blocks - 1)] * block_size + p % block_size
             for b, p in enumerate(positions)]
    L = max(context_lens)
    j = torch.arange(L)
    valid = j[None, :] < torch.tensor(context_lens)[:, None]  # [B, L]
    blk = torch.tensor(rows, dtype=torch.long)[:, (j // block_size).clamp(max=max_blocks - 1)]
    kv_slots = torch.where(valid, blk * block_size + j % block_size, 0)
    to = dict(device=device)
    group = AttnGroup(seqs=None, q_index=torch.arange(B, **to)[:, None], q_valid=torch.ones(B, 1, dtype=torch.bool, **to),
                      kv_slots=kv_slots.to(**to), mask=valid[:, None, :].to(**to), q_rows=torch.arange(B, **to),
                      query_lens=[1] * B, tokens=None)
    return AttnMeta(
        positions=torch.tensor(positions, dtype=torch.long, **to), slot_mapping=torch.tensor(slots, dtype=torch.long, **to),
        groups=[group], query_lens=[1] * B, context_lens=list(context_lens),
        state_slots=None if state_slots is None else torch.tensor(state_slots, dtype=torch.long, **to))


def build_attn_meta(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                    block_size: int, device: str | torch.device = "cpu",
                    state_slots: list[int] | None = None, verify: list[bool] | None = None) -> AttnMeta:
    """For each sequence: ``query_lens[b]`` new tokens at the end of a context of
    ``context_lens[b]`` tokens (new tokens included); its cache blocks are ``block_tables[b]``.
    Attention groups follow :func:`group_sequences`; the sequences ``verify`` marks (carrying
    drafts) form one group of their own."""
    assert len(query_lens) == len(context_lens) == len(block_tables), "batch fields disagree"
    if not any(verify or ()) and all(q == 1 for q in query_lens):
        return _decode_meta(context_lens, block_tables, block_size, device, state_slots)
    return _meta(query_lens, context_lens, block_tables, block_size, device, state_slots, verify)


def _meta(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
          device, state_slots: list[int] | None, verify: list[bool] | None) -> AttnMeta:
    """:func:`build_attn_meta`, any step."""
    B = len(query_lens)
    ql = torch.tensor(query_lens)
    cl = torch.tensor(context_lens)
    assert bool((ql <= cl).all()) and bool((ql > 0).all()), f"bad lens {query_lens} {context_lens}"
    max_blocks = max(1, max(len(t) for t in block_tables))
    table = torch.zeros(B, max_blocks, dtype=torch.long)
    for b, t in enumerate(block_tables):
        table[b, : len(t)] = torch.tensor(t, dtype=torch.long)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ql.cumsum(0)[:-1]])
    # flat tokens [T]: sequence, absolute position, cache slot
    seq = torch.repeat_interleave(torch.arange(B), ql)
    positions = (cl - ql)[seq] + torch.arange(int(ql.sum())) - starts[seq]
    blk = table[seq, (positions // block_size).clamp(max=max_blocks - 1)]
    slot_mapping = blk * block_size + positions % block_size
    if verify is not None and any(verify):
        rest = [b for b in range(B) if not verify[b]]
        groups = [[rest[i] for i in g] for g in group_sequences([query_lens[b] for b in rest])] if rest else []
        groups.append([b for b in range(B) if verify[b]])
    else:
        groups = group_sequences(list(query_lens))
    flags = [verify is not None and verify[g[0]] for g in groups]
    if len(groups) == 1:
        groups = [None]  # the whole batch in order
    groups = [_pad_group(g, ql, cl, starts, table, block_size, device, f) for g, f in zip(groups, flags)]
    return AttnMeta(
        positions=positions.to(device), slot_mapping=slot_mapping.to(device), groups=groups,
        query_lens=list(query_lens), context_lens=list(context_lens),
        state_slots=None if state_slots is None else torch.tensor(state_slots, dtype=torch.long, device=device),
    )
