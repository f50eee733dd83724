"""Reading the actors' load progress (published by :mod:`actors.progress`) while an engine starts."""

from __future__ import annotations

import json

from actors.progress import KEY_PREFIX


def load_progress(placement_group: str | None = None) -> dict[str, dict[str, int]]:
    """Actor name → {"bytes_read", "bytes_total"} for the actors of ``placement_group`` (hex id), or
    of every placement group that is still alive when None; empty in a process without Ray (the
    in-process app), which has no actors to load."""
    try:
        import ray
    except ImportError:
        return {}
    if not ray.is_initialized():
        return {}
    from ray.experimental import internal_kv
    from ray.util.placement_group import placement_group_table

    alive = {pg for pg, info in placement_group_table().items() if info.get("state") != "REMOVED"}
    prefix = KEY_PREFIX if placement_group is None else f"{KEY_PREFIX}{placement_group}/"
    out = {}
    for key in internal_kv._internal_kv_list(prefix):
        key = key.decode() if isinstance(key, bytes) else key
        pg, _, actor = key[len(KEY_PREFIX):].partition("/")
        if pg not in alive:
            continue
        value = internal_kv._internal_kv_get(key)
        if value is not None:
            out[actor] = json.loads(value)
    return out


def still_loading(progress: dict[str, dict[str, int]]) -> bool:
    return any(p["bytes_read"] < p["bytes_total"] for p in progress.values())
