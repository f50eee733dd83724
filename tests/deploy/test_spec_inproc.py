"""Speculative decoding through the served app in one process (tests/deploy/inproc.py: the real
Ingress, engine server and attention worker over HTTP), with async scheduling on, as served by
default: drafting goes on through a long answer after its drafts missed, and changes no token."""

import httpx

from inproc import preset, serve

# greedy continuations of the seeded kimi-k2-tiny that wander first (the suffix drafts miss, so drafting
# rests) and fall into repeats later
PROMPTS = [[(i * 29 + j * 3) % 700 + 13 for j in range(8 + 5 * i)] for i in range(4)]
TOKENS = 160


def _answers(path, speculative) -> tuple[list[str], dict | None]:
    with serve(path, served_model_name="m", attention=1, experts=1, speculative=speculative) as server:
        texts = []
        for p in PROMPTS:
            r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                           json={"model": "m", "prompt": p, "max_tokens": TOKENS, "temperature": 0,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert server.engine_server.engine.stats.ahead_steps > 0  # async scheduling ran (the default)
        return texts, httpx.get(f"{server.url}/status", timeout=30).json()["speculative"]


def test_served_suffix_drafts_keep_coming_after_misses_and_change_no_token():
    """Each answer's drafts miss early (its acceptance falls under the floor, so it rests), and the
    sequence probes again every few steps all through its 160 tokens, accepting drafts once its
    continuation repeats. With async scheduling, steps sent ahead never counted towards the probe:
    these four answers drafted 26 times and accepted 17 tokens, nearly all in their first steps."""
    path = preset("kimi-k2-tiny", seed=8)
    plain, off = _answers(path, None)
    drafted, spec = _answers(path, {"method": "suffix", "num_speculative_tokens": 4})
    assert off is None and drafted == plain
    assert spec["drafts"] >= 10 * len(PROMPTS), spec  # probes all along each answer
    assert spec["accepted_tokens"] >= 2 * len(PROMPTS), spec
