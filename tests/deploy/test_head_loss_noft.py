"""Losing the Ray head node without GCS fault tolerance (issue 38, Must show 2): `moeray up --nodes 3` on this
machine, the head's `gcs_server` killed. Once the raylets give up (their reconnect timeout, short here), the
port answers 503 with a body that says the cluster lost its head node and what to do, never 500; `moeray
status` says the same; `moeray down` then leaves none of the processes `up` started and frees the port.
A module of its own: two clusters with Serve's HAProxy ingress cannot run on one machine at once, and
tests/deploy/test_head_loss.py keeps one up for the whole module."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from deploy import owned
from tests.deploy.headloss import MODEL, PROMPTS, Up, _cmdline, _complete
from tests.deploy.hostprocs import listening

pytestmark = pytest.mark.operator


def test_without_gcs_ft_the_lost_head_answers_503_and_down_cleans_up(tmp_path):
    up = Up(tmp_path, env={"RAY_gcs_rpc_server_reconnect_timeout_s": "8"})
    try:
        assert _complete(up.url, PROMPTS[3], 8)
        started = {tuple(r) for r in owned.alive(up.records())}
        [gcs] = up.find("gcs_server")
        os.kill(gcs, signal.SIGKILL)
        t_kill, served = time.monotonic(), 0
        deadline = t_kill + 120
        while True:
            assert up.proc.poll() is None, up.tail()
            assert time.monotonic() < deadline, f"no 503 within 120 s of the GCS kill\n{up.tail()}"
            try:
                r = httpx.post(f"{up.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                               timeout=30)
            except httpx.TransportError:
                time.sleep(0.5)
                continue
            assert r.status_code in (200, 503), (r.status_code, r.text)
            if r.status_code == 503:
                break
            served += 1  # the data plane goes on until the raylets give up
            time.sleep(0.5)
        print(f"no GCS FT: {served} requests served after the GCS kill, 503 after {time.monotonic() - t_kill:.1f} s")
        message = r.json()["error"]["message"]
        assert "lost its Ray cluster" in message and "moeray down" in message and "--gcs-redis" in message, message
        status = up.moeray("status")
        assert status.returncode != 0 and "lost its Ray cluster" in status.stderr, status
        down = up.down()
        assert down.returncode == 0, down.stderr
        assert not owned.alive([list(r) for r in started]), [(p, _cmdline(p)) for p, _ in owned.alive(list(started))]
        assert not listening("127.0.0.1", up.port)
    finally:
        up.close()
