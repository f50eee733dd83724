"""Who may call what, and the admin routes' request bodies.

:class:`Access` owns, for one Ingress replica, the inference keys (every route but /health, the
OpenAPI pages and /admin/*) and the admin key (/admin/*), resolved once when the replica starts.
Never: logs, returns or echoes a key, or compares keys in time that depends on their contents.
"""

from __future__ import annotations

import hmac
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from . import openai_api as oa
from .config import ServeConfig

ADMIN_OFF = ("the admin routes are off: this server has no admin key. Give it one with `moeray up --admin-key KEY`, "
             "admin_api_key or admin_api_key_file in the serving config, or MOERAY_ADMIN_KEY in the Ray nodes' "
             "environment (the `ray up` YAMLs and the KubeRay manifest in deploy/ set it from a secret); "
             "`moeray up` on a loopback address makes one by itself")


class ScaleRequest(BaseModel):
    """Body of POST /admin/scale/experts, /attention and /workers."""

    model_config = ConfigDict(extra="forbid")
    n: int = Field(..., ge=1, le=4096, description="The number of actors of that kind after the change.")
    engine: Literal["decode", "prefill"] = Field(
        "decode", description="Which engine of a prefill/decode deployment changes: the serving (decode) engine, "
                              "or the prefill engine (the serving config's disaggregation section).")


class ChaosRequest(BaseModel):
    """Body of POST /admin/chaos: which actor to kill."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["expert", "attention", "worker"]
    index: int = Field(..., ge=0, le=65535)


class RebalanceRequest(BaseModel):
    """Body of POST /admin/rebalance."""

    model_config = ConfigDict(extra="forbid")
    redundant_slots: int | None = Field(None, ge=0, le=65536,
                                        description="Spare physical slots per MoE layer for copies of hot "
                                                    "experts; default: the serving config's.")


class Access:
    """Who may call what, for one Ingress replica: the inference keys (every route but /health, the
    OpenAPI pages and /admin/*; none: open) and the admin key (/admin/*; none: those routes are
    off). Resolved once, when the replica starts. Keys are compared in constant time, every key
    each time. Never logs, returns or echoes a key."""

    def __init__(self, inference: list[str], admin: str | None):
        if admin is not None and admin in inference:
            raise ValueError("the admin key must differ from every inference key")
        self._inference = tuple(k.encode() for k in inference)
        self._admin = admin.encode() if admin is not None else None

    @classmethod
    def of(cls, serve_cfg: ServeConfig, env_admin_key: str | None) -> "Access":
        return cls(serve_cfg.inference_keys(), serve_cfg.admin_key(env_admin_key))

    @property
    def needs_key(self) -> bool:
        return bool(self._inference)

    def check(self, request: Request) -> None:
        """A route behind the inference keys: 401 without one of them."""
        if self._inference and not _matches(_bearer(request), self._inference):
            raise oa.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                              code="invalid_api_key")

    def check_admin(self, request: Request) -> None:
        """An /admin/* route: 403 while there is no admin key, 401 without it (an inference key is not it)."""
        if self._admin is None:
            raise oa.APIError(403, ADMIN_OFF, type="permission_error", code="admin_disabled")
        if not _matches(_bearer(request), (self._admin,)):
            raise oa.APIError(401, "missing or wrong admin key: the /admin routes need 'Authorization: Bearer "
                                   "<admin key>', which is not an API key", code="invalid_admin_key")


def _bearer(request: Request) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme in any case), else of an
    ``x-api-key`` header (Anthropic's clients send that), as bytes."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip().encode("latin-1")  # Starlette decodes latin-1
    key = request.headers.get("x-api-key")
    return key.strip().encode("latin-1") if key is not None else None


def _matches(token: bytes | None, keys: tuple[bytes, ...]) -> bool:
    # every key is compared (no early exit): the time does not say which key nearly matched
    return token is not None and sum(hmac.compare_digest(token, k) for k in keys) > 0
