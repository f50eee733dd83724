"""The load generator without a real server: percentiles and per-level aggregation, SSE tallying,
and whole runs against an OpenAI-compatible server faked in an ``httpx.MockTransport`` — one that
refuses ignore_eos, stream_options or token-id prompts, packs several tokens into one chunk, needs
a key, or fails mid-stream. `moeray bench serve` against the real app is in tests/deploy/test_serve_inproc.py."""

import asyncio
import json
import random

import httpx
import pytest
from typer.testing import CliRunner

from deploy.cli import app
from deploy.loadgen import (LoadSpec, StreamTally, make_prompt, normalize_url, parse_concurrency, parse_token_range,
                            run_bench)
from deploy.loadstats import RequestResult, percentile, render_table, summarize, summary_ms

# ---------------------------------------------------------------- percentiles and aggregation


def test_percentile_interpolates_linearly_like_numpy():
    xs = list(range(1, 101))
    random.Random(0).shuffle(xs)
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 100
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError, match="q must be in"):
        percentile(xs, 101)


def test_percentiles_are_ordered_on_any_sample():
    rng = random.Random(1)
    for _ in range(200):
        xs = [rng.expovariate(1.0) for _ in range(rng.randint(1, 40))]
        s = summary_ms(xs)
        assert s["p50"] <= s["p90"] <= s["p99"] <= round(max(xs) * 1e3, 3)  # ms, rounded to 1 µs
    assert summary_ms([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert summary_ms([0.001, 0.003]) == {"p50": 2.0, "p90": 2.8, "p99": 2.98, "mean": 2.0}


def test_summarize_counts_only_successes_in_rates_and_latencies():
    ok1 = RequestResult(ok=True, e2e_s=1.0, ttft_s=0.1, chunk_gaps_s=(0.2, 0.3), output_tokens=4, prompt_tokens=8,
                        counted_by="usage")
    ok2 = RequestResult(ok=True, e2e_s=2.0, ttft_s=0.5, chunk_gaps_s=(0.5,), output_tokens=4, prompt_tokens=8,
                        counted_by="usage")
    bad = RequestResult(ok=False, e2e_s=9.0, error="HTTP 503: busy", http_status=503)
    lv = summarize(4, 2.0, [ok1, bad, ok2, bad], max_tokens=4)
    assert (lv.requests, lv.ok, lv.errors) == (4, 2, 2)
    assert lv.requests_per_s == 1.0 and lv.output_tokens_per_s == 4.0
    assert (lv.tokens_requested, lv.tokens_received, lv.prompt_tokens_mean) == (16, 8, 8.0)
    assert lv.ttft_ms["p50"] == pytest.approx(300.0) and lv.e2e_ms["mean"] == pytest.approx(1500.0)
    assert lv.itl_ms["p50"] == pytest.approx(300.0)  # pooled gaps 0.2, 0.3, 0.5
    assert lv.tpot_ms["mean"] == pytest.approx((0.9 / 3 + 1.5 / 3) / 2 * 1e3)
    assert lv.error_samples == ["HTTP 503: busy"] and lv.counted_by == ["usage"]
    with pytest.raises(ValueError, match="duration"):
        summarize(1, 0.0, [ok1], max_tokens=4)


# ---------------------------------------------------------------- one stream


def _lines(*events):
    return [f"data: {json.dumps(e)}" if isinstance(e, dict) else e for e in events]


def _chunk(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def test_tally_uses_usage_and_skips_an_empty_final_chunk():
    t = StreamTally()
    for now, line in enumerate(_lines(_chunk("a"), "", _chunk(""), ": comment", _chunk("b"), _chunk("", "length"),
                                      {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}},
                                      "data: [DONE]")):
        t.feed(line, float(now))
    r = t.result(9.0)
    assert r.ok and r.output_tokens == 3 and r.counted_by == "usage" and r.prompt_tokens == 5
    assert r.ttft_s == 0.0 and r.chunk_gaps_s == (2.0, 2.0)  # chunks at 0, 2 (empty text, not last), 4


def test_tally_without_usage_counts_chunks_and_fails_broken_streams():
    t = StreamTally()
    for line in _lines(_chunk("a"), _chunk("b", "length"), "data: [DONE]"):
        t.feed(line, 1.0)
    r = t.result(2.0)
    assert r.ok and r.output_tokens == 2 and r.counted_by == "chunks"
    cut = StreamTally()
    cut.feed(_lines(_chunk("a"))[0], 0.5)
    assert cut.result(1.0).error == "the stream ended without data: [DONE]"
    boom = StreamTally()
    boom.feed(_lines({"error": {"message": "engine died", "code": "engine_failed"}})[0], 0.5)
    assert not boom.result(1.0).ok and "engine died" in boom.result(1.0).error
    junk = StreamTally()
    junk.feed("data: {not json", 0.1)
    assert "not JSON" in junk.result(1.0).error


# ---------------------------------------------------------------- whole runs against a fake server


class FakeServer:
    """An OpenAI-compatible server in a function. ``refuse``: fields answered with a 400 naming
    them; ``per_chunk``: tokens per SSE chunk; ``eos_at``: where a request stops without
    ignore_eos; ``fail_every``: every k-th completion ends with an error event."""

    def __init__(self, refuse=(), per_chunk=1, eos_at=3, key=None, fail_every=None, usage=True, context=1 << 20):
        self.refuse, self.per_chunk, self.eos_at, self.key = refuse, per_chunk, eos_at, key
        self.fail_every, self.usage, self.context, self.bodies = fail_every, usage, context, []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.key and request.headers.get("authorization") != f"Bearer {self.key}":
            return httpx.Response(401, json={"error": {"message": "bad key"}})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]})
        if request.url.path != "/v1/completions":
            return httpx.Response(404, json={"error": {"message": "no route"}})
        body = json.loads(request.content)
        for name in self.refuse:
            if name in body and not (name == "prompt" and isinstance(body["prompt"], str)):
                param = None if name == "stream_options" else name  # some servers name it in the message only
                return httpx.Response(400, json={"error": {"message": f"unknown field {name!r}", "param": param}})
        if len(body["prompt"]) + body["max_tokens"] > self.context:
            return httpx.Response(400, json={"error": {
                "message": f"the prompt ({len(body['prompt'])} tokens) plus max_tokens ({body['max_tokens']}) is "
                           f"over this model's context length of {self.context} tokens", "param": "max_tokens"}})
        self.bodies.append(body)
        n = body["max_tokens"] if body.get("ignore_eos") else min(self.eos_at, body["max_tokens"])
        fail = self.fail_every and len(self.bodies) % self.fail_every == 0
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self._events(n, body, fail))

    async def _events(self, n, body, fail):
        sent = 0
        while sent < n:
            await asyncio.sleep(0.001)
            k = min(self.per_chunk, n - sent)
            sent += k
            if fail and sent > 1:
                yield b'data: {"error": {"message": "engine failed", "code": "engine_failed"}}\n\ndata: [DONE]\n\n'
                return
            yield f"data: {json.dumps(_chunk('x' * k, 'length' if sent == n else None))}\n\n".encode()
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(body["prompt"]) if isinstance(body["prompt"], list) else 0,
                     "completion_tokens": n, "total_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"


