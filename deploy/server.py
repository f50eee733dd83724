"""`moeray up` / `down` / `status`: run the Serve app on a Ray cluster and keep track of what was
started, so that `down` stops exactly that and nothing else.

The `up` process owns what it starts (the local Ray nodes when no cluster is given, the Serve
application) and records itself in a state file; `down` signals that process, which shuts
everything down in order. `--detach` re-runs `up` in the background and waits for /health.
Serving on a loopback address without an admin key, it also owns the admin token file (made at
start, removed at stop), which the `moeray` admin commands read to call the app it started.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from . import owned
from .config import ServeConfig
from .settings import admin_key, ingress_env

APP_NAME = "moeray"
NEEDS_API_KEY = "the server needs an API key: pass --api-key"
NEEDS_ADMIN_KEY = ("the admin routes need the server's admin key, which is not an API key: pass --admin-key KEY "
                   "or set MOERAY_ADMIN_KEY")


def state_file(root: Path) -> Path:
    return root / "up.json"


def admin_token_file(root: Path) -> Path:
    """The admin token `moeray up` makes for itself on a loopback address (mode 0600)."""
    return root / "admin_token"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or 0.0.0.0
        return False


def with_loopback_admin_token(serve_cfg: ServeConfig, root: Path) -> ServeConfig:
    """`moeray up`'s own admin key, when none is configured (serving config, key file,
    $MOERAY_ADMIN_KEY) and it serves on a loopback address: a new random token, written to
    :func:`admin_token_file` readable by this user only, and the config with it as admin_api_key.
    Otherwise the config as given, and no token file: elsewhere the admin routes stay off (403)
    until an operator gives a key."""
    token_file = admin_token_file(root)
    token_file.unlink(missing_ok=True)  # an earlier run's
    configured = serve_cfg.admin_api_key or serve_cfg.admin_api_key_file or admin_key()
    if configured or not is_loopback(serve_cfg.host):
        return serve_cfg
    token = secrets.token_urlsafe(32)
    _write_private(token_file, token + "\n")
    return ServeConfig.parse({**serve_cfg.model_dump(), "admin_api_key": token}, where="moeray up")


def _write_private(path: Path, text: str) -> None:
    """``path`` holding ``text``, mode 0600 from its creation on (never readable by others, whatever
    the umask), put in place atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _local_admin_token(root: Path, base: str) -> str | None:
    """The token `moeray up` wrote, if ``base`` is the app it started (never sent anywhere else)."""
    state = read_state(root)
    if state is None or state.get("url") != base:
        return None
    try:
        return admin_token_file(root).read_text().strip() or None
    except OSError:
        return None


def read_state(root: Path) -> dict | None:
    try:
        state = json.loads(state_file(root).read_text())
    except (OSError, ValueError):
        return None
    return state if _up_alive(state) else None


def _up_alive(state: dict) -> bool:
    """The `up` process of ``state`` runs (the same process: a PID reused since is not it)."""
    start = state.get("pid_start")
    return owned.running(state.get("pid")) and (start is None or owned.start_time(state["pid"]) in (start, None))


def ensure_not_running(root: Path, host: str | None = None, port: int | None = None) -> None:
    state = read_state(root)
    if state is not None:
        raise ValueError(f"moeray is already serving at {state['url']} (pid {state['pid']}); "
                         "stop it with `moeray down` first")
    try:
        left = owned.alive(json.loads(state_file(root).read_text()).get("pids", []))
    except (OSError, ValueError):
        left = []
    if left:
        raise ValueError(f"{len(left)} process(es) an earlier `moeray up` started still run (its cluster lost its "
                         f"head node, or it was killed): stop them with `moeray down` first")
    if host is not None and port is not None:
        import socket

        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex((host, port)) == 0:
                raise ValueError(f"something is already listening on {host}:{port}; choose another --port")


