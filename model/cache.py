"""The per-sequence state of attention layers and the per-step attention metadata.

:class:`LatentCache` owns the MLA cache tensor: for every MLA layer, ``num_blocks`` blocks of
``block_size`` tokens, each token exactly ``kv_lora_rank + qk_rope_head_dim`` values (the normed
latent and the rotated rope key). :class:`KDAStateCache` owns the KDA slots (K3 / Kimi Linear):
per KDA layer and slot a fp32 recurrent state [heads, d_k, d_v] and the short-conv tail. Neither
decides which sequence gets which block or slot — that is the :class:`BlockAllocator`'s job
(owned by whoever schedules sequences).

:class:`AttnMeta` is built once per forward step from the sequences in the batch and shared by all
layers: flat token → slot mapping for writes, and padded [B, Q] / [B, L] gather indices for reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    [layers, slots, heads, d_k, d_v] fp32. A slot is zeroed when a sequence takes it."""

    def __init__(self, num_layers: int, num_slots: int, num_heads: int, head_dim: int, conv_kernel: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        P = num_heads * head_dim
        self.num_slots = num_slots
        self.conv = torch.zeros(num_layers, num_slots, 3, conv_kernel - 1, P, dtype=dtype, device=device)
        self.recurrent = torch.zeros(num_layers, num_slots, num_heads, head_dim, head_dim, dtype=torch.float32,
                                     device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[i], self.recurrent[i]

    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    @property
    def bytes_per_sequence(self) -> int:
        return (self.conv[:, 0].numel() * self.conv.element_size()
                + self.recurrent[:, 0].numel() * self.recurrent.element_size())


@dataclass
class ModelCache:
    """Everything one model instance caches, indexed by decoder layer."""

    latent: LatentCache | None
    kda: KDAStateCache | None
    mla_index: dict[int, int]  # decoder layer → row of latent
    kda_index: dict[int, int]  # decoder layer → row of kda

    def mla_layer(self, layer: int) -> torch.Tensor:
        return self.latent.layer(self.mla_index[layer])

    def kda_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kda.layer(self.kda_index[layer])


@dataclass
class AttnMeta:
    """Where this step's tokens live. Built by :func:`build_attn_meta`; read-only for layers.

    Flat query tokens are indexed t ∈ [0, T); sequences b ∈ [0, B).
    """

    positions: torch.Tensor     # [T] absolute position of each query token
    slot_mapping: torch.Tensor  # [T] cache slot each new token is written to
    q_index: torch.Tensor       # [B, Q] flat token index of each padded query (pads point at 0)
    q_valid: torch.Tensor       # [B, Q] bool
    kv_slots: torch.Tensor      # [B, L] cache slot of each context position (pads point at 0)
    mask: torch.Tensor          # [B, Q, L] bool, True where query may attend key
    query_lens: list[int]
    context_lens: list[int]
    state_slots: torch.Tensor | None = None  # [B] KDA slot of each sequence (hybrid models)

    @property
    def last_token_index(self) -> torch.Tensor:
        """[B] flat index of each sequence's last query token (whose logits are sampled)."""
        ends = torch.tensor(self.query_lens).cumsum(0) - 1
        return ends


def build_attn_meta(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                    block_size: int, device: str | torch.device = "cpu",
                    state_slots: list[int] | None = None) -> AttnMeta:
    """For each sequence: ``query_lens[b]`` new tokens at the end of a context of
    ``context_lens[b]`` tokens (new tokens included); its cache blocks are ``block_tables[b]``."""
    assert len(query_lens) == len(context_lens) == len(block_tables), "batch fields disagree"
    B = len(query_lens)
    Q, L = max(query_lens), max(context_lens)
    ql = torch.tensor(query_lens)
    cl = torch.tensor(context_lens)
    assert bool((ql <= cl).all()) and bool((ql > 0).all()), f"bad lens {query_lens} {context_lens}"
    max_blocks = max(1, max(len(t) for t in block_tables))
    table = torch.zeros(B, max_blocks, dtype=torch.long)
    for b, t in enumerate(block_tables):
        table[b, : len(t)] = torch.tensor(t, dtype=torch.long)
    # context slots [B, L]
    j = torch.arange(L)
    kv_valid = j[None, :] < cl[:, None]
    blk = table.gather(1, (j // block_size).clamp(max=max_blocks - 1)[None, :].expand(B, -1))
    kv_slots = torch.where(kv_valid, blk * block_size + j % block_size, 0)
    # padded queries [B, Q]
    i = torch.arange(Q)
    q_valid = i[None, :] < ql[:, None]
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ql.cumsum(0)[:-1]])
    q_index = torch.where(q_valid, starts[:, None] + i[None, :], 0)
    q_pos = (cl - ql)[:, None] + i[None, :]  # [B, Q]
    mask = (j[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
    mask[:, :, 0] |= ~q_valid  # keep pad rows finite; their output is discarded
    positions = q_pos[q_valid]
    slot_mapping = kv_slots.gather(1, q_pos.clamp(max=L - 1))[q_valid]
    to = dict(device=device)
    return AttnMeta(
        positions=positions.to(**to), slot_mapping=slot_mapping.to(**to), q_index=q_index.to(**to),
        q_valid=q_valid.to(**to), kv_slots=kv_slots.to(**to), mask=mask.to(**to),
        query_lens=list(query_lens), context_lens=list(context_lens),
        state_slots=None if state_slots is None else torch.tensor(state_slots, dtype=torch.long, device=device),
    )
