"""Shared Ray fixtures for cluster tests."""

import socket

import pytest
import ray

from cluster.local import LocalCluster


@pytest.fixture(scope="session")
def ray_cluster():
    """A 3-node Ray cluster on this machine (127.0.0.2-4, 4 logical CPUs each) with this process's
    driver connected. One per test session: starting it costs ~7 s. Tests must release what they
    reserve and kill the actors they create."""
    if ray.is_initialized():
        pytest.fail("ray_cluster: this process already has a Ray driver; ray.shutdown() it before using the fixture")
    with LocalCluster(nodes=3, num_cpus=4, object_store_mb=80, memory_mb=2048) as cluster:
        ray.init(address=cluster.address)
        try:
            yield cluster
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_cluster):
    """Ray Serve's HTTP proxy on a free loopback port, started once for the session (a second
    serve.start cannot move the proxy, and serve.shutdown() costs ~30 s each time). Modules deploy
    their apps under their own names and delete them; the cluster's shutdown ends Serve."""
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port
