"""The tests' one preset builder: each preset checkpoint (name, seed, quantisation, dtype) is written once
per test process, into a temporary directory removed at exit, and shared by every module that asks for
it (each module keeps its own seed; equal ones share the files). Checkpoints are read, never written,
by the tests that use them."""

from __future__ import annotations

import atexit
import functools
import hashlib
import shutil
import tempfile
from pathlib import Path

from model.presets import build_preset

_ROOT: Path | None = None


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="moeray-presets-"))
        atexit.register(shutil.rmtree, _ROOT, True)
    return _ROOT


@functools.lru_cache(maxsize=None)
def preset(name: str, *, seed: int = 0, quant: str | None = None, dtype: str = "bfloat16",
           overrides: tuple[tuple[str, object], ...] = ()) -> Path:
    """Preset ``name`` written as a checkpoint (seeded weights; the trained preset's own), once per process;
    ``overrides`` (config field, value) pairs change its shape (fewer layers, fewer experts); a value that
    is itself pairs is a nested mapping (hashable, as the cache needs)."""
    tag = f"-{hashlib.sha1(repr(overrides).encode()).hexdigest()[:10]}" if overrides else ""
    out = _root() / f"{name}-{seed}-{quant}-{dtype}{tag}"
    return build_preset(name, out, seed=seed, quant=quant, dtype=dtype, progress=False,
                        overrides={k: _mapping(v) for k, v in overrides} or None)


def _mapping(value):
    """A nested override as the config takes it: pairs → a dict (their values likewise), a tuple → a list."""
    if isinstance(value, tuple) and value and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                                  for p in value):
        return {k: _mapping(v) for k, v in value}
    return list(value) if isinstance(value, tuple) else value  # a JSON list, as config.json holds it
