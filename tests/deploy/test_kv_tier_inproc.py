"""The KV tier through the serving app (the `kv_offloading_size` key): a conversation's turns are written
through, a later turn evicted from the device pool is loaded back with the answer it had without the tier;
/status, /metrics (vLLM's external prefix cache names, per-tier counters) and `moeray status` show the tier.
In this process (tests/deploy/inproc.py)."""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inproc import preset, serve


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = preset("kimi-k2-tiny", seed=4)
    with serve(path, served_model_name="k2", num_blocks=48, max_tokens_per_step=256, kv_offloading_size=0.125,
               kv_offloading_path=str(tmp_path_factory.mktemp("tier"))) as s:
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
        yield s


def complete(server, prompt):
    body = {"model": "k2", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def flush(server) -> None:
    eng = server.engine_server.engine
    assert eng.executor.tier(0, "tier_flush") is True


def test_an_evicted_turn_comes_back_from_the_tier_and_everything_shows_it(server):
    first = [(7 * i) % 700 + 5 for i in range(600)]  # 37 of the pool's 48 blocks
    want = complete(server, first)
    flush(server)
    for k in range(3):  # others push it out of the device pool
        complete(server, [(11 * i + k) % 700 + 3 for i in range(600)])
    flush(server)
    assert complete(server, first) == want
    st = httpx.get(f"{server.url}/status", timeout=30).json()["kv_tier"]
    assert st["loaded_tokens"] >= 512 and st["missed"] == 0, st
    actor = st["actors"]["0"]
    assert actor["copied"] >= 4 * 37 and actor["tiers"][0]["hits"] >= 32, actor

    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    k2 = (("model_name", "k2"),)
    assert samples[("moeray:external_prefix_cache_hits_total", k2)] == st["loaded_tokens"]
    assert samples[("moeray:external_prefix_cache_queries_total", k2)] == st["queried_tokens"] >= st["loaded_tokens"]
    node = (("actor", "0"), ("model_name", "k2"), ("tier", "node"))
    assert samples[("moeray:kv_tier_hits_total", node)] == actor["tiers"][0]["hits"]
    assert samples[("moeray:kv_tier_used_bytes", node)] > 0
    assert samples[("moeray:kv_tier_capacity_bytes", node)] == 2**27
    assert samples[("moeray:kv_tier_writes_total", (("actor", "0"), ("model_name", "k2"), ("outcome", "copied")))] \
        == actor["copied"]
    assert samples[("moeray:kv_tier_misses_total", node[:2] + (("reason", "corrupt"),) + node[2:])] == 0

    env = {k: v for k, v in os.environ.items() if k != "MOERAY_ADMIN_KEY"} | {"COLUMNS": "300"}
    shown = subprocess.run([str(Path(sys.executable).parent / "moeray"), "status", "--url", server.url],
                           capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "KV tier: " in shown.stdout and "looked-up prompt tokens loaded" in shown.stdout, shown.stdout
    assert "attention[0]: " in shown.stdout and "written through" in shown.stdout and "node " in shown.stdout
