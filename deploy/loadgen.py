"""An OpenAI-API load generator (`moeray bench serve`, `bench/bench_serve.py`): streaming
``/v1/completions`` at fixed concurrency levels against any OpenAI-compatible server (ours, vLLM,
llama.cpp's server), timing every request's first token, each later chunk and its end.

It owns the client side of a run: choosing the model, negotiating the request shape with one
probe, sending the requests and reading their SSE streams. It never starts or stops a server and
never judges a figure; :mod:`deploy.loadstats` aggregates and formats.

What it relies on, per server:
- Prompts are token-id lists of exactly ``prompt_len`` ids (OpenAI's completions API accepts a
  list of ids as ``prompt``), seeded and distinct per request so no prefix cache can share them.
  A server that refuses id prompts gets text of about ``prompt_len`` words instead (the report says
  so, with the prompt length the server counted when it reports usage).
- ``ignore_eos: true`` (vLLM's and our extension) so every request runs to ``max_tokens``; a server
  that answers 400 naming the field is retried without it, and the report says so.
- Output tokens: the ``usage`` the server sends with ``stream_options: {"include_usage": true}``;
  without it (refused or absent), the number of token-carrying chunks, which undercounts on a
  server that puts several tokens in one chunk. A token-carrying chunk is one with a choice whose
  text is non-empty or that is not the last (a final chunk with only a finish reason is not a token).
- ITL is the gap between successive token-carrying chunks; TPOT is (e2e - TTFT) / (tokens - 1).
- One probe request before the levels (not counted) finds what the server accepts and warms
  it up.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx

from .loadstats import LevelReport, RequestResult, summarize

# Common English words, one token each in most BPE vocabularies, for the text fallback.
WORDS = ("the of and to in is was for on with as by at from that this are be it an or not have had his "
         "her they which one you were all we can their has been more when will would there who what so "
         "some time up out about into only other new then than them these two may first any like now "
         "my such over most also after made many did before must through back years where much your way "
         "well down should because each just those people how too little state good very make world still "
         "own see men work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three").split()


def parse_concurrency(text: str) -> tuple[int, ...]:
    """``"1,8,16"`` → (1, 8, 16); each level a positive integer."""
    try:
        levels = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated positive integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must be comma-separated positive integers, got {text!r}")
    return levels


def parse_token_range(text: str) -> tuple[int, int]:
    """``"100:700"`` → (100, 700)."""
    lo, sep, hi = text.strip().partition(":")
    if not (sep and lo.isdigit() and hi.isdigit()):
        raise ValueError(f"--token-range must be LO:HI (non-negative integers), got {text!r}")
    return int(lo), int(hi)


def normalize_url(url: str) -> str:
    """The server's base URL, without a trailing ``/`` or ``/v1``."""
    base = url.strip().rstrip("/")
    try:
        parsed = httpx.URL(base)
    except httpx.InvalidURL as e:
        raise ValueError(f"--url {url!r} is not a valid URL: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host or any(c.isspace() for c in base):
        raise ValueError(f"--url must be an http:// or https:// URL with a host, got {url!r}")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ValueError(f"--url {url!r}: the port must be 1..65535")
    return base.removesuffix("/v1")


@dataclass(frozen=True)
class LoadSpec:
    """What to run, from the command line. ``requests`` is per level (None: 4 × its concurrency)."""

    url: str
    concurrency: tuple[int, ...] = (1, 8, 16, 32)
    prompt_len: int = 128
    max_tokens: int = 128
    requests: int | None = None
    model: str | None = None
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 300.0
    # Ordinary (non-special) ids in every vocabulary we know, our presets' 1,024 included.
    token_range: tuple[int, int] = (100, 700)
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "url", normalize_url(self.url))
        for name, value in (("--prompt-len", self.prompt_len), ("--max-tokens", self.max_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency levels must be >= 1, got {self.concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"--temperature must be in [0, 2], got {self.temperature}")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise ValueError(f"--token-range must be LO:HI with 0 <= LO < HI, got {lo}:{hi}")

    def requests_at(self, concurrency: int) -> int:
        return self.requests if self.requests is not None else 4 * concurrency


@dataclass(frozen=True)
class RequestShape:
    """What the server accepted in the probe: id or text prompts, ignore_eos, usage in the stream."""

    prompt_kind: str = "token_ids"
    ignore_eos: bool = True
    include_usage: bool = True
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class BenchReport:
    """A whole run, made by :func:`run_bench`; ``to_dict()`` is the JSON `moeray bench serve` prints."""

    url: str
    model: str
    shape: RequestShape
    spec: LoadSpec
    levels: tuple[LevelReport, ...] = ()

    @property
    def errors(self) -> int:
        return sum(lv.errors for lv in self.levels)

    def to_dict(self) -> dict:
        counted = sorted({c for lv in self.levels for c in lv.counted_by}) or ["chunks"]
        return {"url": self.url, "model": self.model,
                "prompt": {"kind": self.shape.prompt_kind, "tokens": self.spec.prompt_len},
                "max_tokens": self.spec.max_tokens, "temperature": self.spec.temperature,
                "ignore_eos": self.shape.ignore_eos, "counted_by": "+".join(counted),
                "notes": list(self.shape.notes), "levels": [lv.to_dict() for lv in self.levels]}


def make_prompt(spec: LoadSpec, kind: str, index: int) -> list[int] | str:
    """Request ``index``'s prompt: ``prompt_len`` seeded token ids, or as many words."""
    rng = random.Random(spec.seed * 1_000_003 + index)
    if kind == "token_ids":
        lo, hi = spec.token_range
        return [rng.randrange(lo, hi) for _ in range(spec.prompt_len)]
    return " ".join(rng.choice(WORDS) for _ in range(spec.prompt_len))


def request_body(spec: LoadSpec, shape: RequestShape, model: str, prompt, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": spec.temperature,
            "stream": True}
    if shape.ignore_eos:
        body["ignore_eos"] = True
    if shape.include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


class StreamTally:
    """One request's SSE stream as it arrives: feed it lines with their arrival time (seconds
    since the request was sent); it ends on ``data: [DONE]``."""

    def __init__(self):
        self.token_times: list[float] = []
        self.usage_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return  # blank separators, comments, `event:` lines
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(payload)
        except ValueError:
            self.error = f"the stream sent a line that is not JSON: {payload[:120]!r}"
            return
        if not isinstance(event, dict):
            self.error = f"the stream sent a JSON {type(event).__name__}, not an object"
        elif event.get("error"):
            self.error = f"error event in the stream: {_message(event['error'])}"
        else:
            self._tally(event, now)

    def _tally(self, event: dict, now: float) -> None:
        if isinstance(event.get("usage"), dict):  # the last one wins (vLLM may send one per chunk)
            self.usage_tokens = event["usage"].get("completion_tokens", self.usage_tokens)
            self.prompt_tokens = event["usage"].get("prompt_tokens", self.prompt_tokens)
        for choice in event.get("choices") or []:
            if choice.get("text") or choice.get("finish_reason") is None:
                self.token_times.append(now)
                break  # one prompt, n=1: one choice per chunk

    def result(self, e2e_s: float) -> RequestResult:
        if self.error is None and not self.done:
            self.error = "the stream ended without data: [DONE]"
        if self.error is not None:
            return RequestResult(ok=False, e2e_s=e2e_s, error=self.error)
        times = self.token_times
        counted_by = "usage" if self.usage_tokens is not None else "chunks"
        return RequestResult(ok=True, e2e_s=e2e_s, ttft_s=times[0] if times else None,
                             chunk_gaps_s=tuple(b - a for a, b in zip(times, times[1:])),
                             output_tokens=self.usage_tokens if self.usage_tokens is not None else len(times),
                             prompt_tokens=self.prompt_tokens, counted_by=counted_by)


def _message(error) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error)[:300]


def _error_of(r: httpx.Response) -> tuple[str, str | None]:
    """An error response's message and, when it says, the request field at fault (OpenAI's
    ``{"error": {"message", "param"}}``; vLLM's older top-level ``message``; anything else as text)."""
    try:
        obj = r.json()
    except ValueError:
        return r.text[:300], None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return _message(err), err.get("param") if isinstance(err.get("param"), str) else None
    if isinstance(obj, dict) and (obj.get("message") or obj.get("detail")):
        return str(obj.get("message") or obj.get("detail"))[:300], None
    return r.text[:300], None


async def stream_one(client: httpx.AsyncClient, body: dict, timeout_s: float) -> RequestResult:
    """Send one streaming completion; never raises for a failed request (it is a result)."""
    t0 = time.perf_counter()
    tally, status, param = StreamTally(), [], []

    async def read() -> None:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            status.append(r.status_code)
            if r.status_code != 200:
                await r.aread()
                message, field = _error_of(r)
                tally.error = f"HTTP {r.status_code}: {message}"
                param.append(field)
                return
            async for line in r.aiter_lines():
                tally.feed(line, time.perf_counter() - t0)
                if tally.done or tally.error:
                    return

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        tally.error = f"timed out after {timeout_s:g} s"
    except httpx.HTTPError as e:
        tally.error = f"{type(e).__name__}: {e}"
    return replace(tally.result(time.perf_counter() - t0), http_status=status[0] if status else None,
                   error_param=param[0] if param else None)


# ---------------------------------------------------------------- a run


def _refused(spec: LoadSpec, result: RequestResult) -> ValueError:
    """The probe failed in a way no retry fixes: one line that says what to do."""
    if result.http_status is None:
        return ValueError(f"cannot reach the server at {spec.url}: {result.error}")
    if result.http_status in (401, 403):
        return ValueError(f"the server at {spec.url} refused the request ({result.error}): "
                          + ("check --api-key" if spec.api_key else "pass --api-key"))
    if result.http_status == 404:
        return ValueError(f"the server at {spec.url} answered 404 to POST /v1/completions ({result.error}): is --url "
                          "the server's base URL and --model a model it serves?")
    return ValueError(f"the server at {spec.url} refused the benchmark request ({result.error})")


def adapt(shape: RequestShape, result: RequestResult) -> RequestShape | None:
    """The shape to retry with after the probe's 400 (a field the server does not take), or None.
    The field is the error's ``param`` when the server names one, else a field named in its message."""
    err = result.error or ""
    if result.http_status not in (400, 422):
        return None

    def names(field: str) -> bool:
        return result.error_param == field if result.error_param else field in err

    if shape.ignore_eos and names("ignore_eos"):
        return replace(shape, ignore_eos=False, notes=shape.notes + (
            f"the server refused ignore_eos ({err[:160]}); sent without it, so a request may stop early at an "
            "end-of-sequence token and tokens received can be below tokens requested",))
    if shape.include_usage and names("stream_options"):
        return replace(shape, include_usage=False, notes=shape.notes + (
            f"the server refused stream_options ({err[:160]}); output tokens are counted as SSE chunks",))
    if shape.prompt_kind == "token_ids" and names("prompt") and "context" not in err:
        return replace(shape, prompt_kind="text", notes=shape.notes + (
            f"the server refused token-id prompts ({err[:160]}); prompts are text of --prompt-len words, so "
            "their token count is approximate (prompt_tokens_mean is the server's count when it reports usage)",))
    return None


async def negotiate(client: httpx.AsyncClient, spec: LoadSpec, model: str) -> RequestShape:
    """One probe request of the run's own shape (it also warms the server up), retried without
    each field the server refuses; a refusal nothing fixes (a key, a model, a context too short
    for --prompt-len + --max-tokens) is a ValueError."""
    shape = RequestShape(ignore_eos=spec.ignore_eos)
    for _ in range(4):
        body = request_body(spec, shape, model, make_prompt(spec, shape.prompt_kind, -1), spec.max_tokens)
        result = await stream_one(client, body, spec.timeout_s)
        if result.ok:
            if shape.include_usage and result.counted_by != "usage":
                shape = replace(shape, notes=shape.notes + (
                    "the server sent no usage in the stream; output tokens are counted as SSE chunks",))
            return shape
        if result.http_status == 200:
            raise ValueError(f"the server at {spec.url} broke the benchmark's probe stream: {result.error}")
        retry = adapt(shape, result)
        if retry is None:
            raise _refused(spec, result)
        shape = retry
    raise _refused(spec, result)


async def resolve_model(client: httpx.AsyncClient, spec: LoadSpec) -> str:
    """--model, else the first id of GET /v1/models."""
    if spec.model:
        return spec.model
    try:
        r = await client.get("/v1/models", timeout=min(spec.timeout_s, 30.0))
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {spec.url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise _refused(spec, RequestResult(ok=False, e2e_s=0.0, http_status=r.status_code,
                                           error=f"GET /v1/models: HTTP {r.status_code}: {_error_of(r)[0]}"))
    try:
        ids = [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"GET {spec.url}/v1/models is not an OpenAI model list: {r.text[:120]!r}; "
                         "pass --model") from None
    if not ids:
        raise ValueError(f"the server at {spec.url} lists no models; pass --model")
    return ids[0]


async def run_level(client: httpx.AsyncClient, spec: LoadSpec, shape: RequestShape, model: str,
                    concurrency: int, first_index: int) -> LevelReport:
    """``requests_at(concurrency)`` requests, ``concurrency`` in flight at a time (each worker
    sends its next request when its last one ends)."""
    n = spec.requests_at(concurrency)
    bodies = iter([request_body(spec, shape, model, make_prompt(spec, shape.prompt_kind, first_index + i),
                                spec.max_tokens) for i in range(n)])

    async def worker() -> list[RequestResult]:
        return [await stream_one(client, body, spec.timeout_s) for body in bodies]  # shared iterator

    t0 = time.perf_counter()
    per_worker = await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    duration = time.perf_counter() - t0
    return summarize(concurrency, duration, [r for rs in per_worker for r in rs], spec.max_tokens)


async def _run(spec: LoadSpec, progress: Callable[[str], None],
               transport: httpx.AsyncBaseTransport | None) -> BenchReport:
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    limits = httpx.Limits(max_connections=max(spec.concurrency) + 1, max_keepalive_connections=max(spec.concurrency))
    timeout = httpx.Timeout(spec.timeout_s, connect=min(spec.timeout_s, 10.0))
    async with httpx.AsyncClient(base_url=spec.url, headers=headers, limits=limits, timeout=timeout,
                                 transport=transport) as client:
        model = await resolve_model(client, spec)
        shape = await negotiate(client, spec, model)
        for note in shape.notes:
            progress(f"note: {note}")
        levels, first = [], 0
        for c in spec.concurrency:
            n = spec.requests_at(c)
            progress(f"concurrency {c}: {n} requests of {spec.prompt_len} + {spec.max_tokens} tokens"
                     + (f" (only {n} can be in flight)" if n < c else ""))
            levels.append(await run_level(client, spec, shape, model, c, first))
            first += spec.requests_at(c)  # every request of the run gets its own prompt
        return BenchReport(url=spec.url, model=model, shape=shape, spec=spec, levels=tuple(levels))


def run_bench(spec: LoadSpec, progress: Callable[[str], None] = lambda _: None, *,
              transport: httpx.AsyncBaseTransport | None = None) -> BenchReport:
    """Run every concurrency level in turn. Unusable input (no server, a refused key, a server
    that refuses the request for a reason no retry fixes) is a ValueError; a request that fails
    during a level is counted in that level's ``errors``. ``transport`` replaces the network
    (tests pass an ``httpx.MockTransport``)."""
    return asyncio.run(_run(spec, progress, transport))
