"""Prefill/decode disaggregation in the simulator (cluster/capacity/pd.py) and the commands that size it:
the requests take the selective route, their blocks enter the decode pool's real prefix cache (admitted as a
hit of exactly what crossed), the transfer is priced by its bytes, PD keeps the decode pool's ITL flat where
one engine mixes prefill chunks into its steps, and `moeray simulate --pd` / `moeray plan --pd-prefill` answer
with both pools, against one engine, naming their errors."""

import json
from pathlib import Path

import pytest
from cli_runner import in_process

from cluster.capacity.pd import Link, PDSimulator, transfer_bytes
from cluster.capacity.simulator import Simulator
from cluster.capacity.stepcost import GpuCost, Shape
from cluster.capacity.workload import SimRequest, poisson_workload
from cluster.config import EngineConfig
from cluster.costmodel import load_gpu
from model.config import load_config

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"
K2 = load_config(CONFIGS / "kimi-k2-instruct.json")
K3 = load_config(CONFIGS / "kimi-k3-text.json")
H200 = load_gpu("h200")


def sim(cfg, shape, num_blocks=40_000):
    config = EngineConfig.of(model="simulated", block_size=64, num_blocks=num_blocks, max_num_seqs=256,
                             max_tokens_per_step=8192, snapshot_bytes=16 << 30)  # (K3: 36 KDA snapshots a replica)
    return Simulator(cfg, shape, GpuCost(cfg, H200, shape, exchange="fp8-dedup"), config=config)


@pytest.mark.parametrize("decode", [Shape(8, 8, colocated=True), Shape(8, 8)], ids=["colocated", "disaggregated"])
@pytest.mark.parametrize("cfg", [K2, K3], ids=["k2", "k3"])
def test_pd_routes_and_admits_what_crossed(cfg, decode):
    """Long prompts go to the prefill pool and every one is admitted on decode as a hit of the blocks that
    crossed (the real prefix cache: on K3 with its KDA snapshot); short ones prefill on decode; the transfer
    costs its bytes at the link's rate."""
    work = [SimRequest(0.05 * i, 2000 if i % 2 else 100, 20) for i in range(24)]
    pd = PDSimulator(sim(cfg, Shape(4, 4, colocated=True)), sim(cfg, decode), min_uncached_tokens=256,
                     link=Link(gbps=100))
    out = pd.run(work)
    assert out["routes"] == {"pd": 12, "local": 12} and out["evicted"] == 0
    assert (out["gpus"], out["prefill_gpus"], out["decode_gpus"]) == (4 + decode.devices, 4, decode.devices)
    cut = 1984 if cfg is K2 else 1984 // 64 * 64  # the deepest full block (K3: snapshot grid) before the last token
    assert out["transfer_bytes_mean"] == transfer_bytes(cfg, cut)
    assert out["transfer_p50_s"] == pytest.approx(50e-6 + transfer_bytes(cfg, cut) * 8 / 100e9)
    assert transfer_bytes(K3, 64) - transfer_bytes(K3, 0) == 64 * 27648 and transfer_bytes(K3, 0) > 0  # KDA state


def test_pd_decode_pool_without_room_prefills_there_counted():
    """A decode pool whose cache cannot take the arrivals prefills them itself: counted, never lost."""
    work = [SimRequest(0.0, 2000, 10) for _ in range(4)]
    out = PDSimulator(sim(K2, Shape(2, 2, colocated=True)), sim(K2, Shape(2, 2, colocated=True), num_blocks=40),
                      min_uncached_tokens=256).run(work)
    assert out["routes"].get("no_room", 0) + out["evicted"] > 0
    assert sum(out["routes"].values()) == 4


