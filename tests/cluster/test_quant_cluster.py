"""Quantised residency on a cluster (issue 11, Must show 1): for the fp8, int4 and mxfp4 presets a
2 × 3 cluster whose expert actors hold their experts in checkpoint format gives the greedy tokens
of the dequantised single-process model, and each expert actor's resident weight bytes are its
experts' checkpoint bytes (+ scales), read from the safetensors headers."""

import json
import struct

import pytest
import ray
import torch

from cluster.engine import Engine, EngineConfig
from cluster.topology import ClusterSpec
from model.config import load_config
from model.loader import load_model
from model.presets import build_preset
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
CASES = [("kimi-k2-tiny", "fp8"), ("kimi-k2-tiny", "int4"), ("kimi-k3-tiny", "mxfp4")]


def stored_sizes(path) -> dict[str, int]:
    sizes = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        sizes.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()})
    return sizes


def expert_checkpoint_bytes(path, lo: int, hi: int) -> int:
    """Bytes of routed experts [lo, hi) of every MoE layer in the checkpoint (weights + scales;
    INT4's 8-byte weight_shape is metadata, not resident)."""
    cfg = load_config(path)
    ffn = "block_sparse_moe" if cfg.family == "kimi_linear" else "mlp"
    total = 0
    for name, size in stored_sizes(path).items():
        for layer in cfg.moe_layers:
            prefix = f"model.layers.{layer}.{ffn}.experts."
            if name.startswith(prefix) and lo <= int(name[len(prefix):].split(".")[0]) < hi \
                    and not name.endswith("weight_shape"):
                total += size
    return total


@pytest.mark.parametrize("preset,quant", CASES, ids=[q for _, q in CASES])
def test_quantised_experts_on_2x3_equal_the_dequantised_single_process_model(ray_cluster, tmp_path, preset, quant):
    path = build_preset(preset, tmp_path / quant, quant=quant, seed=5, progress=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 700, (n,), generator=g).tolist() for n in (5, 17, 9)]
    net = load_model(path, progress=False, dequantize=True)
    expect = [generate(ModelRunner(net, num_blocks=16, block_size=16, num_slots=2), [p], GREEDY)[0].output_ids
              for p in prompts]
    eng = Engine(EngineConfig(model=str(path), max_tokens_per_step=32),
                 ClusterSpec(attention=2, experts=3)).start()
    try:
        got = [s.output_ids for s in eng.generate(prompts, GREEDY)]
        weights = eng.expert_weight_bytes()
        ranges = [ray.get(e.shard.remote(), timeout=30) for e in eng.experts]
    finally:
        eng.shutdown()
    assert got == expect
    assert weights == [expert_checkpoint_bytes(path, lo, hi) for lo, hi in ranges]
    assert all(w > 0 for w in weights)
