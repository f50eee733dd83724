"""The harness of the head-loss tests and bench/bench_head_loss.py: a foreground `moeray up --nodes 3` of
its own (cache directory, port), the processes it recorded, greedy completions and streams."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from deploy import owned
from tests.ports import free_port

EXE = str(Path(sys.executable).parent / "moeray")
MODEL = "kimi-k2-tiny"
STREAMS = 4
TOKENS = 96


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _exe(pid: int) -> str:
    return Path(_cmdline(pid).split(" ", 1)[0]).name


class Up:
    """A foreground `moeray up --nodes 3` of this test's own (its cache directory, its port)."""

    def __init__(self, tmp: Path, *extra: str, env: dict[str, str] | None = None,
                 shape: tuple[str, ...] = ("--experts", "2")) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp, self.port = tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "MOERAY_CACHE_DIR": str(tmp), **(env or {})}
        self.log = tmp / "up.out"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([EXE, "up", "--model", MODEL, "--nodes", "3", *shape, "--port", str(self.port), *extra],
                                         stdout=out, stderr=subprocess.STDOUT, env=self.env, stdin=subprocess.DEVNULL)
        self.wait_healthy(300)

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.tail()
            assert time.monotonic() < deadline, f"moeray up not healthy within {timeout_s} s\n{self.tail()}"
            try:
                # healthy, and `up` has let go of its Ray driver (which would die with the head's raylet)
                if (httpx.get(f"{self.url}/health", timeout=5).status_code == 200
                        and json.loads((self.tmp / "up.json").read_text()).get("ready")):
                    return
            except (httpx.HTTPError, OSError, ValueError):
                pass
            time.sleep(0.5)

    def records(self, key: str = "pids") -> list[list[int]]:
        """What `moeray up` recorded: every process it started (``pids``), those of the head node (``head_pids``)."""
        return json.loads((self.tmp / "up.json").read_text())[key]

    def find(self, name: str) -> list[int]:
        """PIDs of recorded processes that run the executable ``name`` (gcs_server, raylet)."""
        return [pid for pid, _ in owned.alive(self.records()) if _exe(pid) == name]

    def moeray(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([EXE, *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def down(self) -> subprocess.CompletedProcess:
        done = self.moeray("down")
        self.proc.wait(timeout=60)
        return done

    def close(self) -> None:
        if self.proc.poll() is None:
            self.moeray("down")
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _complete(url: str, prompt: str, tokens: int = TOKENS) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == tokens
    return choice["text"]


def _stream(url: str, prompt: str, started) -> tuple[str, float]:
    """A streamed greedy completion's text (every one of its TOKENS tokens) and when its last token came;
    ``started`` is set at its first chunk."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage, last = "", None, 0.0
    with httpx.Client(timeout=180) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if any(choice["text"] for choice in chunk["choices"]):
                    text += "".join(choice["text"] for choice in chunk["choices"])
                    last = time.monotonic()
                usage = chunk.get("usage") or usage
                started.set()
    assert usage and usage["completion_tokens"] == TOKENS, usage
    return text, last


PROMPTS = [f"Stream {i}: the head node of a cluster" for i in range(STREAMS)]


def _streams_through(up: Up, fault=None, *, cut_ok: bool = False) -> list[str | None]:
    """The 4 streams' texts, ``fault()`` (if any) called once every one of them has its first token: each
    stream that ends must have had tokens after it (it outlived the fault). ``cut_ok``: a stream cut by
    a connection error is None instead of raising."""
    starts = [threading.Event() for _ in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(_stream, up.url, p, s) for p, s in zip(PROMPTS, starts)]
        for s in starts:
            assert s.wait(120), "a stream never started"
        faulted = time.monotonic()
        if fault is not None:
            fault()
        out = []
        for f in futures:
            try:
                text, last = f.result(timeout=300)
            except httpx.TransportError:
                if not cut_ok:
                    raise
                out.append(None)
                continue
            assert fault is None or last > faulted, "a stream ended before the fault: it tested nothing"
            out.append(text)
        return out
