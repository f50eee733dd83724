"""The `moeray` console script end to end: make-checkpoint, generate, params, and its errors.

Runs the installed entry point in a subprocess, as a user would. Each kind of user error (a bad
tensor, a bad config, a bad prompt, an unknown model, a bad cluster flag) goes through the real
subprocess at least once; further cases of the same kind run the same Typer app in this process
(`in_process`), which checks the same exit code and stderr without paying a Python start-up each."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import in_process
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).parents[1] / "fixtures" / "configs"


def _cmd() -> list[str]:
    exe = Path(sys.executable).parent / "moeray"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "deploy.cli"]


def moeray(*args, env_extra=None, check=True):
    env = {**os.environ, **(env_extra or {})}
    proc = subprocess.run(_cmd() + list(args), capture_output=True, text=True, env=env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"moeray {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def moeray_at_once(*arg_lists) -> list[str]:
    """Several `moeray` runs as separate processes at the same time (each its own start-up, as
    two runs by a user); their stdout, in order. Any failure fails the test with its stderr."""
    procs = [subprocess.Popen(_cmd() + list(a), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in arg_lists]
    outs = []
    for a, p in zip(arg_lists, procs):
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, f"moeray {' '.join(a)} failed ({p.returncode}):\n{err}"
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def k2_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "k2"
    moeray("make-checkpoint", "--preset", "kimi-k2-tiny", "--out", str(out), "--seed", "3")
    return out


def test_make_checkpoint_writes_a_real_hf_directory(k2_dir):
    names = sorted(p.name for p in k2_dir.iterdir())
    assert "config.json" in names and "tiktoken.model" in names and "tokenizer_config.json" in names
    cfg = json.loads((k2_dir / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["rope_scaling"]["factor"] == 32.0
    assert cfg["n_routed_experts"] >= 16 and cfg["num_experts_per_tok"] >= 4 and cfg["n_shared_experts"] >= 1
    tensors = {}
    for f in k2_dir.glob("*.safetensors"):
        tensors.update(load_file(f))
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in tensors
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # dense first layer
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype.is_floating_point


def test_generate_json_is_deterministic(k2_dir):
    greedy = ["generate", "--model", str(k2_dir), "--prompt", "Hello there", "--max-tokens", "8", "--ignore-eos", "--json"]
    seeded = ["generate", "--model", str(k2_dir), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--temperature", "0.8",
              "--seed", "5", "--ignore-eos", "--json"]
    a, b, c, d = map(json.loads, moeray_at_once(greedy, greedy, seeded, seeded))  # four separate processes
    assert set(a) == {"token_ids", "text"} and len(a["token_ids"]) == 8 and a == b
    assert c == d and len(c["token_ids"]) == 4


def test_params_on_real_k2_config_dir(tmp_path):
    shutil.copy(FIXTURES / "kimi-k2-instruct.json", tmp_path / "config.json")
    out = json.loads(moeray("params", "--model", str(tmp_path), "--json").stdout)
    assert out["mla_per_layer"] == 101_124_096
    assert out["moe_decoder_layer"] == 17_059_365_248
    assert out["moe_layers_total"] == 1_023_561_914_880
    assert out["total"] == 1_026_408_232_448
    table = moeray("params", "--model", str(tmp_path)).stdout
    assert "1,026,408,232,448" in table and "101,124,096" in table


def _assert_clear_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert lines[0].startswith("error:"), proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    (f,) = list(dst.glob("*.safetensors"))
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def test_missing_tensor(k2_dir, tmp_path):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    bad = _broken_copy(k2_dir, tmp_path / "m", lambda t: t.pop(name))
    _assert_clear_error(moeray("generate", "--model", str(bad), "--prompt-ids", "1", check=False), name)


def test_wrong_shape(k2_dir, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    bad = _broken_copy(k2_dir, tmp_path / "m", lambda t: t.__setitem__(name, t[name][:-1].clone()))
    _assert_clear_error(in_process("generate", "--model", str(bad), "--prompt-ids", "1"), name)


def test_unexpected_tensor(k2_dir, tmp_path):
    import torch

    name = "model.layers.1.mlp.experts.99.up_proj.weight"
    bad = _broken_copy(k2_dir, tmp_path / "m", lambda t: t.__setitem__(name, torch.zeros(2, 2)))
    _assert_clear_error(in_process("generate", "--model", str(bad), "--prompt-ids", "1"), name)


@pytest.mark.parametrize("edit,needle,run", [
    (lambda c: c.__setitem__("model_type", "llama"), "model_type", "subprocess"),
    (lambda c: c.pop("kv_lora_rank"), "kv_lora_rank", "in_process"),
    (lambda c: c.__setitem__("hidden_size", "big"), "hidden_size", "in_process"),
    (lambda c: c.__setitem__("n_group", 3), "n_group", "in_process"),
    (lambda c: c.__setitem__("rope_scaling", {"type": "yarn", "factor": 4.0}), "original_max_position_embeddings",
     "in_process"),
])
def test_bad_config(k2_dir, tmp_path, edit, needle, run):
    shutil.copytree(k2_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    edit(cfg)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    args = ("generate", "--model", str(tmp_path / "m"), "--prompt-ids", "1")
    _assert_clear_error(moeray(*args, check=False) if run == "subprocess" else in_process(*args), needle)


def test_malformed_config_json(k2_dir, tmp_path):
    shutil.copytree(k2_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"model_type": "kimi_k2",')
    _assert_clear_error(moeray("params", "--model", str(tmp_path / "m"), check=False), "config.json", "malformed JSON")


def test_prompt_ids_out_of_vocabulary(k2_dir):
    _assert_clear_error(moeray("generate", "--model", str(k2_dir), "--prompt-ids", "1,99999", check=False),
                        "99999", "vocabulary")
    _assert_clear_error(in_process("generate", "--model", str(k2_dir), "--prompt-ids", "1,x"), "--prompt-ids")


def test_unknown_model_or_preset():
    _assert_clear_error(moeray("generate", "--model", "no-such-thing", "--prompt", "hi", check=False), "preset")


def test_help_explains_commands():
    out = moeray("--help").stdout
    for cmd in ("generate", "make-checkpoint", "params"):
        assert cmd in out
    assert "--prompt-ids" in moeray("generate", "--help").stdout


@pytest.mark.parametrize("fixture,total,kda,mla", [
    ("kimi-linear-48b.json", 49_122_681_728, 20, 7),
    ("kimi-k3-text.json", 2_779_484_476_000, 69, 24),
])
def test_params_on_hybrid_configs(tmp_path, fixture, total, kda, mla):
    shutil.copy(FIXTURES / fixture, tmp_path / "config.json")
    out = json.loads(moeray("params", "--model", str(tmp_path), "--json", "--cache").stdout)
    assert out["total"] == total and out["n_kda_layers"] == kda and out["n_mla_layers"] == mla
    assert out["cache"]["latent"] == mla * 1152 and out["kda_state"]["kda_layers"] == kda
    if kda == 69:
        assert out["latent_up_proj_per_moe_layer"] == 25_690_112 and out["n_moe_layers"] == 92
    text = moeray("params", "--model", str(tmp_path), "--cache").stdout
    assert "KDA state per sequence" in text and f"{total:,}" in text


def test_k3_preset_mxfp4_checkpoint_generates(tmp_path):
    out = tmp_path / "k3"
    moeray("make-checkpoint", "--preset", "kimi-k3-tiny", "--out", str(out), "--quant", "mxfp4")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(f))
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in tensors
    assert "model.layers.1.self_attn.A_log" in tensors and "model.output_attn_res_proj.weight" in tensors
    res = json.loads(moeray("generate", "--model", str(out), "--prompt", "Hi", "--max-tokens", "5",
                            "--ignore-eos", "--json").stdout)
    assert len(res["token_ids"]) == 5
    lin = json.loads(moeray("generate", "--model", "kimi-linear-tiny", "--prompt", "Hi", "--max-tokens", "3",
                            "--ignore-eos", "--json", env_extra={"MOERAY_CACHE_DIR": str(tmp_path / "c")}).stdout)
    assert len(lin["token_ids"]) == 3


@pytest.mark.operator
def test_generate_on_a_three_node_cluster_equals_single_process(k2_dir):
    args = ["generate", "--model", str(k2_dir), "--prompt", "Hello world", "--max-tokens", "6", "--ignore-eos", "--json"]
    alone, on_cluster = map(json.loads, moeray_at_once(args, args + ["--attention", "2", "--experts", "3", "--nodes", "3"]))
    assert on_cluster == alone


def test_cluster_flag_errors_are_clear(k2_dir):
    proc = moeray("generate", "--model", str(k2_dir), "--prompt-ids", "1", "--experts", "99", "--nodes", "1", check=False)
    _assert_clear_error(proc, "expert actors")


@pytest.mark.parametrize("value, words", [
    ('{"min_uncached_tokens": 0}', ["disaggregation", "min_uncached_tokens", ">= 1"]),
    ('{"layout": "sideways"}', ["disaggregation", "layout", "colocated"]),
    ('{"transport": "rdma"}', ["disaggregation", "transport", "channel", "object_store"]),
    ('{"min_uncached": 64}', ["disaggregation", "unknown key 'min_uncached'", "min_uncached_tokens"]),
    ('{min_uncached_tokens: 64}', ["--pd-config", "not JSON", '{"min_uncached_tokens": 512}']),
])
def test_up_refuses_a_bad_pd_config_naming_the_key_before_starting_anything(value, words):
    r = in_process("up", "--pd-config", value)
    assert r.returncode != 0
    for w in words:
        assert w in r.stderr + r.stdout, (w, r.stderr, r.stdout)


def test_moeray_up_sizes_its_nodes_for_the_prefill_engine_too():
    """`moeray up --pd` on one machine: the local nodes hold both engines' actors (they were sized for the
    serving engine's alone, and the prefill engine's reservation waited out its timeout)."""
    from deploy.config import ServeConfig

    assert ServeConfig.parse({"model": "kimi-k2-tiny"}).actor_count() == 2
    assert ServeConfig.parse({"model": "kimi-k2-tiny", "disaggregation": {}}).actor_count() == 4
    both = ServeConfig.parse({"model": "kimi-k2-tiny", "layout": "colocated", "workers": 3,
                              "disaggregation": {"layout": "colocated", "workers": 2}})
    assert both.actor_count() == 5
