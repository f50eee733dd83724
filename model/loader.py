"""Checkpoint directory → a ready :class:`CausalLM` (built on the meta device, then filled).

``experts`` selects which routed experts to hold: ``None`` all, ``range(lo, hi)`` a shard,
``range(0)`` none (an attention actor). Only the selected experts' bytes are read.
:func:`load_routed_experts` loads just the routed experts an expert actor holds, per MoE layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .checkpoint import read_checkpoint
from .config import ModelConfig, load_config
from .layers import glu_activation
from .model import CausalLM, experts_prefix, fill_experts, load_hf_weights
from .moe import Gate, RoutedExperts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, experts: range | None = None,
               progress: bool = True, cfg: ModelConfig | None = None) -> CausalLM:
    cfg = cfg or load_config(path)
    tensors = read_checkpoint(path, cfg, experts=experts, dtype=dtype, progress=progress)
    with torch.device("meta"):
        model = CausalLM(cfg, experts)
    model = model.to_empty(device="cpu").to(dtype)
    for m in model.modules():  # the selection bias stays fp32, as in the checkpoint and the HF gate
        if isinstance(m, Gate):
            m.e_score_correction_bias.data = m.e_score_correction_bias.data.float()
    load_hf_weights(model, tensors)
    return model.eval()


def load_routed_experts(path: str | Path, cfg: ModelConfig, experts: Mapping[int, Sequence[int]], *,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        progress: bool = False) -> dict[int, RoutedExperts]:
    """MoE layer → its routed experts ``experts[layer]`` (local slot order), reading only their bytes.
    What an expert actor holds: any set of logical experts per layer (a shard, replicas of hot ones)."""
    unknown = sorted(set(experts) - set(cfg.moe_layers))
    if unknown:
        raise ValueError(f"layers {unknown} are not MoE layers of this model (MoE layers: {cfg.moe_layers})")
    tensors = read_checkpoint(path, cfg, experts={l: sorted(ids) for l, ids in experts.items()},
                              include_non_expert=False, dtype=dtype, progress=progress)
    act, out = glu_activation(cfg), {}
    for layer, ids in experts.items():
        with torch.device("meta"):
            ex = RoutedExperts(cfg.expert_hidden_size, cfg.moe_intermediate_size, ids, act)
        ex = ex.to_empty(device=device).to(dtype)
        fill_experts(ex, cfg, experts_prefix(cfg, layer), tensors)
        out[layer] = ex.eval()
    return out
