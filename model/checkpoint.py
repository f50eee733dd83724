"""Hugging Face checkpoint directories: validated, selective, dequantising reads; test writes.

Owns the on-disk layout: ``config.json``, ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, and how each storage format (plain, fp8 block, int4
and mxfp4 compressed-tensors) splits a logical tensor into stored parts. What the
tensors are called lives in :mod:`model.names`; the number formats in :mod:`model.quant`.

A read touches only the bytes of the tensors it needs: the layout is learnt from the
index (or the single file's header), a shard holding nothing needed is never opened,
and ``safe_open`` memory-maps each needed tensor on its own. Everything that is wrong
with a checkpoint is found from names, shapes and dtypes in the headers *before* any
data is read, and reported together in one :class:`CheckpointError`.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from .config import ModelConfig, parse_config
from .names import (
    PART_SUFFIXES,
    ExpertSelection,
    canonical_name,
    check_quant_method,
    is_fp32,
    is_ignored,
    is_quantized,
    is_routed_expert,
    split_stored,
    tensor_specs,
)
from .qweights import QuantTensor
from .quant import pack_int4, pack_mxfp4, quant_fp8_block
from .threads import adopt_torch_threads

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_FLOATS = ("F64", "F32", "F16", "BF16")
_MAX_REPORTED = 20  # problems listed in one error; the rest are counted
DEFAULT_READ_THREADS = 4  # concurrent tensor reads per process (a disk wants several reads in flight)


class CheckpointError(ValueError):
    """A checkpoint directory does not match the model config: missing, unexpected, misshapen
    or mistyped tensors, or missing files. The message names each tensor and file."""


# ---- layout ------------------------------------------------------------------------------


def read_header(file: Path) -> dict[str, dict]:
    """safetensors header of ``file``: stored name → {"dtype", "shape", "data_offsets"}; the
    offsets count from the data section, which starts at byte 8 + header length."""
    try:
        with open(file, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 1 << 30:
                raise ValueError(f"header length {n}")
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


@dataclass
class _Layout:
    root: Path
    weight_map: dict[str, str]  # stored name → file name inside root
    headers: dict[str, dict]  # file name → header, filled lazily


def _layout(root: Path) -> _Layout:
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index, expected a 'weight_map' object ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        return _Layout(root, weight_map, {})
    single = root / SINGLE_FILE
    if single.exists():
        header = read_header(single)
        return _Layout(root, {name: SINGLE_FILE for name in header}, {SINGLE_FILE: header})
    raise CheckpointError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


# ---- validation --------------------------------------------------------------------------


@dataclass
class _Plan:
    """How to read one needed logical tensor: storage format and stored part names."""

    fmt: str  # "plain" | "fp8" | "int4" | "mxfp4"
    parts: dict[str, str]  # part suffix → stored name
    shape: tuple[int, ...]


def _storage_format(logical: str, parts: dict[str, str], cfg: ModelConfig) -> str:
    if set(parts) == {""}:
        return "plain"
    found = sorted(parts.values())
    if cfg.quant is None:
        raise CheckpointError(
            f"tensor {logical!r} is stored quantised ({found}) but config.json has no quantization_config"
        )
    method = cfg.quant.method
    if set(parts) != set(PART_SUFFIXES[method]):
        want = [logical + s for s in PART_SUFFIXES[method]]
        raise CheckpointError(f"tensor {logical!r}: found parts {found}, a {method} checkpoint stores {want}")
    return method


def _expected_parts(logical: str, plan: _Plan, cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Part suffix → (allowed safetensors dtypes, shape)."""
    if plan.fmt == "plain":
        return {"": (_FLOATS, plan.shape)}
    if len(plan.shape) != 2:
        raise CheckpointError(f"tensor {logical!r} is stored {plan.fmt} but its shape {plan.shape} is not [out, in]")
    out, inp = plan.shape
    assert cfg.quant is not None, "a quantised plan needs a quant config"
    g = cfg.quant.group_size
    if plan.fmt == "fp8":
        bo, bi = cfg.quant.block_size
        return {"": (("F8_E4M3",), plan.shape), "_scale_inv": (("F32",), (math.ceil(out / bo), math.ceil(inp / bi)))}
    if plan.fmt == "int4":
        return {
            "_packed": (("I32",), (out, math.ceil(inp / 8))),
            "_scale": (("BF16", "F16", "F32"), (out, math.ceil(inp / g))),
            "_shape": (("I32", "I64"), (2,)),
        }
    return {"_packed": (("U8",), (out, inp // 2)), "_scale": (("U8",), (out, math.ceil(inp / g)))}


def _plan_reads(layout: _Layout, cfg: ModelConfig, wanted: dict[str, tuple[int, ...]],
                mtp: bool = False) -> dict[str, _Plan]:
    """Check names (all), files and headers (needed only); return the read plan or raise."""
    groups: dict[str, dict[str, str]] = {}
    problems: list[str] = []
    for stored in layout.weight_map:
        name = canonical_name(stored)
        if is_ignored(name, cfg, mtp=mtp):
            continue
        logical, suffix = split_stored(name)
        other = groups.setdefault(logical, {}).setdefault(suffix, stored)
        if other != stored:
            problems.append(f"tensor {logical + suffix!r} is stored twice: as {other!r} and as {stored!r}")
    full = tensor_specs(cfg, mtp=mtp)
    problems += [
        f"unexpected tensor {stored!r} in {layout.weight_map[stored]}: not a tensor of this {cfg.model_type} config"
        for logical, parts in groups.items() if logical not in full for stored in parts.values()
    ]
    plans: dict[str, _Plan] = {}
    for logical, shape in wanted.items():
        if logical not in groups:
            problems.append(f"missing tensor {logical!r} (expected shape {shape})")
            continue
        try:
            plans[logical] = _Plan(_storage_format(logical, groups[logical], cfg), groups[logical], shape)
        except CheckpointError as e:
            problems.append(str(e))
    problems += _header_problems(layout, plans, cfg)
    if problems:
        more = f"\n  … and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        listed = "\n  ".join(problems[:_MAX_REPORTED])
        raise CheckpointError(
            f"{layout.root}: checkpoint does not match config ({len(problems)} problems):\n  {listed}{more}"
        )
    return plans


def _header_problems(layout: _Layout, plans: dict[str, _Plan], cfg: ModelConfig) -> list[str]:
    """Missing files, and stored shapes/dtypes that disagree with the plan, from headers only."""
    problems = []
    for file in sorted({layout.weight_map[s] for p in plans.values() for s in p.parts.values()}):
        if not (layout.root / file).exists():
            holds = sorted(s for p in plans.values() for s in p.parts.values() if layout.weight_map[s] == file)
            more = " …" if len(holds) > 3 else ""
            problems.append(f"missing file {file} (listed in {INDEX_FILE}), which holds {holds[:3]}{more}")
        elif file not in layout.headers:
            layout.headers[file] = read_header(layout.root / file)
    for logical, plan in plans.items():
        try:
            expected = _expected_parts(logical, plan, cfg)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        for suffix, (dtypes, shape) in expected.items():
            stored = plan.parts[suffix]
            file = layout.weight_map[stored]
            if file not in layout.headers:  # a missing file, reported above
                continue
            info = layout.headers[file].get(stored)
            if info is None:
                problems.append(f"tensor {stored!r}: listed in {INDEX_FILE} under {file} but absent from that file")
            elif tuple(info["shape"]) != shape or info["dtype"] not in dtypes:
                problems.append(
                    f"tensor {stored!r} in {file}: found shape {tuple(info['shape'])} dtype {info['dtype']}, "
                    f"expected shape {shape} dtype {'/'.join(dtypes)}"
                )
    return problems


# ---- read --------------------------------------------------------------------------------


def read_checkpoint(
    path: str | Path,
    cfg: ModelConfig,
    *,
    experts: ExpertSelection = None,
    include_non_expert: bool = True,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    keep_quantized: bool = False,
    threads: int = DEFAULT_READ_THREADS,
    on_progress: Callable[[int, int], None] | None = None,
    mtp: bool = False,
) -> dict[str, Tensor | QuantTensor]:
    """Load logical HF name → dequantised tensor in ``dtype`` (router bias, KDA A_log and dt_bias
    stay fp32); with ``keep_quantized`` a quantised tensor comes back as a :class:`QuantTensor` in
    its checkpoint format instead (its ``dequant()`` is the dequantised tensor, in fp32).

    ``experts`` selects the routed experts of every MoE layer (None: all; ``range(0)``: none; or a
    mapping MoE layer → ids);
    ``include_non_expert=False`` skips everything but those routed experts. Stray
    ``rotary_emb.inv_freq`` buffers, layers >= ``num_hidden_layers`` (the MTP layer, unless ``mtp``
    asks for the first of them: then its tensors are read too) and a
    multimodal checkpoint's vision tower are ignored; stored names are read through
    :func:`model.names.canonical_name` (K3's ``language_model.`` prefix). Raises
    :class:`CheckpointError` before reading any data if a needed tensor is missing or misshapen,
    any tensor is not part of the model, or a needed file is missing; also for a quant method the
    model family has no layout for (fp8 Kimi Linear).

    ``threads`` readers ``pread`` the tensors' byte ranges concurrently (the GIL is released while
    reading); ``on_progress(bytes_read, bytes_total)`` is called after each tensor, from the
    calling thread.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    try:
        check_quant_method(cfg, cfg.quant.method if cfg.quant else None)
    except ValueError as e:
        raise CheckpointError(f"{path}: config.json quantization_config: {e}") from None
    layout = _layout(Path(path))
    wanted = {
        name: shape for name, shape in tensor_specs(cfg, experts, mtp=mtp).items()
        if include_non_expert or is_routed_expert(name) is not None
    }
    plans = _plan_reads(layout, cfg, wanted, mtp)
    order = sorted(plans, key=lambda n: (layout.weight_map[next(iter(plans[n].parts.values()))], n))
    total = sum(_stored_bytes(layout, s) for p in plans.values() for s in p.parts.values())
    result: dict[str, Tensor | QuantTensor] = {}
    with _Files(layout) as files, ThreadPoolExecutor(threads, initializer=adopt_torch_threads) as pool, _progress_bar(progress) as bar:
        def load(logical: str) -> tuple[str, Tensor | QuantTensor, int]:
            plan = plans[logical]
            parts = {sfx: files.read(s) for sfx, s in plan.parts.items()}
            q = _decode(logical, plan, parts, cfg)
            if isinstance(q, QuantTensor) and not keep_quantized:
                q = q.dequant()
            if isinstance(q, Tensor):
                q = q.to(torch.float32 if is_fp32(logical) else dtype)
            return logical, q, sum(t.numel() * t.element_size() for t in parts.values())

        task = bar.add_task("loading checkpoint", total=len(order))
        done = 0
        for logical, tensor, nbytes in pool.map(load, order):
            result[logical] = tensor
            done += nbytes
            bar.advance(task)
            if on_progress is not None:
                on_progress(done, total)
    return {name: result[name] for name in wanted}


def checkpoint_bytes(path: str | Path, cfg: ModelConfig, *, experts: ExpertSelection = None,
                     include_non_expert: bool = True) -> int:
    """Bytes :func:`read_checkpoint` with the same selection would read (from headers only)."""
    layout = _layout(Path(path))
    wanted = {name: shape for name, shape in tensor_specs(cfg, experts).items()
              if include_non_expert or is_routed_expert(name) is not None}
    plans = _plan_reads(layout, cfg, wanted)
    return sum(_stored_bytes(layout, s) for p in plans.values() for s in p.parts.values())


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _stored_bytes(layout: _Layout, stored: str) -> int:
    start, end = layout.headers[layout.weight_map[stored]][stored]["data_offsets"]
    return end - start


def _open(file: Path) -> int:
    """The one place a checkpoint file is opened for reading (tests count the calls)."""
    return os.open(file, os.O_RDONLY)


class _Files:
    """Open descriptors of a read's files; ``read(stored)`` preads one tensor's bytes (thread-safe)."""

    def __init__(self, layout: _Layout):
        self.layout, self.fds, self.data_start = layout, {}, {}

    def __enter__(self) -> "_Files":
        for file in sorted(self.layout.headers):
            fd = _open(self.layout.root / file)
            self.fds[file] = fd
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            self.data_start[file] = 8 + n
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds.values():
            os.close(fd)

    def read(self, stored: str) -> Tensor:
        file = self.layout.weight_map[stored]
        info = self.layout.headers[file][stored]
        start, end = info["data_offsets"]
        dtype, shape = _DTYPES.get(info["dtype"]), tuple(info["shape"])
        if dtype is None:
            raise CheckpointError(f"tensor {stored!r} in {file}: unsupported dtype {info['dtype']}")
        buf = bytearray(end - start)
        got, offset = 0, self.data_start[file] + start
        while got < len(buf):
            n = os.preadv(self.fds[file], [memoryview(buf)[got:]], offset + got)
            if n <= 0:
                raise CheckpointError(f"tensor {stored!r}: {file} ends before its data ({got} of {len(buf)} bytes)")
            got += n
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def _decode(logical: str, plan: _Plan, parts: dict[str, Tensor], cfg: ModelConfig) -> Tensor | QuantTensor:
    """A plain tensor as stored, or a quantised one as a :class:`QuantTensor` (checked, not decoded)."""
    if plan.fmt == "plain":
        return parts[""]
    assert cfg.quant is not None, "a quantised plan needs a quant config"
    block, group = cfg.quant.block_size, cfg.quant.group_size
    if plan.fmt == "fp8":
        return QuantTensor("fp8", parts[""], parts["_scale_inv"], plan.shape, block, group, logical)
    if plan.fmt == "int4":
        shape = tuple(int(x) for x in parts["_shape"].tolist())
        if shape != plan.shape:
            raise CheckpointError(f"tensor {logical + '_shape'!r}: holds {shape}, expected {plan.shape}")
        return QuantTensor("int4", parts["_packed"], parts["_scale"], plan.shape, block, group, logical)
    return QuantTensor("mxfp4", parts["_packed"], parts["_scale"], plan.shape, block, group, logical)


def _progress_bar(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), disable=not enabled, redirect_stdout=False, redirect_stderr=False,
    )


# ---- write -------------------------------------------------------------------------------

_CT_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
# K3 (a multimodal checkpoint) also leaves its vision tower and projector unquantised
_CT_IGNORE_MULTIMODAL = ["re:.*vision_tower.*", "re:.*mm_projector.*"]


def quantization_config_block(method: str, family: str = "deepseek_v3") -> dict:
    """The ``quantization_config`` of a real checkpoint in ``method``: K2-Instruct (fp8),
    K2-Thinking (int4 compressed-tensors), K3 (mxfp4 compressed-tensors; ``family``
    "kimi_linear" adds K3's vision-tower ignores)."""
    if method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if method not in ("int4", "mxfp4"):
        raise ValueError(f"quant must be None, 'fp8', 'int4' or 'mxfp4', got {method!r}")
    weights = {
        "actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
        "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
        "type": "int" if method == "int4" else "float",
    }
    fmt = "pack-quantized" if method == "int4" else "mxfp4-pack-quantized"
    group = {"input_activations": None, "output_activations": None, "targets": ["Linear"], "weights": weights}
    if method == "mxfp4":
        weights.update(scale_dtype="torch.uint8", zp_dtype=None)
        group["format"] = fmt
    ignore = list(_CT_IGNORE) + (_CT_IGNORE_MULTIMODAL if family == "kimi_linear" else [])
    return {
        "config_groups": {"group_0": group}, "format": fmt, "ignore": ignore, "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed",
    }


def write_checkpoint(
    out_dir: str | Path,
    cfg_raw: dict,
    tensors: dict[str, Tensor],
    *,
    quant: str | None = None,
    max_shard_bytes: int = 64 << 20,
) -> None:
    """Write ``config.json`` and the tensors (logical names) the way real checkpoints store them.

    ``quant`` None stores each tensor as given (fp32 stays fp32); "fp8" stores the linear
    projections as e4m3 + 128x128 ``weight_scale_inv`` and everything else bf16 (router bias
    fp32), as K2-Instruct (DeepSeek-V3 family only: ValueError otherwise); "int4"/"mxfp4"
    quantise routed experts only and store the rest bf16 (router bias, A_log, dt_bias fp32). The config's
    ``quantization_config`` is replaced to match. The tensors are not checked against the
    config — partial or deliberately wrong checkpoints are how the reader is tested.
    Shards of at most ``max_shard_bytes`` (a tensor's parts stay together) plus an index
    when there is more than one; old ``model*.safetensors*`` files in ``out_dir`` are removed.
    """
    raw = {k: v for k, v in cfg_raw.items() if k != "quantization_config"}
    cfg = parse_config(raw, where="write_checkpoint(cfg_raw)")
    check_quant_method(cfg, quant)
    if quant is not None:
        raw["quantization_config"] = quantization_config_block(quant, cfg.family)
        cfg = parse_config(raw, where="write_checkpoint(cfg_raw)")
    groups = [_encode(name, t, cfg) for name, t in tensors.items()]
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for group in groups:
        nbytes = sum(t.numel() * t.element_size() for t in group.values())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(group)
        size += nbytes
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD.fullmatch(old.name):
            old.unlink()
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for g in groups for t in g.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _encode(name: str, t: Tensor, cfg: ModelConfig) -> dict[str, Tensor]:
    """One logical tensor → its stored parts under the config's quant method."""
    t = t.detach().cpu()
    method = cfg.quant.method if cfg.quant else None
    if method is None:
        return {name: _owned(t)}
    if is_quantized(name, method):
        if t.ndim != 2:
            raise ValueError(f"tensor {name!r}: {method} quantisation needs a 2-D weight, got shape {tuple(t.shape)}")
        if method == "fp8":
            q, s = quant_fp8_block(t, cfg.quant.block_size, name=name)
            return {name: q, name + "_scale_inv": s}
        if method == "int4":
            packed, scale, shape = pack_int4(t, cfg.quant.group_size, name=name)
            return {name + "_packed": packed, name + "_scale": scale, name + "_shape": shape}
        packed, scale = pack_mxfp4(t, cfg.quant.group_size, name=name)
        return {name + "_packed": packed, name + "_scale": scale}
    return {name: _owned(t.to(torch.float32 if is_fp32(name) else torch.bfloat16))}


def _owned(t: Tensor) -> Tensor:
    """A contiguous copy: save_file refuses tensors that share memory (views, tied weights)."""
    return t.contiguous().clone()
