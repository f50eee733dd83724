"""What the simulator serves and suffers: requests (a Poisson process, or a JSONL trace) and actor
failures (a Poisson process over the shape's actors).

Owns: the seeded draws. Never: simulates anything.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .stepcost import Shape


# ---- workload ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def poisson_workload(rate: float, num_requests: int, prompt_tokens: int | tuple[int, int],
                     output_tokens: int | tuple[int, int], seed: int = 0) -> list[SimRequest]:
    """Poisson arrivals at ``rate`` requests/s (``rate`` ≤ 0: all at once); lengths fixed or
    uniform in [lo, hi]."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)

    def draw(x):
        return x if isinstance(x, int) else rng.randint(*x)

    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(SimRequest(t, draw(prompt_tokens), draw(output_tokens)))
        if rate > 0:
            t += rng.expovariate(rate)
    return out


def trace_workload(path: str | Path) -> list[SimRequest]:
    """A trace file: one JSON object per line with ``arrival_s``, ``prompt_tokens``, ``output_tokens``."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(SimRequest(float(d["arrival_s"]), int(d["prompt_tokens"]), int(d["output_tokens"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: need a JSON object with arrival_s, prompt_tokens, output_tokens ({e})")
    if not out:
        raise ValueError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival_s)


@dataclass(frozen=True)
class Failure:
    at_s: float
    kind: str  # "attention" or "expert"
    index: int
    actors: int = 1  # actors lost at once (a node's)


def poisson_failures(per_hour: float, duration_s: float, shape: "Shape", seed: int = 0) -> tuple[Failure, ...]:
    """Actors lost at random over ``duration_s``: a Poisson process of ``per_hour`` failures, each
    of an actor drawn uniformly from the shape's (attention or expert, by their share)."""
    if per_hour < 0:
        raise ValueError(f"failures per hour must be >= 0, got {per_hour}")
    rng = random.Random(seed)
    out, t = [], 0.0
    while per_hour > 0:
        t += rng.expovariate(per_hour / 3600)
        if t >= duration_s:
            break
        i = rng.randrange(shape.attention + shape.experts)
        out.append(Failure(t, "attention", i) if i < shape.attention else
                   Failure(t, "expert", i - shape.attention))
    return tuple(out)
