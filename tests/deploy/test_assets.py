"""The operator assets under deploy/ parse, pass the validators of the tools that read them (Ray
Serve's schema, the `ray up` schema, `ray start`'s flags, promtool when installed), and reference
only real things: the app's import path, the cluster's ports, and — for the dashboard and the
Prometheus config — metric names that deploy/metrics.py actually renders."""

import ast
import json
import re
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from actors.messages import ExpertStepResult, StepResult
from actors.router import even_table
from cluster.stats import EngineStats
from deploy.metrics import EngineMetrics

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
SERVE_ARGS = {"model", "served_model_name", "attention", "experts", "dtype", "max_num_seqs", "max_tokens_per_step",
              "num_blocks", "block_size", "max_queue", "max_body_bytes", "api_key"}
LABELS = {"model_name", "layer", "expert", "actor", "kind", "finished_reason", "le"}
METRIC_NAME = re.compile(r"moeray:[a-zA-Z0-9_:]+")
RAY_WORKER_PORTS = range(10002, 20000)


def load_yaml(name: str):
    return yaml.safe_load((DEPLOY / name).read_text())


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "moeray-dashboard.json").read_text())


# ---- a populated EngineMetrics, so every family has samples ----------------------------------
class _Alloc:
    def __init__(self, num_blocks: int, num_free: int):
        self.num_blocks, self.num_free = num_blocks, num_free


def populated_metrics() -> EngineMetrics:
    stats = EngineStats([1, 2], 4)
    table = even_table(4, [1, 2], 1, 2)
    engine = SimpleNamespace(stats=stats, table=table,
                             scheduler=SimpleNamespace(waiting=deque([object()]), running=[object()],
                                                       blocks=[_Alloc(16, 10)]))
    m = EngineMetrics(engine, "tiny")
    attn = [StepResult(1, "attention[0]", expert_tokens=((2, 1, 0, 1), (0, 3, 1, 0)),
                       slot_tokens=(((2, 1), (0, 1)), ((0, 3), (1, 0))), exchange_s=0.002,
                       dispatch_s=0.001, combine_s=0.001)]
    expert = [ExpertStepResult(1, f"expert[{j}]", compute_s=0.004, exchange_s=0.002) for j in range(2)]
    stats.record_step(3, attn, expert, 0.01, table)
    stats.observe_ttft(0.05)
    stats.observe_itl(0.01)
    seq = SimpleNamespace(output_ids=[5, 6], num_prompt_tokens=3, finish_reason="stop")
    stats.observe_finished(0.2, seq)
    return m


@pytest.fixture(scope="module")
def rendered() -> tuple[set[str], set[str]]:
    """(sample names, family names) that EngineMetrics renders."""
    samples, families = set(), set()
    for fam in text_string_to_metric_families(populated_metrics().render().decode()):
        families.add(fam.name)
        samples.update(s.name for s in fam.samples)
    return samples, families


# ---- every file parses --------------------------------------------------------------------
def test_every_yaml_and_json_under_deploy_parses():
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
    names = {p.relative_to(DEPLOY).as_posix() for p in files}
    assert {"serve_config.yaml", "ray-cluster-local.yaml", "ray-cluster-aws.yaml", "prometheus.yml",
            "kuberay-rayservice.yaml", "grafana/moeray-dashboard.json"} <= names
    for p in files:
        doc = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
        assert isinstance(doc, dict) and doc, p