def _run(server, **kw):
    spec = LoadSpec(url="http://fake:1/v1/", **{"concurrency": (1, 3), "prompt_len": 6, "max_tokens": 5,
                                                 "requests": 4, **kw})
    return run_bench(spec, transport=httpx.MockTransport(server)).to_dict(), server


def test_run_counts_every_requested_token_with_ignore_eos():
    report, server = _run(FakeServer())
    assert report["model"] == "m1" and report["url"] == "http://fake:1" and report["notes"] == []
    assert report["prompt"] == {"kind": "token_ids", "tokens": 6} and report["ignore_eos"] is True
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for lv in report["levels"]:
        assert (lv["requests"], lv["errors"], lv["tokens_received"], lv["tokens_requested"]) == (4, 0, 20, 20)
        assert lv["counted_by"] == ["usage"] and lv["prompt_tokens_mean"] == 6 and lv["requests_per_s"] > 0
    prompts = [b["prompt"] for b in server.bodies[1:]]  # [0] is the probe
    assert len(prompts) == 8 and all(len(p) == 6 and all(100 <= t < 700 for t in p) for p in prompts)
    assert len({tuple(p) for p in prompts}) == 8  # distinct: no prefix cache can share them
    assert all(b["stream"] and b["ignore_eos"] and b["stream_options"] == {"include_usage": True}
               for b in server.bodies)
    assert "TTFT" in {c.header for c in render_table(report).columns}


def test_run_drops_refused_fields_and_says_so():
    report, server = _run(FakeServer(refuse=("ignore_eos", "stream_options")), model="m2")
    assert report["model"] == "m2" and report["ignore_eos"] is False and report["counted_by"] == "chunks"
    assert len(report["notes"]) == 2 and "refused ignore_eos" in report["notes"][0]
    assert "refused stream_options" in report["notes"][1]
    for lv in report["levels"]:  # the fake stops at 3 tokens without ignore_eos
        assert lv["errors"] == 0 and (lv["tokens_received"], lv["tokens_requested"]) == (12, 20)


def test_run_falls_back_to_text_prompts():
    report, server = _run(FakeServer(refuse=("prompt",)))
    assert report["prompt"]["kind"] == "text" and "token-id prompts" in report["notes"][0]
    assert all(isinstance(b["prompt"], str) and len(b["prompt"].split()) == 6 for b in server.bodies)


