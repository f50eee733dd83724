"""Checkpoint bytes of routed experts, read from the safetensors headers alone — independent of the
reader under test (import as ``from quant_bytes import expert_checkpoint_bytes``)."""

import json
import struct

from model.config import load_config


def stored_sizes(path) -> dict[str, int]:
    """Stored tensor name → bytes, over every safetensors file of a checkpoint directory."""
    sizes = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        sizes.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()})
    return sizes


def expert_checkpoint_bytes(path, held: dict) -> int:
    """Bytes of the routed experts ``held`` (MoE layer → logical ids) in the checkpoint (weights +
    scales; INT4's 8-byte weight_shape is metadata, not resident)."""
    cfg = load_config(path)
    ffn = "block_sparse_moe" if cfg.family == "kimi_linear" else "mlp"
    total = 0
    for name, size in stored_sizes(path).items():
        for layer, ids in held.items():
            prefix = f"model.layers.{layer}.{ffn}.experts."
            if name.startswith(prefix) and int(name[len(prefix):].split(".")[0]) in set(ids) \
                    and not name.endswith("weight_shape"):
                total += size
    return total
