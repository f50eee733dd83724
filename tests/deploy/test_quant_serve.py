"""Serving an FP8 checkpoint with the experts resident in FP8 on real expert actors (issue 11):
`moeray status --json` reports each expert actor's weight bytes — its experts' checkpoint bytes
(Must show 1) — and `moeray status` shows each actor's load progress while the actors load.

A chat request without max_tokens on a config whose context (4096) exceeds one replica's cache
(Must show 5) is HTTP semantics: test_quant_serve_inproc.py, in one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray import serve

from deploy.app import build_app
from deploy.config import ServeConfig
from quant_bytes import expert_checkpoint_bytes
from deploy.server import wait_ready
from tests.presets import preset

BLOCKS, BLOCK = 6, 16  # 96 tokens of cache per replica, against a 4096-token context


@pytest.fixture(scope="module")
def server(serve_port):
    path = preset("kimi-k2-tiny", quant="fp8", seed=6)
    port = serve_port
    cfg = ServeConfig(model=str(path), served_model_name="k2", attention=1, experts=2, port=port,
                      num_blocks=BLOCKS, block_size=BLOCK, max_num_seqs=4)
    serve.run(build_app(cfg.model_dump()), name="moeray-quant-test", route_prefix="/quant")  # apart from others
    url = f"http://127.0.0.1:{port}/quant"
    wait_ready(url, timeout_s=180)
    yield {"url": url, "path": path}
    serve.delete("moeray-quant-test")


def test_moeray_status_json_reports_expert_weight_bytes(server, tmp_path):
    (tmp_path / "up.json").write_text(json.dumps({"pid": os.getpid(), "url": server["url"], "model": "k2",
                                                  "auth": False}))
    exe = Path(sys.executable).parent / "moeray"
    run = subprocess.run([str(exe), "status", "--json"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MOERAY_CACHE_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    st = json.loads(run.stdout)
    got = [e["weight_bytes"] for e in st["experts"]]
    expect = [expert_checkpoint_bytes(server["path"], {int(l): ids for l, ids in e["slots"].items()})
              for e in st["experts"]]
    assert got == expect and all(b > 0 for b in got)


def test_status_shows_load_progress_per_actor_while_loading(server, tmp_path):
    from ray.experimental import internal_kv
    from ray.util.placement_group import placement_group_table

    from cluster.progress import load_progress

    done = load_progress()  # every actor of the running engine published its completed load
    assert {"attention[0]", "expert[0]", "expert[1]"} <= set(done)
    assert all(p["bytes_read"] == p["bytes_total"] > 0 for p in done.values())
    pg = next(pg for pg, info in placement_group_table().items() if info["state"] == "CREATED")
    key = f"moeray/load/{pg}/expert[9]"  # an actor of the same start-up, halfway through
    internal_kv._internal_kv_put(key, json.dumps({"bytes_read": 1 << 30, "bytes_total": 2 << 30}), overwrite=True)
    try:
        (tmp_path / "up.json").write_text(json.dumps({"pid": os.getpid(), "url": server["url"], "model": "k2",
                                                      "auth": False}))
        exe = Path(sys.executable).parent / "moeray"
        run = subprocess.run([str(exe), "status"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "MOERAY_CACHE_DIR": str(tmp_path)})
    finally:
        internal_kv._internal_kv_del(key)
    assert run.returncode == 0, run.stderr
    assert "loading the weights" in run.stdout and "expert[9]: 1.00 / 2.00 GiB" in run.stdout, run.stdout
