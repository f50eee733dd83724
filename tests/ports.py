"""The tests' one way to pick a TCP port to listen on later: the way `moeray up` picks Serve's proxy port
(deploy/server.py ``_backend_port``): free now, below the kernel's ephemeral range and Ray's, so that a test
that starts Ray (whose processes bind ephemeral ports) and only then listens on it cannot lose it to them (a CI
run lost `moeray up`'s port so)."""

from __future__ import annotations

from deploy.server import _backend_port


def free_port(ip: str = "127.0.0.1") -> int:
    return _backend_port(ip)