def test_pd_keeps_decode_itl_flat_where_one_engine_does_not():
    """Under a steady flow of long prompts, one engine on all the devices puts the prompts' chunks into its
    decode steps (ITL p99 many times PD's); under PD the decode pool computes only each prompt's tail past its
    last full block: with prompts one token past a block (the tail is that token) its ITL p99 stays within 1.3x
    of its p50; with 2,000-token prompts (16 tokens past a 64-token block) the tail's steps show in the p99."""
    p99 = {}
    for prompt in (1985, 2000):
        work = poisson_workload(8.0, 120, prompt, 100, seed=1)
        pd = PDSimulator(sim(K2, Shape(16, 16, colocated=True)), sim(K2, Shape(16, 16, colocated=True))).run(work)
        one = sim(K2, Shape(32, 32, colocated=True)).run(work).summary()
        assert pd["routes"] == {"pd": 120} and one["itl_p99_s"] > 5 * pd["itl_p99_s"]
        p99[prompt] = pd["itl_p99_s"] / pd["itl_p50_s"]
    assert p99[1985] <= 1.3 < p99[2000]


def test_moeray_simulate_pd_and_plan_pd(monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")  # the table whole (rich reads the terminal's width)
    base = ["--model", str(CONFIGS / "kimi-k2-instruct.json"), "--gpu", "h200"]
    load = ["--requests", "60", "--rate", "8", "--prompt-tokens", "2000", "--output-tokens", "60"]
    found = in_process("simulate", *base, *load, "--pd", "--search", "--gpus", "32", "--tpot-ms", "50", "--json")
    assert found.returncode == 0, found.stderr
    rows = json.loads(found.stdout)
    pd = [r for r in rows if r["layout"] == "pd"]
    assert pd and rows[-1]["layout"] == "one engine" and rows[-1]["gpus"] == 32
    assert all(r["prefill_gpus"] + r["decode_gpus"] == 32 and r["routes"] == {"pd": 60} for r in pd)
    assert sum(r["best"] for r in rows) == (1 if any(r["meets"] for r in rows) else 0)
    for r in pd:  # PD pays: it meets the target, and one engine does not or serves less per GPU
        one = rows[-1]
        assert r["pays"] == (r["meets"] and (not one["meets"] or r["tokens_per_s_per_gpu"] > one["tokens_per_s_per_gpu"]))
    given = in_process("simulate", *base, *load, "--pd-prefill", "16", "--attention", "16", "--experts", "16",
                       "--colocated")
    assert given.returncode == 0, given.stderr
    assert "one engine" in given.stdout and "PD pays" in given.stdout
    for args, says in ((["--pd"], "--pd sizes the pools of --gpus with --search"),
                       (["--pd-prefill", "8x"], "--pd-prefill must be N (colocated workers) or AxE"),
                       (["--pd-prefill", "8"], "give the prefill pool (--pd-prefill N or AxE) and the decode pool"),
                       (["--pd-prefill", "8", "--attention", "16", "--experts", "16", "--colocated"],
                        "the prefill pool (8 colocated workers) does not fit this model on h200"),
                       (["--pd", "--search", "--gpus", "4"], "no split of 4 devices into two colocated pools fits"),
                       (["--pd-prefill", "8", "--attention", "8", "--experts", "8", "--gpu", "cpu"],
                        "simulated on GPUs")):
        bad = in_process("simulate", *base, *load, *args)
        assert bad.returncode == 2 and says in bad.stderr, (args, bad.stderr)

    planned = in_process("plan", *base, "--nodes", "8", "--gpus-per-node", "8", "--layout", "colocated",
                         "--pd-prefill", "16", "--prompt-tokens", "2000", "--json")
    assert planned.returncode == 0, planned.stderr
    out = json.loads(planned.stdout)
    assert out["prefill"]["fits"] and out["decode"]["fits"]
    assert out["transfer"]["bytes"] == transfer_bytes(K2, 2000)
    text = in_process("plan", *base, "--nodes", "8", "--gpus-per-node", "8", "--pd-prefill", "16")
    assert text.returncode == 0 and "prefill pool (16 devices)" in text.stdout and "decode pool (48 devices)" in text.stdout
    tight = in_process("plan", *base, "--nodes", "1", "--gpus-per-node", "8", "--layout", "colocated", "--pd-prefill", "4")
    assert tight.returncode == 1 and tight.stdout.count("fits: NO") == 2  # half a node holds neither pool's experts
    gone = in_process("plan", *base, "--nodes", "1", "--gpus-per-node", "8", "--pd-prefill", "8")
    assert gone.returncode == 2 and "none left for the decode pool" in gone.stderr
