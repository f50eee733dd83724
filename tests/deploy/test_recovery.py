"""Recovery through the real path when the cluster cannot recover (issue 9): the Serve app on the
session's local Ray nodes plus one node of its own, greedy SSE streams over HTTP, and a Ray node that
goes away with the only room for the app's expert actors. Every request ends with a clear error
(never a hang), new ones get 503 + Retry-After, and the app heals itself when the node returns.

A node that dies is known unreachable at once (its raylet refuses connections) but the GCS marks it
dead only seconds later: recovery must not place a replacement in the dead node's bundle (it would
wait the whole start timeout), nor plan a new reservation on it.

The faults the cluster recovers from — `moeray chaos kill-expert|kill-attention` while streams run (they
continue token for token), a SIGKILL of the engine's Serve replica — are in test_live.py, on its shared
apps; this app pins its actors to a node it adds and removes, so it has its own."""

import time

import httpx
from live import KEY, deploy, finish, oracle_soon, start_streams
from ray import serve

from deploy.server import healthy
from tests.presets import preset

AUTH = {"Authorization": f"Bearer {KEY}"}


def _prompts(n):
    return [[(i * 31 + j * 11) % 700 + 5 for j in range(3 + 4 * i)] for i in range(n)]



def _status(url):
    return httpx.get(f"{url}/status", headers=AUTH, timeout=30).json()


def test_no_capacity_answers_503_with_retry_after_and_heals_when_a_node_returns(serve_port, ray_cluster,
                                                                                tmp_path_factory):
    """Both expert actors pinned to one extra node; the node goes away, and nowhere else may hold
    them: open and queued requests end with an error, new ones get 503 + Retry-After, /health says
    why; the node comes back and the app serves again, by itself."""
    ip = "127.0.0.9"
    node = ray_cluster.add_node(ip, num_cpus=2)
    path = preset("kimi-k2-tiny", seed=13)
    try:
        expected = oracle_soon(path, _prompts(2), 30)
        url = deploy(serve_port, path, "cap", serve_on=0, attention=1, experts=2, expert_nodes=[ip],
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
        while not healthy(url):
            assert time.monotonic() < deadline, "the app did not heal when capacity came back"
            time.sleep(0.5)
        assert finish(start_streams(url, "cap", _prompts(2), 30)) == expected
        assert _status(url)["last_change"]["kind"] == "recovery"
    finally:
        serve.delete("cap")
        if node is not None:
            ray_cluster.remove_node(node)
