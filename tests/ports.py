"""The tests' one way to pick a TCP port to listen on later."""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default min/max_worker_port


def _ephemeral() -> range:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return range(lo, hi + 1)


def free_port(ip: str = "127.0.0.1") -> int:
    """A port free on ``ip`` now, outside the kernel's ephemeral range and Ray's worker ports: a test that starts
    Ray (whose processes bind ephemeral ports) and only then listens on the port cannot lose it to them (a CI
    run lost `moeray up`'s port so)."""
    ephemeral, rng = _ephemeral(), random.SystemRandom()
    candidates = [p for p in range(20000, 32768) if p not in ephemeral and p not in RAY_WORKER_PORTS]
    for _ in range(500):
        port = rng.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {ip} outside the ephemeral range")