# ---- Serve -------------------------------------------------------------------------------
def _check_serve_config(cfg: dict) -> dict:
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(cfg)  # what `serve deploy` / KubeRay submit
    (app,) = cfg["applications"]
    module, attr = app["import_path"].split(":")
    assert (module, attr) == ("deploy.app", "build_app")
    source = (ROOT / Path(*module.split("."))).with_suffix(".py")
    tree = ast.parse(source.read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == attr for n in tree.body), f"{source} lacks {attr}()"
    assert set(app["args"]) == SERVE_ARGS, set(app["args"]) ^ SERVE_ARGS
    from deploy.config import ServeConfig

    ServeConfig.parse(app["args"])  # the args build_app will parse (extra="forbid")
    assert cfg["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert "working_dir" not in json.dumps(app.get("runtime_env", {}))  # installed package, see comments
    return app


def test_serve_config_is_a_valid_serve_deploy_config():
    cfg = load_yaml("serve_config.yaml")
    app = _check_serve_config(cfg)
    assert app["args"]["api_key"] is None and cfg["proxy_location"] == "HeadOnly"


def test_kuberay_rayservice_carries_the_same_serve_config():
    svc = load_yaml("kuberay-rayservice.yaml")
    assert svc["apiVersion"] == "ray.io/v1" and svc["kind"] == "RayService"
    inner = yaml.safe_load(svc["spec"]["serveConfigV2"])
    app = _check_serve_config(inner)
    local = load_yaml("serve_config.yaml")
    assert app["import_path"] == local["applications"][0]["import_path"]
    assert inner["proxy_location"] == local["proxy_location"]
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token"
    (worker,) = cluster["workerGroupSpecs"]
    limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1
    for group in [cluster["headGroupSpec"], worker]:
        assert int(group["rayStartParams"]["metrics-export-port"]) not in RAY_WORKER_PORTS


# ---- ray up ------------------------------------------------------------------------------------
def _ray_start_options() -> set[str]:
    from ray.scripts.scripts import start

    return {opt for param in start.params for opt in param.opts}


def _start_flags(command: str) -> dict[str, str | None]:
    """`--flag=value` / `--flag` of the `ray start` in one shell command."""
    assert "ray start" in command, command
    tail = command.split("ray start", 1)[1]
    return {m.group(1): m.group(2) for m in re.finditer(r"(--[a-z0-9-]+)(?:=(\S+))?", tail)}


def _prepared(name: str) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = prepare_config(load_yaml(name))  # what `ray up` does first: defaults + provider checks
    validate_config(cfg)  # Ray's ray-schema.json
    return cfg


def _check_commands(cfg: dict) -> tuple[dict, dict]:
    options = _ray_start_options()
    commands = [c for key in ("setup_commands", "head_setup_commands", "worker_setup_commands",
                              "head_start_ray_commands", "worker_start_ray_commands") for c in cfg[key]]
    bash = shutil.which("bash")
    for command in commands:
        if bash:
            subprocess.run([bash, "-n", "-c", command], check=True, timeout=10)  # syntax only
    head = _start_flags(cfg["head_start_ray_commands"][-1])
    worker = _start_flags(cfg["worker_start_ray_commands"][-1])
    for flags in (head, worker):
        assert set(flags) <= options, f"not `ray start` options: {set(flags) - options}"
        assert int(flags["--metrics-export-port"]) not in RAY_WORKER_PORTS
    assert "--head" in head and "--address" in worker
    assert "RAY_AUTH_MODE=token" in cfg["head_start_ray_commands"][-1]
    assert "RAY_AUTH_MODE=token" in cfg["worker_start_ray_commands"][-1]
    assert cfg["file_mounts"]["~/moeray"] == "."  # the repository, installed by setup_commands:
    assert any("pip install" in c and "-e ~/moeray" in c for c in cfg["setup_commands"])
    assert any("torch==" in c for c in cfg["setup_commands"])  # pinned before the project
    assert any("moeray-venv/bin" in c and ".bashrc" in c for c in cfg["setup_commands"])  # `ray` on PATH
    return head, worker


def test_local_cluster_yaml():
    cfg = _prepared("ray-cluster-local.yaml")
    assert cfg["provider"]["type"] == "local"
    assert cfg["provider"]["head_ip"] == "127.0.0.2" and cfg["provider"]["worker_ips"] == ["127.0.0.3"]
    head, worker = _check_commands(cfg)
    assert "RAY_enable_autoscaler_v2=0" in cfg["head_start_ray_commands"][-1]
    assert head["--node-ip-address"] == "127.0.0.2" and "127.0.0.1" not in json.dumps(cfg)
    assert worker["--address"] == f"$RAY_HEAD_IP:{head['--port']}"
    # both nodes share one machine: their metrics ports (bound on all interfaces) must differ
    assert head["--metrics-export-port"] != worker["--metrics-export-port"]
    for flags in (head, worker):
        assert {"--num-cpus", "--memory", "--object-store-memory"} <= set(flags)
    assert "--include-dashboard" in head  # `serve deploy` needs the dashboard


def test_aws_cluster_yaml_is_a_gpu_template():
    cfg = _prepared("ray-cluster-aws.yaml")
    assert cfg["provider"]["type"] == "aws"
    head_type = cfg["head_node_type"]
    workers = {k: v for k, v in cfg["available_node_types"].items() if k != head_type}
    assert any(v["node_config"]["InstanceType"].startswith(("p5", "p4", "p6")) and v.get("min_workers", 0) >= 1
               for v in workers.values())
    head, worker = _check_commands(cfg)
    assert worker["--address"] == f"$RAY_HEAD_IP:{head['--port']}"


# ---- Prometheus and Grafana --------------------------------------------------------------------
def test_prometheus_scrapes_the_app_and_the_local_clusters_ray_ports():
    prom = load_yaml("prometheus.yml")
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    app = jobs["moeray"]
    assert app["metrics_path"] == "/metrics"
    assert [t for c in app["static_configs"] for t in c["targets"]] == ["127.0.0.1:8000"]
    serve = load_yaml("serve_config.yaml")
    assert app["static_configs"][0]["targets"][0].endswith(f":{serve['http_options']['port']}")
    local = _prepared("ray-cluster-local.yaml")
    head = _start_flags(local["head_start_ray_commands"][-1])
    worker = _start_flags(local["worker_start_ray_commands"][-1])
    expected = {f"{local['provider']['head_ip']}:{head['--metrics-export-port']}"} | {
        f"{ip}:{worker['--metrics-export-port']}" for ip in local["provider"]["worker_ips"]}
    assert {t for c in jobs["ray"]["static_configs"] for t in c["targets"]} == expected


@pytest.mark.skipif(shutil.which("promtool") is None and not os.environ.get("CI"),
                    reason="promtool not installed (Debian: prometheus); .ci/run installs it, so CI never skips")
def test_promtool_accepts_the_prometheus_config():
    out = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _queries(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and annotations."""
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    return exprs


def test_every_metric_name_in_the_dashboard_and_prometheus_config_is_rendered(rendered):
    samples, families = rendered
    texts = {"grafana/moeray-dashboard.json": (DEPLOY / "grafana" / "moeray-dashboard.json").read_text(),
             "prometheus.yml": (DEPLOY / "prometheus.yml").read_text()}
    referenced = set()
    for where, text in texts.items():
        for name in METRIC_NAME.findall(text):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in samples or name in families or base in families, f"{where}: {name} is not rendered"
            referenced.add(name)
    # the dashboard covers the engine: every family but the _created bookkeeping is on it somewhere
    used = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in referenced}
    missing = families - used
    assert not missing, f"families without a panel: {sorted(missing)}"


def test_dashboard_structure():
    dash = dashboard()
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    exprs = _queries(dash)
    assert all(e.count("(") == e.count(")") and e.count("{") == e.count("}") for e in exprs)
    for e in exprs:  # label names used by selectors and aggregations exist on our series
        used = set(re.findall(r"([a-z_]+)\s*=~?", e)) | {
            x.strip() for group in re.findall(r"by \(([^)]*)\)", e) for x in group.split(",")}
        assert used <= LABELS, (e, used - LABELS)
    quantiles = [e for e in exprs if e.startswith("histogram_quantile(")]
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert {q.split(",")[0] for q in quantiles if hist in q} == {"histogram_quantile(0.5",
                                                                     "histogram_quantile(0.99"}, hist
    heat = [p for p in panels if p["type"] == "heatmap"]
    assert heat and "by (expert)" in heat[0]["targets"][0]["expr"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "model_name", "layer"} <= set(variables)
    for name in ("model_name", "layer"):
        assert variables[name]["definition"].endswith(f", {name})")


# ---- a real Prometheus scrapes EngineMetrics and runs the dashboard's queries ----------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(base: str, expr: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 400: the expression does not parse
        return json.loads(e.read())


@pytest.mark.skipif(shutil.which("prometheus") is None and not os.environ.get("CI"),
                    reason="prometheus not installed (Debian: prometheus); .ci/run installs it, so CI never skips")
def test_prometheus_ingests_metrics_and_evaluates_every_dashboard_query():
    metrics = populated_metrics()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = metrics.render()
            self.send_response(200)
            self.send_header("Content-Type", metrics.CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "prometheus.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": "moeray", "metrics_path": "/metrics",
                                "static_configs": [{"targets": [f"127.0.0.1:{server.server_port}"]}]}]}))
        proc = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:  # until two scrapes are in (rate() needs two points)
                try:
                    r = _query(base, "count_over_time(moeray:num_requests_running[1m])")
                    if r["data"]["result"] and float(r["data"]["result"][0]["value"][1]) >= 2:
                        break
                except (OSError, KeyError):
                    pass
                assert time.monotonic() < deadline, "prometheus did not scrape the metrics in 60 s"
                time.sleep(0.5)
            metrics.engine.stats.observe_ttft(0.07)  # something moves between scrapes
            time.sleep(1.5)
            for expr in _queries(dashboard()):
                promql = (expr.replace("$__rate_interval", "1m").replace("$model_name", ".*")
                          .replace("$layer", ".*"))
                r = _query(base, promql)
                assert r["status"] == "success", (expr, r.get("error"))
            up = _query(base, 'moeray:kv_cache_usage_perc{model_name="tiny"}')["data"]["result"]
            assert float(up[0]["value"][1]) == pytest.approx(6 / 16)
            heat = _query(base, 'sum by (expert) (moeray:expert_tokens_total{layer=~".*"})')["data"]["result"]
            assert {r["metric"]["expert"]: float(r["value"][1]) for r in heat} == {"0": 2, "1": 4, "2": 1, "3": 1}
            p99 = _query(base, _queries(dashboard())[0].replace("$model_name", ".*"))
            assert p99["data"]["result"], p99
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            server.shutdown()
