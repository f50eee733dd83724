"""Quantised residency: FP8 / INT4 / MXFP4 weights stay in checkpoint format, and the model, the
routed experts and the linears give bit-identical outputs to load-time dequantisation (CPU fp32)."""

import pytest
import torch

from model.config import load_config
from model.loader import load_model, load_routed_experts, weight_bytes
from model.moe import RoutedExperts
from model.presets import build_preset
from model.qweights import QuantLinear, QuantRoutedExperts
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams
from quant_bytes import stored_sizes

CASES = [("kimi-k2-tiny", "fp8"), ("kimi-k2-tiny", "int4"), ("kimi-k3-tiny", "mxfp4")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qres")
    return {q: build_preset(p, root / q, quant=q, seed=4, progress=False) for p, q in CASES}


@pytest.mark.parametrize("quant", [q for _, q in CASES])
def test_resident_model_equals_dequantised_bit_for_bit(ckpts, quant):
    path = ckpts[quant]
    dense = load_model(path, progress=False, dequantize=True)
    resident = load_model(path, progress=False)
    moe = next(iter(resident.moe_blocks().values()))
    assert isinstance(moe.experts, QuantRoutedExperts)
    if quant == "fp8":
        attn = resident.model.layers[0].self_attn
        assert isinstance(attn.q_a_proj, QuantLinear) and isinstance(attn.o_proj, QuantLinear)
        assert isinstance(attn.kv_b_proj, torch.nn.Linear)  # dense for the absorbed path
        assert isinstance(moe.shared_experts.gate_proj, QuantLinear)
    assert weight_bytes(resident) < weight_bytes(dense)
    ids = list(range(3, 40))
    a = ModelRunner(dense, num_blocks=16, block_size=8, num_slots=2)
    b = ModelRunner(resident, num_blocks=16, block_size=8, num_slots=2)
    assert torch.equal(a.full_logits(ids), b.full_logits(ids))
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    assert generate(a, [ids], sp)[0].output_ids == generate(b, [ids], sp)[0].output_ids


@pytest.mark.parametrize("quant", [q for _, q in CASES])
def test_routed_experts_resident_bytes_and_outputs(ckpts, quant):
    path = ckpts[quant]
    cfg = load_config(path)
    a, b = cfg.moe_layers[0], cfg.moe_layers[-1]
    wanted = {a: [5, 0, 2], b: [1]}
    quantised = load_routed_experts(path, cfg, wanted)
    dense = load_routed_experts(path, cfg, wanted, dequantize=True)
    sizes = stored_sizes(path)
    for layer, ids in wanted.items():
        q, d = quantised[layer], dense[layer]
        assert isinstance(q, QuantRoutedExperts) and isinstance(d, RoutedExperts)
        assert q.expert_ids == d.expert_ids == tuple(ids)
        prefix = f"model.layers.{layer}.{'block_sparse_moe' if quant == 'mxfp4' else 'mlp'}.experts"
        expect = sum(size for name, size in sizes.items()
                     if any(name.startswith(f"{prefix}.{e}.") for e in ids) and not name.endswith("weight_shape"))
        assert q.weight_bytes() == expect
        assert d.weight_bytes() == len(ids) * 3 * cfg.moe_intermediate_size * cfg.expert_hidden_size * 4
        x = torch.randn(9, cfg.expert_hidden_size)
        local = torch.tensor([0, len(ids) - 1, 0, 0, len(ids) - 1, 0, 0, 0, 0])
        assert torch.equal(q.grouped(x, local), d.grouped(x, local))
        assert torch.equal(q.grouped(x[:0], local[:0]), d.grouped(x[:0], local[:0]))


def test_only_experts_with_rows_are_dequantised(ckpts, monkeypatch):
    path = ckpts["fp8"]
    cfg = load_config(path)
    layer = cfg.moe_layers[0]
    ex = load_routed_experts(path, cfg, {layer: [0, 1, 2, 3]})[layer]
    seen = []
    real = QuantRoutedExperts.dequant
    monkeypatch.setattr(QuantRoutedExperts, "dequant", lambda self, proj, e: seen.append(e) or real(self, proj, e))
    ex.grouped(torch.randn(4, cfg.expert_hidden_size), torch.tensor([2, 2, 0, 2]))
    assert sorted(set(seen)) == [0, 2]


def test_module_dtype_casts_leave_checkpoint_bytes_alone(ckpts):
    path = ckpts["fp8"]
    cfg = load_config(path)
    layer = cfg.moe_layers[0]
    ex = load_routed_experts(path, cfg, {layer: [0, 1]})[layer]
    before = ex.weight_bytes()
    x = torch.randn(3, cfg.expert_hidden_size)
    y = ex.grouped(x, torch.tensor([0, 1, 1]))
    ex.to(torch.bfloat16)  # a module-wide cast must not touch the stored fp8 bytes or scales
    assert ex.weight_bytes() == before
    assert torch.equal(ex.grouped(x, torch.tensor([0, 1, 1])), y)


def test_reader_threads_give_the_same_tensors(ckpts):
    from model.checkpoint import read_checkpoint

    path = ckpts["int4"]
    cfg = load_config(path)
    seen = []
    one = read_checkpoint(path, cfg, progress=False, threads=1)
    four = read_checkpoint(path, cfg, progress=False, threads=4, on_progress=lambda done, total: seen.append((done, total)))
    assert one.keys() == four.keys() and all(torch.equal(one[k], four[k]) for k in one)
    total = sum(stored_sizes(path).values())
    assert seen[-1] == (total, total) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        read_checkpoint(path, cfg, progress=False, threads=0)


def test_the_fp8_scaled_mm_path_agrees_with_dequantised_weights():
    """The CUDA path (torch._scaled_mm per 128-wide K block with row-wise scales) runs on CPU too:
    its block and scale layout must reproduce x @ dequant(W).T up to the e4m3 rounding of x."""
    from model.quant import dequant_fp8_block, quant_fp8_block
    from model.qweights import fp8_block_matmul

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * torch.linspace(0.1, 3, 256)[:, None]  # scales differ per block
    wq, s = quant_fp8_block(w)
    x = torch.randn(5, 384, generator=g) * torch.linspace(0.5, 2, 384)
    ref = x @ dequant_fp8_block(wq, s).t()
    got = fp8_block_matmul(x, wq, s)
    assert got.shape == ref.shape
    assert ((got - ref).norm() / ref.norm()).item() < 0.05
