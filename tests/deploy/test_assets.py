"""The operator assets under deploy/ parse, pass the validators of the tools that read them (Ray
Serve's schema, the `ray up` schema, `ray start`'s flags, promtool when installed), and reference
only real things: the app's import path, the cluster's ports, and — for the dashboard and the
Prometheus config — metric names that deploy/metrics.py actually renders. The GPU assets are
checked for properties (Must show 4 of the operations issue): GPU fields in the GPU serve configs,
the model directory mounted or synced on every node that may need it, NCCL's transport settings —
not for today's values. The real `ray up` and the real Prometheus scrape are in test_ray_up.py."""

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from actors.messages import ExpertStepResult, StepResult
from actors.router import Router
from cluster.stats import EngineStats, StepRecord
from dashboards import dashboard, panels, queries
from deploy.config import ServeConfig
from deploy.metrics import EngineMetrics
from cluster.block_pool import BlockPool
from cluster.config import RAY_NODE_ENV
from cluster.scheduler import SchedulerSnapshot
from deploy.settings import ADMIN_KEY_ENV, HAPROXY_INGRESS_ENV, haproxy_files_env

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
REQUIRED_ARGS = {"model", "attention", "experts", "dtype"}  # the rest may take ServeConfig's defaults
LABELS = {"model_name", "layer", "expert", "rank", "actor", "kind", "finished_reason", "reason", "le", "tier",
          "outcome", "direction", "status_code", "deployment", "application", "route"}  # the last four: Ray Serve's
METRIC_NAME = re.compile(r"moeray:[a-zA-Z0-9_:]+")
RAY_WORKER_PORTS = range(10002, 20000)


def load_yaml(name: str):
    return yaml.safe_load((DEPLOY / name).read_text())


# ---- a populated EngineMetrics, so every family has samples ----------------------------------
def _pool() -> BlockPool:
    """16 blocks: 6 held, 2 of them registered and then one freed (cached), 10 free."""
    pool = BlockPool(16, 4)
    held = pool.allocate(6)
    pool.register(held, list(range(24)), None, 8)
    pool.free(held[1:2])
    pool.allocate(1)
    return pool


def populated_metrics() -> EngineMetrics:
    stats, router = EngineStats(2), Router(4, [1, 2])
    table = router.initial(1, 2)
    pool = _pool()
    engine = SimpleNamespace(stats=stats, table=table, router=router,
                             scheduler=SimpleNamespace(),
                             snapshot=SchedulerSnapshot(running=1, waiting=1, blocks_held=(pool.num_held,),
                                                        blocks_available=(pool.num_available,),
                                                        blocks_cached=(pool.num_cached,),
                                                        blocks_total=(pool.num_blocks,), prefix_queries=((0, 40),),
                                                        prefix_hits=((0, 16),)))
    engine.tier = SimpleNamespace(status=lambda: {  # the KV tier's (cluster/tiering.py), one actor with two tiers
        "queried_tokens": 64, "loaded_tokens": 48, "missed": 0, "load_s": 0.01, "actors": {"0": {
            "copied": 5, "dropped": 0, "write_errors": 0, "loaded": 3, "tiers": [
                {"tier": t, "hits": 3, "misses": {"absent": 1}, "bytes_in": 100, "bytes_out": 60, "evictions": 1,
                 "used_bytes": 40, "capacity_bytes": 1000} for t in ("node", "disk")]}}})
    m = EngineMetrics(engine, "tiny")
    attn = [StepResult(1, "attention[0]", expert_tokens=((2, 1, 0, 1), (0, 3, 1, 0)),
                       slot_tokens=(((2, 1), (0, 1)), ((0, 3), (1, 0))), exchange_s=0.002,
                       dispatch_s=0.001, combine_s=0.001)]
    expert = [ExpertStepResult(1, f"expert[{j}]", compute_s=0.004, exchange_s=0.002) for j in range(2)]
    rec = StepRecord.of(3, attn, expert, 0.01, table)  # what Engine.record does
    router.report(rec.expert_tokens, rec.actor_tokens, epoch=table.epoch)
    stats.record_step(rec)
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
        ops = isinstance(doc, list) and all(isinstance(op, dict) and {"op", "path"} <= set(op) for op in doc)
        assert (isinstance(doc, dict) or ops) and doc, p  # a document, or a JSON 6902 patch (deploy/kuberay-pd)


