"""Helpers shared by the asset tests: the shipped Grafana dashboard, its PromQL expressions and the
series each names, and a Prometheus HTTP query (import as ``from dashboards import ...``)."""

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

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
