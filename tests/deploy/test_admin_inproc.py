"""Admin access (the admin-security issue), in one process (no Ray): the /admin routes need an admin
key of their own, never an inference key. Without one configured they answer 403 and say how to
enable them; with one, an inference key (or none) is a 401 and the admin key a 200; several
inference keys are each accepted; `moeray scale` beyond the serving config's maximum is a 400 naming
the key, before anything changes; the loopback token `moeray up` writes is private to its app.

Two in-process apps (tests/deploy/inproc.py) on one checkpoint: `on` with an admin key, `off` without.
The quick start's `moeray scale` / `moeray chaos` through the token file, on a real cluster, is in
test_live.py; the real `moeray up` writing and removing the token is in test_down.py.
"""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request

from deploy.access import Access
from deploy.config import ServeConfig
from deploy.openai_api import APIError
from deploy.server import _local_admin_token, admin_token_file, call_admin, with_loopback_admin_token
from inproc import preset, serve

KEYS = ["client-one", "client-two"]  # two inference keys
NAME = "k2"
ADMIN_ROUTES = [("GET", "/admin/experts", None), ("POST", "/admin/scale/experts", {"n": 2}),
                ("POST", "/admin/scale/attention", {"n": 1}), ("POST", "/admin/rebalance", {}),
                ("POST", "/admin/chaos", {"kind": "expert", "index": 0})]


def _request(authorization: str | None = None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers})


def _status_of(fn) -> tuple[int, dict] | None:
    try:
        fn()
    except APIError as e:
        return e.status, e.body()["error"]
    return None


# ---- without Ray ---------------------------------------------------------------------------------
def test_access_without_an_admin_key_is_403_whatever_is_sent():
    access = Access(KEYS, None)
    for header in (None, "Bearer client-one", "Bearer anything"):
        status, err = _status_of(lambda: access.check_admin(_request(header)))
        assert status == 403 and err["type"] == "permission_error" and err["code"] == "admin_disabled"
        assert "--admin-key" in err["message"] and "MOERAY_ADMIN_KEY" in err["message"]


def test_access_admin_key_is_not_an_inference_key_and_back():
    access = Access(KEYS, "the-admin")
    assert _status_of(lambda: access.check_admin(_request("Bearer the-admin"))) is None
    assert _status_of(lambda: access.check_admin(_request("bearer the-admin"))) is None  # the scheme in any case
    for header in (None, "Bearer client-one", "Bearer client-two", "Bearer the-admi", "Basic the-admin", "the-admin"):
        status, err = _status_of(lambda: access.check_admin(_request(header)))
        assert status == 401 and err["type"] == "authentication_error", header
    for key in KEYS:
        assert _status_of(lambda: access.check(_request(f"Bearer {key}"))) is None
    for header in (None, "Bearer the-admin", "Bearer client-three", "Bearer client-one extra"):
        status, err = _status_of(lambda: access.check(_request(header)))
        assert status == 401 and err["code"] == "invalid_api_key", header
    assert _status_of(lambda: Access([], None).check(_request(None))) is None  # no inference key: open
    with pytest.raises(ValueError, match="differ"):
        Access(["same"], "same")


def test_keys_from_the_config_files_and_the_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# one per client\nclient-one\n\n  client-two  \n")
    admin = tmp_path / "admin"
    admin.write_text("from-file\n")
    cfg = ServeConfig(api_key="k0", api_keys=["k1"], api_keys_file=str(keys), admin_api_key_file=str(admin))
    assert cfg.inference_keys() == ["k0", "k1", "client-one", "client-two"]
    assert cfg.admin_key(from_env="from-env") == "from-file"
    assert ServeConfig(admin_api_key="given").admin_key(from_env="from-env") == "given"
    assert ServeConfig().admin_key(from_env="from-env") == "from-env" and ServeConfig().admin_key() is None
    with pytest.raises(ValueError, match="api_keys_file .*cannot read"):
        ServeConfig(api_keys_file=str(tmp_path / "missing")).inference_keys()
    admin.write_text("two words\n")
    with pytest.raises(ValueError, match="admin_api_key_file") as e:
        ServeConfig(admin_api_key_file=str(admin)).admin_key()
    assert "two words" not in str(e.value)  # a key never appears in an error


@pytest.mark.parametrize("raw,needle", [
    ({"admin_api_key": "k", "api_keys": ["k"]}, "admin_api_key must differ"),
    ({"admin_api_key": "k", "admin_api_key_file": "/f"}, "not both"),
    ({"api_key": "has space"}, "api_key: a key must be"),
    ({"experts": 3, "max_expert_actors": 2}, "max_expert_actors"),
    ({"attention": 2, "max_attention": 1}, "max_attention"),
])
def test_config_refuses_contradictions(raw, needle):
    with pytest.raises(ValueError, match=needle):
        ServeConfig.parse(raw)


