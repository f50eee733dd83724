"""The MTP layer (model/mtp.py): DeepSeek-V3's checkpoint layout under ``model.layers.{N}``, a round
trip through the checkpoint names, the serving loader skipping it, and gradients reaching it."""

import pytest
import torch
from safetensors import safe_open

from model.cache import build_attn_meta
from model.config import parse_config
from model.loader import load_model
from model.model import CausalLM, init_random_weights, load_hf_weights, to_hf_tensors
from model.presets import KIMI_K2_MINI_SMOKE as SMALL
from model.presets import kimi_k2_mini, write_model_dir
from model.mtp import mtp_shared_names, with_shared_mtp_tensors
from training.train import losses, share_mtp_embeddings



def _model(seed=0, raw=None):
    raw = raw or kimi_k2_mini() | SMALL
    m = CausalLM(parse_config(raw, where="test"), mtp=True)
    init_random_weights(m, seed)
    return m


def _mtp_logits(m, ids):
    T = ids.numel()
    cache = m.make_cache(1, T, 0, torch.float32)
    meta = build_attn_meta([T], [T], [[0]], T)
    h = m(ids, meta, cache)
    nxt = torch.cat([ids[1:], ids[-1:]])
    return m.mtp_logits(nxt, h, meta, cache)


def test_the_mtp_layer_has_deepseeks_names_and_round_trips():
    m = _model()
    N, H = m.cfg.num_hidden_layers, m.cfg.hidden_size
    t = to_hf_tensors(m)
    p = f"model.layers.{N}."
    for name in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_a_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight",
                 "mlp.experts.0.gate_proj.weight", "mlp.experts.7.down_proj.weight"):
        assert p + name in t, name
    assert t[p + "eh_proj.weight"].shape == (H, 2 * H)
    assert not any(k.startswith(f"model.layers.{N + 1}.") or k.startswith("mtp.") for k in t)

    other = _model(seed=1)
    load_hf_weights(other, t)
    for (name, a), b in zip(m.named_parameters(), other.parameters()):
        assert torch.equal(a, b), name
    ids = torch.tensor([5, 9, 200, 31, 7, 64])
    assert torch.equal(_mtp_logits(m, ids), _mtp_logits(other, ids))


def test_the_serving_loader_skips_the_mtp_layer_unless_asked(tmp_path):
    raw = kimi_k2_mini() | SMALL | {"torch_dtype": "float32"}
    m = _model(raw=raw)
    write_model_dir(to_hf_tensors(m), raw, tmp_path, tokenizer="kimi-mini")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert f"model.layers.{m.cfg.num_hidden_layers}.eh_proj.weight" in stored
    served = load_model(tmp_path, progress=False)
    assert served.mtp is None
    mine = dict(m.named_parameters())
    for name, p in served.named_parameters():
        assert torch.equal(p, mine[name]), name
    whole = load_model(tmp_path, progress=False, mtp=True)  # asked for, it is read too
    assert [n for n, _ in whole.named_parameters()] == list(mine)
    for name, p in whole.named_parameters():
        assert torch.equal(p, mine[name]), name


def test_gradients_reach_every_parameter_through_the_serving_code():
    """One backward of the next-token and MTP losses: every weight but the selection bias (moved by
    the aux-loss-free rule, not by gradients) gets a non-zero gradient — through the paged latent
    cache's writes and reads, the grouped expert GEMMs and the MTP layer."""
    m = _model()
    main, mtp = losses(m, torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(0)))
    (main + mtp).backward()
    for name, p in m.named_parameters():
        if name.endswith("e_score_correction_bias"):
            assert not p.requires_grad and p.grad is None
            continue
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_training_shares_the_mtp_layers_embedding_and_head_and_the_checkpoint_stores_both_names():
    """DeepSeek-V3 trains its MTP module on the main model's embedding and output head (one parameter
    each); its checkpoint names them twice. training.train.share_mtp_embeddings ties them;
    to_hf_tensors then names each once, and with_shared_mtp_tensors writes the MTP layer's copies."""
    m = _model()
    share_mtp_embeddings(m)
    assert m.mtp.embed_tokens is m.model.embed_tokens and m.mtp.shared_head.head is m.lm_head
    shared = mtp_shared_names(m.cfg.num_hidden_layers)
    once = to_hf_tensors(m)
    assert not shared.keys() & once.keys() and set(shared.values()) <= once.keys()
    full = with_shared_mtp_tensors(once, m.cfg.num_hidden_layers)
    for mtp_name, main_name in shared.items():
        assert torch.equal(full[mtp_name], full[main_name])
    with pytest.raises(ValueError, match="already has its own"):
        with_shared_mtp_tensors(full, m.cfg.num_hidden_layers)
    other = CausalLM(parse_config(kimi_k2_mini() | SMALL, where="test"), mtp=True)
    load_hf_weights(other, full)
    ids = torch.tensor([5, 9, 200, 31, 7, 64])
    assert torch.equal(_mtp_logits(m, ids), _mtp_logits(other, ids))  # the checkpoint is the tied model
