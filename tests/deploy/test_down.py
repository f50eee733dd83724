"""`moeray down` against a foreground `moeray up --ingress proxy` whose output goes to a file (issue 9,
Must show 5): it stops in well under 15 s, cleanly (exit 0, no abort), and leaves nothing listening.
The serving port is held by Serve's proxy actor, as ``--ingress`` chose (issue 10), /status says so, and
a streamed completion's first chunk reaches the client while its request is still running (nothing in
front buffers the stream). On loopback without an admin key, `moeray up` makes its admin token (mode
0600), the admin commands use it, and `down` removes it. The same for a detached `moeray up` with the
default ingress, HAProxy: the README's quick start (tests/test_readme.py)."""

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.hostprocs import port_holders
from tests.ports import free_port

pytestmark = pytest.mark.operator


def first_chunk_while_running(url: str, model: str = "kimi-k2-tiny") -> tuple[int, int]:
    """Stream a 48-token completion; at its first chunk ask /status how many sequences run. Returns
    (that count, the number of token chunks received in all)."""
    body = {"model": model, "prompt": "hello", "max_tokens": 48, "ignore_eos": True, "stream": True}
    running, chunks = None, 0
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += bool(json.loads(line[6:])["choices"])
            if running is None:
                running = c.get(f"{url}/status").json()["running"]
    return running, chunks


def test_down_stops_a_foreground_up_quickly_and_cleanly(tmp_path):
    ingress, holder = "proxy", "ray::ProxyActor"
    exe = str(Path(sys.executable).parent / "moeray")
    env = {**os.environ, "MOERAY_CACHE_DIR": str(tmp_path)}
    port = free_port()
    with open(tmp_path / "up.out", "w") as out:
        up = subprocess.Popen([exe, "up", "--model", "kimi-k2-tiny", "--port", str(port), "--ingress", ingress], stdout=out,
                              stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert up.poll() is None, (tmp_path / "up.out").read_text()[-2000:]
            assert time.monotonic() < deadline, "moeray up never became healthy"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}"
        holders = port_holders(port)
        assert holders and all(holder in cmd for cmd in holders), holders
        assert httpx.get(f"{url}/status", timeout=30).json()["ingress"] == ingress
        running, chunks = first_chunk_while_running(url)
        assert running == 1 and chunks == 48, (running, chunks)
        token = tmp_path / "admin_token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert httpx.get(f"{url}/admin/experts", timeout=30).status_code == 401  # the admin routes need it
        experts = subprocess.run([exe, "experts", "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert experts.returncode == 0 and json.loads(experts.stdout)["moe_layers"], experts.stderr
        t0 = time.monotonic()
        down = subprocess.run([exe, "down"], env=env, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        code = up.wait(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    log = (tmp_path / "up.out").read_text()
    assert down.returncode == 0 and "stopped moeray" in down.stderr, down.stderr
    assert took < 15, f"moeray down took {took:.1f}s"
    assert code == 0, f"moeray up exited with {code}: {log[-2000:]}"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # the port is free again
    assert not (tmp_path / "up.json").exists() and not (tmp_path / "admin_token").exists()
