"""Helpers shared by the asset tests: the shipped Grafana dashboard, its PromQL expressions and the
series each names, a real Prometheus started and stopped by the test, a Prometheus HTTP query, and a
polling wait (import as ``from dashboards import ...``)."""

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from hostprocs import die_with_parent, tail
from rayup import free_port

DEPLOY = Path(__file__).parents[2] / "deploy"
SERIES = re.compile(r"\b((?:moeray|vllm):[a-zA-Z0-9_:]+|ray_[a-zA-Z0-9_]+)")


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "moeray-dashboard.json").read_text())


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets, annotations, variables."""
    exprs = [t["expr"] for p in panels(dash) for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    return exprs


def series_names(expr: str) -> set[str]:
    """The sample names an expression selects (``moeray:x_bucket``, ``ray_serve_y_total``)."""
    return set(SERIES.findall(expr))


def runnable(expr: str) -> str:
    """The expression with Grafana's variables replaced, as Grafana would send it."""
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "5m").replace("$model_name", ".*")
            .replace("$layer", ".*"))


def prom_query(base: str, expr: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 400: the expression does not parse
        return json.loads(e.read())


def wait_for(what: str, check, timeout_s: float, every_s: float = 1.0):
    """check()'s first truthy result, polled every every_s; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


@contextmanager
def prometheus(config: dict, workdir: Path) -> Iterator[str]:
    """A real Prometheus (the `prometheus` on PATH) run from ``config``, written to
    workdir/prometheus.yml, its TSDB and log (prometheus.log) in workdir, listening on a free loopback
    port; yields its base URL once it is ready (/-/ready). On exit it is stopped by its Popen handle
    (terminate, 20 s, kill); it also gets SIGTERM if the test process dies (die_with_parent)."""
    exe = shutil.which("prometheus")
    assert exe, "prometheus is not installed (Debian: prometheus; .ci/run installs it)"
    cfg, log = workdir / "prometheus.yml", workdir / "prometheus.log"
    cfg.write_text(yaml.safe_dump(config))
    port = free_port()
    with open(log, "w") as err:
        proc = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                stderr=err, preexec_fn=die_with_parent)
    try:
        def ready() -> bool:
            # Listening is not ready: until its TSDB is open Prometheus answers 503 "Service
            # Unavailable" (plain text) to every query; /-/ready says 200 once it serves them.
            assert proc.poll() is None, f"prometheus exited with {proc.returncode}: {tail(log)}"
            try:  # a port not yet listening refuses: URLError too
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_for(f"prometheus on 127.0.0.1:{port} to be ready", ready, 60, every_s=0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# Every PromQL expression of vLLM's own Grafana dashboard, in panel order: vllm-project/vllm
# examples/observability/prometheus_grafana/grafana.json (at commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9,
# as returned by the code-search index; its one variable is Grafana's label_values(model_name)). With
# metrics_prefix: vllm each must select series that moeray exports, with data.
VLLM_DASHBOARD_QUERIES = [
    *(f'histogram_quantile({q}, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{{model_name="$model_name"}}'
      f'[$__rate_interval])))' for q in ("0.99", "0.95", "0.9", "0.5")),
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    *(f'histogram_quantile({q}, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{{model_name="$model_name"}}'
      f'[$__rate_interval])))' for q in ("0.99", "0.95", "0.9", "0.5")),
    'rate(vllm:inter_token_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:inter_token_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    *(f'histogram_quantile({q}, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{{model_name="$model_name"}}'
      f'[$__rate_interval])))' for q in ("0.99", "0.95", "0.9", "0.5")),
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
]
