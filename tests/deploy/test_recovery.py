"""Recovery through the real path (issue 9, Must show 1-4): the Serve app on 3 local Ray nodes,
greedy SSE streams over HTTP, and real faults — `moeray chaos kill-expert|kill-attention` (a
`ray.kill`), a SIGKILL of the engine's Serve replica, a Ray node that goes away with the only room
for its actors. Streams continue token for token where the cluster can recover; where it cannot,
every request ends with a clear error (never a hang) and the app heals itself.

A node that dies is known unreachable at once (its raylet refuses connections) but the GCS marks it
dead only seconds later: recovery must not place a replacement in the dead node's bundle (it would
wait the whole start timeout), nor plan a new reservation on it."""

import os
import signal
import time

import httpx
import pytest
import ray
from live import (ADMIN, CONSTRAINED, KEY, Stream, chat_reference, deploy, finish, moeray, oracle_soon, run_cli,
                  series, start_streams)
from ray import serve
from ray.util.placement_group import placement_group_table

from model.presets import build_preset

N_TOKENS = 80  # enough that every stream is still running when the kill lands (asserted below)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def port(serve_port):
    return serve_port


def _prompts(n):
    return [[(i * 31 + j * 11) % 700 + 5 for j in range(3 + 4 * i)] for i in range(n)]


def _failures(url, kind):
    return next(v for (name, labels), v in series(url).items()
                if name == "moeray:actor_failures_total" and dict(labels).get("kind") == kind)


def _healthy(url) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def _status(url):
    return httpx.get(f"{url}/status", headers=AUTH, timeout=30).json()


@pytest.mark.parametrize("preset,kills", [("kimi-k2-tiny", (("expert", 1), ("attention", 0))),
                                          ("kimi-k3-tiny", (("expert", 1),))])
def test_chaos_kills_while_6_streams_run(port, tmp_path_factory, preset, kills):
    """K2: kill-expert 1, then kill-attention 0; K3 (KDA state re-prefilled): kill-expert 1 (its
    attention kill is covered at the engine level, tests/cluster/test_engine.py)."""
    name = preset.split("-")[1]
    path = build_preset(preset, tmp_path_factory.mktemp(name) / name, seed=11, progress=False)
    prompts = _prompts(6)
    expected = oracle_soon(path, prompts, N_TOKENS)
    url = deploy(port, path, name, attention=2, experts=3)
    expected = expected.result()
    constrained = chat_reference(url, name, N_TOKENS, CONSTRAINED)  # a grammar-constrained greedy answer
    for kind, index in kills:
        before = _status(url)
        streams = start_streams(url, name, prompts, N_TOKENS, [Stream(url, name, None, N_TOKENS, CONSTRAINED) for _ in range(2)])
        out, killed_at = run_cli(url, "chaos", f"kill-{kind}", str(index))
        assert f"killed {kind}[{index}]" in out
        assert all(s.ended is None or s.ended > killed_at for s in streams), "a stream ended before the kill"
        # the constrained streams too (2: one per replica): a matcher is rebuilt from its tokens where it is
        # re-prefilled
        assert finish(streams) == [*expected, constrained, constrained], f"after killing {kind}[{index}]"
        assert all(len(s.pieces) == N_TOKENS for s in streams[:-2])  # nothing repeated or skipped
        assert all(s.finish == "length" for s in streams[-2:]) and constrained.startswith("[")
        assert httpx.get(f"{url}/health").status_code == 200
        after = _status(url)
        assert after["epoch"] == before["epoch"] + 1 and after["last_change"]["kind"] == "recovery"
        assert _failures(url, kind) == 1
    assert len(after["recoveries_s"]) == len(kills)
    bad = moeray("chaos", "kill-expert", "7", "--url", url, "--admin-key", ADMIN)
    assert bad.returncode == 2 and "there is no expert[7]" in bad.stderr
    serve.delete(name)


def _engine_pgs(app):
    return [v for v in placement_group_table().values()
            if v.get("name", "").startswith(f"moeray-{app}/") and v.get("state") != "REMOVED"]