# ---- Serve -------------------------------------------------------------------------------
def _check_serve_config(cfg: dict) -> dict:
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(cfg)  # what `serve deploy` / KubeRay submit
    (app,) = cfg["applications"]
    module, attr = app["import_path"].split(":")
    assert (module, attr) == ("deploy.app", "build_app")
    source = (ROOT / Path(*module.split("."))).with_suffix(".py")
    tree = ast.parse(source.read_text())
    (builder,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == attr]
    params = builder.args
    # Serve calls an application builder with exactly one argument, the args dict (anything more fails `serve deploy`)
    assert len(params.args) == 1 and not (params.kwonlyargs or params.vararg or params.kwarg), ast.dump(params)
    # the layout's shape keys: attention and experts, or (colocated) workers
    shape = {"workers"} if app["args"].get("layout") == "colocated" else {"attention", "experts"}
    assert (REQUIRED_ARGS - {"attention", "experts"}) | shape <= set(app["args"]) <= set(ServeConfig.model_fields), \
        set(app["args"])
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
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):  # the serving config's default ingress
        env = HAPROXY_INGRESS_ENV | haproxy_files_env("$H")
        assert all(f"{k}={v}" in cfg[key][-1].split() for k, v in env.items()), key
        assert "; H=/tmp/haproxy-serve-$(id -u); " in cfg[key][-1], key
        # the node environment every node moeray starts has (a hung actor SIGKILLed soon after its kill)
        assert all(f"{k}={v}" in cfg[key][-1].split() for k, v in RAY_NODE_ENV.items()), key
        # the admin key on every node, from the file file_mounts copies (the ray up test uses it for real)
        assert f" {ADMIN_KEY_ENV}=$(cat ~/.moeray/admin_key) " in f" {' '.join(cfg[key][-1].split())} ", key
    assert cfg["file_mounts"]["~/.moeray/admin_key"] == "~/.moeray/admin_key"
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


def test_every_metric_name_in_the_dashboard_and_prometheus_config_is_rendered(rendered):
    samples, families = rendered
    texts = {"grafana/moeray-dashboard.json": "\n".join(queries(dashboard())),  # descriptions may name opt-in series
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
    all_panels = panels(dash)
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    for p in all_panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    exprs = queries(dash)
    assert all(e.count("(") == e.count(")") and e.count("{") == e.count("}") for e in exprs)
    for e in exprs:  # label names used by selectors and aggregations exist on our series
        used = set(re.findall(r"([a-z_]+)\s*=~?", e)) | {
            x.strip() for group in re.findall(r"by \(([^)]*)\)", e) for x in group.split(",")}
        assert used <= LABELS, (e, used - LABELS)
    quantiles = [e for e in exprs if e.startswith("histogram_quantile(")]
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert {q.split(",")[0] for q in quantiles if hist in q} == {"histogram_quantile(0.5",
                                                                     "histogram_quantile(0.99"}, hist
    heat = [p for p in all_panels if p["type"] == "heatmap"]
    assert heat and "by (expert)" in heat[0]["targets"][0]["expr"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "model_name", "layer"} <= set(variables)
    for name in ("model_name", "layer"):
        assert variables[name]["definition"].endswith(f", {name})")
    names = " ".join(exprs)
    assert "ray_serve_" in names, "no panel on Ray Serve's own series"
    assert "moeray:epoch_pause_seconds" in names and "moeray:epoch{" in names, "no elastic-plane panels"


# ---- GPU assets: properties (Must show 4) ------------------------------------------------------------
def _gpu_args() -> dict:
    cfg = load_yaml("serve_config.gpu.yaml")
    return _check_serve_config(cfg)["args"]


def test_gpu_and_cpu_serve_configs_are_apart():
    gpu, cpu = ServeConfig.parse(_gpu_args()), ServeConfig.parse(load_yaml("serve_config.yaml")["applications"][0]["args"])
    assert gpu.gpus_per_actor >= 1 and gpu.dtype == "bfloat16"
    assert cpu.gpus_per_actor == 0 and cpu.dtype == "float32"
    assert Path(gpu.model).is_absolute(), "a GPU cluster serves a checkpoint directory, not a preset"
    spec = gpu.cluster_spec()
    assert spec.attention_resources.get("GPU") == spec.expert_resources.get("GPU") == gpu.gpus_per_actor


def test_kuberay_sets_the_admin_key_from_a_secret_and_the_node_environment_in_every_ray_container():
    cluster = load_yaml("kuberay-rayservice.yaml")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [w["template"] for w in cluster["workerGroupSpecs"]]
    for pod in pods:
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            ref = env[ADMIN_KEY_ENV]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "moeray-admin-key", "key": "admin-key"} and "value" not in env[ADMIN_KEY_ENV]
            assert all(env[k]["value"] == v for k, v in RAY_NODE_ENV.items()), container["name"]


