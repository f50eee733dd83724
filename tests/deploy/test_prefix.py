"""Prefix caching through the real Serve app and the official `openai` client (issue 26, Must show
1, 4, 5, 6): five-turn conversations on kimi-k2-tiny and kimi-k3-tiny (2 attention × 2 expert
actors over 2 nodes) answer exactly what a cluster without prefix caching answers, with
`cached_tokens` equal to the grid-rounded shared length from turn 2 on; later turns go where
their conversation's cache is unless load outweighs it; a conversation survives `moeray scale
attention 2 → 1` and `moeray chaos kill-attention` exactly; salts separate tenants.

A conversation here is token ids (completions with `return_token_ids`, as agent and RL frameworks
drive a model), so the shared length is known exactly: each turn's prompt is the last turn's
prompt and answer plus a new message."""

import asyncio
import random
import threading

import httpx
import openai
import pytest
from ray import serve

from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.spec import ClusterSpec
from model.presets import build_preset
from model.sampling import SamplingParams

from live import KEY, deploy, run_cli, series

ANSWER = 24
GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def apps(serve_port, ray_cluster, tmp_path_factory):
    """name → (url, checkpoint, cache grid): kimi-k2-tiny and kimi-k3-tiny, 2 attention × 2 experts."""
    out = {}
    for name, preset, grid in (("pk2", "kimi-k2-tiny", 16), ("pk3", "kimi-k3-tiny", 64)):
        path = build_preset(preset, tmp_path_factory.mktemp(name) / name, seed=3, progress=False)
        out[name] = (deploy(serve_port, path, name, attention=2, experts=2), path, grid)
    yield out
    for name in out:
        serve.delete(name)


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _turn(url, name, prompt, sampling, salt=None):
    """(generated ids, cached_tokens) of one completion on token ids."""
    extra = {"return_token_ids": True, "ignore_eos": True, **({"cache_salt": salt} if salt else {})}
    r = _client(url).completions.create(model=name, prompt=prompt, max_tokens=ANSWER, extra_body=extra, **sampling)
    choice = r.choices[0].model_dump()
    assert choice["prompt_token_ids"] == prompt
    return choice["token_ids"], r.usage.prompt_tokens_details.cached_tokens


