"""Start-up bounds: how long loading the weights may take before the engine gives up.

Owns the default load timeout, which scales with the bytes the actors read (the checkpoint's
weights as :mod:`cluster.planner` counts them: every attention replica reads the non-expert
weights, the expert actors the routed experts once). Never: reads files or talks to Ray.
"""

from __future__ import annotations

from model.config import ModelConfig

from .planner import weight_bytes

LOAD_BASE_S = 300.0  # actor start-up, process group, compilation: independent of the size
LOAD_BYTES_PER_S = 250e6  # a conservative aggregate read rate (one shared disk or network filesystem)


def bytes_to_read(cfg: ModelConfig, attention: int) -> int:
    w = weight_bytes(cfg)
    return attention * (w.total - w.routed_experts) + w.routed_experts


def default_load_timeout_s(cfg: ModelConfig, attention: int = 1) -> float:
    """``LOAD_BASE_S`` plus the bytes to read at ``LOAD_BYTES_PER_S``: K2 FP8 (1.03 TB) gets ~70 min,
    a tiny preset 300 s."""
    return LOAD_BASE_S + bytes_to_read(cfg, attention) / LOAD_BYTES_PER_S
