"""Shared Ray fixtures for cluster tests."""

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
