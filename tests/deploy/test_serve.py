"""The Serve app on a real cluster (2 attention replicas × 2 expert actors over real actors), over
real HTTP with the official `openai` client: what needs Ray and Serve. A greedy completion equals
`moeray generate` (the single process); a client going away under Serve — a stream, or a request
not streamed — frees its sequences (Serve's proxy cancels the handler, and the replica's engine
stream, opened under an earlier request, survives).

Everything else of the serving issue's HTTP semantics (Must show 1-4: streaming, chat, n > 1, stop
strings, logprobs, concurrency, bad inputs, the queue, /metrics, the API key, /admin/experts) and
`moeray bench serve` (issue 10) are tested on the same app in one process: test_serve_inproc.py."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from deploy.app import build_app
from deploy.config import ServeConfig
from model.presets import build_preset

KEY = "test-key-123"
ADMIN = "test-admin-key-456"
NAME = "k2"


@pytest.fixture(scope="module")
def server(serve_port, tmp_path_factory):
    path = build_preset("kimi-k2-tiny", tmp_path_factory.mktemp("serve") / "k2", seed=4, progress=False)
    port = serve_port
    cfg = ServeConfig(model=str(path), served_model_name=NAME, attention=2, experts=2, api_key=KEY,
                      admin_api_key=ADMIN, port=port,
                      max_queue=20, max_num_seqs=8, max_body_bytes=64 * 1024, max_tokens_per_step=64)
    serve.run(build_app(cfg.model_dump()), name="moeray-test", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "server never became healthy"
        time.sleep(0.5)
    yield {"url": url, "path": path, "port": port}
    serve.delete("moeray-test")


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0)


def _generate_cli(path, ids, n):
    exe = Path(sys.executable).parent / "moeray"
    out = subprocess.run([str(exe), "generate", "--model", str(path), "--prompt-ids", ",".join(map(str, ids)),
                          "--max-tokens", str(n), "--ignore-eos", "--json"], capture_output=True, text=True,
                         check=True, env=os.environ, timeout=300)
    return json.loads(out.stdout)


def test_greedy_completion_equals_moeray_generate(client, server):
    ids = [5, 77, 300, 12, 9]
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    ref = _generate_cli(server["path"], ids, 8)
    assert got.choices[0].text == ref["text"]
    assert got.usage.completion_tokens == 8 and got.usage.prompt_tokens == 5 and got.choices[0].finish_reason == "length"


def _headers(key=KEY):
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


GREEDY = {"model": NAME, "prompt": [5, 77, 300, 12, 9], "temperature": 0, "ignore_eos": True}


def test_disconnect_frees_the_sequence(server):
    """A stream whose client goes away under Serve (the proxy cancels the handler) frees its sequence; the
    replica's engine stream, opened under an earlier request, is not cancelled with it."""
    body = {"model": NAME, "prompt": "go", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server['url']}/v1/completions", headers=_headers(), json=body, timeout=60) as r:
        for _ in zip(range(3), r.iter_lines()):
            pass
    deadline = time.monotonic() + 20
    while True:  # the engine thread aborts the sequence and the replica's event loop drops its stream
        st = httpx.get(f"{server['url']}/status", headers=_headers(), timeout=30).json()  # apart: both must end
        if st["running"] == 0 and st["waiting"] == 0 and st["streams"]["requests"] == 0:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    assert all(a["cache_blocks_used"] == 0 for a in st["attention"])
    assert st["streams"] == {"subscriptions": 1, "requests": 0}, st


def _status(server) -> dict:
    return httpx.get(f"{server['url']}/status", headers=_headers(), timeout=30).json()


def _wait_idle(server, within_s: float) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        st = _status(server)
        if st["running"] == 0 and st["waiting"] == 0 and st["streams"]["requests"] == 0:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.1)


def test_served_non_streamed_request_freed_when_its_client_goes(server):
    """Under Serve, whose proxy cancels the handler of a client that went away (moved from
    test_api_gaps.py's own app; the Ingress's poll without Serve: test_api_gaps_inproc.py)."""
    _wait_idle(server, 60)
    before = _generated(server)
    payload = json.dumps({**GREEDY, "prompt": "go", "max_tokens": 4000}).encode()
    sock = socket.create_connection(("127.0.0.1", server["port"]), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(payload)).encode()
                 + b"\r\n\r\n" + payload)
    deadline = time.monotonic() + 60
    while _status(server)["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    time.sleep(0.5)
    sock.close()
    st = _wait_idle(server, 5)
    assert st["streams"]["subscriptions"] == 1, st  # the replica's engine stream outlives the request
    assert all(a["cache_blocks_used"] == 0 for a in st["attention"]), st
    generated = _generated(server) - before
    assert generated < 4000, generated  # cut short, not run to its max_tokens


def _generated(server) -> float:
    text = httpx.get(f"{server['url']}/metrics", headers=_headers(), timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "moeray:generation_tokens_total")
