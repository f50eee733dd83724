"""Prefill/decode disaggregation through the serving app (the `disaggregation` key): a long prompt's
blocks come from the prefill engine and its answer is the one the decode engine gives once it caches that
prompt itself; short prompts stay local; /status shows both engines, the routes and nothing held. In this
process (tests/deploy/inproc.py): both engines over the in-process executor."""

import time

import httpx
import pytest

from inproc import preset, serve


ADMIN = "pd-admin"


@pytest.fixture(scope="module")
def server():
    path = preset("kimi-k2-tiny", seed=4)
    with serve(path, served_model_name="k2", attention=2, experts=1, max_tokens_per_step=64, admin_api_key=ADMIN,
               disaggregation={"min_uncached_tokens": 32, "max_tokens_per_step": 256}) as s:
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
        yield s


def complete(server, prompt, **extra):
    body = {"model": "k2", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def status(server):
    return httpx.get(f"{server.url}/status", timeout=30).json()


def alone(server, prompt, max_tokens=8) -> list[int]:
    """The single process's greedy tokens for ``prompt`` (the served dtype, fp32): no transfer, no cache."""
    import torch

    from model.loader import load_model
    from model.runner import ModelRunner, generate
    from model.sampling import SamplingParams

    net = load_model(server.model_path, dtype=torch.float32, progress=False)
    seq = generate(ModelRunner(net, num_blocks=64, block_size=16, num_slots=2), [prompt],
                   [SamplingParams(max_tokens=max_tokens, ignore_eos=True)])[0]
    return seq.output_ids


def test_a_long_prompt_crosses_and_answers_as_the_decode_engine_would(server):
    long = [(7 * i) % 700 + 5 for i in range(150)]
    first = complete(server, long)
    routes = status(server)["disaggregation"]["routes"]
    assert routes == {"pd": 1}, routes
    assert first["token_ids"] == alone(server, long)  # what crossed is what the single process computes
    again = complete(server, long)  # now the decode engine caches every full block of it: prefilled there
    assert again["token_ids"] == first["token_ids"] and again["text"] == first["text"]
    short = complete(server, [11, 12, 13])
    assert short["token_ids"]
    s = status(server)
    d = s["disaggregation"]
    assert d["routes"] == {"pd": 1, "local": 2}, d
    assert (d["leases"], d["prefill_blocks_leased"], d["decode_blocks_arriving"], d["failures"]) == (0, 0, 0, {})
    assert d["bytes_moved"] > 0 and d["prefill"]["healthy"] and d["prefill"]["shape"]


def test_n_choices_of_a_long_prompt_share_one_answer_path(server):
    long = [(11 * i) % 700 + 3 for i in range(120)]
    body = {"n": 2, "temperature": 0.8, "seed": 5}
    two = httpx.post(f"{server.url}/v1/completions", timeout=120,
                     json={"model": "k2", "prompt": long, "max_tokens": 6, "ignore_eos": True,
                           "return_token_ids": True, **body}).json()["choices"]
    assert len(two) == 2 and all(len(c["token_ids"]) == 6 for c in two)
    deadline = time.monotonic() + 30  # (the arrivals' releases run on the engine thread, queued behind the request;
    # the routes are counted as the requests' streams close, which may come after the answer was sent: a CI run
    # with both cores busy took over 5 s)
    while True:
        d = status(server)["disaggregation"]
        if (d["leases"], d["decode_blocks_arriving"]) == (0, 0) and d["routes"].get("pd", 0) >= 3 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (d["leases"], d["decode_blocks_arriving"]) == (0, 0), d
    assert d["routes"]["pd"] >= 3, d  # both choices crossed (the second found the first's blocks: nothing written)


def test_metrics_count_the_routes_and_transfers(server):
    from prometheus_client.parser import text_string_to_metric_families

    complete(server, [(13 * i) % 700 + 2 for i in range(90)])  # one that crosses, whatever ran before
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    d = status(server)["disaggregation"]
    for route in ("pd", "local", "aborted"):
        assert samples[("moeray:pd_requests_total", (("model_name", "k2"), ("route", route)))] == d["routes"].get(route, 0)
    assert samples[("moeray:kv_transfer_bytes_total", (("model_name", "k2"),))] == d["bytes_moved"] > 0
    assert samples[("moeray:kv_transfer_seconds_total", (("model_name", "k2"),))] > 0
    assert samples[("moeray:kv_transfer_failures_total", (("model_name", "k2"), ("reason", "TransportError")))] == 0
    assert samples[("moeray:kv_transfer_leased_blocks", (("model_name", "k2"),))] == 0
    for route in ("pd", "local"):  # (no worker was lost here)
        assert samples[("moeray:pd_recovered_sequences_total", (("model_name", "k2"), ("route", route)))] == 0


def test_scale_reaches_the_engine_named(server):
    """`moeray scale prefill ...` (the body's engine) reaches the prefill engine, and only it: this in-process
    engine refuses any change of shape, and the refusal names the prefill engine; the decode engine is asked
    without it; an unknown engine is a 400 naming the field. Neither engine's shape changed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    before = status(server)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(f"{server.url}/admin/scale/attention", json={"n": 2, "engine": "prefill"}, headers=admin, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["message"].startswith("the prefill engine: "), r.text
    assert "cannot change its shape (attention)" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/admin/scale/experts", json={"n": 2}, headers=admin, timeout=60)
    assert r.status_code == 503 and "the prefill engine" not in r.text and "cannot change its shape" in r.text
    r = httpx.post(f"{server.url}/admin/scale/experts", json={"n": 2, "engine": "both"}, headers=admin, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "engine", r.text
    env = {k: v for k, v in os.environ.items() if k != "MOERAY_ADMIN_KEY"} | {"COLUMNS": "300"}
    done = subprocess.run([str(Path(sys.executable).parent / "moeray"), "scale", "prefill", "workers", "2", "--url",
                           server.url, "--admin-key", ADMIN], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and "the prefill engine: " in done.stderr, done.stderr
    after = status(server)
    assert (after["shape"], after["disaggregation"]["prefill"]["shape"]) == (
        before["shape"], before["disaggregation"]["prefill"]["shape"])
