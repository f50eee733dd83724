"""Admin access (the admin-security issue): the /admin routes need an admin key of their own, never an
inference key. Without one configured they answer 403 and say how to enable them; with one, an
inference key (or none) is a 401 and the admin key a 200; several inference keys are each accepted;
`moeray scale` beyond the serving config's maximum is a 400 naming the key, before anything changes;
and the quick start's `moeray scale` / `moeray chaos` work on loopback through the token file that
`moeray up` writes, mode 0600.

The HTTP tests share one engine: the app `adm` (its engine, and an Ingress with the admin key
`moeray up` makes on loopback) and a second Ingress, `adm-off`, on the same engine with no admin key.
The rest runs without Ray. The real `moeray up` writing and removing the token is in test_down.py.
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
from starlette.requests import Request

from deploy.app import Access, Ingress, build_app
from deploy.config import ServeConfig
from deploy.openai_api import APIError
from deploy.server import _local_admin_token, admin_token_file, call_admin, with_loopback_admin_token
from model.presets import build_preset

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


# ---- over HTTP, one engine --------------------------------------------------------------------------
def _wait_healthy(url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, f"{url} never became healthy"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def apps(serve_port, tmp_path_factory):
    """`adm`: the Serve app with the admin token `moeray up` makes on loopback, recorded as `moeray up`
    records its app (up.json in the cache directory); `adm-off`: an Ingress on the same engine with
    no admin key."""
    root = tmp_path_factory.mktemp("cache")
    path = build_preset("kimi-k2-tiny", tmp_path_factory.mktemp("adm") / "k2", seed=5, progress=False)
    cfg = ServeConfig(model=str(path), served_model_name=NAME, api_keys=KEYS, host="127.0.0.1", port=serve_port,
                      max_expert_actors=2, num_blocks=128, max_num_seqs=8, max_tokens_per_step=64)
    cfg = with_loopback_admin_token(cfg, root)
    assert cfg.admin_api_key is not None
    serve.run(build_app(cfg.model_dump()), name="adm", route_prefix="/adm")
    url = f"http://127.0.0.1:{serve_port}/adm"
    _wait_healthy(url)
    off = cfg.model_dump() | {"admin_api_key": None}
    engine = serve.get_deployment_handle("EngineServer", app_name="adm")
    serve.run(Ingress.options(name="IngressOff").bind(engine, off, str(path)), name="adm-off", route_prefix="/adm-off")
    off_url = f"http://127.0.0.1:{serve_port}/adm-off"
    _wait_healthy(off_url)
    (root / "up.json").write_text(json.dumps({"pid": os.getpid(), "url": url, "model": NAME, "auth": True}))
    yield {"url": url, "off": off_url, "root": root, "admin": cfg.admin_api_key}
    serve.delete("adm-off")
    serve.delete("adm")


def _moeray(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`moeray ARGS` as after `moeray up`: its cache directory, no key given, none in the environment."""
    env = {k: v for k, v in os.environ.items() if k != "MOERAY_ADMIN_KEY"} | {"MOERAY_CACHE_DIR": str(root),
                                                                                "COLUMNS": "300"}
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
    done = _moeray(apps["root"], "scale", "experts", "2", "--url", url)
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
    done = _moeray(apps["root"], "scale", "experts", "3")
    assert done.returncode == 2 and "max_expert_actors" in done.stderr, done.stderr
    after = httpx.get(f"{url}/status", headers=_bearer(KEYS[0]), timeout=30).json()
    assert (after["epoch"], after["shape"]) == (before["epoch"], before["shape"])


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