def test_kuberay_mounts_the_model_on_every_pod_and_asks_for_gpus():
    svc = load_yaml("kuberay-rayservice.yaml")
    args = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]
    cfg = ServeConfig.parse(args)
    assert cfg.gpus_per_actor >= 1 and cfg.dtype == "bfloat16"
    assert {k: v for k, v in args.items() if k != "model"} == {k: v for k, v in _gpu_args().items() if k != "model"}
    cluster = svc["spec"]["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    for name, group in groups:  # build_app and the ingress may run on the head: every pod reads the model
        spec = group["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = [m for c in spec["containers"] for m in c.get("volumeMounts", [])
                  if cfg.model == m["mountPath"] or cfg.model.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts, f"{name}: no volume mounted at a parent of {cfg.model}"
        volume = volumes[mounts[0]["name"]]
        assert volume.get("persistentVolumeClaim") or volume.get("hostPath") or volume.get("csi"), (name, volume)
    workers = [g for _, g in groups[1:]]
    gpus = sum(int(g["replicas"]) * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
               for g in workers)
    assert gpus >= (cfg.attention + cfg.experts) * cfg.gpus_per_actor, (gpus, cfg.attention, cfg.experts)


def _node_commands(cfg: dict, node_type: str) -> list[str]:
    """The setup commands `ray up` runs on a node of this type, in order (node-type lists override)."""
    t = cfg["available_node_types"][node_type]
    role = "head" if node_type == cfg["head_node_type"] else "worker"
    own = t.get(f"{role}_setup_commands", cfg[f"{role}_setup_commands"])
    return list(cfg["setup_commands"]) + list(own)


def _sync_destinations(commands: list[str]) -> list[tuple[str, bool]]:
    """(destination, weights included) of every checkpoint sync (aws s3 sync / gcloud storage rsync)."""
    out = []
    for c in commands:
        words = shlex.split(c.replace("\n", " "))
        for i in range(len(words) - 1):
            if words[i:i + 2] in (["s3", "sync"], ["storage", "rsync"]):
                rest = [w for w in words[i + 2:] if not w.startswith("--")]
                src, dst = rest[-2], rest[-1]
                assert src.startswith(("s3://", "gs://")), c
                out.append((dst, "safetensors" not in c))
    return out


@pytest.mark.parametrize("name", ["ray-cluster-aws.yaml", "ray-cluster-gcp.yaml"])
def test_cloud_yaml_puts_the_checkpoint_on_every_gpu_node(name):
    cfg = _prepared(name)
    model = ServeConfig.parse(_gpu_args()).model
    head = cfg["head_node_type"]
    gpu_types = {k: v for k, v in cfg["available_node_types"].items() if k != head}
    assert gpu_types
    text = (DEPLOY / name).read_text()
    assert re.search(r"~?\d+(\.\d+)? TB", text), "the checkpoint sizes are documented"
    for node_type in gpu_types:
        commands = _node_commands(cfg, node_type)
        full = [dst for dst, weights in _sync_destinations(commands) if weights]
        assert any(model == d or model.startswith(d.rstrip("/") + "/") for d in full), \
            f"{name}:{node_type} never syncs the whole checkpoint to {model}: {full}"
        # ... onto a local disk assembled in the same commands, mounted at a parent of the model path
        mounts = [c for c in commands if re.search(r"\bmount\b\s+\S+\s+(\S+)", c)]
        points = {re.search(r"\bmount\b\s+\S+\s+(\S+?);?\s", c + " ").group(1) for c in mounts}
        assert any(model.startswith(p.rstrip("/") + "/") for p in points), (node_type, points)
        assert any("mdadm" in c for c in commands), f"{node_type}: local disks are not assembled"
    # the head, which may run build_app and the ingress, can read the model directory (not the weights)
    head_dsts = [d for d, _ in _sync_destinations(_node_commands(cfg, head))]
    assert model in head_dsts, f"{name}: the head never gets {model}: {head_dsts}"


def test_nccl_transport_settings_on_the_gpu_workers():
    aws, gcp = _prepared("ray-cluster-aws.yaml"), _prepared("ray-cluster-gcp.yaml")
    aws_start, gcp_start = aws["worker_start_ray_commands"][-1], gcp["worker_start_ray_commands"][-1]
    for var in ("FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1", "NCCL_SOCKET_IFNAME="):
        assert var in aws_start, var
        assert var.split("=")[0] in (DEPLOY / "ray-cluster-aws.yaml").read_text().split("cluster_name:")[0], \
            f"{var} is not explained in the header"
    gpu = aws["available_node_types"]["gpu_worker"]["node_config"]
    assert any(n.get("InterfaceType") == "efa" for n in gpu["NetworkInterfaces"])
    assert "NCCL_SOCKET_IFNAME=" in gcp_start
    gcp_gpu = gcp["available_node_types"]["gpu_worker"]["node_config"]
    assert all(n.get("nicType") == "GVNIC" for n in gcp_gpu["networkInterfaces"])
    header = (DEPLOY / "ray-cluster-gcp.yaml").read_text().split("cluster_name:")[0]
    for var in re.findall(r"\b(NCCL_[A-Z_]+)=", gcp_start):
        assert var in header, f"{var} is not explained in the header"
    for cfg in (aws, gcp):  # NCCL settings sit on the workers' `ray start`, whose processes inherit them
        assert "NCCL_" not in cfg["head_start_ray_commands"][-1]


def test_gcp_cluster_yaml_is_a_gpu_template():
    cfg = _prepared("ray-cluster-gcp.yaml")
    assert cfg["provider"]["type"] == "gcp"
    head, worker = _check_commands(cfg)
    assert worker["--address"] == f"$RAY_HEAD_IP:{head['--port']}"
    workers = {k: v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"]}
    assert any(v["node_config"]["machineType"].startswith(("a3-", "a4-")) and v.get("min_workers", 0) >= 1
               for v in workers.values())


def test_colocated_gpu_serve_config_is_k2_fp8_on_2x8_h200_one_worker_per_gpu_and_fits_the_plan():
    """deploy/serve_config.colocated.gpu.yaml (issue 33): a valid `serve deploy` config of the colocated
    layout, one worker per GPU of 2 × 8, whose cache fits what `moeray plan --layout colocated` leaves
    for sequences on an H200."""
    from cluster.planner import DEVICES, plan_colocated
    from model.config import load_config

    args = _check_serve_config(load_yaml("serve_config.colocated.gpu.yaml"))["args"]
    cfg = ServeConfig.parse(args)
    assert cfg.layout == "colocated" and cfg.workers == 16 and cfg.gpus_per_actor == 1 and cfg.dtype == "bfloat16"
    assert cfg.max_expert_actors == cfg.workers
    spec = cfg.cluster_spec()
    assert spec.colocated and spec.workers == 16 and spec.attention_resources.get("GPU") == 1
    k2 = load_config(ROOT / "tests" / "fixtures" / "configs" / "kimi-k2-instruct.json")
    plan = plan_colocated(k2, model="k2", device=DEVICES["h200"], nodes=2, gpus_per_node=8, workers=cfg.workers,
                          context=4096)
    assert plan.fits
    assert cfg.num_blocks * cfg.block_size * plan.sequence_bytes["latent_per_token"] <= plan.cache_bytes
    assert cfg.num_blocks * cfg.block_size >= 4096 * plan.concurrent_sequences


def test_kuberay_gcs_fault_tolerance_uses_the_redis_that_its_own_manifest_runs():
    """The RayService keeps its GCS in Redis (issue 38): the address is the Service of
    deploy/kuberay-redis.yaml, the password the Secret that Redis requires."""
    ft = load_yaml("kuberay-rayservice.yaml")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    items = {item["kind"]: item for item in load_yaml("kuberay-redis.yaml")["items"]}
    host, port = ft["redisAddress"].split(":")
    service = items["Service"]
    assert host == service["metadata"]["name"] and int(port) in [p["port"] for p in service["spec"]["ports"]]
    pod = items["Deployment"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    [redis] = pod["spec"]["containers"]
    [env] = [e for e in redis["env"] if e["name"] == "REDIS_PASSWORD"]
    assert env["valueFrom"] == ft["redisPassword"]["valueFrom"]
    assert "--requirepass" in " ".join(redis["command"]) and "--appendonly yes" in " ".join(redis["command"])


def test_pd_gpu_serve_config_is_two_engines_of_16_workers_on_4x8_h200():
    """deploy/serve_config.pd.gpu.yaml (issue 55): a valid `serve deploy` config whose decode engine is the
    colocated config's 16 workers and whose prefill engine (disaggregation) is 16 more, one GPU each, with
    the same model, dtype and cache layout (the blocks cross only between such engines)."""
    args = _check_serve_config(load_yaml("serve_config.pd.gpu.yaml"))["args"]
    colocated = _check_serve_config(load_yaml("serve_config.colocated.gpu.yaml"))["args"]
    assert {k: v for k, v in args.items() if k != "disaggregation"} == colocated
    cfg = ServeConfig.parse(args)
    d = cfg.disaggregation.record
    assert d.min_uncached_tokens == 512 and d.max_tokens_per_step > cfg.max_tokens_per_step
    decode = cfg.engine_config(args["model"], owner="moeray")
    prefill, spec = d.prefill_engine(decode, cfg.cluster_spec().attention_resources)
    assert spec.colocated and spec.workers == 16 and spec.attention_resources == {"CPU": 1, "GPU": 1}
    assert (prefill.model, prefill.dtype, prefill.cache, prefill.owner) == (decode.model, decode.dtype, decode.cache,
                                                                            "moeray-prefill")


def _json6902(doc: dict, ops: list[dict]) -> dict:
    """Apply a JSON 6902 patch of `replace` operations (what kustomize does with deploy/kuberay-pd/pd.yaml)."""
    import copy

    out = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "replace", op
        *parents, last = [int(k) if k.isdigit() else k for k in op["path"].strip("/").split("/")]
        node = out
        for key in parents:
            node = node[key]
        assert last in node if isinstance(node, dict) else last < len(node), op["path"]  # replace needs it there
        node[last] = op["value"]
    return out


def test_kuberay_pd_overlay_is_the_base_with_the_pd_serve_config_on_4_gpu_pods():
    """deploy/kuberay-pd (issue 55): a kustomization of the base RayService whose patch carries exactly
    deploy/serve_config.pd.gpu.yaml and gives the GPU group the pods both engines need."""
    kust = load_yaml("kuberay-pd/kustomization.yaml")
    assert kust["kind"] == "Kustomization" and kust["resources"] == ["../kuberay-rayservice.yaml"]
    (patch,) = kust["patches"]
    assert patch["target"]["kind"] == "RayService" and patch["target"]["name"] == load_yaml("kuberay-rayservice.yaml")["metadata"]["name"]
    svc = _json6902(load_yaml("kuberay-rayservice.yaml"), load_yaml(f"kuberay-pd/{patch['path']}"))
    inner = yaml.safe_load(svc["spec"]["serveConfigV2"])
    assert inner == load_yaml("serve_config.pd.gpu.yaml")
    args = _check_serve_config(inner)["args"]
    cfg = ServeConfig.parse(args)
    workers = [g for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    gpus = sum(int(g["replicas"]) * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
               for g in workers)
    assert all(g["minReplicas"] == g["replicas"] == g["maxReplicas"] for g in workers)
    assert gpus == (cfg.workers + cfg.disaggregation.record.workers) * cfg.gpus_per_actor == 32


@pytest.mark.parametrize("name", ["ray-cluster-aws.yaml", "ray-cluster-gcp.yaml"])
def test_ray_up_configs_say_how_to_start_both_pd_engines(name):
    """The `ray up` YAMLs (issue 55): their header starts 4 GPU nodes with `ray up`'s own --min-workers /
    --max-workers and deploys serve_config.pd.gpu.yaml; the node type allows 4 nodes of 8 GPUs, the workers of
    both engines."""
    from ray.scripts.scripts import up

    header = (DEPLOY / name).read_text().split("cluster_name:")[0]
    line = next(line for line in header.splitlines() if f"ray up deploy/{name} --min-workers" in line)
    flags = _start_flags(line.replace("ray up", "ray start"))
    assert {"--min-workers", "--max-workers"} <= {opt for p in up.params for opt in p.opts} and set(flags) == {
        "--min-workers", "--max-workers"}
    n = int(line.split("--min-workers")[1].split()[0])
    assert "serve_config.pd.gpu.yaml" in header
    cfg = _prepared(name)
    gpu = cfg["available_node_types"]["gpu_worker"]
    assert gpu["max_workers"] >= n and cfg["max_workers"] >= n
    args = load_yaml("serve_config.pd.gpu.yaml")["applications"][0]["args"]
    assert n * 8 == args["workers"] + args["disaggregation"]["workers"]
