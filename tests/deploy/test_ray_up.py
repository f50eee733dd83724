"""The operator's path, for real (Must show 1 and 2 of the operations issue): `ray up
deploy/ray-cluster-local.yaml` against a private sshd on two loopback aliases, `serve deploy
deploy/serve_config.yaml` through `ray exec` as the YAML documents it, a completion through the head's
proxy with the expert actors on both nodes, a real Prometheus started from deploy/prometheus.yml
scraping the app and both nodes' Ray metrics ports (every dashboard query names a scraped series), and
`ray down` leaving no Ray process, sshd or port behind.

What is rewritten for the test, and why, is in rayup.py (addresses, ports, the throwaway login, the
install step); everything else runs as shipped. It needs root, openssh-server and rsync, which .ci/run
installs; when they are missing it fails — never skips. Tests run in file order; the last one is the
teardown under test. About 2 min on an idle 2-core machine, also beside the session's Ray cluster
(more when other work shares the cores). Each phase has its own limit, and a failure names the phase
and quotes the end of Ray's output; whatever happens, the fixture stops every process it started.
"""

import pwd
import socket
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from dashboards import dashboard, prom_query, prometheus, queries, runnable, series_names
from dashboards import wait_for as _wait
from hostprocs import listening
from rayup import ROOT, SHIPPED_HEAD_IP, SHIPPED_WORKER_IP, RayUpCluster, node_ips

from deploy.server import healthy

pytestmark = pytest.mark.operator

MODEL = "kimi-k2-tiny"  # the shipped serve config's model (a preset: built on the node that builds the app)


def _alive_nodes(c: RayUpCluster) -> int:
    """Alive Ray nodes, from the head's dashboard (Ray's state API; token auth is on)."""
    try:
        r = httpx.get(f"http://127.0.0.1:{c.dash_port}/api/v0/nodes", timeout=10,
                      headers={"Authorization": f"Bearer {(c.base / 'token').read_text()}"})
        nodes = r.json()["data"]["result"]["result"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(n["state"] == "ALIVE" for n in nodes)



def _ray_ok(c: RayUpCluster, what: str, out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, f"{what} exited with {out.returncode}; its output ends:\n{out.stdout[-4000:]}"


class _Phases:
    """Times each set-up phase; a failure inside one is re-raised naming it (and the ones before)."""

    def __init__(self) -> None:
        self.done: list[tuple[str, float]] = []

    def run(self, name: str, fn):
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as e:
            raise AssertionError(f"phase `{name}` failed after {time.monotonic() - t0:.0f}s "
                                 f"(done: {self}): {e}") from e
        self.done.append((name, time.monotonic() - t0))
        return out

    def __str__(self) -> str:
        return ", ".join(f"{n} {s:.0f}s" for n, s in self.done) or "none"


# Ray gives a starting raylet 30 s to register with the GCS (hard-coded in ray/_private/node.py). On an
# overloaded machine the head's or the worker's can miss it: `ray start` then fails with this, and the
# autoscaler leaves a worker "update-failed". Either way: one `ray up --restart-only` (the head's start
# commands begin with `ray stop`), as an operator would do; a second miss fails the test.
RAYLET_MISSED = "timed out during startup"


def _bring_up(c: RayUpCluster, phases: _Phases) -> None:
    serve_cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    serve_cfg["http_options"]["port"] = c.serve_port  # the only change: a free port
    phases.run("prepare (user, keys, sshd)", lambda: c.prepare(serve_cfg))
    up = ("up", "-y", "--no-config-cache", str(c.cluster_yaml))
    restart = (*up[:-1], "--restart-only", up[-1])
    first = phases.run("ray up", lambda: c.ray(*up, timeout=240))
    if first.returncode != 0 and RAYLET_MISSED in first.stdout:
        print(f"the head's raylet missed Ray's 30 s:\n{first.stdout[-2000:]}", file=sys.stderr)
        phases.run("ray up --restart-only (head)", lambda: _ray_ok(c, "ray up --restart-only", c.ray(*restart)))
    else:
        _ray_ok(c, f"ray up (after: {phases})", first)
    try:
        phases.run("worker joins", lambda: _wait("2 alive Ray nodes", lambda: _alive_nodes(c) == 2, 90, every_s=2))
    except AssertionError:
        print(f"the worker did not join in time; {c.autoscaler_log()}", file=sys.stderr)
        phases.run("ray up --restart-only (worker)", lambda: _ray_ok(c, "ray up --restart-only", c.ray(*restart)))
        phases.run("worker joins after the restart",
                   lambda: _wait("2 alive Ray nodes", lambda: _alive_nodes(c) == 2, 120, every_s=2))
    # as deploy/ray-cluster-local.yaml documents it (the dashboard port is the rewritten one)
    deploy = f"cd ~/moeray && serve deploy ~/serve_config.yaml -a http://127.0.0.1:{c.dash_port}"
    phases.run("serve deploy", lambda: _ray_ok(c, "serve deploy", c.exec_on_head(deploy, timeout=120)))
    c.url = f"http://{c.head_ip}:{c.serve_port}"
    phases.run("app healthy", lambda: _wait("the app's /health through the head's proxy", lambda: healthy(c.url), 180))


@pytest.fixture(scope="module")
def cluster():
    c = RayUpCluster()  # raises (the test errors, never skips) when sshd / rsync / root are missing
    phases = _Phases()
    try:
        _bring_up(c, phases)
        print(f"ray up cluster on {c.head_ip}/{c.worker_ip}: {phases}", file=sys.stderr)
        yield c
    finally:
        try:
            if not c.downed:
                c.ray("down", "-y", str(c.cluster_yaml), timeout=120)
        finally:
            c.close()  # by PID, even when `ray down` failed or timed out


# ---- the set-up's own guards (first: no cluster of this module is up yet) -------------------------------
@pytest.fixture
def stranger_on_port_22():
    """Something else on port 22 of the node addresses a run would pick — as the sshd of an earlier,
    killed run once was (the cause of `ray up` retrying ssh into it until the test's limit)."""
    pair = node_ips()
    socks = []
    try:
        for ip in pair:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ip, 22))
            s.listen()
            socks.append(s)
        yield pair
    finally:
        for s in socks:
            s.close()


