"""Checkpoint directory → a ready :class:`CausalLM` (built on the meta device, then filled).

``experts`` selects which routed experts to hold: ``None`` all, ``range(lo, hi)`` a shard,
``range(0)`` none (an attention actor). Only the selected experts' bytes are read. Quantised
weights stay in their checkpoint format (FP8 / INT4 / MXFP4, :mod:`model.qweights`) unless
``dequantize`` asks for everything dequantised at load (the oracle).
:func:`load_routed_experts` loads just the routed experts an expert actor holds, per MoE layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from .checkpoint import DEFAULT_READ_THREADS, read_checkpoint
from .config import ModelConfig, load_config
from .layers import glu_activation
from .model import CausalLM, experts_prefix, fill_experts, load_hf_weights
from .moe import Gate, RoutedExperts
from .names import EXPERT_WEIGHT_NAMES
from .qweights import QuantLinear, QuantRoutedExperts, QuantStack, QuantTensor

ProgressFn = Callable[[int, int], None]
# FP8 linears kept dequantised even when the rest stays in checkpoint format: the absorbed MLA
# path splits kv_b_proj into W_UK / W_UV on every call (MODEL_SPEC §1.9, §2.3)
DENSE_RESIDENT = ("kv_b_proj.weight",)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _materialize(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to_empty(device="cpu").to(dtype)`` without its cost: ``to_empty`` on meta tensors runs
    torch's Python reference ops, which import sympy (0.5 s of every actor's start). Every parameter
    and buffer becomes uninitialised CPU memory of its shape (floating point ones in ``dtype``), to be
    filled from the checkpoint."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype)

    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = nn.Parameter(empty(p), requires_grad=p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = empty(b)
    return model


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, experts: range | None = None,
               progress: bool = True, cfg: ModelConfig | None = None, dequantize: bool = False,
               threads: int = DEFAULT_READ_THREADS, on_progress: ProgressFn | None = None,
               mtp: bool = False) -> CausalLM:
    """The model, with quantised weights resident in checkpoint format (``dequantize=False``): FP8
    linears become :class:`QuantLinear` (``kv_b_proj`` excepted: the absorbed path reads it
    whole, MODEL_SPEC §1.9), quantised routed experts :class:`QuantRoutedExperts`. Outputs are
    bit-identical to ``dequantize=True`` (everything dequantised at load) on CPU. With ``mtp`` the
    model holds its multi-token-prediction layer too (model/mtp.py; its weights dequantised)."""
    cfg = cfg or load_config(path)
    tensors = read_checkpoint(path, cfg, experts=experts, dtype=dtype, progress=progress,
                              keep_quantized=not dequantize, threads=threads, on_progress=on_progress, mtp=mtp)
    if mtp:
        prefix = f"model.layers.{cfg.num_hidden_layers}."
        tensors.update({n: t.dequant().to(dtype) for n, t in tensors.items()
                        if n.startswith(prefix) and isinstance(t, QuantTensor)})
    with torch.device("meta"):
        model = CausalLM(cfg, experts, mtp=mtp)
    model = _materialize(model, dtype)
    for m in model.modules():  # the selection bias stays fp32, as in the checkpoint and the HF gate
        if isinstance(m, Gate):
            m.e_score_correction_bias.data = m.e_score_correction_bias.data.float()
    for layer, moe in model.moe_blocks().items():
        routed = quant_experts(cfg, layer, moe.experts.expert_ids, tensors, dtype, moe.experts.act)
        if routed is not None:
            moe.experts = routed
    for name in [n for n, t in tensors.items() if isinstance(t, QuantTensor)]:
        q = tensors.pop(name)
        if name.endswith(DENSE_RESIDENT):
            tensors[name] = q.dequant().to(dtype)
            continue
        parent, _, child = name.removesuffix(".weight").rpartition(".")
        assert isinstance(getattr(model.get_submodule(parent), child), nn.Linear), f"{name}: not a linear"
        setattr(model.get_submodule(parent), child, QuantLinear(q, dtype))
    load_hf_weights(model, tensors)
    return model.eval()


def quant_experts(cfg: ModelConfig, layer: int, ids: Sequence[int], tensors: dict, dtype: torch.dtype,
                  act) -> QuantRoutedExperts | None:
    """Layer ``layer``'s experts ``ids`` in checkpoint format, taking their tensors out of ``tensors``;
    None when they are not quantised (or there are none)."""
    prefix = experts_prefix(cfg, layer)
    names = [[f"{prefix}.{e}.{p}.weight" for e in ids] for p in EXPERT_WEIGHT_NAMES[cfg.family]]
    if not ids or not isinstance(tensors[names[0][0]], QuantTensor):
        return None
    gate, up, down = (QuantStack([tensors.pop(n) for n in proj]) for proj in names)
    return QuantRoutedExperts(ids, gate, up, down, act, dtype)


def served_moe_layers(cfg: ModelConfig, *, mtp: bool) -> list[int]:
    """The MoE layers whose routed experts are served: the decoder's, and with ``mtp`` the first
    multi-token-prediction layer's (DeepSeek-V3's layer ``num_hidden_layers``) when the checkpoint
    has one with routed experts."""
    layers = list(cfg.moe_layers)
    if mtp and cfg.num_nextn_predict_layers >= 1 and cfg.family == "deepseek_v3" and cfg.is_moe_layer(cfg.num_hidden_layers):
        layers.append(cfg.num_hidden_layers)
    return layers


def load_routed_experts(path: str | Path, cfg: ModelConfig, experts: Mapping[int, Sequence[int]], *,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        progress: bool = False, dequantize: bool = False, threads: int = DEFAULT_READ_THREADS,
                        on_progress: ProgressFn | None = None) -> dict[int, RoutedExperts | QuantRoutedExperts]:
    """MoE layer → its routed experts ``experts[layer]`` (local slot order), reading only their bytes.
    What an expert actor holds: any set of logical experts per layer (a shard, replicas of hot ones).
    A quantised checkpoint's experts stay in its format (:class:`QuantRoutedExperts`, same interface)
    unless ``dequantize``."""
    layers = served_moe_layers(cfg, mtp=True)
    unknown = sorted(set(experts) - set(layers))
    if unknown:
        raise ValueError(f"layers {unknown} are not MoE layers of this model (MoE layers: {layers})")
    tensors = read_checkpoint(path, cfg, experts={l: sorted(ids) for l, ids in experts.items()},
                              include_non_expert=False, dtype=dtype, progress=progress,
                              keep_quantized=not dequantize, threads=threads, on_progress=on_progress,
                              mtp=cfg.num_hidden_layers in experts)
    act, out = glu_activation(cfg), {}
    for layer, ids in experts.items():
        quant = quant_experts(cfg, layer, ids, tensors, dtype, act)
        if quant is not None:
            out[layer] = quant.to(device).eval()
            continue
        with torch.device("meta"):
            ex = RoutedExperts(cfg.expert_hidden_size, cfg.moe_intermediate_size, ids, act)
        ex = ex.to_empty(device=device).to(dtype)
        fill_experts(ex, cfg, experts_prefix(cfg, layer), tensors)
        out[layer] = ex.eval()
    return out


def weight_bytes(module: nn.Module) -> int:
    """Resident bytes of a module's parameters and buffers (quantised ones at their checkpoint size)."""
    return sum(t.numel() * t.element_size() for t in itertools.chain(module.parameters(), module.buffers()))
