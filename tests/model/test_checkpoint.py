"""Checkpoint names (MODEL_SPEC §1.9, §3.8, §3.11, §4), write → read round trips in every storage
format, selective expert reads that touch only the selected bytes, and validation errors; for
DeepSeek-V3 / K2 and for Kimi Linear / K3 (names checked against transformers' KimiLinear)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_configs import random_tensors, tiny_k2_raw, tiny_k3_raw, tiny_kimi_linear_raw

import model.checkpoint as ckpt
from model.checkpoint import CheckpointError, quantization_config_block, read_checkpoint, write_checkpoint
from model.config import load_config, parse_config
from model.names import canonical_name, is_fp32, is_quantized, is_routed_expert, split_stored, tensor_specs
from model.quant import dequant_fp8_block, pack_int4, pack_mxfp4, quant_fp8_block, unpack_int4, unpack_mxfp4

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
K2_CONFIG = CONFIGS / "kimi-k2-instruct.json"
L1 = "model.layers.1."


@pytest.fixture(scope="module")
def raw() -> dict:
    return tiny_k2_raw()


@pytest.fixture(scope="module")
def cfg(raw):
    return parse_config(raw)


@pytest.fixture(scope="module")
def weights(cfg) -> dict[str, torch.Tensor]:
    return random_tensors(tensor_specs(cfg), seed=0)


def header(file: Path) -> tuple[dict, int]:
    """(safetensors header without metadata, byte offset of the data section)."""
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        h = json.loads(fh.read(n))
    h.pop("__metadata__", None)
    return h, 8 + n


def stored_tensors(d: Path) -> dict[str, tuple[str, list[int], str]]:
    """Every stored tensor of a checkpoint dir: name → (dtype, shape, file)."""
    out = {}
    for f in sorted(d.glob("model*.safetensors")):
        for name, info in header(f)[0].items():
            out[name] = (info["dtype"], info["shape"], f.name)
    return out


def overwrite_bytes(file: Path, names: list[str], byte: int = 0xFF) -> None:
    """Scribble over the data of ``names`` in place (0xFF.. is NaN in f32, bf16 and e4m3)."""
    h, base = header(file)
    with open(file, "r+b") as fh:
        for name in names:
            a, b = h[name]["data_offsets"]
            fh.seek(base + a)
            fh.write(bytes([byte]) * (b - a))


def expert_of(name: str) -> int | None:
    le = is_routed_expert(name)
    return None if le is None else le[1]


# ---- names -------------------------------------------------------------------------------


def test_tiny_specs(cfg):
    s = tensor_specs(cfg)
    a = "model.layers.0.self_attn."
    assert s["model.embed_tokens.weight"] == (128, 64) and s["lm_head.weight"] == (128, 64)
    assert s[a + "q_a_proj.weight"] == (32, 64) and s[a + "q_a_layernorm.weight"] == (32,)
    assert s[a + "q_b_proj.weight"] == (4 * 24, 32)
    assert s[a + "kv_a_proj_with_mqa.weight"] == (32 + 8, 64) and s[a + "kv_a_layernorm.weight"] == (32,)
    assert s[a + "kv_b_proj.weight"] == (4 * (16 + 16), 32) and s[a + "o_proj.weight"] == (64, 4 * 16)
    assert s["model.layers.0.mlp.gate_proj.weight"] == (96, 64) and s["model.layers.0.mlp.down_proj.weight"] == (64, 96)
    assert "model.layers.0.mlp.gate.weight" not in s  # layer 0 is dense
    assert s[L1 + "mlp.gate.weight"] == (8, 64) and s[L1 + "mlp.gate.e_score_correction_bias"] == (8,)
    assert s[L1 + "mlp.experts.7.up_proj.weight"] == (32, 64) and s[L1 + "mlp.experts.7.down_proj.weight"] == (64, 32)
    assert s[L1 + "mlp.shared_experts.gate_proj.weight"] == (32, 64)
    assert "model.layers.1.mlp.gate_proj.weight" not in s and "model.layers.3.input_layernorm.weight" not in s
    # 3 model-level; dense layer: 2 norms + 7 MLA + 3 MLP; MoE layer: 2 + 7 + router 2 + 8·3 + shared 3
    assert len(s) == 3 + 12 + 2 * 38


def test_specs_expert_subsets(cfg):
    sub = tensor_specs(cfg, range(2, 5))
    assert {expert_of(n) for n in sub} - {None} == {2, 3, 4}
    assert len([n for n in sub if is_routed_expert(n)]) == 2 * 3 * 3
    none = tensor_specs(cfg, range(0))
    assert not any(is_routed_expert(n) for n in none)
    assert L1 + "mlp.gate.weight" in none and L1 + "mlp.shared_experts.down_proj.weight" in none
    with pytest.raises(ValueError, match="expert id 8"):
        tensor_specs(cfg, range(6, 9))


def test_specs_variants():
    s = tensor_specs(parse_config(tiny_k2_raw(q_lora_rank=None, tie_word_embeddings=True, n_shared_experts=0)))
    assert s["model.layers.0.self_attn.q_proj.weight"] == (4 * 24, 64)
    assert not any("q_a_proj" in n or "q_b_proj" in n or "shared_experts" in n for n in s)
    assert "lm_head.weight" not in s


def test_specs_reproduce_k2_checkpoint_inventory():
    """MODEL_SPEC §4: total weights 1,026,408,232,448; fp8 scale elements 62,495,192; and with
    the 61 stray inv_freq buffers the K2CFG inventory's 139,644 tensors."""
    cfg = load_config(K2_CONFIG)
    s = tensor_specs(cfg)
    assert sum(math.prod(shape) for shape in s.values()) == 1_026_408_232_448
    quantized = [n for n in s if is_quantized(n, "fp8")]
    assert sum(math.ceil(s[n][0] / 128) * math.ceil(s[n][1] / 128) for n in quantized) == 62_495_192
    assert len(s) + len(quantized) + 61 == 139_644


