"""`moeray bench serve` against the real app (issue 10, Must show 2): kimi-k2-tiny served on the test
session's Ray cluster, the load generator run through the installed `moeray` entry point with
--json, as a user would. Its figures must be sane: every requested token counted (ignore_eos), no
errors, ordered percentiles, a positive rate."""

import json

import pytest
from live import KEY, deploy, moeray
from ray import serve

from model.presets import build_preset

NAME = "bench"
LEVELS, REQUESTS, PROMPT, MAX_TOKENS = (1, 4), 4, 8, 8


@pytest.fixture(scope="module")
def url(serve_port, tmp_path_factory):
    path = build_preset("kimi-k2-tiny", tmp_path_factory.mktemp("k2") / "k2", seed=10, progress=False)
    try:
        yield deploy(serve_port, path, NAME, attention=1, experts=1)
    finally:
        serve.delete(NAME)


def test_bench_serve_reports_sane_figures(url, tmp_path):
    saved = tmp_path / "report.json"
    done = moeray("bench", "serve", "--url", f"{url}/v1", "--api-key", KEY, "--concurrency", "1,4",
                  "--requests", str(REQUESTS), "--prompt-len", str(PROMPT), "--max-tokens", str(MAX_TOKENS),
                  "--json", "--save", str(saved))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert json.loads(saved.read_text()) == report
    assert report["model"] == NAME  # the first id of GET /v1/models
    assert report["ignore_eos"] is True and report["notes"] == [] and report["counted_by"] == "usage"
    assert report["prompt"] == {"kind": "token_ids", "tokens": PROMPT}
    assert [lv["concurrency"] for lv in report["levels"]] == list(LEVELS)
    for lv in report["levels"]:
        assert (lv["requests"], lv["ok"], lv["errors"]) == (REQUESTS, REQUESTS, 0), lv["error_samples"]
        assert lv["tokens_received"] == lv["tokens_requested"] == REQUESTS * MAX_TOKENS
        assert lv["prompt_tokens_mean"] == PROMPT  # the server counted the id prompts as sent
        assert lv["requests_per_s"] > 0 and lv["output_tokens_per_s"] > 0
        for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            s = lv[metric]
            assert 0 <= s["p50"] <= s["p90"] <= s["p99"], (metric, s)
        assert lv["ttft_ms"]["p99"] <= lv["e2e_ms"]["p99"]
    assert "concurrency 4: 4 requests" in done.stderr


def test_bench_serve_table_and_a_wrong_key(url):
    done = moeray("bench", "serve", "--url", url, "--api-key", KEY, "--concurrency", "2", "--requests", "2",
                  "--prompt-len", "4", "--max-tokens", "4")
    assert done.returncode == 0, done.stderr
    assert "TTFT" in done.stdout and "8 / 8" in done.stdout, done.stdout  # tokens received / requested
    bad = moeray("bench", "serve", "--url", url, "--api-key", "wrong", "--concurrency", "1")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "check --api-key" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
