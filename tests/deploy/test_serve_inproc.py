"""The app over real HTTP with the official `openai` client (Must show 1-4 of the serving issue), in
one process (no Ray): completions and chat, streaming and not, n > 1, stop strings, logprobs;
concurrency; every bad input's status and envelope; a full queue; /metrics; the API key; /admin/experts and `moeray experts`; and `moeray bench serve` against this server
(issue 10, Must show 2: every requested token counted, no errors, ordered percentiles).

One in-process app for the module (tests/deploy/inproc.py) in test_live.py's K2 shape: 2 attention
replicas, 2 expert actors' table, every routed expert in this process. What needs the cluster stays
in test_live.py: the served 2 × 2 cluster over real actors generating what `moeray generate` does,
and a client going away under Serve (its proxy cancels the handler; the replica's engine stream
survives). How an answer ends when its client goes away, or its engine fails, is tested once for
every front door, in test_doors_inproc.py."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inproc import preset, serve

KEY = "test-key-123"
ADMIN = "test-admin-key-456"
NAME = "k2"


@pytest.fixture(scope="module")
def server():
    path = preset("kimi-k2-tiny", seed=4)
    with serve(path, served_model_name=NAME, attention=2, experts=2, api_key=KEY, admin_api_key=ADMIN,
               max_queue=20, max_num_seqs=8, max_body_bytes=64 * 1024, max_tokens_per_step=64) as s:
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
        yield {"url": s.url, "path": path, "app": s}


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=120)


def _generate_cli(path, ids, n):
    exe = Path(sys.executable).parent / "moeray"
    out = subprocess.run([str(exe), "generate", "--model", str(path), "--prompt-ids", ",".join(map(str, ids)),
                          "--max-tokens", str(n), "--ignore-eos", "--json"], capture_output=True, text=True,
                         check=True, env=os.environ, timeout=300)
    return json.loads(out.stdout)


def test_greedy_completion_equals_moeray_generate(client, server):
    """The in-process executor generates what the single process does (the cluster's own oracle is
    test_live.py's)."""
    ids = [5, 77, 300, 12, 9]
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    ref = _generate_cli(server["path"], ids, 8)
    assert got.choices[0].text == ref["text"]
    assert got.usage.completion_tokens == 8 and got.usage.prompt_tokens == 5 and got.choices[0].finish_reason == "length"


def test_streaming_equals_non_streaming_with_usage(client):
    kw = dict(model=NAME, prompt="The cat sat on", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []


def test_chat_streaming_and_not_n_and_logprobs(client):
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0.9, seed=7, n=3,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.content for c in r.choices}) > 1
    lp = r.choices[0].logprobs.content
    assert len(lp) == 6 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
    again = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0.9, seed=7, n=3,
                                           extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeded
    stream = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    greedy = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert "".join(d.content or "" for d in deltas) == greedy.choices[0].message.content


def _idle_engine_steps(server) -> int:
    """The engine's step count once nothing runs or waits (what earlier tests left has drained)."""
    deadline = time.monotonic() + 60
    while True:
        s = httpx.get(f"{server['url']}/status", headers=_headers(), timeout=30).json()
        if s["running"] == 0 and s["waiting"] == 0:
            return s["steps"]
        assert time.monotonic() < deadline, f"the engine never went idle: {s}"
        time.sleep(0.2)


