"""Oracle 1: our model == transformers' DeepseekV3ForCausalLM on checkpoints transformers wrote.

transformers is a test-only reference; it writes the checkpoint (fp32, real HF naming) and we
load it through our own reader."""

import pytest
import torch

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from model.loader import load_model  # noqa: E402
from model.runner import ModelRunner, generate  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 64,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
DSV3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
PLAIN = {"rope_type": "default", "rope_theta": 10000.0}

VARIANTS = {
    "k2_qlora_yarn_dense1": dict(q_lora_rank=24, n_group=1, topk_group=1, rope_parameters=YARN, first_k_dense_replace=1),
    "no_qlora_plain_dense2": dict(q_lora_rank=None, n_group=1, topk_group=1, rope_parameters=PLAIN, first_k_dense_replace=2),
    "groups_dsv3_yarn": dict(q_lora_rank=24, n_group=4, topk_group=2, rope_parameters=DSV3_YARN, first_k_dense_replace=1),
    "groups_no_qlora_yarn_dense2": dict(q_lora_rank=None, n_group=2, topk_group=1, rope_parameters=YARN, first_k_dense_replace=2),
    "neox_rope": dict(q_lora_rank=24, n_group=1, topk_group=1, rope_parameters=YARN, first_k_dense_replace=1, rope_interleave=False),
}


def _hf_model(variant: dict, seed: int) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16, kv_lora_rank=32,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=4, max_position_embeddings=2048,
        num_mtp_layers=0, routed_scaling_factor=2.5, initializer_range=0.08, **variant)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF starts norms at 1 and the bias at 0: perturb so every path is exercised
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * (0.02 if "bias" in name else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.02)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    hf = _hf_model(VARIANTS[request.param], seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = load_model(path, dtype=torch.float32, progress=False)
    return hf, ModelRunner(ours, num_blocks=64, block_size=8)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_sequence_logits_match(pair):
    hf, runner = pair
    ids = _prompt(50)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.std() > 0.05, "reference logits are degenerate; the comparison would prove nothing"
    for impl in ("absorbed", "naive"):
        runner.impl = impl
        got = runner.full_logits(ids)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0, msg=f"{impl} MLA")
    runner.impl = "absorbed"


def test_greedy_32_tokens_identical(pair):
    hf, runner = pair
    ids = _prompt(20, seed=3)
    ref, seq = list(ids), None
    with torch.no_grad():  # HF oracle: full recompute per step, no cache
        for _ in range(32):
            ref.append(int(hf(torch.tensor([ref])).logits[0, -1].argmax()))
    seq = generate(runner, [ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert seq.output_ids == ref[len(ids):]
