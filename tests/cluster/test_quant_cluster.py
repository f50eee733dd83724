"""Quantised residency on a cluster (issue 11, Must show 1): for the fp8, int4 and mxfp4 presets a
2 × 3 cluster whose expert actors hold their experts in checkpoint format gives the greedy tokens
of the dequantised single-process model, and each expert actor's resident weight bytes are its
experts' checkpoint bytes (+ scales), read from the safetensors headers."""

import pytest
import ray
import torch

from cluster.engine import Engine, EngineConfig
from cluster.spec import ClusterSpec
from model.loader import load_model
from model.presets import build_preset
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams
from quant_bytes import expert_checkpoint_bytes

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
CASES = [("kimi-k2-tiny", "fp8"), ("kimi-k2-tiny", "int4"), ("kimi-k3-tiny", "mxfp4")]


@pytest.mark.parametrize("preset,quant", CASES, ids=[q for _, q in CASES])
def test_quantised_experts_on_2x3_equal_the_dequantised_single_process_model(ray_cluster, tmp_path, preset, quant):
    path = build_preset(preset, tmp_path / quant, quant=quant, seed=5, progress=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 700, (n,), generator=g).tolist() for n in (5, 17, 9)]
    net = load_model(path, progress=False, dequantize=True)
    expect = [generate(ModelRunner(net, num_blocks=16, block_size=16, num_slots=2), [p], GREEDY)[0].output_ids
              for p in prompts]
    eng = Engine(EngineConfig.of(model=str(path), max_tokens_per_step=32),
                 ClusterSpec(attention=2, experts=3)).start()
    try:
        got = [s.output_ids for s in eng.generate(prompts, GREEDY)]
        weights = [f.result(timeout=30) for f in eng.executor.describe()["weight_bytes"]]
        held = [ray.get(m.actor.held.remote(), timeout=30) for m in eng.executor.fleet.experts]
    finally:
        eng.shutdown()
    assert got == expect
    assert weights == [expert_checkpoint_bytes(path, h) for h in held]
    assert all(w > 0 for w in weights)
