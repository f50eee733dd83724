"""What prefill/decode disaggregation moves: a prompt's cached blocks, checked on arrival.

A :class:`KVBlocks` is one request's transfer: the MLA latent rows of its first full blocks (every MLA
layer, the MTP layer's too), and on hybrid models the KDA state snapshot at their end, with what the
receiver needs to trust them — the model fingerprint (:class:`Fingerprint`: the checkpoint's config, the
dtype, the block size, the cache's row shapes), the blocks' chained prefix-cache hashes (which tokens,
under which salt, they hold) and a checksum over every byte. :meth:`KVBlocks.check` refuses a transfer
that does not fit the receiving engine with an error naming what differs: the block size, the dtype,
the model, a shape, the number of blocks, the checksum. A refused transfer is never written; the request
is prefilled where it is (cluster/pd.py), so a mismatch costs time, never a wrong token.

Owns: the transfer's layout and its checks. Never: decides which requests cross (cluster/pd.py), or
touches a cache (the actors read and write the blocks: model/cache.py ``read_blocks``/``write_blocks``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

import torch

from actors.kv_tier import checksum


class TransferError(ValueError):
    """A transfer that does not fit the engine receiving it (the message names what differs)."""


# how a transfer's blocks leave and reach the actors (an executor's read_blocks/write_blocks ``via``): each
# actor's blocks channel (a direct connection beside its step channel), or Ray calls through the object store
TRANSPORTS = ("channel", "object_store")


class TransportError(ConnectionError):
    """Reading or writing a transfer's blocks failed (the actor holding them died or did not answer)."""


@dataclass(frozen=True)
class Fingerprint:
    """What two engines must share for one's cached blocks to mean the same in the other's cache."""

    model: str  # a hash of the checkpoint's config (its every field) and whether the MTP layer is cached
    dtype: str  # the cache's dtype
    block_size: int
    latent: tuple[int, int] | None  # (MLA layers cached, latent width): a block is [layers, block_size, width]
    conv: tuple[int, ...] | None  # a KDA snapshot's conv state [layers, 3, W-1, P] (hybrid models)
    recurrent: tuple[int, ...] | None  # ... and recurrent state [layers, heads, d_k, d_v], fp32


def fingerprint(model_cfg, dtype: str, block_size: int, mtp: bool) -> Fingerprint:
    """The fingerprint of an engine serving ``model_cfg`` (a :class:`~model.config.ModelConfig`) in
    ``dtype`` with ``block_size``-token blocks, caching the MTP layer's latent too when ``mtp``."""
    raw = json.dumps(model_cfg.raw, sort_keys=True, default=str).encode()
    model = hashlib.blake2b(raw + (b"\x01" if mtp else b"\x00"), digest_size=16).hexdigest()
    mla = len(model_cfg.mla_layers) + (1 if mtp else 0)
    latent = (mla, model_cfg.latent_dim) if mla else None
    conv = recurrent = None
    if model_cfg.kda_layers:
        k, n = model_cfg.kda, len(model_cfg.kda_layers)
        conv = (n, 3, k.conv_kernel - 1, k.num_heads * k.head_dim)
        recurrent = (n, k.num_heads, k.head_dim, k.head_dim)
    return Fingerprint(model, str(dtype).removeprefix("torch."), block_size, latent, conv, recurrent)


def mismatch(got: Fingerprint, want: Fingerprint) -> str | None:
    """What makes blocks of fingerprint ``got`` unfit for an engine of ``want`` (None: they fit)."""
    if got.block_size != want.block_size:
        return f"block size: the blocks hold {got.block_size} tokens each, this engine's {want.block_size}"
    if got.dtype != want.dtype:
        return f"dtype: the blocks are {got.dtype}, this engine caches {want.dtype}"
    if got.model != want.model:
        return f"model: the blocks come from another model or config (fingerprint {got.model}, this engine's {want.model})"
    for name in ("latent", "conv", "recurrent"):
        if getattr(got, name) != getattr(want, name):
            return f"{name}: the blocks' rows are {getattr(got, name)}, this engine's {getattr(want, name)}"
    return None


def layout_digest(fp: Fingerprint) -> str:
    """A digest of every field of ``fp``: the KV tier's entries (actors/kv_tier.py) are named and checked by it,
    so that those of another model, config, dtype, block size or row shape never hit (a key alone is not
    enough: the same tokens cached in two dtypes)."""
    return hashlib.blake2b(json.dumps(dataclasses.astuple(fp), default=str).encode(), digest_size=16).hexdigest()


def tier_spec(config, model_cfg) -> dict | None:
    """What an attention actor of an engine of ``config`` serving ``model_cfg`` opens as its KV tier: the cache
    config's directories and sizes (CacheConfig.tier()) and the layout digest of its cache; None when off."""
    spec = config.cache.tier()
    if spec is None:
        return None
    fp = fingerprint(model_cfg, config.dtype, config.cache.block_size, config.mtp)
    return {**spec, "layout": layout_digest(fp)}


@dataclass(frozen=True)
class KVBlocks:
    """One request's cached blocks in transit (see the module docstring)."""

    fingerprint: Fingerprint
    hashes: tuple[bytes, ...]  # the blocks' chained prefix-cache hashes, in order
    tokens: int  # the prompt tokens they cover (len(hashes) · block_size)
    parts: dict[str, torch.Tensor] = field(repr=False)  # latent [layers, n, bs, width]; conv, recurrent (hybrid)
    crc: int = 0

    @classmethod
    def of(cls, fp: Fingerprint, hashes: list[bytes], parts: dict[str, torch.Tensor]) -> "KVBlocks":
        return cls(fp, tuple(hashes), len(hashes) * fp.block_size, parts, checksum(parts))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def check(self, want: Fingerprint) -> None:
        """Raise :class:`TransferError` unless these blocks fit an engine of fingerprint ``want``."""
        problem = mismatch(self.fingerprint, want)
        if problem:
            raise TransferError(problem)
        n, bs = len(self.hashes), want.block_size
        if self.tokens != n * bs:
            raise TransferError(f"tokens: {n} blocks cover {n * bs} tokens, the transfer says {self.tokens}")
        expect = {"latent": None if want.latent is None else (want.latent[0], n, bs, want.latent[1]),
                  "conv": want.conv, "recurrent": want.recurrent}
        dtypes = {"latent": want.dtype, "conv": want.dtype, "recurrent": "float32"}
        for name, shape in expect.items():
            t = self.parts.get(name)
            if shape is None:
                if t is not None:
                    raise TransferError(f"{name}: this engine's model has no {name} state, the blocks carry "
                                        f"{tuple(t.shape)}")
                continue
            if t is None:
                raise TransferError(f"{name}: missing (this engine's model needs {shape})")
            if tuple(t.shape) != shape:
                raise TransferError(f"{name}: shape {tuple(t.shape)}, this engine's is {shape}")
            if str(t.dtype).removeprefix("torch.") != dtypes[name]:
                raise TransferError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')}, this engine's is "
                                    f"{dtypes[name]}")
        extra = set(self.parts) - set(expect)
        if extra:
            raise TransferError(f"parts: unknown {sorted(extra)}")
        if checksum(self.parts) != self.crc:
            raise TransferError("checksum: the blocks' bytes changed in transit")
