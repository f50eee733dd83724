"""Liveness probes of Ray nodes, each about one node: is the node of a bundle alive in the GCS, and
does its raylet accept a connection? (The GCS marks a node dead only seconds after it stopped
answering; a refused connection tells at once.) Used by the fleet and the step transport.
"""

from __future__ import annotations

import socket

import ray

from .members import Home


def node_of(home: Home) -> str | None:
    try:
        return home.reservation.node_of(home.kind, home.index)
    except (KeyError, IndexError):  # the bundle is not placed (its node is gone)
        return None


def node_reachable(home: Home) -> bool:
    """The node of ``home``'s bundle is alive in the GCS and its raylet accepts a connection (only
    that node's raylet is probed). The GCS marks a node dead only seconds after it stopped
    answering; a refused connection tells at once."""
    node_id = node_of(home)
    if node_id is None:
        return False
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    return node is not None and node["Alive"] and raylet_answers(node)


def raylet_answers(node: dict, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s):
            return True
    except OSError:
        return False


def unreachable_nodes() -> frozenset[str]:
    """Nodes the GCS still lists alive whose raylet does not answer (asked only when a replacement
    needs a fresh bundle, to keep it off those nodes)."""
    return frozenset(n["NodeID"] for n in ray.nodes() if n["Alive"] and not raylet_answers(n))
