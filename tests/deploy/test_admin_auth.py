"""The quick start's `moeray scale` / `moeray chaos` on a real cluster, with neither --url nor a key: the
app and the admin token (mode 0600) come from the cache directory `moeray up` wrote them to. The
admin routes' access rules are tested in one process (test_admin_inproc.py); the real `moeray up`
writing and removing the token is in test_down.py.
"""

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from deploy.app import build_app
from deploy.config import ServeConfig
from deploy.server import admin_token_file, with_loopback_admin_token
from model.presets import build_preset

KEYS = ["client-one", "client-two"]  # two inference keys
NAME = "k2"

# ---- over HTTP, one engine --------------------------------------------------------------------------
def _wait_healthy(url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, f"{url} never became healthy"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def apps(serve_port, tmp_path_factory):
    """`adm`: the Serve app with the admin token `moeray up` makes on loopback, recorded as `moeray up`
    records its app (up.json in the cache directory)."""
    root = tmp_path_factory.mktemp("cache")
    path = build_preset("kimi-k2-tiny", tmp_path_factory.mktemp("adm") / "k2", seed=5, progress=False)
    cfg = ServeConfig(model=str(path), served_model_name=NAME, api_keys=KEYS, host="127.0.0.1", port=serve_port,
                      max_expert_actors=2, num_blocks=128, max_num_seqs=8, max_tokens_per_step=64)
    cfg = with_loopback_admin_token(cfg, root)
    assert cfg.admin_api_key is not None
    serve.run(build_app(cfg.model_dump()), name="adm", route_prefix="/adm")
    url = f"http://127.0.0.1:{serve_port}/adm"
    _wait_healthy(url)
    (root / "up.json").write_text(json.dumps({"pid": os.getpid(), "url": url, "model": NAME, "auth": True}))
    yield {"url": url, "root": root, "admin": cfg.admin_api_key}
    serve.delete("adm")


def _moeray(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`moeray ARGS` as after `moeray up`: its cache directory, no key given, none in the environment."""
    env = {k: v for k, v in os.environ.items() if k != "MOERAY_ADMIN_KEY"} | {"MOERAY_CACHE_DIR": str(root),
                                                                                "COLUMNS": "300"}
    return subprocess.run([str(Path(sys.executable).parent / "moeray"), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def _bearer(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_quick_start_scale_and_chaos_work_on_loopback_through_the_token_file(apps):
    """`moeray scale` and `moeray chaos` with neither --url nor a key, as in the README: the app and
    the token come from the cache directory `moeray up` wrote them to."""
    root, url = apps["root"], apps["url"]
    assert stat.S_IMODE(admin_token_file(root).stat().st_mode) == 0o600
    done = _moeray(root, "scale", "experts", "2")
    assert done.returncode == 0 and "1 attention × 1 expert actors → 1 attention × 2 expert actors" in done.stderr, \
        done.stderr
    done = _moeray(root, "chaos", "kill-expert", "1")
    assert done.returncode == 0 and "killed expert[1]" in done.stderr, done.stderr
    r = httpx.post(f"{url}/v1/completions", headers=_bearer(KEYS[0]), timeout=300,  # its step finds the dead actor
                   json={"model": NAME, "prompt": "after the kill", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    st = httpx.get(f"{url}/status", headers=_bearer(KEYS[0]), timeout=30).json()
    assert st["last_change"]["kind"] == "recovery" and len(st["experts"]) == 2, st["last_change"]
    done = _moeray(root, "experts", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["url"] == url, done.stderr
