"""Losing the Ray head node (issue 38): `moeray up --nodes 3` on this machine, the head's processes killed.

With GCS fault tolerance on a Redis the test starts: the GCS killed while 4 greedy streams run is started
again by `moeray up` on the same Redis, every stream equals its fault-free run, new requests and `moeray
scale` works afterwards; then the whole head node killed (GCS, raylet, agents, and every process
under them: Serve's controller, the head's HAProxy) is started again, and the app serves again; requests
and streams in flight go on: `moeray up`'s own listener (deploy/gate.py) relays to the ingress replica
past the head's proxy. Both layouts (disaggregated, colocated). Without GCS fault tolerance:
tests/deploy/test_head_loss_noft.py.

The processes are found in `moeray up`'s state file (the PIDs it records for `moeray down`), by PID and
start time; the test signals only those and the Redis and `moeray up` it started itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from deploy import owned
from tests.deploy.headloss import MODEL, PROMPTS, Up, _complete, _exe, _streams_through
from tests.deploy.hostprocs import listening
from tests.ports import free_port

pytestmark = pytest.mark.operator

@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    port = free_port()
    work = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(work)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not listening("127.0.0.1", port):
        assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.1)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


SHAPES = {"disaggregated": ("--experts", "2"), "colocated": ("--layout", "colocated", "--workers", "2")}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def ft_up(request, redis, tmp_path_factory):
    up = Up(tmp_path_factory.mktemp("ft"), "--gcs-redis", redis, shape=SHAPES[request.param])
    up.layout = request.param
    yield up
    up.close()


def _fault_free(up) -> list:
    """The 4 streams' texts without a fault: run once per `moeray up` (each test of it compares with them)."""
    if getattr(up, "fault_free", None) is None:
        up.fault_free = _streams_through(up)
    return up.fault_free


def test_gcs_killed_and_restarted_on_its_redis_streams_equal_the_fault_free_run(ft_up):
    up = ft_up
    shown = json.loads(up.moeray("status", "--json").stdout)
    nodes = {a["node"] for a in shown["attention"] + shown["experts"]}
    assert nodes and "127.0.0.2" not in nodes, nodes  # no engine actor on the head node
    expected = _fault_free(up)
    [gcs] = up.find("gcs_server")

    def kill_gcs():
        os.kill(gcs, signal.SIGKILL)

    t0 = time.monotonic()
    got = _streams_through(up, kill_gcs)
    assert got == expected
    # `moeray up` started the GCS again on the same Redis (a new process at the same port)
    deadline = time.monotonic() + 20
    while not [p for p in up.find("gcs_server") if p != gcs]:
        assert time.monotonic() < deadline, f"the GCS was not started again within 20 s\n{up.tail()}"
        time.sleep(0.2)
    assert "started it again on its Redis" in up.tail()
    print(f"GCS kill -> restarted and streams done in {time.monotonic() - t0:.1f} s")
    assert _complete(up.url, PROMPTS[0]) == expected[0]
    # The control plane works again: a scale (down: one expert actor stopped, its placement group
    # removed, the rest re-formed, all through the new GCS; a scale up would also start a worker process,
    # minutes under CI's load on 2 cores with or without a GCS restart, measured)
    kind = "workers" if up.layout == "colocated" else "experts"
    scaled = up.moeray("scale", kind, "1", "--json", timeout=400)
    assert scaled.returncode == 0, scaled.stderr
    status = json.loads(up.moeray("status", "--json").stdout)
    assert len(status[kind]) == 1, status
    assert _complete(up.url, PROMPTS[1]) == expected[1]


def test_whole_head_node_killed_and_restarted_app_serves_again(ft_up):
    up = ft_up
    expected = _fault_free(up)  # (from before the GCS test's faults and scale: outputs do not depend on either)
    raylets = up.find("raylet")
    head_gcs = up.find("gcs_server")
    assert len(raylets) == 3 and len(head_gcs) == 1, (raylets, head_gcs)
    # the head node's processes (GCS, raylet, agents) and everything below them (its workers, HAProxy)
    victims = owned.with_descendants([p for p, _ in owned.alive(up.records("head_pids"))])
    assert head_gcs[0] in victims and len([p for p in victims if _exe(p) == "raylet"]) == 1, victims
    outcomes, t_kill = [], []  # (seconds after the kill, "ok" | what failed, seconds it took)

    def kill_head():
        t_kill.append(time.monotonic())
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    got = _streams_through(up, kill_head)
    # the streams were relayed straight to the ingress replica on node 1 (deploy/gate.py): the head's loss
    # did not touch them
    assert got == expected
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        t = time.monotonic() - t_kill[0]
        try:
            r = httpx.post(f"{up.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                           timeout=150)
            outcome = "ok" if r.status_code == 200 else f"{r.status_code} {r.text[:80]}"
        except httpx.TransportError as e:
            outcome = f"connection error: {type(e).__name__}"
        outcomes.append((round(t, 1), outcome, round(time.monotonic() - t_kill[0] - t, 1)))
        if "the head node stopped; started it again" in up.tail() and outcome == "ok" and len(outcomes) >= 5:
            break
        time.sleep(0.2)
    assert "the head node stopped; started it again" in up.tail(), (outcomes, up.tail())
    # `moeray up` keeps the serving port (deploy/gate.py): nothing fails while the head is away and after
    assert all(o[1] == "ok" for o in outcomes), f"{outcomes}"
    assert _complete(up.url, PROMPTS[2]) == expected[2]  # the app serves as before the kill
    # and the control plane is back: a new GCS, and the proxy on the new head serves the app too
    assert len(up.find("gcs_server")) == 1 and up.find("gcs_server") != head_gcs
    deadline = time.monotonic() + 120
    while True:
        port = _proxy_port(up)
        try:
            if port and httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, up.tail()
        time.sleep(0.5)
    print(f"head kill: {len(outcomes)} requests after it, failed {[o for o in outcomes if o[1] != 'ok']}; "
          f"the longest took {max(o[2] for o in outcomes)} s")


def _proxy_port(up) -> int | None:
    """The port Serve's proxy (an HAProxy `moeray up` recorded) listens on behind `moeray up`'s own
    listener, or None while there is none."""
    for pid, _ in owned.alive(up.records()):
        if _exe(pid) == "haproxy":
            ports = [port for ip, port in owned.listening_addresses(pid) if ip == "127.0.0.1"]
            if ports:
                return ports[0]
    return None
