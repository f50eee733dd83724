"""Oracle 1 for the hybrid family: our model == transformers' KimiLinearForCausalLM on checkpoints
transformers wrote (fp32), through the chunked KDA prefill and the recurrent decode."""

import pytest
import torch

from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from model.loader import load_model  # noqa: E402
from model.runner import ModelRunner, Sequence, generate  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module", params=["no_qlora", "qlora_groups"])
def pair(request, tmp_path_factory):
    torch.manual_seed(11)
    extra = dict(q_lora_rank=None) if request.param == "no_qlora" else dict(q_lora_rank=24, num_expert_group=2, topk_group=1)
    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, num_shared_experts=1, num_experts=16, kv_lora_rank=32,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_token=4,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]},
        first_k_dense_replace=1, pad_token_id=VOCAB - 1, bos_token_id=0, eos_token_id=1,
        initializer_range=0.08, routed_scaling_factor=2.446, **extra)
    hf = KimiLinearForCausalLM(cfg).float().eval()
    with torch.no_grad():  # perturb the parameters HF initialises to constants
        for name, p in hf.named_parameters():
            if p.dim() == 1 and "dt_bias" not in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.02)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, ModelRunner(load_model(path, progress=False), num_blocks=64, block_size=8, num_slots=4)


def _prompt(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_logits_match_on_chunked_path(pair):
    hf, runner = pair
    ids = _prompt(150)  # > 2 KDA chunks of 64
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.std() > 0.05
    torch.testing.assert_close(runner.full_logits(ids), ref, atol=1e-4, rtol=0)


def test_decode_steps_match(pair):
    """Prefill 70 tokens (chunked), then decode 10 tokens one by one (recurrent KDA + latent cache)."""
    hf, runner = pair
    ids = _prompt(80, seed=1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    seq = Sequence(0, ids[:70], 70, SamplingParams())
    got = [runner.forward([seq], [70])[0]]
    for t in ids[70:]:
        seq.token_ids.append(t)
        got.append(runner.forward([seq], [1])[0])
    runner.release(seq)
    torch.testing.assert_close(torch.stack(got), ref[69:], atol=1e-4, rtol=0)


def test_greedy_32_tokens_identical(pair):
    hf, runner = pair
    ids = _prompt(70, seed=2)
    ref = list(ids)
    with torch.no_grad():  # HF oracle: full recompute per step
        for _ in range(32):
            ref.append(int(hf(torch.tensor([ref])).logits[0, -1].argmax()))
    out = generate(runner, [ids], SamplingParams(max_tokens=32, ignore_eos=True))[0].output_ids
    assert out == ref[len(ids):]
    # Not compared: transformers 5.24's cached `generate` for this class, whose very first scores
    # already differ from its own uncached forward (seen on these checkpoints; margins ~0.3).