def _status(url) -> dict:
    return httpx.get(f"{url}/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()


def _admitted(url) -> list[int]:
    return [a["prefix_cache"]["admitted"] for a in _status(url)["attention"]]


def _where(url, before: list[int]) -> int:
    """The one replica that admitted a sequence since ``before``."""
    moved = [r for r, (a, b) in enumerate(zip(_admitted(url), before)) if a != b]
    assert len(moved) == 1, (before, _admitted(url))
    return moved[0]


def _reference(path, prompts_and_sampling) -> list[list[int]]:
    """The same requests, one by one, on a cluster without prefix caching (1 × 1, this process's engine)."""
    with Engine(EngineConfig.of(model=str(path), prefix_caching=False, num_blocks=512, max_tokens_per_step=128),
                ClusterSpec(attention=1, experts=1)) as eng:
        return [eng.generate([p], SamplingParams(max_tokens=ANSWER, ignore_eos=True,
                                                 temperature=s["temperature"], seed=s.get("seed")))[0].output_ids
                for p, s in prompts_and_sampling]


@pytest.mark.parametrize("name", ["pk2", "pk3"])
def test_five_turns_equal_a_cluster_without_prefix_caching_and_hit_the_shared_length(apps, name):
    url, path, grid = apps[name]
    assert len({a["node"] for a in _status(url)["attention"] + _status(url)["experts"]}) >= 2
    rng = random.Random(hash(name) % 1000)
    convs = {"greedy": [rng.randrange(1, 700) for _ in range(90)], "seeded": [rng.randrange(1, 700) for _ in range(75)]}
    sampling = {"greedy": GREEDY, "seeded": SEEDED}
    asked, answers, homes, shared = [], {c: [] for c in convs}, {c: [] for c in convs}, {c: 0 for c in convs}

    async def first_turns():  # together, so the two conversations start on different replicas
        return await asyncio.gather(*(asyncio.to_thread(_turn, url, name, convs[c], sampling[c]) for c in convs))

    before = _admitted(url)
    for c, (ids, cached) in zip(convs, asyncio.run(first_turns())):
        assert cached == 0
        asked.append((convs[c], sampling[c]))
        answers[c].append(ids)
    assert sorted(a - b for a, b in zip(_admitted(url), before)) == [1, 1], "one first turn on each replica"
    for turn in range(1, 5):
        for c in convs:
            full = convs[c] + answers[c][-1]
            shared[c] = len(full)
            convs[c] = full + [rng.randrange(1, 700) for _ in range(rng.randrange(5, 20))]
            before = _admitted(url)
            ids, cached = _turn(url, name, convs[c], sampling[c])
            homes[c].append(_where(url, before))
            # what the last turn wrote (all but its last token), rounded down to the grid (K3: its snapshots')
            assert cached == (shared[c] - 1) // grid * grid, (c, turn, cached, shared[c])
            asked.append((convs[c], sampling[c]))
            answers[c].append(ids)
    assert all(len(set(h)) == 1 for h in homes.values()) and homes["greedy"] != homes["seeded"], homes
    got = [a for c in convs for a in answers[c][:1]] + [answers[c][t] for t in range(1, 5) for c in convs]
    assert got == _reference(path, asked)


def test_a_busy_home_keeps_a_long_conversation_and_loses_a_short_one(apps):
    """The rule: a replica's score is its cached tokens of the request minus prefix_load_weight (256)
    per sequence running there. With one long stream running at each conversation's home, a
    conversation with 400 cached tokens stays and one with 48 moves to the idle replica."""
    url, _, _ = apps["pk2"]
    rng = random.Random(4)
    result = {}
    for label, length in (("long", 400), ("short", 40)):
        prompt = [rng.randrange(1, 700) for _ in range(length)]
        before = _admitted(url)
        ids, _ = _turn(url, "pk2", prompt, GREEDY)
        home = _where(url, before)
        # a long stream that shares 32 tokens of the conversation, so it goes to the same replica
        before = _admitted(url)
        stop = threading.Event()
        blocker = threading.Thread(target=_stream_until, args=(url, prompt[:32] + [1, 2, 3], stop))
        blocker.start()
        try:
            _wait_running(url, home)
            assert _where(url, before) == home
            before = _admitted(url)
            _, cached = _turn(url, "pk2", prompt + ids + [5, 6, 7], GREEDY)
            result[label] = (_where(url, before) == home, cached)
        finally:
            stop.set()
            blocker.join(60)
    assert result["long"][0] and result["long"][1] >= 400, result  # 400+ cached − 256 > 0 − 0
    assert not result["short"][0] and result["short"][1] == 0, result  # 48 cached − 256 < 0: moved, computed


def _stream_until(url, prompt, stop: threading.Event) -> None:
    body = {"model": "pk2", "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for _ in r.iter_lines():
            if stop.is_set():
                return  # closing the stream aborts the request


def _wait_running(url, replica: int, timeout_s: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _status(url)["attention"][replica]["cache_blocks_used"] > 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the blocking stream never ran on attention[{replica}]")


def test_salts_separate_equal_prompts(apps):
    url, _, grid = apps["pk2"]
    prompt = [random.Random(9).randrange(1, 700) for _ in range(100)]
    assert _turn(url, "pk2", prompt, GREEDY, salt="tenant-a")[1] == 0
    assert _turn(url, "pk2", prompt, GREEDY, salt="tenant-b")[1] == 0
    assert _turn(url, "pk2", prompt, GREEDY)[1] == 0  # no salt is a salt of its own
    assert _turn(url, "pk2", prompt, GREEDY, salt="tenant-a")[1] == 96


def test_metrics_and_status_show_the_prefix_cache(apps):
    url, _, _ = apps["pk2"]
    s = series(url)
    hits = {dict(labels)["actor"]: v for (n, labels), v in s.items() if n == "moeray:prefix_cache_hits_total"}
    queries = {dict(labels)["actor"]: v for (n, labels), v in s.items() if n == "moeray:prefix_cache_queries_total"}
    assert set(hits) == set(queries) == {"0", "1"} and sum(hits.values()) > 0
    assert all(hits[a] <= queries[a] for a in hits)
    st = _status(url)
    assert st["prefix_caching"] and sum(a["prefix_cache"]["blocks_cached"] for a in st["attention"]) > 0
    assert sum(a["prefix_cache"]["hit_tokens"] for a in st["attention"]) == sum(hits.values())


def test_a_conversation_through_scale_down_and_a_killed_attention_actor_answers_exactly(apps):
    """K3 (blocks and KDA snapshots): turns 1–2, `moeray scale attention 1`, turn 3 (its cache went
    with the removed replica or stayed, either way exact), `moeray chaos kill-attention 0`, turns
    4–5 (the replacement starts with an empty cache): the answers are the fault-free cluster's."""
    url, path, _ = apps["pk3"]
    rng = random.Random(12)
    conv = [rng.randrange(1, 700) for _ in range(110)]
    asked, answers = [], []
    for turn in range(5):
        if turn == 2:
            run_cli(url, "scale", "attention", "1")
        if turn == 3:
            run_cli(url, "chaos", "kill-attention", "0")
        if turn:
            conv = conv + answers[-1] + [rng.randrange(1, 700) for _ in range(8)]
        ids, _ = _turn(url, "pk3", conv, SEEDED)
        asked.append((conv, SEEDED))
        answers.append(ids)
    assert len(_status(url)["attention"]) == 1
    assert answers == _reference(path, asked)