@pytest.mark.parametrize("kind", ["n", "prompts"])
def test_one_requests_sequences_share_their_steps(server, client, kind):
    """n = 4 (or 4 prompts) enter the engine together (issue 10): the request takes exactly max_tokens
    steps — one step gives all four their first token — not one more step per choice, as when the
    choices were submitted one by one and TTFT grew with n."""
    before = _idle_engine_steps(server)
    kw = dict(model=NAME, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    r = (client.completions.create(prompt=[5, 77, 300], n=4, **kw) if kind == "n" else
         client.completions.create(prompt=[[5, 77], [300, 12, 9], [1], [42, 43]], **kw))
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and r.usage.completion_tokens == 20
    assert _idle_engine_steps(server) - before == 5


def test_stop_strings(client):
    kw = dict(model=NAME, prompt=[5, 77, 300], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 4
    stop = full[2:4]
    cut = client.completions.create(**kw, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_completion_logprobs(client):
    r = client.completions.create(model=NAME, prompt="Hi", max_tokens=4, logprobs=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs[0]) <= 3 and max(lp.top_logprobs[0].values()) >= lp.token_logprobs[0]


def test_sixteen_concurrent_streams_equal_their_solo_output(server):
    aclient = openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=120)
    prompts = [[(i * 37 + j) % 700 + 1 for j in range(3 + i * 3)] for i in range(16)]

    async def one(p, stream):
        kw = dict(model=NAME, prompt=p, max_tokens=6 + len(p) % 5, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            return (await aclient.completions.create(**kw)).choices[0].text
        return "".join([c.choices[0].text async for c in await aclient.completions.create(**kw, stream=True)])

    async def watch(done: asyncio.Event, seen: list):
        async with httpx.AsyncClient(headers=_headers(), timeout=30) as c:
            while not done.is_set():
                seen.append((await c.get(f"{server['url']}/status")).json()["streams"])
                await asyncio.sleep(0.05)

    async def run():
        solo = [await one(p, False) for p in prompts]
        done, seen = asyncio.Event(), []
        watcher = asyncio.create_task(watch(done, seen))
        together = await asyncio.gather(*(one(p, True) for p in prompts))
        done.set()
        await watcher
        return solo, together, seen

    solo, together, seen = asyncio.run(run())
    assert together == solo
    # one multiplexed engine stream carries every request of the (one) Ingress
    assert {s["subscriptions"] for s in seen} == {1}, seen
    assert max(s["requests"] for s in seen) > 1, seen


BAD = [  # (route, body, status, param)
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "x", "temperature": 7}, 400, "temperature"),
    ("completions", {"model": NAME, "prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"model": NAME, "prompt": "x", "bogus": 1}, 400, "bogus"),
    ("completions", {"model": NAME, "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "bot", "content": "x"}]}, 400, "messages"),
    ("chat/completions", {"model": NAME, "messages": [], "max_tokens": 2}, 400, "messages"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
]


def _headers(key=KEY):
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


@pytest.mark.parametrize("route,body,status,param", BAD)
def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server, client, route, body, status, param):
    r = httpx.post(f"{server['url']}/v1/{route}", headers=_headers(), content=json.dumps(body), timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=1).choices[0].text is not None


def test_malformed_json_oversized_body_and_missing_key(server):
    url = f"{server['url']}/v1/completions"
    r = httpx.post(url, headers=_headers(), content=b'{"model": "k2", "prompt": ', timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, headers=_headers(), content=json.dumps({"model": NAME, "prompt": "x" * 70000}), timeout=30)
    assert r.status_code == 413 and "error" in r.json()
    for path in ("/v1/models", "/metrics", "/v1/completions"):
        r = httpx.request("POST" if "completions" in path else "GET", server["url"] + path, timeout=30,
                          headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server['url']}/health", timeout=30).status_code == 200  # /health needs no key


def test_full_queue_gets_503_with_retry_after(server):
    """The engine thread is held while the flood arrives (so that the queue fills however fast this
    machine steps): past max_queue (20) waiting, a request is answered 503 at once; once the engine
    goes on, the queued ones are answered 200."""
    body = json.dumps({"model": NAME, "prompt": "x" * 40, "max_tokens": 60, "ignore_eos": True})
    aengine = server["app"].engine_server.aengine
    go = threading.Event()
    held = aengine.control(lambda engine: go.wait(60))  # the engine thread waits here, between steps

    async def flood():
        async with httpx.AsyncClient(timeout=120) as c:
            posts = [asyncio.ensure_future(c.post(f"{server['url']}/v1/completions", headers=_headers(), content=body))
                     for _ in range(48)]
            try:
                await asyncio.wait(posts, timeout=60, return_when=asyncio.FIRST_COMPLETED)  # a refusal came back
            finally:
                go.set()
            return await asyncio.gather(*posts)

    try:
        responses = asyncio.run(flood())
    finally:
        go.set()
    assert held.result(timeout=30) is True  # the engine was held, not timed out
    codes = [r.status_code for r in responses]
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}, codes
    busy = next(r for r in responses if r.status_code == 503)
    assert busy.headers["retry-after"] and busy.json()["error"]["type"] == "service_unavailable"


def _metrics(server) -> dict:
    text = httpx.get(f"{server['url']}/metrics", headers=_headers(), timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_metrics_series_move_with_traffic(server, client):
    before = _metrics(server)
    client.completions.create(model=NAME, prompt="metrics please", max_tokens=5, extra_body={"ignore_eos": True})
    after = _metrics(server)

    def total(m, name):
        return sum(v for _, v in m.get(name, []))

    for name in ("moeray:generation_tokens_total", "moeray:prompt_tokens_total", "moeray:engine_steps_total",
                 "moeray:expert_actor_tokens_total",
                 "moeray:time_to_first_token_seconds_count", "moeray:e2e_request_latency_seconds_count",
                 "moeray:moe_dispatch_latency_seconds_count", "moeray:moe_combine_latency_seconds_count"):
        assert total(after, name) > total(before, name), name
    for name in ("moeray:num_requests_running", "moeray:num_requests_waiting", "moeray:kv_cache_usage_perc",
                 "moeray:moe_load_imbalance", "moeray:epoch", "moeray:moe_hot_expert_tokens",
                 "moeray:epoch_pause_seconds_count"):
        assert name in after, name
    assert "moeray:expert_tokens_total" not in after  # the per-(layer, expert) counter is opt-in
    labels = {k for series in after.values() for lab, _ in series for k in lab}
    assert not labels & {"request_id", "seq_id", "id"}


def test_admin_experts_route_and_cli_dump_the_full_distribution(server, client):
    url = server["url"]
    assert httpx.get(f"{url}/admin/experts", timeout=30).status_code == 401
    assert httpx.get(f"{url}/admin/experts", headers=_headers(), timeout=30).status_code == 401  # an inference key
    before = httpx.get(f"{url}/admin/experts", headers=_headers(ADMIN), timeout=30).json()
    client.completions.create(model=NAME, prompt="route me", max_tokens=4, extra_body={"ignore_eos": True})
    d = httpx.get(f"{url}/admin/experts", headers=_headers(ADMIN), timeout=30).json()
    from model.config import load_config

    cfg = load_config(server["path"])
    assert d["model"] == NAME and d["num_experts"] == cfg.n_routed_experts
    assert len(d["tokens_total"]) == len(d["moe_layers"]) > 0
    assert all(len(row) == cfg.n_routed_experts for row in d["tokens_total"])
    moved = sum(map(sum, d["tokens_total"])) - sum(map(sum, before["tokens_total"]))
    assert moved > 0 and moved % cfg.num_experts_per_tok == 0  # top-k experts per token per layer
    exe = Path(sys.executable).parent / "moeray"
    out = subprocess.run([str(exe), "experts", "--json", "--url", url, "--admin-key", ADMIN], capture_output=True,
                         text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)
    assert cli["url"] == url and cli["moe_layers"] == d["moe_layers"]
    assert sum(map(sum, cli["tokens_total"])) >= sum(map(sum, d["tokens_total"]))
    table = subprocess.run([str(exe), "experts", "--url", url, "--admin-key", ADMIN], capture_output=True, text=True,
                           timeout=120, env=os.environ)
    assert table.returncode == 0 and "imbalance" in table.stdout, table.stderr
    bad = subprocess.run([str(exe), "experts", "--url", url], capture_output=True, text=True, timeout=120,
                         env=os.environ)
    assert bad.returncode == 2 and "--admin-key" in bad.stderr


# ---- `moeray bench serve` (issue 10) ------------------------------------------------------------
BENCH_LEVELS, BENCH_REQUESTS, BENCH_PROMPT, BENCH_MAX_TOKENS = (1, 4), 4, 8, 8


def _moeray(*args) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "moeray"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "300"})  # rich would wrap the table at 80 columns


def test_bench_serve_reports_sane_figures(server, tmp_path):
    url = server["url"]
    saved = tmp_path / "report.json"
    done = _moeray("bench", "serve", "--url", f"{url}/v1", "--api-key", KEY, "--concurrency", "1,4",
                   "--requests", str(BENCH_REQUESTS), "--prompt-len", str(BENCH_PROMPT), "--max-tokens",
                   str(BENCH_MAX_TOKENS), "--json", "--save", str(saved))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert json.loads(saved.read_text()) == report
    assert report["model"] == NAME  # the first id of GET /v1/models
    assert report["ignore_eos"] is True and report["notes"] == [] and report["counted_by"] == "usage"
    assert report["prompt"] == {"kind": "token_ids", "tokens": BENCH_PROMPT}
    assert [lv["concurrency"] for lv in report["levels"]] == list(BENCH_LEVELS)
    for lv in report["levels"]:
        assert (lv["requests"], lv["ok"], lv["errors"]) == (BENCH_REQUESTS, BENCH_REQUESTS, 0), lv["error_samples"]
        assert lv["tokens_received"] == lv["tokens_requested"] == BENCH_REQUESTS * BENCH_MAX_TOKENS
        assert lv["prompt_tokens_mean"] == BENCH_PROMPT  # the server counted the id prompts as sent
        assert lv["requests_per_s"] > 0 and lv["output_tokens_per_s"] > 0
        for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            s = lv[metric]
            assert 0 <= s["p50"] <= s["p90"] <= s["p99"], (metric, s)
        assert lv["ttft_ms"]["p99"] <= lv["e2e_ms"]["p99"]
    assert "concurrency 4: 4 requests" in done.stderr


def test_bench_serve_table_and_a_wrong_key(server):
    url = server["url"]
    done = _moeray("bench", "serve", "--url", url, "--api-key", KEY, "--concurrency", "2", "--requests", "2",
                   "--prompt-len", "4", "--max-tokens", "4")
    assert done.returncode == 0, done.stderr
    assert "TTFT" in done.stdout and "8 / 8" in done.stdout, done.stdout  # tokens received / requested
    bad = _moeray("bench", "serve", "--url", url, "--api-key", "wrong", "--concurrency", "1")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "check --api-key" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