def test_node_addresses_skip_a_port_22_held_by_another_process(stranger_on_port_22):
    assert not set(node_ips()) & set(stranger_on_port_22)


def test_sshd_that_cannot_bind_fails_setup_and_leaves_nothing(stranger_on_port_22):
    c = RayUpCluster()
    c.head_ip, c.worker_ip = stranger_on_port_22  # as if another run took them between the check and the bind
    try:
        with pytest.raises(RuntimeError, match="sshd did not start"):
            c.prepare({})
        sshd = c.sshd
    finally:
        c.close()
    assert sshd.poll() is not None and not c.base.exists() and not c.user_processes()
    with pytest.raises(KeyError):
        pwd.getpwnam(c.user)


def _complete(url: str, prompt: str, n: int = 4) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                   "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_serve_deploy_places_experts_on_both_nodes_and_serves_through_the_head_proxy(cluster):
    out = _complete(cluster.url, "The capital of France is", 6)
    assert out["model"] == MODEL and out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["text"]
    status = httpx.get(f"{cluster.url}/status", timeout=60).json()
    assert status["healthy"] and len(status["experts"]) == 2
    assert status["ingress"] == "haproxy"  # the YAML's `ray start` environment (deploy/settings.py)
    assert {e["node"] for e in status["experts"]} == {cluster.head_ip, cluster.worker_ip}, status["experts"]
    assert all(e["tokens"] > 0 for e in status["experts"]), status["experts"]


def test_the_admin_key_reaches_the_app_through_the_yamls_environment(cluster):
    """The shipped serve config names no admin key: the YAML's `ray start` puts the copied key file in
    MOERAY_ADMIN_KEY on every node, and the ingress reads it there (deploy/settings.py)."""
    url = f"{cluster.url}/admin/experts"
    assert httpx.get(url, timeout=60).status_code == 401
    r = httpx.get(url, headers={"Authorization": f"Bearer {cluster.admin_key}"}, timeout=60)
    assert r.status_code == 200 and r.json()["moe_layers"], r.text


# ---- Must show 2: a real Prometheus from deploy/prometheus.yml ---------------------------------------
def _prometheus_config(c: RayUpCluster) -> dict:
    """deploy/prometheus.yml with its targets' addresses and ports rewritten to this cluster's (and a
    short interval, so that the test takes seconds): nothing else changes."""
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    prom["global"]["scrape_interval"] = "2s"
    rewrite = {"127.0.0.1:8000": f"127.0.0.1:{c.serve_port}",
               f"{SHIPPED_HEAD_IP}:8080": f"{c.head_ip}:{c.metrics_head}",
               f"{SHIPPED_WORKER_IP}:8081": f"{c.worker_ip}:{c.metrics_worker}"}
    seen = set()
    for job in prom["scrape_configs"]:
        if "scrape_timeout" in job:
            job["scrape_timeout"] = "2s"
        for sc in job.get("static_configs", []):
            seen.update(sc["targets"])
            sc["targets"] = [rewrite[t] for t in sc["targets"]]
    assert seen == set(rewrite), f"deploy/prometheus.yml targets changed: {seen}"
    return prom


