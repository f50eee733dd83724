"""Checkpoint directory → a ready :class:`CausalLM` (built on the meta device, then filled).

``experts`` selects which routed experts to hold: ``None`` all, ``range(lo, hi)`` a shard,
``range(0)`` none (an attention actor). Only the selected experts' bytes are read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import read_checkpoint
from .config import ModelConfig, load_config
from .model import CausalLM, load_hf_weights
from .moe import Gate

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
