"""Hostile input (Must show 6 of the survival issue): /openapi.json describes every route's body and
responses with the models the routes validate with, and schemathesis fuzzes that document against
the serving app on loopback: a bounded number of examples per operation, no 5xx, no hang, no
"mostly rejected" warning, and the server answers a normal completion the same way afterwards.

Nothing generated is altered or filtered. Generation stays short through the document's own bound:
the server serves a context of CONTEXT tokens (``max_model_len``), so max_tokens <= CONTEXT - 1.

The app exports its serving series under vLLM's names (``metrics_prefix: vllm``), and a real
Prometheus scraping it has data for every query of vLLM's own Grafana dashboard.

In one process (tests/deploy/inproc.py, no Ray): the same Ingress and engine server as under Serve,
the engine on the in-process executor, served by uvicorn on a loopback port; schemathesis and
Prometheus are the real tools, each a subprocess talking HTTP to that port. The Prometheus test
starts a process, so it is marked `cluster` (out of the fast subset)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deploy.access import RebalanceRequest, ScaleRequest
from deploy.openai_models import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                  TokenizeCompletionRequest)

from dashboards import VLLM_DASHBOARD_QUERIES, prom_query, prometheus, wait_for
from inproc import preset, serve
from deploy.server import wait_ready

KEY = "fuzz-key"
NAME = "k2"
EXAMPLES = 30  # per operation, positive and negative together (50 cost the suite 56 s of its 2 cores)
CONTEXT = 64
BODIES = {"/v1/completions": (CompletionRequest,), "/v1/chat/completions": (ChatCompletionRequest,),
          "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest), "/detokenize": (DetokenizeRequest,),
          "/admin/scale/experts": (ScaleRequest,), "/admin/scale/attention": (ScaleRequest,),
          "/admin/rebalance": (RebalanceRequest,)}
ROUTES = {("get", "/health"), ("get", "/v1/models"), ("get", "/metrics"), ("get", "/status"),
          *(("post", p) for p in BODIES)}
PROBE = {"model": NAME, "prompt": [5, 77, 300, 12], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _headers() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def _probe(url: str) -> str:
    r = httpx.post(f"{url}/v1/completions", headers=_headers(), json=PROBE, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def server():
    """The app's loopback URL: the settings the Serve app of this test had (attention 1, experts 2)."""
    path = preset("kimi-k2-tiny", seed=4)
    with serve(path, served_model_name=NAME, attention=1, experts=2, api_key=KEY, max_queue=32, max_num_seqs=16,
               max_body_bytes=64 * 1024, max_tokens_per_step=128, max_model_len=CONTEXT,
               metrics_prefix="vllm") as app:
        wait_ready(app.url, timeout_s=120)
        yield app.url


