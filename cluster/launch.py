"""Connecting this process to a Ray cluster for a run: an existing one (``address``) or K
throwaway nodes on this machine (:class:`LocalCluster`). Owns only what it started."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import ray

from .local import LocalCluster
from .spec import ClusterSpec


@contextlib.contextmanager
def connected(spec: ClusterSpec, *, nodes: int | None = None, address: str | None = None,
              env: dict[str, str] | None = None) -> Iterator[str]:
    """Yield the address of a cluster this driver is connected to; disconnect (and stop the
    nodes, if this started them) on exit. ``env`` reaches every process of nodes started here."""
    if address is not None and nodes is not None:
        raise ValueError("give --address (an existing cluster) or --nodes (start one here), not both")
    if address is not None:
        ray.init(address=address, logging_level="WARNING")
        try:
            yield address
        finally:
            ray.shutdown()
        return
    n = nodes or 1
    if n < 1:
        raise ValueError(f"--nodes must be >= 1, got {n}")
    per_node = max(2, math.ceil((spec.attention + spec.experts) / n) + 1)
    with LocalCluster(nodes=n, num_cpus=per_node, env=env) as cluster:
        ray.init(address=cluster.address, logging_level="WARNING")
        try:
            yield cluster.address
        finally:
            ray.shutdown()