def test_chunks_carrying_several_tokens_are_counted_by_usage():
    report, _ = _run(FakeServer(per_chunk=2))
    assert all(lv["tokens_received"] == 20 and lv["counted_by"] == ["usage"] for lv in report["levels"])
    report, _ = _run(FakeServer(per_chunk=2, usage=False))
    assert "no usage" in report["notes"][0] and report["counted_by"] == "chunks"
    assert all(lv["tokens_received"] == 12 for lv in report["levels"])  # 3 chunks of 2, 2, 1 tokens


def test_failures_during_a_level_are_counted_not_raised():
    report, _ = _run(FakeServer(fail_every=3))
    lv = report["levels"]
    assert sum(x["errors"] for x in lv) == 3 and lv[0]["error_samples"] == ["error event in the stream: engine failed"]
    assert all(x["ok"] + x["errors"] == 4 for x in lv)


@pytest.mark.parametrize("server,kw,needle", [
    (FakeServer(key="k"), {}, "pass --api-key"),
    (FakeServer(key="k"), {"api_key": "wrong"}, "check --api-key"),
    (FakeServer(refuse=("max_tokens",)), {}, "refused the benchmark request (HTTP 400: unknown field 'max_tokens')"),
])
def test_unusable_servers_are_one_clear_error(server, kw, needle):
    with pytest.raises(ValueError) as info:
        _run(server, **kw)
    assert needle in str(info.value)


def test_a_prompt_too_long_is_not_mistaken_for_a_refused_id_prompt():
    with pytest.raises(ValueError, match="over this model's context length of 10 tokens") as info:
        _run(FakeServer(context=10))
    assert "refused the benchmark request" in str(info.value)


def test_error_bodies_of_several_servers():
    from deploy.loadgen import _error_of

    assert _error_of(httpx.Response(400, json={"error": {"message": "bad", "param": "ignore_eos"}})) == \
        ("bad", "ignore_eos")
    assert _error_of(httpx.Response(400, json={"object": "error", "message": "old vllm"})) == ("old vllm", None)
    assert _error_of(httpx.Response(400, json={"detail": "fastapi"})) == ("fastapi", None)
    assert _error_of(httpx.Response(400, text="plain")) == ("plain", None)
    assert _error_of(httpx.Response(400, json=[1])) == ("[1]", None)


def test_a_404_says_what_to_check():
    async def nothing(request):
        return httpx.Response(404, text="not found")

    with pytest.raises(ValueError, match="is --url the server's base URL"):
        _run(nothing, model="m")


# ---------------------------------------------------------------- input checks


def test_flags_are_checked():
    assert parse_concurrency("1, 8,16") == (1, 8, 16) and parse_token_range("5:9") == (5, 9)
    assert normalize_url("http://h:8/v1/") == "http://h:8" and normalize_url("https://h/x") == "https://h/x"
    for bad, needle in (("0,1", "--concurrency"), ("a", "--concurrency"), ("", "--concurrency")):
        with pytest.raises(ValueError, match=needle):
            parse_concurrency(bad)
    for bad in ("localhost:8000", "ftp://h", "http://", "http:///x", "http://[::1", "http://h:99999", "http://a b"):
        with pytest.raises(ValueError, match="--url"):
            LoadSpec(url=bad)
    for field, value in (("prompt_len", 0), ("max_tokens", 0), ("requests", 0), ("timeout_s", 0),
                         ("temperature", 3.0), ("token_range", (5, 5))):
        with pytest.raises(ValueError, match="--"):
            LoadSpec(url="http://h", **{field: value})
    spec = LoadSpec(url="http://h", prompt_len=4, seed=2)
    assert make_prompt(spec, "token_ids", 1) == make_prompt(spec, "token_ids", 1) != make_prompt(spec, "token_ids", 2)
    assert spec.requests_at(8) == 32


@pytest.mark.parametrize("args,needle", [
    (["--token-range", "7"], "--token-range must be LO:HI"),
    (["--concurrency", "4,-1"], "--concurrency"),
    (["--url", "127.0.0.1:8000"], "--url must be an http"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_cli_bad_flags_exit_2_with_one_line(args, needle):
    result = CliRunner().invoke(app, ["bench", "serve", "--url", "http://127.0.0.1:9", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output


def test_cli_prints_the_table_and_exits_1_when_requests_failed(monkeypatch, tmp_path):
    import deploy.loadgen as loadgen

    real = loadgen.run_bench
    monkeypatch.setattr(loadgen, "run_bench", lambda spec, progress: real(
        spec, progress, transport=httpx.MockTransport(FakeServer(fail_every=3))))
    saved = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--url", "http://fake:1", "--concurrency", "1,2",
                                      "--requests", "3", "--max-tokens", "4", "--save", str(saved)])
    assert result.exit_code == 1, result.output
    assert "TTFT" in result.output and "2 request(s) failed; first errors: error event in the stream" in result.output
    assert [lv["errors"] for lv in json.loads(saved.read_text())["levels"]] == [1, 1]