def test_name_parsers():
    assert is_routed_expert("model.layers.12.mlp.experts.345.down_proj.weight") == (12, 345)
    assert is_routed_expert("model.layers.12.mlp.experts.3.down_proj.weight_packed") == (12, 3)
    assert is_routed_expert("model.layers.4.block_sparse_moe.experts.7.w1.weight") == (4, 7)
    assert is_routed_expert("model.layers.12.mlp.shared_experts.down_proj.weight") is None
    assert is_routed_expert("model.layers.12.mlp.gate.weight") is None
    assert split_stored("a.weight_scale_inv") == ("a.weight", "_scale_inv")
    assert split_stored("a.weight_packed") == ("a.weight", "_packed")
    assert split_stored("m.gate.e_score_correction_bias") == ("m.gate.e_score_correction_bias", "")
    assert not is_quantized(L1 + "mlp.gate.weight", "fp8")
    assert is_quantized(L1 + "mlp.shared_experts.up_proj.weight", "fp8")
    assert not is_quantized(L1 + "mlp.shared_experts.up_proj.weight", "int4")
    assert is_quantized(L1 + "mlp.experts.0.up_proj.weight", "mxfp4")


# ---- round trips -------------------------------------------------------------------------


def test_unquantized_round_trip_is_exact(tmp_path, raw, cfg, weights):
    write_checkpoint(tmp_path, raw, weights)
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "model.safetensors.index.json").exists()
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert {d for d, _, _ in stored_tensors(tmp_path).values()} == {"F32"}
    got = read_checkpoint(tmp_path, load_config(tmp_path), progress=False)
    assert got.keys() == weights.keys()
    for name, w in weights.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], w), name


