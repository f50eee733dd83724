"""Live scaling through the real path (issue 8, Must show 1-4): the Serve app on 3 local Ray nodes,
8 greedy SSE streams over HTTP, and the `moeray scale` / `moeray rebalance` commands changing the
shape while they run. Every stream's text equals the single-process model's, with no token repeated
or dropped; the epoch and pause metrics move."""

import json

import httpx
import pytest
from live import (ADMIN, CONSTRAINED, KEY, Stream, chat_reference, deploy, finish, metrics, moeray, oracle_soon,
                  run_cli, start_streams)
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from model.presets import build_preset


@pytest.fixture(scope="module")
def port(serve_port):
    return serve_port


def _imbalance(url) -> float:
    """Mean over MoE layers of the measured max/mean tokens per expert actor, from /metrics."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    values = [s.value for f in text_string_to_metric_families(text) if f.name == "moeray:expert_actor_imbalance"
              for s in f.samples]
    assert values
    return sum(values) / len(values)


def _prompts(n):
    return [[(i * 53 + j * 7) % 700 + 3 for j in range(4 + 3 * i)] for i in range(n)]


# Long enough that every stream outlasts the changes made while it runs (asserted): measured on 2
# cores, K2's 2 → 4 → 2 expert actors took 6 s and its 400-token streams 8 s; K3's 2 → 3 took 3 s
# and its 400-token streams 8.6 s. The streams should end well after the changes, not just after.
K2_TOKENS = 640
K3_TOKENS = 400


def test_scale_experts_2_4_2_and_attention_2_1_while_8_streams_run(port, tmp_path_factory):
    path = build_preset("kimi-k2-tiny", tmp_path_factory.mktemp("k2") / "k2", seed=8, progress=False)
    prompts = _prompts(8)
    expected = oracle_soon(path, prompts, K2_TOKENS)
    url = deploy(port, path, "k2", attention=2, experts=2)
    expected = expected.result()
    before = metrics(url)
    assert before["moeray:epoch"] == 0

    streams = start_streams(url, "k2", prompts, K2_TOKENS)
    out, up_at = run_cli(url, "scale", "experts", "4")
    assert "epoch 1 (experts): 2 attention × 2 expert actors → 2 attention × 4 expert actors" in out, out
    out, down_at = run_cli(url, "scale", "experts", "2")
    assert "2 attention × 4 expert actors → 2 attention × 2 expert actors" in out and "paused" in out, out
    assert all(s.ended is None or s.ended > down_at for s in streams), "a stream ended before the changes"
    assert finish(streams) == expected
    assert all(s.finish == "length" and len(s.pieces) == K2_TOKENS for s in streams)  # one chunk per token

    # attention 2 → 1: the removed replica's sequences are re-prefilled on the other; SSE unbroken; a
    # grammar-constrained greedy stream among them gives its fault-free answer
    constrained = chat_reference(url, "k2", K2_TOKENS, CONSTRAINED)
    streams = start_streams(url, "k2", prompts, K2_TOKENS, [Stream(url, "k2", None, K2_TOKENS, CONSTRAINED) for _ in range(2)])
    out, at = run_cli(url, "scale", "attention", "1")
    assert "→ 1 attention × 2 expert actors" in out and "sequences moved" in out, out
    assert all(s.ended is None or s.ended > at for s in streams)
    assert finish(streams) == [*expected, constrained, constrained]
    assert all(len(s.pieces) == K2_TOKENS for s in streams[:-2])  # nothing repeated or dropped

    after = metrics(url)
    assert after["moeray:epoch"] == 3
    assert after["moeray:epoch_pause_seconds_count"] - before["moeray:epoch_pause_seconds_count"] == 3
    assert after["moeray:epoch_pause_seconds_sum"] > 0
    st = json.loads(moeray("status", "--url", url, "--api-key", KEY, "--json").stdout)
    assert st["epoch"] == 3 and st["last_change"]["kind"] == "attention" and len(st["experts"]) == 2
    assert st["experts"][0]["slots"] == {str(l): list(range(8)) for l in st["experts"][0]["slots"]}
    serve.delete("k2")


def test_uneven_k3_scale_and_rebalance_over_http(port, tmp_path_factory):
    """kimi-k3-tiny: 16 experts from 2 actors to 3 (6/5/5) while streams run, then `moeray rebalance`
    with replicas; outputs unchanged, the imbalance report printed."""
    path = build_preset("kimi-k3-tiny", tmp_path_factory.mktemp("k3") / "k3", seed=9, progress=False)
    prompts = _prompts(8)
    skewed = [[t] * 30 for t in (5, 5, 9, 5, 9, 5)]  # a skewed mix: the same experts win again and again
    oracles = [oracle_soon(path, prompts, K3_TOKENS), oracle_soon(path, skewed, 12), oracle_soon(path, prompts, 40)]
    url = deploy(port, path, "k3", attention=1, experts=2, rebalance_window_steps=16)
    expected, skewed_expected, expected_40 = (o.result() for o in oracles)
    streams = start_streams(url, "k3", prompts, K3_TOKENS)
    out, at = run_cli(url, "scale", "experts", "3")
    assert "1 attention × 2 expert actors → 1 attention × 3 expert actors" in out, out
    assert all(s.ended is None or s.ended > at for s in streams)
    assert finish(streams) == expected
    st = json.loads(moeray("status", "--url", url, "--api-key", KEY, "--json").stdout)
    assert [len(e["slots"][next(iter(e["slots"]))]) for e in st["experts"]] == [6, 5, 5]

    run_cli(url, "scale", "experts", "3")  # the same shape: a new epoch, so the gauge below sees this mix alone
    assert finish(start_streams(url, "k3", skewed, 12)) == skewed_expected
    before = _imbalance(url)  # and the router's 16-step window holds this mix too
    out, _ = run_cli(url, "rebalance", "--redundant-slots", "2")
    assert "imbalance (max/mean tokens per expert actor" in out and "→" in out, out
    st = json.loads(moeray("status", "--url", url, "--api-key", KEY, "--json").stdout)
    assert st["epoch"] == 3 and any(r for e in st["experts"] for r in e["replicas"].values())
    assert finish(start_streams(url, "k3", skewed, 12)) == skewed_expected  # the same mix, re-placed experts
    after = _imbalance(url)  # the gauge's window holds the current epoch's steps only
    assert 0 < after < before, (before, after)
    assert finish(start_streams(url, "k3", prompts, 40)) == expected_40  # the 8 prompts on the re-placed experts
    bad = httpx.post(f"{url}/admin/scale/experts", json={"n": 0}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    too_many = moeray("scale", "experts", "99", "--url", url, "--admin-key", ADMIN)
    assert too_many.returncode == 2 and "expert actors must be in 1..16" in too_many.stderr
    assert httpx.post(f"{url}/admin/rebalance", json={}).status_code == 401  # guarded by the admin key
    inference = httpx.post(f"{url}/admin/rebalance", json={}, headers={"Authorization": f"Bearer {KEY}"})
    assert inference.status_code == 401  # which an inference key is not
    serve.delete("k3")