def healthy(url: str, timeout_s: float = 5.0) -> bool:
    """Whether the app at ``url`` answers its ``/health`` with 200 within ``timeout_s``."""
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(url: str, *, timeout_s: float, proc: subprocess.Popen | None = None,
               stop: threading.Event | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return
        if proc is not None and proc.poll() is not None:
            raise ValueError(f"the server exited during start-up (code {proc.returncode})")
        if healthy(url, 2):
            return
        time.sleep(0.5)
    raise ValueError(f"the server did not become healthy at {url} within {timeout_s:.0f}s")


def start_proxy(host: str, port: int) -> None:
    """Serve's HTTP proxy: one, on the head node, as deploy/serve_config.yaml has it (HeadOnly).

    Serve's default (EveryNode) runs a proxy on every node that holds a replica. On a one-machine
    cluster (Ray nodes on loopback aliases) those proxies all bind host:port: Serve's HAProxies cannot
    (their fixed metrics and stats ports, and the serving port, are taken by the first; measured), and
    its Python proxies do with SO_REUSEPORT, so the kernel hands each new connection to any of them; when
    a replica moves (a scale of the app, a replica that died and came back elsewhere) the old node's
    proxy drains and is killed, and the connections the kernel had just given it are cut before any
    response ("Server disconnected"). The engine is one replica anyway, so proxies on the workers would
    only add a hop."""
    from ray import serve

    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})


def serve_foreground(serve_cfg: ServeConfig, root: Path, *, nodes: int | None, address: str | None, status=None) -> None:
    """Start everything, print nothing but progress, block until SIGTERM/SIGINT, then stop it all."""
    import ray
    from ray import serve

    from cluster.launch import started

    from .gate import Gate
    from .headwatch import HeadWatch, LocalRedis

    ensure_not_running(root, serve_cfg.host, serve_cfg.port)
    ft = serve_cfg.gcs_fault_tolerance
    if ft is not None and address is not None:
        raise ValueError("gcs_fault_tolerance (--gcs-redis) is for the cluster `moeray up` starts; a cluster given "
                         "by --address is made fault tolerant where its head starts (RAY_REDIS_ADDRESS: "
                         "docs/operations.md)")
    stop = threading.Event()

    def on_signal() -> None:
        # Ours, and installed again once Ray is up: the local head node (LocalCluster) and ray.init()
        # each put their own SIGTERM handler in place, which would drain the node and exit from inside
        # the handler instead of the orderly stop below (app deleted, ray.shutdown, nodes stopped).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())

    on_signal()
    spec = serve_cfg.cluster_spec()
    url = f"http://{serve_cfg.host}:{serve_cfg.port}"
    root.mkdir(parents=True, exist_ok=True)
    serve_cfg = with_loopback_admin_token(serve_cfg, root)
    # recorded first, so that `moeray down` finds this process at every stage of its start-up
    auth = bool(serve_cfg.api_key or serve_cfg.api_keys or serve_cfg.api_keys_file)
    state = {"pid": os.getpid(), "pid_start": owned.start_time(os.getpid()), "url": url, "model": serve_cfg.model,
             "auth": auth, "pids": []}
    _write_state(root, state)
    redis = watch = None
    try:
        gcs_redis = None
        if ft is not None:
            from cluster.local import GcsRedis

            # a namespace of this run's own unless one is given: a Redis that another run's cluster used
            # (one killed before it could clean up) holds tables this cluster must not recover
            namespace = ft.namespace or f"moeray-{secrets.token_hex(6)}"
            if ft.redis_address == "local":
                _update(status, "starting a Redis for the GCS")
                redis = LocalRedis(root / "redis")
                state["pids"] = owned.record([redis.proc.pid])
                gcs_redis = GcsRedis(redis.address, "", namespace)
            else:
                gcs_redis = GcsRedis(ft.redis_address, ft.password(), namespace)
        _update(status, "starting Ray")
        with started(spec, nodes=nodes, address=address, env=ingress_env(serve_cfg.ingress),
                     gcs_redis=gcs_redis, actors=serve_cfg.actor_count()) as (gcs_address, cluster):
            on_signal()
            # On several nodes of its own this process keeps the serving port itself (deploy/gate.py) and Serve's
            # proxy listens on a port of its own behind it.
            gate = (Gate(serve_cfg.host, serve_cfg.port, _backend_port(serve_cfg.host))
                    if cluster is not None and cluster.nodes > 1 else None)
            watch = HeadWatch(cluster, host=serve_cfg.host, port=serve_cfg.port, gate=gate,
                              save=lambda pids, head: _write_state(root, {**state, "pids": pids, "head_pids": head}),
                              extra_pids=[redis.proc.pid] if redis else [])
            ray.init(address=gcs_address, logging_level="WARNING")
            on_signal()
            serve_started = False
            try:
                _update(status, "checking that the cluster can hold the model")
                load_s = preflight_serve_config(serve_cfg, root)  # refuse before anything is reserved
                _update(status, "building the model and the Serve application")
                app = _app(serve_cfg, cluster, pinned=cluster is not None and gcs_redis is not None)
                serve_started = True
                start_proxy(serve_cfg.host, gate.backend_port if gate else serve_cfg.port)
                _update(status, f"loading the model onto {spec.describe()}")
                if not stop.is_set():
                    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
                    wait_ready(url, timeout_s=load_s + 300, stop=stop)
                if stop.is_set():  # stopped while starting: no need to let go of the driver first
                    _delete_app()
                    return
                _update(status, None)
                _ready_message(url, serve_cfg, root)
            except BaseException:
                if serve_started:
                    _delete_app()
                ray.shutdown()
                raise
            # The driver goes (the Serve application lives on without it): a driver dies with the raylet
            # it is attached to, the head's, and this process must outlive the head node it watches.
            ray.shutdown()
            on_signal()  # ray.shutdown() puts back the handlers it found, which are not ours
            state["ready"] = True  # serving, with no driver left in this process (the head may go now)
            watch.record()
            while not stop.wait(0.5):
                restarts = sum(watch.restarts.values())
                watch.tick()
                if sum(watch.restarts.values()) != restarts:
                    on_signal()  # a new head node puts Ray's own SIGTERM handler in place
            if not watch.lost:
                ray.init(address=gcs_address, logging_level="WARNING")
                _delete_app()
    finally:
        # each step whatever the one before did: what `up` started must not outlive it
        for step in (lambda: watch is not None and watch.close(),
                     # what outlived its node (an old head's HAProxy), or the cluster
                     lambda: watch is not None and owned.stop(watch.records),
                     lambda: redis is not None and redis.stop()):
            try:
                step()
            except Exception as e:  # noqa: BLE001 — reported, and the next step still runs
                print(f"moeray up: while stopping: {e!r}", file=sys.stderr, flush=True)
        state_file(root).unlink(missing_ok=True)
        admin_token_file(root).unlink(missing_ok=True)