def test_loopback_token_is_private_and_only_on_loopback(tmp_path, monkeypatch):
    monkeypatch.delenv("MOERAY_ADMIN_KEY", raising=False)
    old = os.umask(0)  # even with nothing masked, the file is this user's only
    try:
        cfg = with_loopback_admin_token(ServeConfig(host="127.0.0.1"), tmp_path)
    finally:
        os.umask(old)
    token = admin_token_file(tmp_path)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert cfg.admin_api_key == token.read_text().strip() and len(cfg.admin_api_key) >= 32
    again = with_loopback_admin_token(ServeConfig(host="localhost"), tmp_path)
    assert again.admin_api_key != cfg.admin_api_key  # a new one each start
    for given in (ServeConfig(host="0.0.0.0"), ServeConfig(host="127.0.0.1", admin_api_key="mine")):
        out = with_loopback_admin_token(given, tmp_path)
        assert out.admin_api_key == given.admin_api_key and not token.exists()
    monkeypatch.setenv("MOERAY_ADMIN_KEY", "from-env")
    assert with_loopback_admin_token(ServeConfig(), tmp_path).admin_api_key is None and not token.exists()


def test_the_token_goes_only_to_the_app_moeray_up_started(tmp_path, monkeypatch):
    monkeypatch.delenv("MOERAY_ADMIN_KEY", raising=False)
    with_loopback_admin_token(ServeConfig(), tmp_path)
    token = admin_token_file(tmp_path).read_text().strip()
    (tmp_path / "up.json").write_text(json.dumps({"pid": os.getpid(), "url": "http://127.0.0.1:8000"}))
    assert _local_admin_token(tmp_path, "http://127.0.0.1:8000") == token
    assert _local_admin_token(tmp_path, "http://10.0.0.5:8000") is None
    sent = []
    monkeypatch.setattr(httpx, "request", lambda *a, headers, **kw: sent.append(headers) or httpx.Response(
        200, json={}))
    call_admin(tmp_path, "GET", "/admin/experts", url=None, admin_key_given=None)
    call_admin(tmp_path, "GET", "/admin/experts", url="http://10.0.0.5:8000", admin_key_given=None)
    assert sent == [{"Authorization": f"Bearer {token}"}, {}]


# ---- over HTTP, in this process ----------------------------------------------------------------
ADMIN = "the-admin-key-for-this-module"


@pytest.fixture(scope="module")
def apps():
    """`on`: the app with an admin key (and max_expert_actors 2); `off`: the same without one."""
    path = preset("kimi-k2-tiny", seed=5)
    settings = dict(served_model_name=NAME, api_keys=KEYS, max_expert_actors=2, num_blocks=128, max_num_seqs=8,
                    max_tokens_per_step=64)
    with serve(path, admin_api_key=ADMIN, **settings) as on, serve(path, **settings) as off:
        yield {"url": on.url, "off": off.url, "admin": ADMIN}


def _moeray(*args: str) -> subprocess.CompletedProcess:
    """`moeray ARGS` with no key given and none in the environment."""
    env = {k: v for k, v in os.environ.items() if k != "MOERAY_ADMIN_KEY"} | {"COLUMNS": "300"}
    return subprocess.run([str(Path(sys.executable).parent / "moeray"), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def _bearer(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_admin_routes_answer_403_without_an_admin_key(apps):
    url = apps["off"]
    for method, route, body in ADMIN_ROUTES:
        for key in (None, KEYS[0], apps["admin"]):
            r = httpx.request(method, f"{url}{route}", json=body, headers=_bearer(key), timeout=30)
            err = r.json()["error"]
            assert r.status_code == 403 and err["type"] == "permission_error", (route, r.text)
            assert "--admin-key" in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert httpx.get(f"{url}/v1/models", headers=_bearer(KEYS[1]), timeout=30).status_code == 200  # serves on
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    done = _moeray("scale", "experts", "2", "--url", url)
    assert done.returncode == 2 and "answered 403" in done.stderr and "--admin-key" in done.stderr, done.stderr


def test_admin_routes_answer_401_with_an_inference_key_and_200_with_the_admin_key(apps):
    url = apps["url"]
    for method, route, body in ADMIN_ROUTES:
        for key in (None, *KEYS, "wrong"):
            r = httpx.request(method, f"{url}{route}", json=body, headers=_bearer(key), timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (route, key, r.text)
    r = httpx.get(f"{url}/admin/experts", headers=_bearer(apps["admin"]), timeout=30)
    assert r.status_code == 200 and r.json()["model"] == NAME
    for key in KEYS:  # every inference key generates; the admin key does not
        r = httpx.post(f"{url}/v1/completions", headers=_bearer(key), timeout=60,
                       json={"model": NAME, "prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
    for key in (None, apps["admin"]):
        r = httpx.get(f"{url}/status", headers=_bearer(key), timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # open


def test_scale_over_the_configured_maximum_is_refused_before_anything_changes(apps):
    url, admin = apps["url"], _bearer(apps["admin"])
    before = httpx.get(f"{url}/status", headers=_bearer(KEYS[0]), timeout=30).json()
    r = httpx.post(f"{url}/admin/scale/experts", json={"n": 3}, headers=admin, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "max_expert_actors (2)" in r.json()["error"]["message"]
    done = _moeray("scale", "experts", "3", "--url", url, "--admin-key", apps["admin"])
    assert done.returncode == 2 and "max_expert_actors" in done.stderr, done.stderr
    r = httpx.post(f"{url}/admin/scale/attention", json={"n": 1, "engine": "prefill"}, headers=admin, timeout=30)
    assert r.status_code == 400 and "has no prefill engine" in r.json()["error"]["message"], r.text
    after = httpx.get(f"{url}/status", headers=_bearer(KEYS[0]), timeout=30).json()
    assert (after["epoch"], after["shape"]) == (before["epoch"], before["shape"])