def test_fp8_checkpoint_layout_and_values(tmp_path, raw, weights):
    write_checkpoint(tmp_path, raw, weights, quant="fp8")
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    }
    st = stored_tensors(tmp_path)
    a = "model.layers.0.self_attn."
    for name in [a + "q_a_proj", a + "q_b_proj", a + "kv_a_proj_with_mqa", a + "kv_b_proj", a + "o_proj",
                 "model.layers.0.mlp.down_proj", L1 + "mlp.experts.5.gate_proj", L1 + "mlp.shared_experts.up_proj"]:
        assert st[name + ".weight"][0] == "F8_E4M3", name
        assert st[name + ".weight_scale_inv"][:2] == ("F32", [1, 1]), name
    for name in [a + "q_a_layernorm.weight", a + "kv_a_layernorm.weight", L1 + "input_layernorm.weight",
                 L1 + "mlp.gate.weight", "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]:
        assert st[name][0] == "BF16", name
        assert name + "_scale_inv" not in st
    assert st[L1 + "mlp.gate.e_score_correction_bias"][0] == "F32"

    cfg = load_config(tmp_path)
    got = read_checkpoint(tmp_path, cfg, progress=False)
    for name, w in weights.items():
        if is_quantized(name, "fp8"):
            want = dequant_fp8_block(*quant_fp8_block(w))
        elif name.endswith("e_score_correction_bias"):
            want = w
        else:
            want = w.bfloat16().float()
        assert torch.equal(got[name], want), name
    bf16 = read_checkpoint(tmp_path, cfg, dtype=torch.bfloat16, progress=False)
    assert bf16[a + "q_b_proj.weight"].dtype == torch.bfloat16
    assert bf16[L1 + "mlp.gate.e_score_correction_bias"].dtype == torch.float32


@pytest.mark.parametrize("quant", ["int4", "mxfp4"])
def test_compressed_tensors_checkpoints(tmp_path, raw, weights, quant):
    write_checkpoint(tmp_path, raw, weights, quant=quant)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc == quantization_config_block(quant)
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == {"int4": "pack-quantized", "mxfp4": "mxfp4-pack-quantized"}[quant]
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (
        4, "int" if quant == "int4" else "float", True, "group", 32)
    assert qc["ignore"] == [
        "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"
    ]

    st = stored_tensors(tmp_path)
    e = L1 + "mlp.experts.3.down_proj.weight"  # [64, 32]
    if quant == "int4":
        assert st[e + "_packed"][:2] == ("I32", [64, 4]) and st[e + "_scale"][:2] == ("BF16", [64, 1])
        assert st[e + "_shape"][:2] == ("I32", [2])
    else:
        assert st[e + "_packed"][:2] == ("U8", [64, 16]) and st[e + "_scale"][:2] == ("U8", [64, 1])
    assert e not in st
    unquantized = {n: d for n, (d, _, _) in st.items() if "experts." not in n or "shared_experts" in n}
    assert {d for n, d in unquantized.items() if "correction_bias" not in n} == {"BF16"}

    got = read_checkpoint(tmp_path, load_config(tmp_path), progress=False)
    for name, t in weights.items():
        if is_routed_expert(name):
            want = unpack_int4(*pack_int4(t)) if quant == "int4" else unpack_mxfp4(*pack_mxfp4(t))
        elif name.endswith("e_score_correction_bias"):
            want = t
        else:
            want = t.bfloat16().float()
        assert torch.equal(got[name], want), name


# ---- selective reads ---------------------------------------------------------------------


def test_expert_subset_read(tmp_path, raw, cfg, weights):
    write_checkpoint(tmp_path, raw, weights)
    got = read_checkpoint(tmp_path, cfg, experts=range(2, 5), progress=False)
    assert got.keys() == tensor_specs(cfg, range(2, 5)).keys()
    assert all(torch.equal(t, weights[n]) for n, t in got.items())
    only = read_checkpoint(tmp_path, cfg, experts=range(2, 5), include_non_expert=False, progress=False)
    assert only.keys() == {n for n in got if is_routed_expert(n)} and len(only) == 2 * 3 * 3
    attn = read_checkpoint(tmp_path, cfg, experts=range(0), progress=False)
    assert not any(is_routed_expert(n) for n in attn) and L1 + "mlp.gate.weight" in attn


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_subset_read_with_other_experts_absent(tmp_path, raw, cfg, weights, quant):
    keep = {n: t for n, t in weights.items() if expert_of(n) in (None, 2, 3, 4)}
    write_checkpoint(tmp_path, raw, keep, quant=quant)
    c = load_config(tmp_path)
    got = read_checkpoint(tmp_path, c, experts=range(2, 5), progress=False)
    assert got.keys() == keep.keys()
    for n in got:
        if quant is None:
            want = weights[n]
        elif is_quantized(n, quant):
            want = dequant_fp8_block(*quant_fp8_block(weights[n]))
        else:
            want = weights[n] if n.endswith("correction_bias") else weights[n].bfloat16().float()
        assert torch.equal(got[n], want), n
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight'"):
        read_checkpoint(tmp_path, c, progress=False)


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_subset_read_never_touches_other_experts_bytes(tmp_path, raw, cfg, weights, quant):
    write_checkpoint(tmp_path, raw, weights, quant=quant)
    c = load_config(tmp_path)
    clean = read_checkpoint(tmp_path, c, experts=range(2, 5), progress=False)
    file = tmp_path / "model.safetensors"
    others = [n for n in header(file)[0] if expert_of(n) not in (None, 2, 3, 4)]
    assert len(others) == 2 * 5 * 3 * (1 if quant is None else 2)
    overwrite_bytes(file, others)
    got = read_checkpoint(tmp_path, c, experts=range(2, 5), progress=False)
    assert got.keys() == clean.keys()
    assert all(torch.equal(got[n], clean[n]) for n in got)
    poisoned = read_checkpoint(tmp_path, c, progress=False)  # the scribbles are real
    assert poisoned[L1 + "mlp.experts.0.up_proj.weight"].isnan().all()


def test_sharded_checkpoint_opens_only_needed_shards(tmp_path, raw, cfg, weights, monkeypatch):
    write_checkpoint(tmp_path, raw, weights, max_shard_bytes=24 << 10)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (tmp_path / "model.safetensors").exists()
    assert index["weight_map"].keys() == weights.keys() and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in weights.values())
    for s in shards:
        assert all(index["weight_map"][k] == s for k in header(tmp_path / s)[0])

    got = read_checkpoint(tmp_path, cfg, progress=False)
    assert all(torch.equal(got[k], w) for k, w in weights.items())

    opened: list[str] = []
    real = ckpt._open

    def spy(filename):
        opened.append(Path(filename).name)
        return real(filename)

    monkeypatch.setattr(ckpt, "_open", spy)
    sub = read_checkpoint(tmp_path, cfg, experts=range(2, 5), include_non_expert=False, progress=False)
    needed = {index["weight_map"][k] for k in sub}
    assert sorted(opened) == sorted(needed) and len(needed) < n
    # a shard nobody needs may even be gone
    for s in set(shards) - needed:
        (tmp_path / s).unlink()
    again = read_checkpoint(tmp_path, cfg, experts=range(2, 5), include_non_expert=False, progress=False)
    assert all(torch.equal(again[k], weights[k]) for k in sub)


