"""Tiny model configs for CPU tests (import as ``from tiny_configs import tiny_k2_raw``).

Plain functions returning fresh dicts, so a test may mutate its copy; parse with
``model.config.parse_config``.
"""

from __future__ import annotations

import torch


def tiny_k2_raw(**overrides) -> dict:
    """A DeepSeek-V3 / Kimi K2 shaped config.json: 3 layers (layer 0 dense, 1-2 MoE),
    8 routed experts top-2, 1 shared expert, q-LoRA, YaRN, untied head, no quantization."""
    raw = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64,
            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "num_nextn_predict_layers": 0,
        "torch_dtype": "bfloat16",
    }
    raw.update(overrides)
    return raw


def random_tensors(specs: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 normal(0, 1) tensors for every name in ``specs`` (e.g. ``names.tensor_specs(cfg)``)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in specs.items()}


def tiny_kimi_linear_raw(**overrides) -> dict:
    """A Kimi Linear shaped config.json (MODEL_SPEC §3.1): 4 layers, KDA at 1-based 1..3 and MLA
    (NoPE, no q-LoRA) at 4; layer 0 dense, 1-3 MoE with 8 experts top-2 and 1 shared expert;
    KDA 4 heads x 16, conv 4. Kimi Linear's field spellings (num_experts, …)."""
    raw = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "rope_scaling": None,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "num_expert_group": 1,
        "topk_group": 1,
        "linear_attn_config": {
            "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3], "full_attn_layers": [4],
        },
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 127,
        "tie_word_embeddings": False,
        "model_max_length": 2048,
        "torch_dtype": "bfloat16",
    }
    raw.update(overrides)
    return raw


def tiny_k3_raw(**overrides) -> dict:
    """:func:`tiny_kimi_linear_raw` with K3's switches (MODEL_SPEC §3.9, §3.10): lower-bounded
    forget gate, full-rank KDA output gate, gated MLA with q-LoRA, SiTU, latent MoE (experts in 32
    of 64 dims, normed), 2 shared experts, attention residuals every 2 layers. The expert width
    (48) differs from the latent width (32) so that transposed shapes cannot pass."""
    raw = tiny_kimi_linear_raw(
        q_lora_rank=24,
        mla_use_output_gate=True,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        moe_intermediate_size=48,
        num_shared_experts=2,
        routed_expert_hidden_size=32,
        latent_moe_use_norm=True,
        routed_scaling_factor=1.0,
        topk_method="noaux_tc",
        attn_res_block_size=2,
    )
    raw["linear_attn_config"] = {
        **raw["linear_attn_config"], "gate_lower_bound": -5.0, "use_full_rank_gate": True,
    }
    raw.update(overrides)
    return raw