def test_openapi_declares_every_body_and_response(server):
    doc = httpx.get(f"{server}/openapi.json", timeout=30).json()
    ops = {(m, p): op for p, item in doc["paths"].items() for m, op in item.items()}
    assert ROUTES <= set(ops), sorted(ops)
    schemas = doc["components"]["schemas"]
    for (method, path), op in ops.items():
        if (method, path) not in ROUTES:
            continue
        codes = set(op["responses"])
        assert "200" in codes and "422" not in codes, (path, codes)
        for code in codes - {"200"} if path != "/health" else ():
            ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse"), (path, code, ref)
        models = BODIES.get(path)
        if models is None:
            assert "requestBody" not in op, path
            continue
        body = op["requestBody"]
        assert body["required"] is True
        schema = body["content"]["application/json"]["schema"]
        refs = [s["$ref"] for s in schema["anyOf"]] if len(models) > 1 else [schema["$ref"]]
        for ref, model in zip(refs, models, strict=True):
            name = ref.rsplit("/", 1)[1]
            assert name == model.__name__ and set(schemas[name]["properties"]) == set(model.model_fields), path
            assert schemas[name]["additionalProperties"] is False and op["security"] == [{"bearer": []}]
    gen = schemas["CompletionRequest"]["properties"]
    assert gen["model"]["enum"] == [NAME] and gen["max_tokens"]["maximum"] == CONTEXT - 1
    for vllm in ("top_k", "ignore_eos", "min_tokens", "min_p", "repetition_penalty", "stop_token_ids",
                 "skip_special_tokens", "include_stop_str_in_output"):
        assert vllm in gen and vllm in schemas["ChatCompletionRequest"]["properties"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    for openai_field in ("user", "store", "metadata", "service_tier", "prediction", "modalities", "audio",
                         "reasoning_effort", "web_search_options", "parallel_tool_calls", "prompt_cache_key",
                         "safety_identifier", "verbosity", "function_call", "functions", "logprobs", "tools",
                         "tool_choice", "response_format", "chat_template_kwargs"):
        assert openai_field in chat, openai_field
    assert "ignored" in chat["store"]["description"] and "ignored" in chat["service_tier"]["description"]
    assert gen["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"].endswith("|1023)$")  # ids below the vocabulary
    assert gen["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == 1023
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 1023
    assert schemas["ModelCard"]["properties"]["max_model_len"]
    assert gen["temperature"] == {"default": 1.0, "maximum": 2.0, "minimum": 0.0, "title": "Temperature",
                                  "type": "number"}
    assert "text/event-stream" in ops[("post", "/v1/completions")]["responses"]["200"]["content"]


def test_framework_errors_leave_in_the_openai_envelope(server):
    for method, path, status in (("GET", "/nope", 404), ("DELETE", "/v1/completions", 405)):
        r = httpx.request(method, server + path, headers=_headers(), timeout=30)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def _schemathesis(url: str, report: Path, *args: str) -> tuple[str, dict]:
    """One `st run` against the served document; its console output and its JSON report."""
    cmd = [str(Path(sys.executable).parent / "st"), "run", f"{url}/openapi.json", "-H", f"Authorization: Bearer {KEY}",
           "--max-examples", str(EXAMPLES), "--phases", "examples,fuzzing", "--seed", "7", "--workers", "1", "--request-timeout", "60",
           "--max-response-time", "60",
           "--report", "json", "--report-json-path", str(report), "--no-color", *args]
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(report.parent), "NO_COLOR": "1", "COLUMNS": "200"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=report.parent)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out, json.loads(report.read_text())


def test_schemathesis_no_5xx_no_hang_no_rejection_and_still_correct(server, tmp_path):
    """Every check schemathesis has (no 5xx, conformance of statuses, content types, bodies and SSE
    events to the document, negative data rejected, auth enforced, response within the request
    timeout) but positive_data_acceptance: the API has cross-field rules the document states in
    words but JSON Schema cannot (best_of == n, prompt plus max_tokens within the context, ...)."""
    before = _probe(server)
    out, report = _schemathesis(server, tmp_path / "gen.json", "--exclude-path-regex", "^/admin",
                                "--checks", "all", "--exclude-checks", "positive_data_acceptance")
    print(out[-3000:])
    cases = report["test_cases"]
    assert f"{cases['generated']} generated, {cases['generated']} passed" in out, out[-4000:]
    assert cases["generated"] >= 2 * EXAMPLES and cases["with_failures"] == 0 and cases["errored"] == 0, cases
    assert "mostly rejected" not in out and not any(report["warnings"].values()), report["warnings"]
    for op in ("POST /v1/completions", "POST /v1/chat/completions"):
        rate = report["valid_rates"][op]["fuzzing"]
        assert rate["accepted"] > rate["rejected"] / 4, (op, rate)  # the engine was reached, not just validation
    for op in ("POST /tokenize", "POST /detokenize"):  # vLLM's routes, fuzzed as well
        assert report["valid_rates"][op]["fuzzing"]["accepted"] > 0, (op, report["valid_rates"][op])
    assert _probe(server) == before
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


def _drive(url: str, i: int) -> None:
    """Traffic between two scrapes: one completion, and one streamed, of a few tokens each."""
    body = {**PROBE, "prompt": [5, 77, 300, 12 + i % 900], "max_tokens": 3 + i % 4}
    r = httpx.post(f"{url}/v1/completions", headers=_headers(), json=body, timeout=60)
    assert r.status_code == 200, r.text
    with httpx.stream("POST", f"{url}/v1/completions", headers=_headers(), json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert any(line == "data: [DONE]" for line in r.iter_lines()), "the stream never ended with [DONE]"


@pytest.mark.cluster
def test_a_real_prometheus_has_data_for_every_query_of_vllms_dashboard(server, tmp_path):
    """metrics_prefix: vllm, end to end: a real Prometheus scrapes the app's /metrics (with the bearer
    key) every second while completions, some streamed, run; every query of vLLM's own Grafana dashboard
    (VLLM_DASHBOARD_QUERIES), for this model, returns a non-empty result and no NaN within 60 s."""
    host = server.removeprefix("http://")
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "moeray", "metrics_path": "/metrics",
                                  "authorization": {"type": "Bearer", "credentials": KEY},
                                  "static_configs": [{"targets": [host]}]}]}
    exprs = [q.replace("$model_name", NAME).replace("$__rate_interval", "30s") for q in VLLM_DASHBOARD_QUERIES]
    assert all("$" not in e for e in exprs), exprs
    with prometheus(config, tmp_path) as base:
        sent = 0

        def missing() -> dict[str, str]:
            """The queries without data yet, each with why."""
            out = {}
            for e in exprs:
                r = prom_query(base, e)
                if r.get("status") != "success":
                    out[e] = f"error: {r.get('error')}"
                elif not r["data"]["result"]:
                    out[e] = "empty"
                elif any(math.isnan(float(x["value"][1])) for x in r["data"]["result"]):
                    out[e] = f"NaN: {r['data']['result']}"
            return out

        def all_have_data() -> bool:
            nonlocal sent
            _drive(server, sent)
            sent += 1
            return not missing()

        try:
            wait_for("data for every query of vLLM's dashboard", all_have_data, 60, every_s=0.5)
        except AssertionError:
            targets = httpx.get(f"{base}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            scrape = [(t["health"], t["lastError"]) for t in targets]
            lacking = "\n".join(f"  {e!r}: {why}" for e, why in missing().items())
            raise AssertionError(f"after {sent} rounds of requests, no data for:\n{lacking}\n"
                                 f"scrape (health, last error): {scrape}") from None
        print(f"every query of vLLM's dashboard had data after {sent} rounds of requests")