def _app(serve_cfg: ServeConfig, cluster, *, pinned: bool):
    """The Serve application; ``pinned`` (GCS fault tolerance on a cluster of several nodes started here):
    its two replicas on a worker node (node 1), so that they outlive the head node (the engine's actors
    too: the head gets no CPU for them, cluster/launch.py)."""
    from .app import build_app, pinned_app

    if not pinned or cluster is None or cluster.nodes < 2:
        return build_app(serve_cfg.model_dump())
    return pinned_app(serve_cfg.model_dump(), {"num_cpus": 0, "resources": {"moeray_node_1": 0.001}})


def _delete_app() -> None:
    """Delete our application (its replicas stop, and with them the engine's actors and placement groups)
    rather than serve.shutdown(): that waits 30 s on the controller's graceful_shutdown, which Ray retries
    after the controller kills itself, and on a cluster given by --address it would also take down other
    people's applications."""
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            serve.delete(APP_NAME)
        finally:
            ray.shutdown()


def _backend_port(host: str) -> int:
    """A free port for Serve's proxy behind the gate, below Linux's ephemeral range (from 32768): a port the
    kernel picked would be free again for the next process that asks it, and Ray's workers ask it often
    (measured: the proxy then failed to bind)."""
    import random
    import socket

    for port in random.sample(range(20000, 30000), 200):  # under Serve's direct-ingress ports (30000-31000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise ValueError(f"no free port for Serve's proxy on {host} in 20000-29999")


def _write_state(root: Path, state: dict) -> None:
    tmp = state_file(root).with_name(f".up.json.{os.getpid()}")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, state_file(root))


def preflight_serve_config(serve_cfg: ServeConfig, root: Path) -> float:
    """The engine's preflight (planner vs the connected cluster's resources), run by `moeray up`;
    returns the load timeout (the config's, or one scaled by the bytes to read)."""
    from cluster.preflight import preflight
    from cluster.startup import default_load_timeout_s
    from model.config import load_config
    from model.presets import resolve_model

    path = resolve_model(serve_cfg.model, root)
    model_cfg = load_config(path)
    preflight(model_cfg, serve_cfg.cluster_spec(), serve_cfg.dtype, serve_cfg.engine_config(str(path)))
    return serve_cfg.load_timeout_s or default_load_timeout_s(model_cfg, serve_cfg.attention)


