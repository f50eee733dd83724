"""`moeray down` against a foreground `moeray up` whose output goes to a file (issue 9, Must show 5):
it stops in well under 15 s, cleanly (exit 0, no abort), and leaves nothing listening."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_down_stops_a_foreground_up_quickly_and_cleanly(tmp_path):
    exe = str(Path(sys.executable).parent / "moeray")
    env = {**os.environ, "MOERAY_CACHE_DIR": str(tmp_path)}
    port = _free_port()
    with open(tmp_path / "up.out", "w") as out:
        up = subprocess.Popen([exe, "up", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env,
                              stdin=subprocess.DEVNULL)
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
    assert not (tmp_path / "up.json").exists()
