"""Config parsing: both families, the spellings real checkpoints use, and errors that name the field."""

import json
from pathlib import Path

import pytest

from deploy.config import ServeConfig
from model.config import load_config, parse_config

FIXTURES = Path(__file__).parents[1] / "fixtures" / "configs"


def _raw(name):
    return json.loads((FIXTURES / name).read_text())


def test_k3_multimodal_wrapper_is_read_as_its_text_model():
    text = _raw("kimi-k3-text.json")
    quant = text.pop("quantization_config")
    wrapped = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
               "vision_config": {"depth": 27}, "media_placeholder_token_id": 163605, "quantization_config": quant}
    cfg = parse_config(wrapped)
    assert cfg.model_type == "kimi_linear" and cfg.quant.method == "mxfp4"
    assert len(cfg.kda_layers) == 69 and len(cfg.mla_layers) == 24


def test_one_based_schedule_and_renamed_fields():
    cfg = load_config(FIXTURES / "kimi-linear-48b.json")
    assert cfg.mla_layers == [3, 7, 11, 15, 19, 23, 26]
    assert cfg.n_routed_experts == 256 and cfg.num_experts_per_tok == 8 and cfg.n_shared_experts == 1
    assert cfg.max_position_embeddings == 1048576 and cfg.rope.kind == "none"


def test_transformers5_rope_parameters_equal_rope_scaling():
    raw = _raw("kimi-k2-instruct.json")
    old = parse_config(raw)
    new = dict(raw)
    rs = new.pop("rope_scaling")
    new["rope_parameters"] = {"rope_type": rs["type"], "rope_theta": new.pop("rope_theta"),
                              **{k: v for k, v in rs.items() if k != "type"}}
    assert parse_config(new).rope == old.rope and abs(old.softmax_scale - 0.1308608) < 1e-6


@pytest.mark.parametrize("edit,field", [
    (lambda r: r["linear_attn_config"].__setitem__("kda_layers", [0, 1]), "kda_layers"),
    (lambda r: r["linear_attn_config"]["full_attn_layers"].remove(27), "full_attn_layers"),
    (lambda r: r.__setitem__("hidden_act", "gelu"), "hidden_act"),
    (lambda r: r.__setitem__("num_experts", "many"), "'num_experts'"),
])
def test_bad_hybrid_configs_name_the_field(edit, field):
    raw = _raw("kimi-linear-48b.json")
    edit(raw)
    with pytest.raises(ValueError, match=field):
        parse_config(raw)


def test_serving_config_yaml(tmp_path):
    (tmp_path / "c.yaml").write_text("model: kimi-k3-tiny\nattention: 2\nport: 9000\n")
    cfg = ServeConfig.from_yaml(tmp_path / "c.yaml", experts=3)
    assert (cfg.model, cfg.attention, cfg.experts, cfg.port) == ("kimi-k3-tiny", 2, 3, 9000)
    (tmp_path / "bad.yaml").write_text("model: x\nattenton: 2\n")
    with pytest.raises(ValueError, match="attenton"):
        ServeConfig.from_yaml(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="port"):
        ServeConfig.parse({"port": 0})
