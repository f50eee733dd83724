"""NCCL deployments (issue 9): every actor gets the environment that makes a dead peer abortable
(async error handling "clean up only"), gloo ones get nothing extra. The GPU path itself cannot run
here (no GPU); this checks what the fleet asks Ray for."""

from actors.group import NCCL_ENV
from cluster.config import EngineConfig
from cluster.spec import ClusterSpec
from cluster.fleet import Fleet
from model.config import parse_config
from model.presets import preset_config


def _group(**spec):
    cfg = parse_config(preset_config("kimi-k2-tiny"), where="preset")
    return Fleet(EngineConfig.of(model="kimi-k2-tiny", load_timeout_s=60), ClusterSpec(**spec), cfg)


def test_nccl_actors_get_the_abortable_environment_and_gloo_ones_do_not():
    gpu = _group(attention_resources={"CPU": 1, "GPU": 1}, expert_resources={"CPU": 1, "GPU": 0.5})
    assert gpu.backend == "nccl"
    assert gpu._options({"num_gpus": 1})["runtime_env"] == {"env_vars": NCCL_ENV}
    assert NCCL_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # abort the communicators, keep the process
    cpu = _group()
    assert cpu.backend == "gloo" and "runtime_env" not in cpu._options({"num_cpus": 1})
