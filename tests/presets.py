"""The tests' one preset builder: each preset checkpoint (name, seed, quantisation, dtype) is written once
per test process, into a temporary directory removed at exit, and shared by every module that asks for
it (each module keeps its own seed; equal ones share the files). Checkpoints are read, never written,
by the tests that use them."""

from __future__ import annotations

import atexit
import functools
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
    ``overrides`` (config field, value) pairs change its shape (fewer layers, fewer experts)."""
    tag = "".join(f"-{k}={v}" for k, v in overrides)
    out = _root() / f"{name}-{seed}-{quant}-{dtype}{tag}"
    return build_preset(name, out, seed=seed, quant=quant, dtype=dtype, progress=False,
                        overrides=dict(overrides) or None)
