"""Live scaling through the real path (issue 8, Must show 1-4): the Serve app on 3 local Ray nodes,
8 greedy SSE streams over HTTP, and the `moeray scale` / `moeray rebalance` commands changing the
shape while they run. Every stream's text equals the single-process model's, with no token repeated
or dropped; the epoch and pause metrics move."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from deploy.app import build_app
from deploy.config import ServeConfig
from model.loader import load_model
from model.presets import build_preset
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

KEY = "scale-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def port(ray_cluster):
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


def _deploy(port, path, name, **shape):
    cfg = ServeConfig(model=str(path), served_model_name=name, api_key=KEY, port=port, num_blocks=512,
                      max_num_seqs=16, max_tokens_per_step=128, **shape)
    serve.run(build_app(cfg.model_dump()), name=name, route_prefix=f"/{name}")
    url = f"http://127.0.0.1:{port}/{name}"
    deadline = time.monotonic() + 180
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "server never became healthy"
        time.sleep(0.5)
    return url


def _moeray(*args) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "moeray"
    env = {**os.environ, "COLUMNS": "300"}  # rich would wrap the report at 80 columns
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=600)


def _oracle(path, prompts, n):
    runner = ModelRunner(load_model(path, progress=False), num_blocks=512, block_size=16, num_slots=16)
    seqs = generate(runner, prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    tok = Tokenizer.from_dir(path)
    return [tok.decode(s.output_ids) for s in seqs]


class _Stream(threading.Thread):
    """One SSE completion stream: its text pieces, and when it started and ended."""

    def __init__(self, url, name, prompt, n):
        super().__init__(daemon=True)
        self.url, self.name, self.prompt, self.n = url, name, prompt, n
        self.pieces, self.error, self.finish, self.ended = [], None, None, None

    def run(self):
        body = {"model": self.name, "prompt": self.prompt, "max_tokens": self.n, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=600,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choice = json.loads(line[6:])["choices"][0]
                        self.pieces.append(choice["text"])
                        self.finish = choice["finish_reason"] or self.finish
        except Exception as e:  # noqa: BLE001 — reported by the test
            self.error = e
        self.ended = time.monotonic()


def _streams(url, name, prompts, n):
    streams = [_Stream(url, name, p, n) for p in prompts]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 120
    while not all(s.pieces for s in streams):  # every stream is running before the change
        assert time.monotonic() < deadline and not any(s.error for s in streams), [s.error for s in streams]
        time.sleep(0.05)
    return streams


def _finish(streams):
    for s in streams:
        s.join(600)
    assert not any(s.error for s in streams), [repr(s.error) for s in streams]
    return ["".join(s.pieces) for s in streams]


def _scale(url, *args):
    done = _moeray(*args, "--url", url, "--api-key", KEY)
    assert done.returncode == 0, done.stderr
    return done.stderr, time.monotonic()


def _metrics(url) -> dict:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _imbalance(url) -> float:
    """Mean over MoE layers of the measured max/mean tokens per expert actor, from /metrics."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    values = [s.value for f in text_string_to_metric_families(text) if f.name == "moeray:expert_actor_imbalance"
              for s in f.samples]
    assert values
    return sum(values) / len(values)


def _prompts(n):
    return [[(i * 53 + j * 7) % 700 + 3 for j in range(4 + 3 * i)] for i in range(n)]


N_TOKENS = 160