def _scraped_names(base: str) -> set[str]:
    return set(httpx.get(f"{base}/api/v1/label/__name__/values", timeout=10).json()["data"])


def test_prometheus_from_the_shipped_config_scrapes_the_app_and_ray(cluster, tmp_path):
    with prometheus(_prometheus_config(cluster), tmp_path) as base:  # stopped by its Popen handle on exit
        def targets_up():
            r = prom_query(base, "up")
            ups = {(x["metric"]["job"], x["metric"]["instance"]): x["value"][1]
                   for x in r.get("data", {}).get("result", [])}
            return len(ups) == 3 and all(v == "1" for v in ups.values()) and ups

        ups = _wait("3 targets up (app, head and worker Ray ports)", targets_up, 90)
        assert {job for job, _ in ups} == {"moeray", "ray"}
        wanted = {n for e in queries(dashboard()) for n in series_names(e)}
        # the KV tier's series exist only with kv_offloading_size set, not in the shipped config deployed here
        # (tests/deploy/test_kv_tier_inproc.py renders and reads them)
        wanted = {n for n in wanted if not n.startswith(("moeray:kv_tier_", "moeray:external_prefix_cache_"))}

        def all_scraped():
            _complete(cluster.url, "Prometheus scrapes this", 3)  # traffic: counters and histograms move
            httpx.get(f"{cluster.url}/v1/no-such-route", timeout=30)  # and an HTTP error for the error panel
            return wanted <= _scraped_names(base)

        try:
            _wait("every series the dashboard names", all_scraped, 120, every_s=3)
        except AssertionError:
            raise AssertionError(f"never scraped: {sorted(wanted - _scraped_names(base))}") from None
        # the expert plane, queried
        for expr in (f'moeray:moe_load_imbalance{{model_name="{MODEL}"}}',
                     f'moeray:expert_actor_tokens_total{{model_name="{MODEL}"}}',
                     f'moeray:moe_hot_expert_tokens{{model_name="{MODEL}", rank="1"}}'):
            result = prom_query(base, expr)["data"]["result"]
            assert result and all(float(x["value"][1]) > 0 for x in result if "actor_tokens" in expr), (expr, result)
        actors = prom_query(base, "moeray:expert_actor_tokens_total")["data"]["result"]
        assert {x["metric"]["actor"] for x in actors} == {"0", "1"}
        # the ray_* series come from the Ray metrics ports (job "ray"), not from the app
        for name in sorted(n for n in wanted if n.startswith("ray_")):
            jobs = {x["metric"]["job"] for x in prom_query(base, f"count by (job) ({name})")["data"]["result"]}
            assert jobs == {"ray"}, (name, jobs)
        # every dashboard query evaluates; those on Ray's series return data (their labels exist)
        for expr in queries(dashboard()):
            r = prom_query(base, runnable(expr))
            assert r["status"] == "success", (expr, r.get("error"))
        on_ray = [runnable(e) for e in queries(dashboard())
                  if any(n.startswith("ray_") for n in series_names(e)) and "histogram_quantile" not in e]

        def without_data() -> list[str]:  # a rate() needs two samples of a series, i.e. one more scrape
            return [e for e in on_ray if not prom_query(base, e)["data"]["result"]]

        try:
            _wait("data for every panel on Ray's series", lambda: not without_data(), 30, every_s=2)
        except AssertionError:
            raise AssertionError(f"no data for: {without_data()}") from None


# ---- Must show 1, last step: ray down -----------------------------------------------------------------
def test_ray_down_leaves_no_ray_process_sshd_or_port_behind(cluster):
    phases = _Phases()
    down = phases.run("ray down", lambda: cluster.ray("down", "-y", str(cluster.cluster_yaml), timeout=120))
    cluster.downed = True
    _ray_ok(cluster, "ray down", down)
    phases.run("Ray processes exit", lambda: _wait("no Ray process of the cluster's login",
                                                   lambda: not cluster.ray_processes(), 30))
    # the ssh connection masters Ray opened (ControlPersist=10s) close on their own
    phases.run("ssh masters exit", lambda: _wait("Ray's ssh connection masters to exit",
                                                 lambda: not cluster.ssh_masters(), 30))
    cluster.stop_sshd()
    phases.run("sshd sessions end", lambda: _wait("sshd's sessions to end", lambda: not cluster.user_processes(),
                                                  20, every_s=0.5))
    print(f"ray down: {phases}", file=sys.stderr)
    assert cluster.listening_ports() == [], cluster.listening_ports()
    assert not any(listening(ip, 22) for ip in (cluster.head_ip, cluster.worker_ip))