def _alive(*classes):
    """The session cluster's alive actors of these classes (Ray's actor table records)."""
    return [a for a in ray._private.state.actors(actor_state_name="ALIVE").values() if a["ActorClassName"] in classes]


def _engine_actors():
    return sorted(a["ActorClassName"] for a in _alive("AttentionWorker", "ExpertWorker", "Router"))


def _proxy_ips():
    return sorted(a["Address"]["IPAddress"] for a in _alive("ProxyActor"))


def test_killed_engine_replica_ends_streams_with_an_error_and_the_app_heals(port, ray_cluster, tmp_path_factory):
    """The streams cut by the kill ask for 400 tokens (they are surely still running when it comes);
    the healed app's output is checked token for token on 40 (what it serves, not for how long).
    The replicas are on a worker node, and the one HTTP proxy stays on the head throughout: a proxy
    that followed the replica would be drained and killed with connections the kernel had given it
    (every proxy of a one-machine cluster binds the same port)."""
    path = build_preset("kimi-k2-tiny", tmp_path_factory.mktemp("eng") / "eng", seed=12, progress=False)
    expected = oracle_soon(path, _prompts(3), 40)
    url = deploy(port, path, "eng", serve_on=1, attention=1, experts=2)
    expected = expected.result()
    head = [ray_cluster.node_ips[0]]
    assert _proxy_ips() == head
    actors = _engine_actors()  # this app's, plus any other app's still on the session cluster
    assert len(_engine_pgs("eng")) == 1 and actors.count("ExpertWorker") >= 2
    pid = _status(url)["pid"]
    streams = start_streams(url, "eng", _prompts(3), 400)
    os.kill(pid, signal.SIGKILL)
    for s in streams:
        s.join(120)
        assert s.ended is not None, "a stream hung after its engine died"
        assert s.error_event is not None and s.error_event["code"] == "engine_failed", (s.error, s.pieces[-3:])
    deadline = time.monotonic() + 240
    while not _healthy(url):  # Serve starts a new replica by itself
        assert time.monotonic() < deadline, "the app did not heal by itself"
        time.sleep(0.25)
    assert _status(url)["pid"] != pid
    assert finish(start_streams(url, "eng", _prompts(3), 40)) == expected
    assert _proxy_ips() == head
    assert len(_engine_pgs("eng")) == 1  # the dead replica's reservation did not stay behind
    assert _engine_actors() == actors  # the dead replica's actors are gone, the new one's are there
    serve.delete("eng")


def test_no_capacity_answers_503_with_retry_after_and_heals_when_a_node_returns(port, ray_cluster,
                                                                                tmp_path_factory):
    """Both expert actors pinned to one extra node; the node goes away, and nowhere else may hold
    them: open and queued requests end with an error, new ones get 503 + Retry-After, /health says
    why; the node comes back and the app serves again, by itself."""
    ip = "127.0.0.9"
    node = ray_cluster.add_node(ip, num_cpus=2)
    path = build_preset("kimi-k2-tiny", tmp_path_factory.mktemp("cap") / "cap", seed=13, progress=False)
    try:
        expected = oracle_soon(path, _prompts(2), 30)
        url = deploy(port, path, "cap", serve_on=0, attention=1, experts=2, expert_nodes=[ip],
                     attention_nodes=[ray_cluster.node_ips[0]])
        expected = expected.result()
        streams = start_streams(url, "cap", _prompts(2), 2000)
        ray_cluster.remove_node(node)
        node = None
        for s in streams:
            s.join(120)
            assert s.ended is not None and s.error_event is not None, "a stream hung without capacity"
            assert "no node has room" in s.error_event["message"]
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503 and "no node has room" in health.json()["error"]
        body = {"model": "cap", "prompt": "Hello", "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert "no node has room" in r.json()["error"]["message"]
        node = ray_cluster.add_node(ip, num_cpus=2)  # capacity is back
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert time.monotonic() < deadline, "the app did not heal when capacity came back"
            time.sleep(0.5)
        assert finish(start_streams(url, "cap", _prompts(2), 30)) == expected
        assert _status(url)["last_change"]["kind"] == "recovery"
    finally:
        serve.delete("cap")
        if node is not None:
            ray_cluster.remove_node(node)