def test_stray_inv_freq_and_mtp_layer_are_ignored(tmp_path, raw, weights):
    raw = {**raw, "num_nextn_predict_layers": 1}
    cfg = parse_config(raw)
    extra = dict(weights)
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    extra["model.layers.3.eh_proj.weight"] = torch.ones(64, 128)  # MTP layer (index = num_hidden_layers)
    extra["model.layers.3.mlp.experts.0.up_proj.weight"] = torch.ones(2, 2)
    write_checkpoint(tmp_path, raw, extra)
    got = read_checkpoint(tmp_path, cfg, progress=False)
    assert got.keys() == weights.keys()


def test_extra_layer_without_mtp_is_unexpected(tmp_path, raw, cfg, weights):
    write_checkpoint(tmp_path, raw, {**weights, "model.layers.3.input_layernorm.weight": torch.ones(64)})
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.input_layernorm\.weight"):
        read_checkpoint(tmp_path, cfg, progress=False)


def test_progress_bar_goes_to_stderr_only(tmp_path, raw, cfg, weights, capsys):
    write_checkpoint(tmp_path, raw, weights)
    read_checkpoint(tmp_path, cfg, progress=False)
    assert capsys.readouterr() == ("", "")
    read_checkpoint(tmp_path, cfg, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "91/91" in err


# ---- errors ------------------------------------------------------------------------------


def check_error(tmp_path, cfg, *needles: str, **kwargs) -> str:
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path, cfg, progress=False, **kwargs)
    assert isinstance(e.value, ValueError)
    for needle in needles:
        assert needle in str(e.value), str(e.value)
    return str(e.value)


def test_missing_tensor(tmp_path, raw, cfg, weights):
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    write_checkpoint(tmp_path, raw, {k: v for k, v in weights.items() if k != name})
    check_error(tmp_path, cfg, name, "(128, 32)")
    # an expert actor does not need it
    assert read_checkpoint(tmp_path, cfg, experts=range(1), include_non_expert=False, progress=False)


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.bogus.weight",
    "model.layers.1.mlp.experts.8.up_proj.weight",  # expert id past n_routed_experts
    "model.layers.0.mlp.experts.0.up_proj.weight",  # layer 0 is dense
    "model.layers.1.mlp.up_proj.weight",  # layer 1 is MoE
])
def test_unexpected_tensor_found_from_names_alone(tmp_path, raw, cfg, weights, name):
    write_checkpoint(tmp_path, raw, {**weights, name: torch.zeros(2, 2)})
    check_error(tmp_path, cfg, f"unexpected tensor '{name}'", "model.safetensors")
    # an expert actor reading nothing else still refuses a checkpoint of another model
    check_error(tmp_path, cfg, name, experts=range(0), include_non_expert=False)


def test_wrong_shape(tmp_path, raw, cfg, weights):
    name = L1 + "mlp.experts.4.down_proj.weight"
    write_checkpoint(tmp_path, raw, {**weights, name: torch.zeros(64, 31)})
    check_error(tmp_path, cfg, name, "(64, 31)", "(64, 32)", "model.safetensors")