def _update(status, text: str | None) -> None:
    if status is not None:
        if text is None:
            status.stop()
        else:
            status.update(text)


def _ready_message(url: str, serve_cfg: ServeConfig, root: Path) -> None:
    name = serve_cfg.served_model_name or serve_cfg.model
    auth = f" -H 'Authorization: Bearer {serve_cfg.api_key}'" if serve_cfg.api_key else ""
    print(f"moeray is serving {name} at {url}/v1", flush=True)
    print(f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'", flush=True)
    if admin_token_file(root).exists():
        print(f"  admin commands (moeray scale, rebalance, experts, chaos) use the token in {admin_token_file(root)}",
              flush=True)
    print("  stop it with: moeray down", flush=True)


def start_detached(argv: list[str], root: Path, host: str, port: int) -> dict:
    """Run `moeray up ARGS` in the background (its own session), wait until it is healthy."""
    ensure_not_running(root, host, port)
    url = f"http://{host}:{port}"
    root.mkdir(parents=True, exist_ok=True)
    log = root / "up.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", *argv], stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(url, timeout_s=600, proc=proc)
    except ValueError as e:
        if proc.poll() is None:
            proc.terminate()
        raise ValueError(f"{e}; see {log}") from None
    return {"pid": proc.pid, "log": str(log)}


def stop_running(root: Path, *, timeout_s: float = 180) -> dict | None:
    """Signal the `up` process recorded in the state file and wait for it to finish; then stop every
    process it had started that still runs (all of them, if `up` itself died: a cluster that lost its
    head node takes its driver with it, and leaves Serve's HAProxy and Ray's agents behind). The state
    (with ``"leftovers"``: the PIDs stopped here), or None when nothing was recorded."""
    try:
        state = json.loads(state_file(root).read_text())
    except (OSError, ValueError):
        return None
    pid = state.get("pid")
    if _up_alive(state):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while owned.running(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
            try:  # reap it if it is our child (detached runs are not)
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if owned.running(pid):
            os.kill(pid, signal.SIGKILL)
        try:  # what it recorded last (a head node it started again since this was read)
            state["pids"] = json.loads(state_file(root).read_text()).get("pids", state.get("pids", []))
        except (OSError, ValueError):
            pass
    elif not owned.alive(state.get("pids", [])):
        state_file(root).unlink(missing_ok=True)
        return None
    state["leftovers"] = owned.stop(state.get("pids", []))
    state_file(root).unlink(missing_ok=True)
    admin_token_file(root).unlink(missing_ok=True)
    return state


def find_app(root: Path, url: str | None) -> str:
    """The base URL of the running app: ``url`` if given, else the one `moeray up` recorded."""
    if url:
        return url.rstrip("/")
    state = read_state(root)
    if state is None:
        raise ValueError("no server started by `moeray up` is running; start one with `moeray up`, "
                         "or pass --url for a server started another way")
    return state["url"]


def call_app(root: Path, method: str, route: str, *, url: str | None, api_key: str | None,
             body: dict | None = None, timeout_s: float = 10) -> dict:
    """One request to the running app's ``route`` with an API key; its JSON, or a ValueError that
    says what to do."""
    base = find_app(root, url)
    return _request(base, method, route, api_key, body, timeout_s, NEEDS_API_KEY)


def call_admin(root: Path, method: str, route: str, *, url: str | None, admin_key_given: str | None,
               body: dict | None = None, timeout_s: float = 10) -> dict:
    """One request to an /admin route with the admin key: ``admin_key_given`` (--admin-key), else,
    for the app `moeray up` started, the token it wrote, else $MOERAY_ADMIN_KEY."""
    base = find_app(root, url)
    key = admin_key_given or _local_admin_token(root, base) or admin_key()
    return _request(base, method, route, key, body, timeout_s, NEEDS_ADMIN_KEY)


def _request(base: str, method: str, route: str, key: str | None, body: dict | None, timeout_s: float,
             on_401: str) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, f"{base}{route}", headers=headers, json=body, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ValueError(f"the server at {base} did not answer: {e}") from None
    if r.status_code == 401:
        raise ValueError(on_401)
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:300]
        raise ValueError(f"the server at {base} answered {r.status_code}: {message}")
    return {"url": base, **r.json()}


def fetch_status(root: Path, api_key: str | None, url: str | None = None) -> dict:
    return call_app(root, "GET", "/status", url=url, api_key=api_key)
