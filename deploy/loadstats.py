"""The numbers of a load-generator run: per-request results, percentiles, one report per
concurrency level, and the table `moeray bench serve` prints.

Pure arithmetic and formatting over what :mod:`deploy.loadgen` measured: no HTTP, no clock, no
randomness. It never judges a figure (no pass/fail thresholds); it reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from rich.table import Table

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestResult:
    """One streamed request, made by :mod:`deploy.loadgen`, consumed by :func:`summarize`.

    Times are seconds from the moment the request was sent. ``chunk_gaps_s`` are the gaps
    between successive token-carrying SSE chunks (the inter-token latencies when each chunk
    carries one token). ``output_tokens`` comes from the server's ``usage`` when it reported one
    (``counted_by == "usage"``), else it is the number of token-carrying chunks. A failed request
    has ``ok`` False and an ``error`` that says why."""

    ok: bool
    e2e_s: float
    ttft_s: float | None = None
    chunk_gaps_s: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int | None = None
    counted_by: str = "chunks"
    error: str | None = None
    http_status: int | None = None  # the response's status; None when no response came
    error_param: str | None = None  # the request field an error response names, if it names one

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); None for no values. Monotone in q, so p50 <= p90 <= p99 always."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """{"p50", "p90", "p99", "mean"} in milliseconds of values given in seconds (None when empty)."""
    out: dict[str, float | None] = {f"p{q}": _ms(percentile(values_s, q)) for q in QUANTILES}
    out["mean"] = _ms(sum(values_s) / len(values_s)) if values_s else None
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass(frozen=True)
class LevelReport:
    """The figures of one concurrency level. Rates are per second of the level's wall time (first
    request sent to last response ended) and count only successful requests."""

    concurrency: int
    requests: int
    ok: int
    errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    tokens_requested: int
    tokens_received: int
    prompt_tokens_mean: float | None
    ttft_ms: dict
    itl_ms: dict
    tpot_ms: dict
    e2e_ms: dict
    counted_by: list[str]
    error_samples: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(concurrency: int, duration_s: float, results: Sequence[RequestResult], max_tokens: int) -> LevelReport:
    """Aggregate one level. ITL percentiles pool every chunk gap of every successful request;
    TTFT, TPOT and end-to-end latency take one value per successful request."""
    if duration_s <= 0:
        raise ValueError(f"a level's duration must be > 0 s, got {duration_s}")
    good = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    tokens = sum(r.output_tokens for r in good)
    prompts = [r.prompt_tokens for r in good if r.prompt_tokens is not None]
    samples = list(dict.fromkeys(r.error or "unknown error" for r in bad))[:5]  # distinct, in order
    return LevelReport(
        concurrency=concurrency, requests=len(results), ok=len(good), errors=len(bad),
        duration_s=round(duration_s, 6), requests_per_s=len(good) / duration_s,
        output_tokens_per_s=tokens / duration_s, tokens_requested=len(results) * max_tokens,
        tokens_received=tokens, prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
        ttft_ms=summary_ms([r.ttft_s for r in good if r.ttft_s is not None]),
        itl_ms=summary_ms([g for r in good for g in r.chunk_gaps_s]),
        tpot_ms=summary_ms([t for r in good if (t := r.tpot_s) is not None]),
        e2e_ms=summary_ms([r.e2e_s for r in good]),
        counted_by=sorted({r.counted_by for r in good}), error_samples=samples)


def _triple(s: dict) -> str:
    return " / ".join("-" if s[f"p{q}"] is None else f"{s[f'p{q}']:,.1f}" for q in QUANTILES)


def render_table(report: dict) -> Table:
    """The report (``BenchReport.to_dict()`` of :mod:`deploy.loadgen`) as a rich table."""
    prompt = report["prompt"]
    t = Table(title=f"{report['model']} at {report['url']}: {prompt['tokens']}-token prompts ({prompt['kind']}), "
                    f"max_tokens {report['max_tokens']}, ignore_eos {'on' if report['ignore_eos'] else 'off'}, "
                    f"tokens counted by {report['counted_by']}",
              caption="latencies in ms, p50 / p90 / p99", title_justify="left")
    for name in ("conc.", "ok / err", "req/s", "out tok/s", "TTFT", "ITL", "TPOT", "E2E", "tokens recv / req"):
        t.add_column(name, justify="right")
    for lv in report["levels"]:
        t.add_row(str(lv["concurrency"]), f"{lv['ok']} / {lv['errors']}", f"{lv['requests_per_s']:,.2f}",
                  f"{lv['output_tokens_per_s']:,.1f}", _triple(lv["ttft_ms"]), _triple(lv["itl_ms"]),
                  _triple(lv["tpot_ms"]), _triple(lv["e2e_ms"]),
                  f"{lv['tokens_received']:,} / {lv['tokens_requested']:,}")
    return t
