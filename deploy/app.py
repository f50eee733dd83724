"""The Ray Serve application: the one place that names ``serve.deployment`` and ``serve.ingress``.

:func:`build_app` wraps the plain :class:`~deploy.ingress.Ingress` and
:class:`~deploy.engine_server.EngineServer` for Serve (``serve deploy``, ``serve run
deploy.app:build_app``, ``moeray up``); deploy/inprocess.py serves the same two classes without
Ray. Never: holds serving logic — everything here is wiring.

The FastAPI app is made at import, here: Serve binds the routes to each replica's instance through
the route functions' signatures, which every process that imports this module sets alike.
"""

from __future__ import annotations

from ray import serve

from .config import ServeConfig
from .engine_server import EngineServer
from .ingress import Ingress
from .routes import make_api, specialize
from .settings import admin_key, serve_ingress

# A replica being removed (`moeray down`, a redeploy, a scale-in) checks every 0.5 s, not Serve's default 2 s,
# whether its requests have drained: an idle app goes away 1.5 s sooner per replica in the chain.
SERVE_OPTIONS = {"max_ongoing_requests": 4096, "graceful_shutdown_wait_loop_s": 0.5}

api, doc = make_api(lambda name: getattr(Ingress, name))


class _ServeEngine(EngineServer):
    """The engine server as a Serve replica: its placement groups are named after the application."""

    def __init__(self, raw: dict, model_path: str):
        super().__init__(raw, model_path, owner=f"moeray-{serve.get_replica_context().app_name}")


@serve.ingress(api)
class _ServeIngress(Ingress):
    """The Ingress as a Serve replica: the admin key from this node's environment (settings.py), and
    this replica's OpenAPI document narrowed to the model it serves."""

    def __init__(self, engine, raw: dict, model_path: str):
        super().__init__(engine, raw, model_path, admin_key=admin_key())
        specialize(doc, self.serve_cfg, model_path)
        if serve_ingress() == "haproxy":
            self.own_address = _direct_http_address


def _direct_http_address() -> tuple[str, int] | None:
    """This replica's own HTTP server under Serve's direct ingress: the one socket this process listens on in
    Serve's direct-ingress HTTP port range (Serve keeps the port to itself; `moeray up` relays to it while
    the head node is away, deploy/gate.py). None until it listens."""
    import os

    from ray.serve._private.constants import (RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT,
                                              RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT)

    from .owned import listening_addresses

    found = [(ip, port) for ip, port in listening_addresses(os.getpid())
             if RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT <= port <= RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT]
    return found[0] if len(found) == 1 else None


def build_app(args: dict):
    """``serve deploy`` / ``serve run deploy.app:build_app``: ``args`` are a :class:`ServeConfig` (Serve
    calls an application builder with that one argument)."""
    return pinned_app(args)


def pinned_app(args: dict, ray_actor_options: dict | None = None):
    """:func:`build_app` with both deployments' Ray options (``ray_actor_options``: an operator or a
    test pinning the app to a node; default: no CPUs, anywhere)."""
    from model.presets import resolve_model

    from .settings import cache_root

    serve_cfg = ServeConfig.parse(args or {})
    path = str(resolve_model(serve_cfg.model, cache_root()).resolve())
    raw = serve_cfg.model_dump()
    options = {"num_cpus": 0} if ray_actor_options is None else ray_actor_options
    engine = serve.deployment(name="EngineServer", ray_actor_options=options, health_check_period_s=2,
                              health_check_timeout_s=10, **SERVE_OPTIONS)(_ServeEngine)
    ingress = serve.deployment(name="Ingress", ray_actor_options=options, **SERVE_OPTIONS)(_ServeIngress)
    return ingress.bind(engine.bind(raw, path), raw, path)
