"""A running Serve app on the test session's Ray cluster, driven as a user would: SSE streams over
HTTP in threads, the `moeray` command in a subprocess, /metrics parsed. Shared by the live-scaling
and recovery tests."""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from deploy.app import pinned_app
from deploy.config import ServeConfig
from deploy.server import wait_ready
from model.loader import load_model
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

KEY = "live-key"  # the inference key
ADMIN = "live-admin-key"  # the /admin routes' key (moeray scale, rebalance, chaos)


def serve_config(port, path, name, **settings) -> ServeConfig:
    """The tests' serving config: the inference key KEY, the admin key ADMIN (``admin_api_key=None``
    for none, as `moeray up` on loopback then makes its own), and ``settings`` (the shape, ...)."""
    return ServeConfig(**{"model": str(path), "served_model_name": name, "api_key": KEY, "admin_api_key": ADMIN,
                          "port": port, "num_blocks": 512, "max_num_seqs": 16, "max_tokens_per_step": 128,
                          **settings})


def deploy(port, path, name, *, serve_on=None, **shape):
    """serve_on: the index of the node the Serve replicas go to (moeray_node_<i>; 0 is the head), as
    an operator would pin them; otherwise Serve places them (build_app as `serve deploy` does)."""
    return deploy_config(serve_config(port, path, name, **shape), serve_on=serve_on)


def deploy_config(cfg: ServeConfig, *, serve_on=None) -> str:
    """The app of ``cfg`` under its served model name (also its route prefix), once healthy: its URL."""
    name = cfg.served_model_name
    where = None if serve_on is None else {"num_cpus": 0, "resources": {f"moeray_node_{serve_on}": 0.001}}
    app = pinned_app(cfg.model_dump(), where)
    serve.run(app, name=name, route_prefix=f"/{name}")
    url = f"http://127.0.0.1:{cfg.port}/{name}"
    wait_ready(url, timeout_s=180)
    return url


def moeray(*args) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "moeray"
    env = {**os.environ, "COLUMNS": "300"}  # rich would wrap the report at 80 columns
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=600)


def oracle(path, prompts, n):
    runner = ModelRunner(load_model(path, progress=False), num_blocks=1100, block_size=16, num_slots=16)
    seqs = generate(runner, prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    tok = Tokenizer.from_dir(path)
    return [tok.decode(s.output_ids, skip_special_tokens=True) for s in seqs]  # as the server decodes by default


def oracle_soon(path, prompts, n) -> Future:
    """oracle() in a thread of this process, started before deploy() so that the single-process run
    overlaps the app's start (mostly other processes starting); .result() gives the texts."""
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(oracle, path, prompts, n)
    pool.shutdown(wait=False)
    return future


# a grammar that cannot end within a test's stream (at least 200 numbers): a constrained stream runs
# as long as a plain one, and greedy, it must come out the same through any fault or change
CONSTRAINED = {"response_format": {"type": "json_schema", "json_schema": {"name": "numbers", "schema": {
    "type": "array", "minItems": 200, "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}}


def chat_body(name, n, chat: dict) -> dict:
    return {"model": name, "messages": [{"role": "user", "content": "Count."}], "max_tokens": n, "temperature": 0,
            **chat}


def chat_reference(url, name, n, chat: dict) -> str:
    """The content of the same chat request, not streamed (run before a fault: the fault-free answer)."""
    r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(name, n, chat), timeout=600,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


class Stream(threading.Thread):
    """One SSE completion stream: its text pieces, an error event if one came, and when it ended.
    With ``chat`` (extra body fields), a chat completion of ``n`` tokens whose content deltas are the
    pieces."""

    def __init__(self, url, name, prompt, n, chat: dict | None = None):
        super().__init__(daemon=True)
        self.url, self.name, self.prompt, self.n, self.chat = url, name, prompt, n, chat
        self.pieces, self.error, self.finish, self.ended, self.error_event = [], None, None, None, None
        self.stop = threading.Event()  # set: the client goes away (see close_after)

    def run(self):
        route = "/v1/chat/completions" if self.chat is not None else "/v1/completions"
        body = {"model": self.name, "prompt": self.prompt, "max_tokens": self.n, "temperature": 0,
                "ignore_eos": True}
        if self.chat is not None:
            body = chat_body(self.name, self.n, self.chat)
        body["stream"] = True
        try:
            with httpx.stream("POST", f"{self.url}{route}", json=body, timeout=600,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if self.stop.is_set():
                        break
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error_event = event["error"]
                            continue
                        choice = event["choices"][0]
                        if self.chat is None:
                            self.pieces.append(choice["text"])
                        elif choice["delta"].get("content"):
                            self.pieces.append(choice["delta"]["content"])
                        self.finish = choice["finish_reason"] or self.finish
        except Exception as e:  # noqa: BLE001 — reported by the test
            self.error = e
        self.ended = time.monotonic()


def start_streams(url, name, prompts, n, extra=()):
    """Start one stream per prompt, and the ``extra`` streams after them; returns once every one
    has its first token."""
    streams = [Stream(url, name, p, n) for p in prompts] + list(extra)
    for s in streams:
        s.start()
    deadline = time.monotonic() + 120
    while not all(s.pieces for s in streams):  # every stream is running before the change
        assert time.monotonic() < deadline and not any(s.error for s in streams), [s.error for s in streams]
        time.sleep(0.05)
    return streams


def close_after(streams, more: int, timeout_s: float = 120) -> None:
    """Let every stream take ``more`` pieces beyond what it has now, then close them all (each client
    goes away, as a client that has read enough does): a test of outputs through changes needs the
    tokens up to just past its last change, not a stream length guessed to outlast them. A stream that
    reaches its own end first (its max_tokens) ends as usual."""
    marks = [len(s.pieces) for s in streams]
    deadline = time.monotonic() + timeout_s
    while not all(len(s.pieces) >= m + more or s.ended for s, m in zip(streams, marks)):
        assert time.monotonic() < deadline, f"the streams did not take {more} more pieces in {timeout_s} s"
        time.sleep(0.05)
    assert all(s.finish for s in streams if s.ended), [(len(s.pieces), s.finish) for s in streams]
    for s in streams:
        s.stop.set()
    for s in streams:
        s.join(60)
    assert not any(s.error for s in streams), [repr(s.error) for s in streams]
    assert not any(s.error_event for s in streams), [s.error_event for s in streams]


def finish(streams):
    for s in streams:
        s.join(600)
    assert not any(s.error for s in streams), [repr(s.error) for s in streams]
    assert not any(s.error_event for s in streams), [s.error_event for s in streams]
    return ["".join(s.pieces) for s in streams]


def run_cli(url, *args, admin=ADMIN):
    """`moeray ARGS --url URL --admin-key ADMIN` (an admin command; ``admin``: the app's admin key when
    it is another): its stderr (the report) and when it returned."""
    done = moeray(*args, "--url", url, "--admin-key", admin)
    assert done.returncode == 0, done.stderr
    return done.stderr, time.monotonic()


def metrics(url) -> dict:
    """Sample name → value (label sets dropped: use for series with one label set per app)."""
    return {name: v for (name, _), v in series(url).items()}


def series(url) -> dict:
    """(sample name, frozenset of its labels) → value, from the app's /metrics."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}