def test_wrong_dtype_and_missing_part_of_quantised_weight(tmp_path, raw, weights):
    write_checkpoint(tmp_path, raw, weights, quant="fp8")
    cfg = load_config(tmp_path)
    file = tmp_path / "model.safetensors"
    t = load_file(file)
    name = "model.layers.0.self_attn.o_proj.weight"
    t[name] = t[name].float().bfloat16()
    del t[L1 + "self_attn.o_proj.weight_scale_inv"]
    save_file(t, file, metadata={"format": "pt"})
    msg = check_error(tmp_path, cfg, name, "BF16", "F8_E4M3", L1 + "self_attn.o_proj.weight")
    assert "2 problems" in msg  # one error reports everything


def test_missing_files(tmp_path, raw, cfg, weights):
    check_error(tmp_path, cfg, "model.safetensors", "model.safetensors.index.json")
    write_checkpoint(tmp_path, raw, weights, max_shard_bytes=24 << 10)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = L1 + "mlp.experts.3.up_proj.weight"
    shard = index["weight_map"][name]
    (tmp_path / shard).unlink()
    check_error(tmp_path, cfg, f"missing file {shard}", experts=range(3, 4), include_non_expert=False)
    msg = check_error(tmp_path, cfg, shard)
    assert any(k in msg for k, f in index["weight_map"].items() if f == shard)


def test_quantised_checkpoint_needs_its_config(tmp_path, raw, cfg, weights):
    write_checkpoint(tmp_path, raw, weights, quant="int4")
    check_error(tmp_path, cfg, "weight_packed", "no quantization_config")  # cfg without quant


# ---- Kimi Linear / K3 --------------------------------------------------------------------

KL_VARIANTS = {"kimi_linear": tiny_kimi_linear_raw, "k3": tiny_k3_raw}
K1 = "model.layers.1."  # KDA + MoE
K3_MLA = "model.layers.3.self_attn."  # the MLA layer (1-based 4)


def test_kimi_linear_tiny_specs():
    s = tensor_specs(parse_config(tiny_kimi_linear_raw()))
    a = "model.layers.0.self_attn."
    for x in "qkv":
        assert s[f"{a}{x}_proj.weight"] == (64, 64) and s[f"{a}{x}_conv1d.weight"] == (64, 1, 4)
    assert s[a + "A_log"] == (1, 1, 4, 1) and s[a + "dt_bias"] == (64,)
    assert s[a + "f_a_proj.weight"] == (16, 64) and s[a + "f_b_proj.weight"] == (64, 16)
    assert s[a + "b_proj.weight"] == (4, 64) and s[a + "o_norm.weight"] == (16,)
    assert s[a + "g_a_proj.weight"] == (16, 64) and s[a + "g_b_proj.weight"] == (64, 16)
    assert s[a + "o_proj.weight"] == (64, 64) and a + "g_proj.weight" not in s
    assert s[K3_MLA + "q_proj.weight"] == (4 * 24, 64) and s[K3_MLA + "kv_b_proj.weight"] == (4 * 32, 32)
    assert K3_MLA + "g_proj.weight" not in s and "model.layers.3.self_attn.A_log" not in s
    assert s["model.layers.0.mlp.gate_proj.weight"] == (96, 64) and s["model.layers.0.mlp.down_proj.weight"] == (64, 96)
    m = K1 + "block_sparse_moe."
    assert s[m + "gate.weight"] == (8, 64) and s[m + "gate.e_score_correction_bias"] == (8,)
    assert s[m + "experts.7.w1.weight"] == s[m + "experts.7.w3.weight"] == (32, 64)
    assert s[m + "experts.7.w2.weight"] == (64, 32)
    assert s[m + "shared_experts.gate_proj.weight"] == (32, 64) and s[m + "shared_experts.down_proj.weight"] == (64, 32)
    assert not any("mlp." in n for n in s if n.startswith(K1)) and not any("_res_" in n for n in s)
    # 3 model-level; per layer 2 norms; KDA 15, MLA 5; dense 3; MoE router 2 + 8·3 + shared 3
    assert len(s) == 3 + 4 * 2 + 3 * 15 + 5 + 3 + 3 * 29


