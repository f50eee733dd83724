"""GPU assignment (issue 11, Must show 2): an actor computes on the GPUs Ray assigned it, exactly
those, and on the CPU when it has none; an actor given a GPU while torch has no CUDA fails with an
error naming the actor and the node. Fake GPUs (a Ray node started with num_gpus=2) stand in for
real ones; a subprocess holds its own driver and cluster (this test session's shared cluster has
no GPUs)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actors.device import DeviceError, choose_device
from model.presets import build_preset

ROOT = Path(__file__).parents[2]

SCRIPT = textwrap.dedent('''
    import dataclasses, json, sys
    import ray
    from actors.device import choose_device
    from cluster.engine import Engine, EngineConfig, EngineError
    from cluster.local import LocalCluster
    from cluster.spec import ClusterSpec

    @ray.remote
    class Probe:
        def place(self, name, cuda):
            p = choose_device(name, cuda_available=lambda: cuda)  # as if torch had CUDA on this node
            return dataclasses.asdict(p)

    out = {}
    with LocalCluster(nodes=1, num_cpus=8, num_gpus=2, memory_mb=4096, first_ip=40) as cluster:  # apart from the session's
        ray.init(address=cluster.address)
        whole = [Probe.options(num_cpus=0.1, num_gpus=1).remote() for _ in range(2)]
        none = Probe.options(num_cpus=0.1).remote()
        out["whole"] = ray.get([p.place.remote(f"expert[{i}]", True) for i, p in enumerate(whole)], timeout=300)
        out["none"] = ray.get(none.place.remote("attention[0]", True), timeout=300)
        for p in whole:  # free both GPUs for the halves
            ray.kill(p)
        halves = [Probe.options(num_cpus=0.1, num_gpus=0.5).remote() for _ in range(2)]
        out["halves"] = ray.get([p.place.remote(f"expert[{i}]", True) for i, p in enumerate(halves)], timeout=300)
        for p in halves + [none]:
            ray.kill(p)
        spec = ClusterSpec(attention=1, experts=2, attention_resources={"CPU": 1, "GPU": 1},
                           expert_resources={"CPU": 1, "GPU": 0.5})
        try:
            Engine(EngineConfig.of(model=sys.argv[1], load_timeout_s=120), spec).start()
            out["engine"] = "started"
        except EngineError as e:
            out["engine"] = str(e)
    print("RESULT " + json.dumps(out))
''')


def test_choose_device_follows_the_assignment_not_torch():
    assert choose_device("expert[0]", gpu_ids=(), cuda_available=lambda: True).device == "cpu"
    p = choose_device("expert[1]", gpu_ids=("3",), node="10.0.0.7", cuda_available=lambda: True)
    assert (p.device, p.gpu_ids) == ("cuda:0", ("3",))
    with pytest.raises(DeviceError, match=r"expert\[2\] on node 10\.0\.0\.7: Ray assigned it GPU\(s\) 1 but this "
                                          r"torch has no CUDA"):
        choose_device("expert[2]", gpu_ids=("1",), node="10.0.0.7", cuda_available=lambda: False)


@pytest.mark.operator
def test_fake_gpus_distinct_ids_cpu_without_and_a_clear_error_without_cuda(tmp_path):
    path = build_preset("kimi-k2-tiny", tmp_path / "k2", seed=1, progress=False)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "RAY_AUTH_MODE": "disabled"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, env=env,
                         timeout=900, cwd=ROOT)
    line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(line[len("RESULT "):])
    whole = out["whole"]
    assert sorted(p["gpu_ids"][0] for p in whole) == ["0", "1"]  # distinct ids, one each
    assert all(len(p["gpu_ids"]) == 1 and p["device"] == "cuda:0" for p in whole)  # its own, first visible
    halves = out["halves"]
    assert all(len(p["gpu_ids"]) == 1 and p["device"] == "cuda:0" for p in halves)
    assert halves[0]["gpu_ids"] == halves[1]["gpu_ids"]  # two halves share one GPU
    assert out["none"]["gpu_ids"] == [] and out["none"]["device"] == "cpu"  # even where torch would say CUDA
    assert "attention[0] on node 127.0.0.40" in out["engine"] or "expert[" in out["engine"], out["engine"]
    assert "Ray assigned it GPU(s)" in out["engine"] and "this torch has no CUDA" in out["engine"], out["engine"]
