"""Serving an FP8 checkpoint (issue 11), in one process (no Ray): a chat request without max_tokens
succeeds on a config whose context (4096) exceeds one replica's cache (Must show 5) — the default
max_tokens is the largest that fits the cache.

One in-process app for the module (tests/deploy/inproc.py), on test_quant_serve.py's checkpoint and
cache. What needs actors stays there: each expert actor's resident weight bytes in `moeray status
--json` (Must show 1), and the load progress the actors publish."""

import httpx
import openai
import pytest

from inproc import preset, serve
from model.config import load_config

BLOCKS, BLOCK = 6, 16  # 96 tokens of cache per replica, against a 4096-token context


@pytest.fixture(scope="module")
def server():
    path = preset("kimi-k2-tiny", seed=6, quant="fp8")
    with serve(path, served_model_name="k2", attention=1, experts=2, num_blocks=BLOCKS, block_size=BLOCK,
               max_num_seqs=4) as s:
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
        yield {"url": s.url, "path": path}


def test_chat_without_max_tokens_fits_the_cache(server):
    assert load_config(server["path"]).max_position_embeddings > BLOCKS * BLOCK
    client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="k2", messages=[{"role": "user", "content": "hello there"}],
                                       extra_body={"ignore_eos": True}, timeout=300)
    prompt = r.usage.prompt_tokens
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == BLOCKS * BLOCK - prompt  # the largest that fits the cache