def test_k3_tiny_specs():
    s = tensor_specs(parse_config(tiny_k3_raw()))
    a = "model.layers.0.self_attn."
    assert s[a + "A_log"] == (4,) and s[a + "g_proj.weight"] == (64, 64)
    assert a + "g_a_proj.weight" not in s and a + "g_b_proj.weight" not in s
    assert s[K3_MLA + "q_a_proj.weight"] == (24, 64) and s[K3_MLA + "q_b_proj.weight"] == (4 * 24, 24)
    assert s[K3_MLA + "g_proj.weight"] == (4 * 16, 64) and K3_MLA + "q_proj.weight" not in s
    m = K1 + "block_sparse_moe."
    assert s[m + "experts.0.w1.weight"] == s[m + "experts.0.w3.weight"] == (48, 32)  # [I_m, H_e]
    assert s[m + "experts.0.w2.weight"] == (32, 48)
    assert s[m + "shared_experts.up_proj.weight"] == (2 * 48, 64)
    assert s[m + "shared_experts.down_proj.weight"] == (64, 96)
    assert s[m + "routed_expert_down_proj.weight"] == (32, 64) and s[m + "routed_expert_up_proj.weight"] == (64, 32)
    assert s[m + "routed_expert_norm.weight"] == (32,)
    assert s[m + "gate.weight"] == (8, 64)  # the router reads the full width
    for layer in range(4):
        p = f"model.layers.{layer}."
        assert s[p + "self_attention_res_norm.weight"] == s[p + "mlp_res_norm.weight"] == (64,)
        assert s[p + "self_attention_res_proj.weight"] == s[p + "mlp_res_proj.weight"] == (1, 64)
    assert s["model.output_attn_res_norm.weight"] == (64,) and s["model.output_attn_res_proj.weight"] == (1, 64)
    no_norm = tensor_specs(parse_config(tiny_k3_raw(latent_moe_use_norm=False)))
    assert m + "routed_expert_norm.weight" not in no_norm and m + "routed_expert_up_proj.weight" in no_norm


@pytest.mark.parametrize("fixture", ["kimi-linear-48b.json", "kimi-k3-text.json"])
def test_specs_reproduce_kimi_linear_counts(fixture):
    """Names and MODEL_SPEC §4's counts agree: KL's checkpoint sum 49,122,681,728 exactly; K3
    2,779,484,476,000 with A_log [96]."""
    from model.params import count_params

    cfg = load_config(CONFIGS / fixture)
    s = tensor_specs(cfg)
    total = sum(math.prod(shape) for shape in s.values())
    assert total == count_params(cfg).total == {"kimi-linear-48b.json": 49_122_681_728,
                                                "kimi-k3-text.json": 2_779_484_476_000}[fixture]
    if fixture.startswith("kimi-k3"):
        assert s["model.layers.0.self_attn.A_log"] == (96,)
        assert s["model.layers.1.block_sparse_moe.experts.895.w2.weight"] == (3584, 3072)
        assert s["model.layers.92.self_attn.g_proj.weight"] == (12288, 7168)
    else:
        assert s["model.layers.0.self_attn.A_log"] == (1, 1, 32, 1)
        assert s["model.layers.26.self_attn.q_proj.weight"] == (6144, 2304)


def test_kimi_linear_name_helpers():
    assert canonical_name("language_model.model.layers.3.self_attn.A_log") == "model.layers.3.self_attn.A_log"
    assert canonical_name("language_model.lm_head.weight") == "lm_head.weight"
    assert canonical_name("model.layers.0.block_sparse_moe.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    for kept in ["model.layers.1.block_sparse_moe.shared_experts.up_proj.weight",
                 "model.layers.1.block_sparse_moe.experts.3.w1.weight", "model.layers.1.block_sparse_moe.gate.weight"]:
        assert canonical_name(kept) == kept
    assert is_routed_expert("model.layers.2.block_sparse_moe.experts.5.w2.weight_packed") == (2, 5)
    assert is_quantized("model.layers.2.block_sparse_moe.experts.5.w2.weight", "mxfp4")
    for name in ["model.layers.2.block_sparse_moe.shared_experts.down_proj.weight",
                 "model.layers.2.block_sparse_moe.routed_expert_up_proj.weight", K3_MLA + "g_proj.weight"]:
        assert not is_quantized(name, "mxfp4") and not is_quantized(name, "int4"), name
    assert is_fp32("model.layers.0.self_attn.A_log") and is_fp32("model.layers.0.self_attn.dt_bias")
    assert not is_fp32("model.layers.0.self_attn.b_proj.weight")


