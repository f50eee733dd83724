"""The training script (scripts/train_preset.py, issue 35 Must show 4): a short run of it — a smaller
model of the same architecture, a tiny corpus, well under a minute — lowers the held-out losses (the
next token's and the MTP layer's) and writes a checkpoint that the real loader and the served app
(in one process, tests/deploy/inproc.py) answer with, token for token, as the single process does."""

import importlib.util
import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from inproc import serve
from model.loader import load_model
from model.mtp import mtp_shared_names
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams

ROOT = Path(__file__).parents[2]
PROMPTS = [[5, 17, 300], [9] * 7, [400, 12, 81, 3, 77]]
N = 16


def _script():
    spec = importlib.util.spec_from_file_location("train_preset", ROOT / "scripts" / "train_preset.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("mini") / "kimi-k2-mini"
    rc = _script().main(["--out", str(out), "--tiny", "--lookup-steps", "20", "--lookup-rows", "8", "--steps", "20",
                         "--docs", "60", "--held-out-docs", "8", "--call-rows", "200", "--rows-per-step", "4",
                         "--seq-len", "256", "--eval-every", "20", "--threads", "1"])
    assert rc == 0
    return out


def test_a_short_run_lowers_the_held_out_losses(trained):
    rows = json.loads((trained / "train_log.json").read_text())
    evals = [r for r in rows if "held_out" in r]
    assert [r["step"] for r in evals] == [0, 20, 40]
    first, last = evals[0], evals[-1]
    assert last["held_out"] < first["held_out"] - 1.0, evals
    assert last["held_out_mtp"] < first["held_out_mtp"] - 1.0, evals
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    # The MTP layer trained on the main model's embedding and head (DeepSeek-V3's sharing): the checkpoint
    # holds them under both names, equal; preset.safetensors (what the repository commits) once.
    full, committed = load_file(trained / "model.safetensors"), load_file(trained / "preset.safetensors")
    shared = mtp_shared_names(cfg["num_hidden_layers"])
    assert set(full) - set(committed) == set(shared)
    for mtp_name, main_name in shared.items():
        assert torch.equal(full[mtp_name], full[main_name]) and torch.equal(committed[main_name], full[main_name])


def test_the_written_checkpoint_serves_token_for_token_as_the_single_process(trained):
    runner = ModelRunner(load_model(trained, progress=False), num_blocks=32, block_size=16, num_slots=4)
    alone = [s.output_ids for s in generate(runner, PROMPTS, SamplingParams(max_tokens=N, ignore_eos=True))]
    with serve(trained, served_model_name="mini", attention=1, experts=2) as s:
        r = httpx.post(f"{s.url}/v1/completions", timeout=120, json={
            "model": "mini", "prompt": PROMPTS, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        served = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert served == alone
