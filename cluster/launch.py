"""Connecting this process to a Ray cluster for a run: an existing one (``address``) or K
throwaway nodes on this machine (:class:`LocalCluster`). Owns only what it started."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import ray

from .local import GcsRedis, LocalCluster
from .spec import ClusterSpec


@contextlib.contextmanager
def connected(spec: ClusterSpec, *, nodes: int | None = None, address: str | None = None,
              env: dict[str, str] | None = None) -> Iterator[str]:
    """Yield the address of a cluster this driver is connected to; disconnect (and stop the
    nodes, if this started them) on exit. ``env`` reaches every process of nodes started here."""
    with started(spec, nodes=nodes, address=address, env=env) as (gcs_address, _):
        ray.init(address=gcs_address, logging_level="WARNING")
        try:
            yield gcs_address
        finally:
            ray.shutdown()


@contextlib.contextmanager
def started(spec: ClusterSpec, *, nodes: int | None = None, address: str | None = None,
            env: dict[str, str] | None = None,
            gcs_redis: GcsRedis | None = None,
            actors: int | None = None) -> Iterator[tuple[str, LocalCluster | None]]:
    """Yield (GCS address, the :class:`LocalCluster` started here or None for ``address``); stop the
    nodes started here on exit. Connects no driver. ``actors``: the actors the nodes must hold (default
    ``spec``'s; more with a prefill engine beside it)."""
    if address is not None and nodes is not None:
        raise ValueError("give --address (an existing cluster) or --nodes (start one here), not both")
    if address is not None:
        yield address, None
        return
    n = nodes or 1
    if n < 1:
        raise ValueError(f"--nodes must be >= 1, got {n}")
    # With a head node that can be started again, the actors go to the other nodes (the head gets no CPU for
    # them, as KubeRay's head holds no model actors), so that they outlive it.
    spare_head = gcs_redis is not None and n > 1
    actors = spec.attention + spec.experts if actors is None else actors
    per_node = max(2, math.ceil(actors / (n - spare_head)) + 1)
    with LocalCluster(nodes=n, num_cpus=per_node, env=env, gcs_redis=gcs_redis,
                      head_num_cpus=0 if spare_head else None) as cluster:
        yield cluster.address, cluster