def test_kimi_linear_specs_match_transformers(tmp_path):
    """What transformers' KimiLinearForCausalLM.save_pretrained writes for the same config, name
    for name and shape for shape, and our reader loads that directory as written. (transformers
    writes the dense layer-0 MLP as ``block_sparse_moe.*_proj``; canonical_name maps it back.)"""
    import transformers  # a test dependency: missing means failing, never skipping
    raw = tiny_kimi_linear_raw()
    skip = ("architectures", "model_type", "rope_scaling")
    hf_cfg = transformers.KimiLinearConfig(**{k: v for k, v in raw.items() if k not in skip})
    torch.manual_seed(0)
    transformers.KimiLinearForCausalLM(hf_cfg).save_pretrained(tmp_path)
    written = {n: tuple(shape) for n, (_, shape, _) in stored_tensors(tmp_path).items()}
    canonical = {canonical_name(n): shape for n, shape in written.items()}
    assert len(canonical) == len(written)
    ours = tensor_specs(parse_config(raw))
    assert canonical.keys() == ours.keys(), (sorted(canonical.keys() - ours.keys()), sorted(ours.keys() - canonical))
    assert canonical == ours
    dense_as_hf_writes_it = {f"model.layers.0.block_sparse_moe.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert written.keys() - ours.keys() == dense_as_hf_writes_it

    cfg = load_config(tmp_path)  # transformers' own config.json (layer_types, mlp_layer_types, …)
    assert cfg.layer_types == ("kda", "kda", "kda", "mla") and tensor_specs(cfg) == ours
    got = read_checkpoint(tmp_path, cfg, progress=False)
    stored = load_file(tmp_path / "model.safetensors")
    assert got.keys() == ours.keys()
    for name, t in stored.items():
        assert torch.equal(got[canonical_name(name)], t.float()), name


@pytest.mark.parametrize("quant", [None, "mxfp4"])
@pytest.mark.parametrize("variant", sorted(KL_VARIANTS))
def test_kimi_linear_round_trip(tmp_path, variant, quant):
    raw = KL_VARIANTS[variant]()
    cfg = parse_config(raw)
    weights = random_tensors(tensor_specs(cfg), seed=1)
    write_checkpoint(tmp_path, raw, weights, quant=quant)
    st = stored_tensors(tmp_path)
    if quant is None:
        assert {d for d, _, _ in st.values()} == {"F32"} and st.keys() == weights.keys()
    else:
        e = K1 + "block_sparse_moe.experts.6.w2.weight"
        h_e, i_m = (32, 48) if variant == "k3" else (64, 32)
        assert st[e + "_packed"][:2] == ("U8", [h_e, i_m // 2])
        assert st[e + "_scale"][:2] == ("U8", [h_e, math.ceil(i_m / 32)])
        assert e not in st and e + "_shape" not in st
        for name in ["model.layers.0.self_attn.A_log", "model.layers.2.self_attn.dt_bias",
                     K1 + "block_sparse_moe.gate.e_score_correction_bias"]:
            assert st[name][0] == "F32", name
        plain = {n: d for n, (d, _, _) in st.items() if not is_routed_expert(n) and not is_fp32(n)}
        assert set(plain.values()) == {"BF16"} and K1 + "block_sparse_moe.shared_experts.up_proj.weight" in plain
        if variant == "k3":
            assert st[K1 + "block_sparse_moe.routed_expert_up_proj.weight"][0] == "BF16"

    loaded = load_config(tmp_path)
    assert (loaded.quant.method if loaded.quant else None) == quant
    got = read_checkpoint(tmp_path, loaded, progress=False)
    assert got.keys() == weights.keys()
    for name, w in weights.items():
        if quant is None or is_fp32(name):
            want = w
        elif is_routed_expert(name):
            want = unpack_mxfp4(*pack_mxfp4(w))
        else:
            want = w.bfloat16().float()
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name
    bf16 = read_checkpoint(tmp_path, loaded, dtype=torch.bfloat16, experts=range(0), progress=False)
    assert bf16["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert bf16["model.layers.0.self_attn.dt_bias"].dtype == torch.float32
    assert bf16["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_k3_mxfp4_quantization_config_matches_fixture(tmp_path):
    fixture = json.loads((CONFIGS / "kimi-k3-text.json").read_text())["quantization_config"]
    write_checkpoint(tmp_path, tiny_k3_raw(), random_tensors(tensor_specs(parse_config(tiny_k3_raw()))), quant="mxfp4")
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    for key in ("quant_method", "format"):
        assert qc[key] == fixture[key], key
    ours, theirs = qc["config_groups"]["group_0"], fixture["config_groups"]["group_0"]
    assert ours["targets"] == theirs["targets"]
    for key in ("num_bits", "type", "group_size", "symmetric", "strategy"):
        assert ours["weights"][key] == theirs["weights"][key], key
    assert ours["weights"]["scale_dtype"].removeprefix("torch.") == theirs["weights"]["scale_dtype"] == "uint8"
    assert set(fixture["ignore"]) <= set(qc["ignore"]) and "re:.*vision_tower.*" in qc["ignore"]
    assert load_config(tmp_path).quant == load_config(CONFIGS / "kimi-k3-text.json").quant  # method, group 32


def test_kimi_linear_expert_subset_read(tmp_path):
    raw = tiny_k3_raw()
    cfg = parse_config(raw)
    weights = random_tensors(tensor_specs(cfg), seed=2)
    keep = {n: t for n, t in weights.items() if expert_of(n) in (None, 2, 3, 4)}
    write_checkpoint(tmp_path, raw, keep, quant="mxfp4")
    c = load_config(tmp_path)
    only = read_checkpoint(tmp_path, c, experts=range(2, 5), include_non_expert=False, progress=False)
    assert only.keys() == {n for n in weights if expert_of(n) in (2, 3, 4)} and len(only) == 3 * 3 * 3
    assert all(torch.equal(t, unpack_mxfp4(*pack_mxfp4(weights[n]))) for n, t in only.items())
    sub = read_checkpoint(tmp_path, c, experts=range(2, 5), progress=False)
    assert sub.keys() == keep.keys() and "model.layers.0.self_attn.g_proj.weight" in sub
    missing = r"missing tensor 'model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\.weight'"
    with pytest.raises(CheckpointError, match=missing):
        read_checkpoint(tmp_path, c, progress=False)


@pytest.mark.parametrize("variant,name,shape", [
    ("kimi_linear", "model.layers.2.self_attn.A_log", "(1, 1, 4, 1)"),
    ("kimi_linear", "model.layers.1.self_attn.k_conv1d.weight", "(64, 1, 4)"),
    ("k3", "model.layers.0.self_attn.A_log", "(4,)"),
    ("k3", "model.layers.0.self_attn.g_proj.weight", "(64, 64)"),
])
def test_missing_kda_tensor(tmp_path, variant, name, shape):
    raw = KL_VARIANTS[variant]()
    cfg = parse_config(raw)
    weights = random_tensors(tensor_specs(cfg))
    write_checkpoint(tmp_path, raw, {k: v for k, v in weights.items() if k != name})
    msg = check_error(tmp_path, cfg, f"missing tensor {name!r}", shape)
    assert "1 problems" in msg
    # an expert actor does not need attention weights
    assert read_checkpoint(tmp_path, cfg, experts=range(1), include_non_expert=False, progress=False)


def test_kda_tensor_with_kimi_linear_shape_in_k3(tmp_path):
    raw = tiny_k3_raw()
    cfg = parse_config(raw)
    weights = random_tensors(tensor_specs(cfg))
    name = "model.layers.1.self_attn.A_log"
    write_checkpoint(tmp_path, raw, {**weights, name: torch.zeros(1, 1, 4, 1)})
    check_error(tmp_path, cfg, name, "(1, 1, 4, 1)", "(4,)")


def test_k3_multimodal_prefix_and_vision_tower(tmp_path):
    """K3's checkpoint nests the text model under ``language_model.`` beside a vision tower."""
    raw = tiny_k3_raw()
    cfg = parse_config(raw)
    weights = random_tensors(tensor_specs(cfg), seed=3)
    write_checkpoint(tmp_path, raw, weights, quant="mxfp4")
    plain = read_checkpoint(tmp_path, load_config(tmp_path), progress=False)
    file = tmp_path / "model.safetensors"
    stored = load_file(file)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    wrapper = {"architectures": ["KimiK3ForConditionalGeneration"], "text_config": raw,
               "vision_config": {"hidden_size": 16}, "quantization_config": qc}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    prefixed = {"language_model." + n: t for n, t in stored.items()}
    prefixed["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(4, 4)
    prefixed["mm_projector.proj.0.weight"] = torch.zeros(4, 4)
    save_file(prefixed, file, metadata={"format": "pt"})
    c = load_config(tmp_path)
    assert c.quant is not None and c.quant.method == "mxfp4"
    got = read_checkpoint(tmp_path, c, progress=False)
    assert got.keys() == plain.keys() and all(torch.equal(got[n], plain[n]) for n in got)
    # the same tensor under both spellings is ambiguous
    name = "model.layers.0.self_attn.A_log"
    save_file({**prefixed, name: stored[name].clone()}, file, metadata={"format": "pt"})
    check_error(tmp_path, c, f"tensor {name!r} is stored twice", "language_model." + name)


def test_kimi_linear_rejects_fp8(tmp_path):
    raw = tiny_kimi_linear_raw()
    weights = random_tensors(tensor_specs(parse_config(raw)))
    with pytest.raises(ValueError, match=r"'fp8' is not supported for kimi_linear"):
        write_checkpoint(tmp_path, raw, weights, quant="fp8")
    assert not (tmp_path / "config.json").exists()
    write_checkpoint(tmp_path, raw, weights)
    cfg = parse_config({**raw, "quantization_config": quantization_config_block("fp8")})
    check_error(tmp_path, cfg, "'fp8' is not supported for kimi_linear")
