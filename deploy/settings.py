"""The one module that reads environment variables. Everything else receives values."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where presets are built and kept: $MOERAY_CACHE_DIR, else ~/.cache/moeray."""
    env = os.environ.get("MOERAY_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "moeray"