def test_scale_experts_2_4_2_and_attention_2_1_while_8_streams_run(port, tmp_path_factory):
    path = build_preset("kimi-k2-tiny", tmp_path_factory.mktemp("k2") / "k2", seed=8, progress=False)
    url = _deploy(port, path, "k2", attention=2, experts=2)
    prompts = _prompts(8)
    expected = _oracle(path, prompts, N_TOKENS)
    before = _metrics(url)
    assert before["moeray:epoch"] == 0

    streams = _streams(url, "k2", prompts, N_TOKENS)
    out, up_at = _scale(url, "scale", "experts", "4")
    assert "epoch 1 (experts): 2 attention × 2 expert actors → 2 attention × 4 expert actors" in out, out
    out, down_at = _scale(url, "scale", "experts", "2")
    assert "2 attention × 4 expert actors → 2 attention × 2 expert actors" in out and "paused" in out, out
    assert all(s.ended is None or s.ended > down_at for s in streams), "a stream ended before the changes"
    assert _finish(streams) == expected
    assert all(s.finish == "length" and len(s.pieces) == N_TOKENS for s in streams)  # one chunk per token

    # attention 2 → 1: the removed replica's sequences are re-prefilled on the other; SSE unbroken
    streams = _streams(url, "k2", prompts, N_TOKENS)
    out, at = _scale(url, "scale", "attention", "1")
    assert "→ 1 attention × 2 expert actors" in out and "sequences moved" in out, out
    assert all(s.ended is None or s.ended > at for s in streams)
    assert _finish(streams) == expected
    assert all(len(s.pieces) == N_TOKENS for s in streams)  # nothing repeated or dropped

    after = _metrics(url)
    assert after["moeray:epoch"] == 3
    assert after["moeray:epoch_pause_seconds_count"] - before["moeray:epoch_pause_seconds_count"] == 3
    assert after["moeray:epoch_pause_seconds_sum"] > 0
    st = json.loads(_moeray("status", "--url", url, "--api-key", KEY, "--json").stdout)
    assert st["epoch"] == 3 and st["last_change"]["kind"] == "attention" and len(st["experts"]) == 2
    assert st["experts"][0]["slots"] == {str(l): list(range(8)) for l in st["experts"][0]["slots"]}
    serve.delete("k2")


def test_uneven_k3_scale_and_rebalance_over_http(port, tmp_path_factory):
    """kimi-k3-tiny: 16 experts from 2 actors to 3 (6/5/5) while streams run, then `moeray rebalance`
    with replicas; outputs unchanged, the imbalance report printed."""
    path = build_preset("kimi-k3-tiny", tmp_path_factory.mktemp("k3") / "k3", seed=9, progress=False)
    url = _deploy(port, path, "k3", attention=1, experts=2)
    prompts = _prompts(8)
    expected = _oracle(path, prompts, N_TOKENS)
    streams = _streams(url, "k3", prompts, N_TOKENS)
    out, at = _scale(url, "scale", "experts", "3")
    assert "1 attention × 2 expert actors → 1 attention × 3 expert actors" in out, out
    assert all(s.ended is None or s.ended > at for s in streams)
    assert _finish(streams) == expected
    st = json.loads(_moeray("status", "--url", url, "--api-key", KEY, "--json").stdout)
    assert [len(e["slots"][next(iter(e["slots"]))]) for e in st["experts"]] == [6, 5, 5]

    skewed = [[t] * 30 for t in (5, 5, 9, 5, 9, 5)]  # a skewed mix: the same experts win again and again
    skewed_expected = _oracle(path, skewed, 12)
    assert _finish(_streams(url, "k3", skewed, 12)) == skewed_expected
    before = _imbalance(url)
    out, _ = _scale(url, "rebalance", "--redundant-slots", "2")
    assert "imbalance (max/mean tokens per expert actor" in out and "→" in out, out
    st = json.loads(_moeray("status", "--url", url, "--api-key", KEY, "--json").stdout)
    assert st["epoch"] == 2 and any(r for e in st["experts"] for r in e["replicas"].values())
    assert _finish(_streams(url, "k3", skewed, 12)) == skewed_expected  # the same mix, re-placed experts
    after = _imbalance(url)  # the gauge's window holds the current epoch's steps only
    assert 0 < after < before, (before, after)
    assert _finish(_streams(url, "k3", prompts, N_TOKENS)) == expected
    bad = httpx.post(f"{url}/admin/scale/experts", json={"n": 0}, headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    too_many = _moeray("scale", "experts", "99", "--url", url, "--api-key", KEY)
    assert too_many.returncode == 2 and "expert actors must be in 1..16" in too_many.stderr
    assert httpx.post(f"{url}/admin/rebalance", json={}).status_code == 401  # guarded by the API key
    serve.delete("k3")
