"""The Serve app on the session's 3 local Ray nodes, driven as a user drives it: greedy SSE streams and
the official `openai` client over HTTP, the `moeray` command in a subprocess, /metrics parsed. Two apps
serve every test here, each started once for its class (a start costs ~15 s of setup and ~5 s of
teardown): kimi-k2-tiny (:class:`TestK2`) and kimi-k3-tiny (:class:`TestK3`), each 2 attention × 2
expert actors, one after the other (the K2 app is deleted before the K3 app starts, so each class's
tests see the session cluster's engine actors as their app's). Every test leaves its app as it found it — the shape restored, healthy, idle — and
says so (the ``as_found`` check after each), so their order does not matter; counters (epoch, failures,
recoveries, pauses, tokens) are read as deltas around what a test does.

What they show:
- a greedy completion equals `moeray generate` (the single process); a client going away under Serve —
  a stream, or a request not streamed — frees its sequences (Serve's proxy cancels the handler, and
  the replica's engine stream, opened under an earlier request, survives). The rest of the serving
  issue's HTTP semantics is tested on the same app in one process: test_serve_inproc.py;
- the quick start's `moeray scale` / `moeray chaos` with neither --url nor a key: the app and the
  admin token (mode 0600) come from the cache directory `moeray up` wrote them to (the K2 app runs with
  the admin token `moeray up` makes on loopback, recorded as `moeray up` records its app: up.json). The
  admin routes' access rules are tested in one process (test_admin_inproc.py); the real `moeray up`
  writing and removing the token is in test_down.py;
- live scaling (issue 8, Must show 1-4) and recovery (issue 9, Must show 1-4) while streams run: one
  set of streams per app outlives every change and fault made while it runs (`moeray scale`,
  `moeray chaos kill-expert|kill-attention`, a `ray.kill`), and every stream's text equals the
  single-process model's, token for token, with no token repeated or skipped; grammar-constrained
  greedy streams among them give their fault-free answer; the epoch, pause, failure and recovery
  counters move by what was done; `moeray rebalance` re-places K3's experts (the imbalance falls);
- changes that cannot fit, and faults during changes: `moeray scale experts 16` on a cluster that can
  never hold it is refused in seconds with the planner's explanation, and the app serves on, exactly;
  `moeray chaos kill-expert` while `moeray scale experts` is preparing (its new actors still loading):
  the change completes or is abandoned, the recovery runs, every stream is exact, `/health` is 200, and
  no actor or placement group of the app is left without a place in its shape;
- prefix caching (issue 26, Must show 1, 4, 5, 6) through the official `openai` client: five-turn
  conversations on both apps answer exactly what the single process (no prefix cache) answers, with
  `cached_tokens` equal to the grid-rounded shared length from turn 2 on; later turns go where their
  conversation's cache is unless load outweighs it; a K3 conversation survives `moeray scale attention
  2 → 1` and `moeray chaos kill-attention` exactly; salts separate tenants; /metrics and /status show
  the cache;
- a SIGKILL of the engine's Serve replica (last on the K2 app: Serve starts a new replica, whose
  engine starts afresh): its streams end with a clear error, never a hang, and the app heals itself.

A Ray node that goes away with the only room for an app's actors (503 + Retry-After, healed when it
returns) needs an app pinned to a node of its own: test_recovery.py."""

import asyncio
import json
import re
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import ray
from live import (ADMIN, CONSTRAINED, KEY, Stream, chat_reference, close_after, deploy, deploy_config, finish, metrics,
                  moeray, oracle, oracle_soon, run_cli, serve_config, series, start_streams)
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.util.placement_group import placement_group_table

from deploy.server import admin_token_file, healthy, with_loopback_admin_token
from model.loader import load_model
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams
from tests.presets import preset

MOERAY = str(Path(sys.executable).parent / "moeray")
AUTH = {"Authorization": f"Bearer {KEY}"}
CLIENT_KEYS = ["client-one", "client-two"]  # two more inference keys of the K2 app (one per client)
SHAPE = "2 attention × 2 expert actors"  # both apps', between tests

# Long enough that every stream outlasts the changes made while it runs (asserted): K2's stream set
# sees five changes (two of them recoveries), K3's two. Measured alone on 2 cores (12-04), the streams
# had 165-174 (K2, of 400 then: its app now drafts, so its streams are twice as long) and 107-109 (K3)
# tokens when the last change returned, the colocated K2 streams 147-180 of STREAM_TOKENS (before drafts); under load the streams (a chain of processes per step) slow down more
# than the changes (mostly actor starts), so the margin grows.
# what the changing streams ask for: more than five changes take (the app drafts: its streams run up to twice as
# fast as without; 800, then 1200, ran out before the last change once actors ran at niceness 0); they are
# closed just past the last change and compared as far as they went
K2_TOKENS = 1600
# the single process's answers to them, computed beside the app's start: as far as the streams usually go
# (~350 tokens when they are closed); a run whose streams went further computes more (_long_answers)
K2_ORACLE_TOKENS = 500
K3_TOKENS = 250
FAULT_TOKENS = 120  # the faults-during-changes streams
ENGINE_TOKENS = 40  # the healed app's output after its engine replica was killed


def _prompts(n):  # the streams that outlive the changes
    return [[(i * 53 + j * 7) % 700 + 3 for j in range(4 + 3 * i)] for i in range(n)]


FAULT_PROMPTS = [[(i * 37 + j * 5) % 700 + 7 for j in range(4 + 3 * i)] for i in range(4)]
ENGINE_PROMPTS = [[(i * 31 + j * 11) % 700 + 5 for j in range(3 + 4 * i)] for i in range(3)]
SKEWED = [[t] * 30 for t in (5, 5, 9, 5, 9, 5)]  # a skewed mix: the same experts win again and again


@dataclass
class App:
    name: str
    url: str
    path: Path
    admin: str  # its admin key
    expected: dict  # label → the single-process model's texts
    root: Path | None = None  # the cache directory `moeray up` would have written (K2)
    parity_tokens: int = 80  # the colocated apps' parity streams' length (PARITY_TOKENS)

    def cli(self, *args):
        """`moeray ARGS --url URL --admin-key KEY`: its report and when it returned."""
        return run_cli(self.url, *args, admin=self.admin)


def _status(url) -> dict:
    return httpx.get(f"{url}/status", headers=AUTH, timeout=30).json()



def _failures(url, kind) -> float:
    return next(v for (name, labels), v in series(url).items()
                if name == "moeray:actor_failures_total" and dict(labels).get("kind") == kind)


def _delta(after: dict, before: dict) -> dict:
    """The counts that moved (e.g. /status's failures by kind)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _kill(app: App, kind: str, index: int) -> float:
    """`moeray chaos kill-KIND INDEX` while streams run, waited for until the next step found the dead
    actor and the recovery replaced it: exactly one recovery epoch, one failure of that kind. Returns
    when the command returned."""
    before, failures = _status(app.url), _failures(app.url, kind)
    out, killed_at = app.cli("chaos", f"kill-{kind}", str(index))
    assert f"killed {kind}[{index}]" in out, out
    deadline = time.monotonic() + 120
    while (st := _status(app.url))["epoch"] == before["epoch"]:
        assert time.monotonic() < deadline, f"no recovery after killing {kind}[{index}]: {st['last_change']}"
        time.sleep(0.1)
    assert st["epoch"] == before["epoch"] + 1 and st["last_change"]["kind"] == "recovery", st["last_change"]
    assert _delta(st["failures"], before["failures"]) == {kind: 1}, (st["failures"], before["failures"])
    assert _failures(app.url, kind) == failures + 1
    assert len(st["recoveries_s"]) == len(before["recoveries_s"]) + 1
    return killed_at


def _as_found(app: App, shape: str = SHAPE) -> None:
    """The app as every test finds it: healthy, the shape, no change in progress, nothing running."""
    assert healthy(app.url), f"{app.name} is not healthy"
    deadline = time.monotonic() + 30  # an aborted request's sequence is freed at a later step
    while True:
        st = _status(app.url)
        if st["running"] == 0 and st["waiting"] == 0:
            break
        assert time.monotonic() < deadline, (st["running"], st["waiting"])
        time.sleep(0.1)
    assert st["shape"] == shape and not st["changing"], (st["shape"], st["change"])
    assert not any(r for e in st["experts"] for r in e["replicas"].values()), "replicated experts left behind"


def _shape_back(app: App) -> None:
    """Back to SHAPE from the shapes a K2 change test passes through, if a failed one left it there."""
    shape = _status(app.url)["shape"]
    if shape != SHAPE and not _status(app.url)["changing"]:
        attention, experts = (int(x) for x in re.findall(r"\d+", shape)[:2])
        if attention != 2:
            app.cli("scale", "attention", "2")
        if experts != 2:
            app.cli("scale", "experts", "2")


def _engine_actors():
    """The session cluster's alive engine actors (Ray's actor table records), by class."""
    return sorted(a["ActorClassName"] for a in _alive("AttentionWorker", "ExpertWorker", "Router"))


def _alive(*classes):
    return [a for a in ray._private.state.actors(actor_state_name="ALIVE").values() if a["ActorClassName"] in classes]


def _engine_pgs(app):
    return [v for v in placement_group_table().values()
            if v.get("name", "").startswith(f"moeray-{app}/") and v.get("state") != "REMOVED"]


def _proxy_ips():
    return sorted(a["Address"]["IPAddress"] for a in _alive("ProxyActor"))


# ---- prefix caching ---------------------------------------------------------------------------------
# A conversation here is token ids (completions with `return_token_ids`, as agent and RL frameworks drive
# a model), so the shared length is known exactly: each turn's prompt is the last turn's prompt and
# answer plus a new message.
ANSWER = 24
GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=1.0, seed=7)


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _turn(url, name, prompt, sampling, salt=None):
    """(generated ids, cached_tokens) of one completion on token ids."""
    extra = {"return_token_ids": True, "ignore_eos": True, **({"cache_salt": salt} if salt else {})}
    r = _client(url).completions.create(model=name, prompt=prompt, max_tokens=ANSWER, extra_body=extra, **sampling)
    choice = r.choices[0].model_dump()
    assert choice["prompt_token_ids"] == prompt
    return choice["token_ids"], r.usage.prompt_tokens_details.cached_tokens


def _admitted(url) -> list[int]:
    return [a["prefix_cache"]["admitted"] for a in _status(url)["attention"]]


def _where(url, before: list[int]) -> int:
    """The one replica that admitted a sequence since ``before``."""
    moved = [r for r, (a, b) in enumerate(zip(_admitted(url), before)) if a != b]
    assert len(moved) == 1, (before, _admitted(url))
    return moved[0]


def _reference(path, prompts_and_sampling) -> list[list[int]]:
    """The same requests, one by one, on the single process (model.runner: each its own cache, no prefix
    caching), in this process; the cluster without prefix caching equals it (tests/cluster/)."""
    net = load_model(path, progress=False)
    return [generate(ModelRunner(net, num_blocks=64, block_size=16, num_slots=1), [p],
                     [SamplingParams(max_tokens=ANSWER, ignore_eos=True, temperature=s["temperature"],
                                     seed=s.get("seed"))])[0].output_ids
            for p, s in prompts_and_sampling]


def _first_turns_together(url, name, prompts, sampling):
    """The first turns of conversations sent together, so that they start on different replicas."""
    async def together():
        return await asyncio.gather(*(asyncio.to_thread(_turn, url, name, p, s) for p, s in zip(prompts, sampling)))
    return asyncio.run(together())


def _five_turns(app: App, grid: int) -> None:
    """Two five-turn conversations (one greedy, one seeded) answer exactly what a cluster without prefix
    caching answers, with `cached_tokens` equal to the grid-rounded shared length from turn 2 on; each
    stays on its home replica, and the two homes differ."""
    url, name = app.url, app.name
    assert len({a["node"] for a in _status(url)["attention"] + _status(url)["experts"]}) >= 2
    rng = random.Random(hash(name) % 1000)
    convs = {"greedy": [rng.randrange(1, 700) for _ in range(90)], "seeded": [rng.randrange(1, 700) for _ in range(75)]}
    sampling = {"greedy": GREEDY, "seeded": SEEDED}
    asked, answers, homes, shared = [], {c: [] for c in convs}, {c: [] for c in convs}, {c: 0 for c in convs}
    before = _admitted(url)
    for c, (ids, cached) in zip(convs, _first_turns_together(url, name, convs.values(), sampling.values())):
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
    assert got == _reference(app.path, asked)


def _stream_until(url, prompt, stop: threading.Event) -> None:
    body = {"model": "k2", "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for _ in r.iter_lines():
            if stop.is_set():
                return  # closing the stream aborts the request


def _wait_running(url, replica: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _status(url)["attention"][replica]["cache_blocks_used"] > 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the blocking stream never ran on attention[{replica}]")


# ==== kimi-k2-tiny =====================================================================================
@pytest.fixture(scope="class")
def k2(serve_port, tmp_path_factory):
    """kimi-k2-tiny, 2 attention × 2 expert actors, its Serve replicas on a worker node (node 1; the one
    HTTP proxy is on the head), three inference keys, and the admin token `moeray up` makes on loopback,
    recorded in a cache directory as `moeray up` records its app (up.json)."""
    root = tmp_path_factory.mktemp("cache")
    path = preset("kimi-k2-tiny", seed=8)
    # (the single process's answers computed while the app starts: mostly other processes starting)
    oracles = {"long": oracle_soon(path, _prompts(8), K2_ORACLE_TOKENS), "faults": oracle_soon(path, FAULT_PROMPTS, FAULT_TOKENS),
               "engine": oracle_soon(path, ENGINE_PROMPTS, ENGINE_TOKENS)}
    # speculative decoding on (ngram, 4 drafts, every one of up to 16 sequences drafting): every test of
    # this app is then also a test of exact outputs with drafts, its faults and changes among them
    cfg = serve_config(serve_port, path, "k2", attention=2, experts=2, api_keys=CLIENT_KEYS, admin_api_key=None,
                       speculative={"method": "ngram", "num_speculative_tokens": 4, "full_draft_batch": 16})
    cfg = with_loopback_admin_token(cfg, root)
    assert cfg.admin_api_key is not None
    url = deploy_config(cfg, serve_on=1)
    (root / "up.json").write_text(json.dumps({"pid": os.getpid(), "url": url, "model": "k2", "auth": True}))
    try:
        yield App("k2", url, path, cfg.admin_api_key, {k: o.result() for k, o in oracles.items()}, root)
    finally:
        serve.delete("k2")


def _long_answers(k2, streams) -> list[str]:
    """The single process's answers to the long streams' prompts, at least as far as ``streams`` went
    (a greedy answer's first tokens do not depend on its length; 8 tokens' margin for a character
    that a stream's last token left half decoded)."""
    need = max(len(s.pieces) for s in streams) + 8
    return k2.expected["long"] if need <= K2_ORACLE_TOKENS else oracle(k2.path, _prompts(8), need)


def _moeray_up(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`moeray ARGS` as after `moeray up`: its cache directory, no key given, none in the environment."""
    env = {k: v for k, v in os.environ.items() if k != "MOERAY_ADMIN_KEY"} | {"MOERAY_CACHE_DIR": str(root),
                                                                                "COLUMNS": "300"}
    return subprocess.run([MOERAY, *args], capture_output=True, text=True, env=env, timeout=600)


def _generate_cli(path, ids, n):
    out = subprocess.run([MOERAY, "generate", "--model", str(path), "--prompt-ids", ",".join(map(str, ids)),
                          "--max-tokens", str(n), "--ignore-eos", "--json"], capture_output=True, text=True,
                         check=True, env=os.environ, timeout=300)
    return json.loads(out.stdout)


def _wait_idle(url, within_s: float) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        st = _status(url)
        if st["running"] == 0 and st["waiting"] == 0 and st["streams"]["requests"] == 0:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.1)


def _generated(url) -> float:
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "moeray:generation_tokens_total")


def _no_orphans(app: str, members: int) -> None:
    """The app's live actors are exactly its shape, and its placement groups reserve exactly one
    bundle for each of them (a change's reservation is released when it is abandoned). The live
    actors are the session cluster's: this app's alone while its class runs."""
    deadline = time.monotonic() + 30  # Ray marks a killed actor dead asynchronously
    while True:
        alive = _alive("AttentionWorker", "ExpertWorker")
        bundles = sum(len(v.get("bundles", {})) for v in _engine_pgs(app))
        if len(alive) == members == bundles:
            return
        assert time.monotonic() < deadline, f"{len(alive)} live actors and {bundles} bundles for a shape of {members}"
        time.sleep(0.2)


class TestK2:
    @pytest.fixture(autouse=True)
    def as_found(self, k2):
        _shape_back(k2)  # a test that failed mid-change left its shape: that test failed, not the next ones
        _as_found(k2)
        yield
        _as_found(k2)

    # ---- serving under Serve ------------------------------------------------------------------------
    def test_greedy_completion_equals_moeray_generate(self, k2):
        client = openai.OpenAI(base_url=f"{k2.url}/v1", api_key=KEY, max_retries=0)
        ids = [5, 77, 300, 12, 9]
        got = client.completions.create(model="k2", prompt=ids, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        ref = _generate_cli(k2.path, ids, 8)
        assert got.choices[0].text == ref["text"]
        assert got.usage.completion_tokens == 8 and got.usage.prompt_tokens == 5
        assert got.choices[0].finish_reason == "length"

    def test_disconnect_frees_the_sequence(self, k2):
        """A stream whose client goes away under Serve (the proxy cancels the handler) frees its sequence;
        the replica's engine stream, opened under an earlier request, is not cancelled with it."""
        body = {"model": "k2", "prompt": "go", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{k2.url}/v1/completions", headers=AUTH, json=body, timeout=60) as r:
            for _ in zip(range(3), r.iter_lines()):
                pass
        st = _wait_idle(k2.url, 20)  # the engine thread aborts the sequence and the replica's event loop drops its stream
        assert all(a["cache_blocks_used"] == 0 for a in st["attention"])
        assert st["streams"] == {"subscriptions": 1, "requests": 0}, st

    def test_served_non_streamed_request_freed_when_its_client_goes(self, k2, serve_port):
        """Under Serve, whose proxy cancels the handler of a client that went away (the Ingress's poll
        without Serve, at every front door: test_doors_inproc.py)."""
        _wait_idle(k2.url, 60)
        before = _generated(k2.url)
        payload = json.dumps({"model": "k2", "prompt": "go", "temperature": 0, "ignore_eos": True,
                              "max_tokens": 4000}).encode()
        sock = socket.create_connection(("127.0.0.1", serve_port), timeout=30)
        sock.sendall(b"POST /k2/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(payload)).encode()
                     + b"\r\n\r\n" + payload)
        deadline = time.monotonic() + 60
        while _status(k2.url)["running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        time.sleep(0.5)
        sock.close()
        st = _wait_idle(k2.url, 5)
        assert st["streams"]["subscriptions"] == 1, st  # the replica's engine stream outlives the request
        assert all(a["cache_blocks_used"] == 0 for a in st["attention"]), st
        generated = _generated(k2.url) - before
        assert generated < 4000, generated  # cut short, not run to its max_tokens

    # ---- the quick start's admin commands through the token file -----------------------------------
    def test_quick_start_scale_and_chaos_work_on_loopback_through_the_token_file(self, k2):
        """`moeray scale` and `moeray chaos` with neither --url nor a key, as in the README: the app and
        the token come from the cache directory `moeray up` wrote them to."""
        root, url = k2.root, k2.url
        assert stat.S_IMODE(admin_token_file(root).stat().st_mode) == 0o600
        done = _moeray_up(root, "scale", "experts", "3")
        assert done.returncode == 0 and f"{SHAPE} → 2 attention × 3 expert actors" in done.stderr, done.stderr
        done = _moeray_up(root, "chaos", "kill-expert", "1")
        assert done.returncode == 0 and "killed expert[1]" in done.stderr, done.stderr
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {CLIENT_KEYS[0]}"}, timeout=300,
                       json={"model": "k2", "prompt": "after the kill", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text  # its step finds the dead actor
        st = httpx.get(f"{url}/status", headers={"Authorization": f"Bearer {CLIENT_KEYS[0]}"}, timeout=30).json()
        assert st["last_change"]["kind"] == "recovery" and len(st["experts"]) == 3, st["last_change"]
        done = _moeray_up(root, "experts", "--json")
        assert done.returncode == 0 and json.loads(done.stdout)["url"] == url, done.stderr
        done = _moeray_up(root, "scale", "experts", "2")  # as found
        assert done.returncode == 0 and f"2 attention × 3 expert actors → {SHAPE}" in done.stderr, done.stderr

    # ---- live scaling and recovery under one set of streams ----------------------------------------
    def test_scale_experts_2_4_2_kills_and_attention_2_1_while_10_streams_run(self, k2):
        """8 greedy streams and 2 grammar-constrained ones (one per attention replica) run while, one
        after another: `moeray scale experts 4`, `moeray chaos kill-expert 1` (recovered), `moeray scale
        experts 2`, `moeray chaos kill-attention 0` (its sequences re-prefilled on the replacement, a
        constrained stream's matcher rebuilt from its tokens), `moeray scale attention 1` (the removed
        replica's sequences re-prefilled on the other). SSE unbroken: every stream outlives every change
        and equals the single-process model's (the constrained ones their fault-free answer), one chunk
        per token, nothing repeated or skipped; each change is one epoch and one pause, each kill one
        failure and one recovery. Then `moeray scale attention 2` restores the shape.

        The streams ask for K2_TOKENS and are closed 16 tokens past the last change (the clients go
        away): what they received must be the start of the single process's answer (the constrained
        ones' of their fault-free answer, computed afterwards as long as they went)."""
        url = k2.url
        before, before_m = _status(url), metrics(url)
        epoch = before["epoch"]
        streams = start_streams(url, "k2", _prompts(8), K2_TOKENS,
                                [Stream(url, "k2", None, K2_TOKENS, CONSTRAINED) for _ in range(2)])
        out, at = k2.cli("scale", "experts", "4")
        assert f"epoch {epoch + 1} (experts): {SHAPE} → 2 attention × 4 expert actors" in out, out
        _kill(k2, "expert", 1)
        out, at = k2.cli("scale", "experts", "2")
        assert f"epoch {epoch + 3} (experts): 2 attention × 4 expert actors → {SHAPE}" in out and "paused" in out, out
        _kill(k2, "attention", 0)
        out, last = k2.cli("scale", "attention", "1")
        assert "→ 1 attention × 2 expert actors" in out and "sequences moved" in out, out
        assert all(s.ended is None for s in streams), "a stream ended before the last change"
        close_after(streams, 16)
        got = ["".join(s.pieces) for s in streams]
        expected = _long_answers(k2, streams)
        # a grammar-constrained greedy answer, fault-free, as long as the longest constrained stream
        constrained = chat_reference(url, "k2", max(len(s.pieces) for s in streams[-2:]), CONSTRAINED)
        for text, want, s in zip(got, [*expected, constrained, constrained], streams):
            # one chunk per token, nothing repeated or skipped: the text received is the answer's start
            assert text and want.startswith(text), (len(s.pieces), text[-80:], want[len(text) - 80: len(text) + 20])
        assert constrained.startswith("[")
        assert httpx.get(f"{url}/health").status_code == 200

        after, after_m = _status(url), metrics(url)
        assert after["epoch"] == epoch + 5 and after_m["moeray:epoch"] == epoch + 5
        assert after_m["moeray:epoch_pause_seconds_count"] - before_m["moeray:epoch_pause_seconds_count"] == 5
        assert after_m["moeray:epoch_pause_seconds_sum"] > before_m["moeray:epoch_pause_seconds_sum"]
        assert _delta(after["failures"], before["failures"]) == {"expert": 1, "attention": 1}
        assert len(after["recoveries_s"]) == len(before["recoveries_s"]) + 2
        spec, was = after["speculative"], before["speculative"]  # the streams ran with drafts, some accepted
        assert spec["accepted_tokens"] > was["accepted_tokens"], spec
        assert spec["draft_tokens"] - was["draft_tokens"] > spec["accepted_tokens"] - was["accepted_tokens"], spec
        st = json.loads(moeray("status", "--url", url, "--api-key", KEY, "--json").stdout)
        assert st["epoch"] == epoch + 5 and st["last_change"]["kind"] == "attention" and len(st["experts"]) == 2
        assert st["experts"][0]["slots"] == {str(l): list(range(8)) for l in st["experts"][0]["slots"]}
        bad = moeray("chaos", "kill-expert", "7", "--url", url, "--admin-key", k2.admin)
        assert bad.returncode == 2 and "there is no expert[7]" in bad.stderr
        out, _ = k2.cli("scale", "attention", "2")  # as found
        assert f"1 attention × 2 expert actors → {SHAPE}" in out, out

    # ---- changes that cannot fit, and faults during changes ----------------------------------------
    def test_a_scale_the_cluster_cannot_hold_is_refused_at_once(self, k2):
        url, expected = k2.url, k2.expected["faults"]
        before = _status(url)
        t0 = time.monotonic()
        refused = moeray("scale", "experts", "16", "--url", url, "--admin-key", k2.admin)
        took = time.monotonic() - t0
        assert refused.returncode != 0 and took < 10, (took, refused.stderr)
        assert "cannot hold" in refused.stderr and "Planner:" in refused.stderr, refused.stderr
        assert "a shape that fits" in refused.stderr
        st = _status(url)
        assert st["shape"] == SHAPE and not st["changing"] and st["epoch"] == before["epoch"]
        assert finish(start_streams(url, "k2", FAULT_PROMPTS, FAULT_TOKENS)) == expected

    def test_an_actor_killed_while_a_scale_prepares_leaves_a_consistent_app(self, k2):
        url, expected = k2.url, k2.expected["faults"]
        before = _status(url)
        scale = subprocess.Popen([MOERAY, "scale", "experts", "4", "--url", url, "--admin-key", k2.admin],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "COLUMNS": "300"})
        try:
            deadline = time.monotonic() + 60
            while not _status(url)["changing"]:  # the new actors are being started and loaded
                assert time.monotonic() < deadline and scale.poll() is None, "the scale never began"
                time.sleep(0.05)
            # the streams start once the change prepares (started before it, they once ended during the
            # 5 s it took to begin, and the kill then landed on an idle app: no step failed to count it)
            streams = start_streams(url, "k2", FAULT_PROMPTS, FAULT_TOKENS)
            k2.cli("chaos", "kill-expert", "1")
            assert all(s.ended is None for s in streams), "a stream ended before the kill"
            _, err = scale.communicate(timeout=600)
        finally:
            if scale.poll() is None:
                scale.kill()
        assert finish(streams) == expected
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        st = _status(url)
        if scale.returncode == 0:  # it completed before the kill's step failed: the recovery came after
            assert st["shape"] == "2 attention × 4 expert actors", (st["shape"], err)
        else:  # abandoned: the old shape, recovered
            assert "interrupted" in err and st["shape"] == SHAPE, (st["shape"], err)
        assert st["last_change"]["kind"] == "recovery" and not st["changing"]
        assert _delta(st["failures"], before["failures"]) == {"expert": 1}, (st["failures"], before["failures"])
        assert st["epoch"] > before["epoch"]
        _no_orphans("k2", len(st["attention"]) + len(st["experts"]))
        assert finish(start_streams(url, "k2", FAULT_PROMPTS, FAULT_TOKENS)) == expected  # and it serves on, exactly
        if st["shape"] != SHAPE:  # as found
            k2.cli("scale", "experts", "2")
            _no_orphans("k2", 4)

    def test_status_with_an_expert_down_and_no_step_to_notice_it(self, k2):
        """`moeray status` between a kill and the next step (nothing has noticed the dead actor yet): the
        table prints, that actor's weights unknown; the next request recovers it and is exact."""
        url, expected = k2.url, k2.expected["faults"]
        k2.cli("chaos", "kill-expert", "0")
        deadline = time.monotonic() + 30
        while True:
            shown = moeray("status", "--url", url, "--api-key", KEY)
            assert shown.returncode == 0, shown.stderr
            if "weights unknown" in shown.stdout:
                break
            assert time.monotonic() < deadline, shown.stdout  # Ray marks the killed actor dead asynchronously
            time.sleep(0.5)
        assert "expert[0]" in shown.stdout and "expert[1]" in shown.stdout
        assert finish(start_streams(url, "k2", FAULT_PROMPTS, FAULT_TOKENS)) == expected
        assert _status(url)["last_change"]["kind"] == "recovery"

    # ---- prefix caching (issue 26, Must show 1, 4, 5, 6) ---------------------------------------------
    def test_five_turns_equal_a_cluster_without_prefix_caching_and_hit_the_shared_length(self, k2):
        _five_turns(k2, grid=16)

    def test_a_busy_home_keeps_a_long_conversation_and_loses_a_short_one(self, k2):
        """The rule: a replica's score is its cached tokens of the request minus prefix_load_weight (256)
        per sequence running there. With one long stream running at each conversation's home, a
        conversation with 400 cached tokens stays and one with 48 moves to the idle replica."""
        url = k2.url
        rng = random.Random(4)
        result = {}
        for label, length in (("long", 400), ("short", 40)):
            prompt = [rng.randrange(1, 700) for _ in range(length)]
            before = _admitted(url)
            ids, _ = _turn(url, "k2", prompt, GREEDY)
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
                _, cached = _turn(url, "k2", prompt + ids + [5, 6, 7], GREEDY)
                result[label] = (_where(url, before) == home, cached)
            finally:
                stop.set()
                blocker.join(60)
        assert result["long"][0] and result["long"][1] >= 400, result  # 400+ cached − 256 > 0 − 0
        assert not result["short"][0] and result["short"][1] == 0, result  # 48 cached − 256 < 0: moved, computed

    def test_salts_separate_equal_prompts(self, k2):
        prompt = [random.Random(9).randrange(1, 700) for _ in range(100)]
        assert _turn(k2.url, "k2", prompt, GREEDY, salt="tenant-a")[1] == 0
        assert _turn(k2.url, "k2", prompt, GREEDY, salt="tenant-b")[1] == 0
        assert _turn(k2.url, "k2", prompt, GREEDY)[1] == 0  # no salt is a salt of its own
        assert _turn(k2.url, "k2", prompt, GREEDY, salt="tenant-a")[1] == 96

    def test_metrics_and_status_show_the_prefix_cache(self, k2):
        """After two conversations of two turns (their first turns together: one on each replica), /metrics
        counts prefix cache hits and queries per attention replica, and /status agrees."""
        url = k2.url
        rng = random.Random(5)
        convs = [[rng.randrange(1, 700) for _ in range(60)] for _ in range(2)]
        for conv, (ids, _) in zip(convs, _first_turns_together(url, "k2", convs, [GREEDY, GREEDY])):
            assert _turn(url, "k2", conv + ids + [5, 6, 7], GREEDY)[1] > 0
        s = series(url)
        hits = {dict(labels)["actor"]: v for (n, labels), v in s.items() if n == "moeray:prefix_cache_hits_total"}
        queries = {dict(labels)["actor"]: v for (n, labels), v in s.items() if n == "moeray:prefix_cache_queries_total"}
        assert set(hits) == set(queries) == {"0", "1"} and sum(hits.values()) > 0
        assert all(hits[a] <= queries[a] for a in hits)
        st = _status(url)
        assert st["prefix_caching"] and sum(a["prefix_cache"]["blocks_cached"] for a in st["attention"]) > 0
        assert sum(a["prefix_cache"]["hit_tokens"] for a in st["attention"]) == sum(hits.values())

    # ---- last: Serve replaces the killed replica with a new one (the engine starts afresh) -----------
    def test_killed_engine_replica_ends_streams_with_an_error_and_the_app_heals(self, k2, ray_cluster):
        """The streams cut by the kill ask for 400 tokens (they are surely still running when it comes);
        the healed app's output is checked token for token on 40 (what it serves, not for how long).
        The replicas are on a worker node, and the one HTTP proxy stays on the head throughout: a proxy
        that followed the replica would be drained and killed with connections the kernel had given it
        (every proxy of a one-machine cluster binds the same port)."""
        url, expected = k2.url, k2.expected["engine"]
        head = [ray_cluster.node_ips[0]]
        assert _proxy_ips() == head
        actors = _engine_actors()  # this app's, plus any other app's still on the session cluster
        assert len(_engine_pgs("k2")) == 1 and actors.count("ExpertWorker") >= 2
        pid = _status(url)["pid"]
        streams = start_streams(url, "k2", ENGINE_PROMPTS, 400)
        os.kill(pid, signal.SIGKILL)
        for s in streams:
            s.join(120)
            assert s.ended is not None, "a stream hung after its engine died"
            assert s.error_event is not None and s.error_event["code"] == "engine_failed", (s.error, s.pieces[-3:])
        deadline = time.monotonic() + 240
        while not healthy(url):  # Serve starts a new replica by itself
            assert time.monotonic() < deadline, "the app did not heal by itself"
            time.sleep(0.25)
        assert _status(url)["pid"] != pid
        assert finish(start_streams(url, "k2", ENGINE_PROMPTS, ENGINE_TOKENS)) == expected
        assert _proxy_ips() == head
        assert len(_engine_pgs("k2")) == 1  # the dead replica's reservation did not stay behind
        assert _engine_actors() == actors  # the dead replica's actors are gone, the new one's are there


# ==== kimi-k3-tiny =====================================================================================
@pytest.fixture(scope="class")
def k3(serve_port):
    """kimi-k3-tiny (16 experts; KDA layers, whose state is re-prefilled), 2 attention × 2 expert actors,
    the router's rebalance window 16 steps."""
    path = preset("kimi-k3-tiny", seed=9)
    oracles = {"long": oracle_soon(path, _prompts(8), K3_TOKENS), "skewed": oracle_soon(path, SKEWED, 12),
               "40": oracle_soon(path, _prompts(8), 40)}
    url = deploy(serve_port, path, "k3", attention=2, experts=2, rebalance_window_steps=16)
    try:
        yield App("k3", url, path, ADMIN, {k: o.result() for k, o in oracles.items()})
    finally:
        serve.delete("k3")


def _imbalance(url) -> float:
    """Mean over MoE layers of the measured max/mean tokens per expert actor, from /metrics."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    values = [s.value for f in text_string_to_metric_families(text) if f.name == "moeray:expert_actor_imbalance"
              for s in f.samples]
    assert values
    return sum(values) / len(values)


class TestK3:
    @pytest.fixture(autouse=True)
    def as_found(self, k3):
        _as_found(k3)
        yield
        _as_found(k3)

    def test_uneven_scale_and_a_killed_expert_while_10_streams_run(self, k3):
        """16 experts from 2 actors to 3 (6/5/5), then `moeray chaos kill-expert 1` (recovered), while 8
        greedy streams and 2 grammar-constrained ones (one per attention replica) run: every stream
        outlives both, each equals the single-process model's (the constrained ones their fault-free
        answer), nothing repeated or skipped; one epoch each, one expert failure and one recovery. Then
        `moeray scale experts 2` restores the shape. (K3's attention kill is covered at the engine level,
        tests/cluster/test_engine.py.)"""
        url, expected = k3.url, k3.expected["long"]
        before = _status(url)
        constrained = chat_reference(url, "k3", K3_TOKENS, CONSTRAINED)
        streams = start_streams(url, "k3", _prompts(8), K3_TOKENS,
                                [Stream(url, "k3", None, K3_TOKENS, CONSTRAINED) for _ in range(2)])
        out, _ = k3.cli("scale", "experts", "3")
        assert f"{SHAPE} → 2 attention × 3 expert actors" in out, out
        last = _kill(k3, "expert", 1)
        assert all(s.ended is None or s.ended > last for s in streams), "a stream ended before the kill"
        assert finish(streams) == [*expected, constrained, constrained]
        assert all(s.finish == "length" and len(s.pieces) == K3_TOKENS for s in streams[:-2])
        assert all(s.finish == "length" for s in streams[-2:]) and constrained.startswith("[")
        assert httpx.get(f"{url}/health").status_code == 200
        st = json.loads(moeray("status", "--url", url, "--api-key", KEY, "--json").stdout)
        assert [len(e["slots"][next(iter(e["slots"]))]) for e in st["experts"]] == [6, 5, 5]
        assert st["epoch"] == before["epoch"] + 2
        assert _delta(st["failures"], before["failures"]) == {"expert": 1}
        assert len(st["recoveries_s"]) == len(before["recoveries_s"]) + 1
        bad = moeray("chaos", "kill-expert", "7", "--url", url, "--admin-key", ADMIN)
        assert bad.returncode == 2 and "there is no expert[7]" in bad.stderr
        out, _ = k3.cli("scale", "experts", "2")  # as found
        assert f"2 attention × 3 expert actors → {SHAPE}" in out, out

    def test_uneven_k3_rebalance_over_http(self, k3):
        """`moeray scale experts 3` (6/5/5), then `moeray rebalance` with replicas: outputs unchanged, the
        imbalance report printed, the measured imbalance lower; then `moeray scale experts 2` (contiguous
        shards again: no replicas). The admin routes refuse bad counts and inference keys."""
        url = k3.url
        before_epoch = _status(url)["epoch"]
        out, _ = k3.cli("scale", "experts", "3")  # a new epoch, so the gauge below sees this mix alone
        assert f"{SHAPE} → 2 attention × 3 expert actors" in out, out
        assert finish(start_streams(url, "k3", SKEWED, 12)) == k3.expected["skewed"]
        before = _imbalance(url)  # and the router's 16-step window holds this mix too
        out, _ = k3.cli("rebalance", "--redundant-slots", "2")
        assert "imbalance (max/mean tokens per expert actor" in out and "→" in out, out
        st = json.loads(moeray("status", "--url", url, "--api-key", KEY, "--json").stdout)
        assert st["epoch"] == before_epoch + 2 and any(r for e in st["experts"] for r in e["replicas"].values())
        assert finish(start_streams(url, "k3", SKEWED, 12)) == k3.expected["skewed"]  # the same mix, re-placed experts
        after = _imbalance(url)  # the gauge's window holds the current epoch's steps only
        assert 0 < after < before, (before, after)
        assert finish(start_streams(url, "k3", _prompts(8), 40)) == k3.expected["40"]  # the 8 prompts, re-placed
        bad = httpx.post(f"{url}/admin/scale/experts", json={"n": 0}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
        too_many = moeray("scale", "experts", "99", "--url", url, "--admin-key", ADMIN)
        assert too_many.returncode == 2 and "expert actors must be in 1..16" in too_many.stderr
        assert httpx.post(f"{url}/admin/rebalance", json={}).status_code == 401  # guarded by the admin key
        inference = httpx.post(f"{url}/admin/rebalance", json={}, headers=AUTH)
        assert inference.status_code == 401  # which an inference key is not
        out, _ = k3.cli("scale", "experts", "2")  # as found: contiguous shards, the replicas gone
        assert f"2 attention × 3 expert actors → {SHAPE}" in out, out


    # ---- prefix caching (issue 26, Must show 1, 4, 5, 6) ---------------------------------------------
    def test_five_turns_equal_a_cluster_without_prefix_caching_and_hit_the_shared_length(self, k3):
        _five_turns(k3, grid=64)  # K3's cache grid: its KDA snapshots'

    def test_a_conversation_through_scale_down_and_a_killed_attention_actor_answers_exactly(self, k3):
        """K3 (blocks and KDA snapshots): turns 1–2, `moeray scale attention 1`, turn 3 (its cache went
        with the removed replica or stayed, either way exact), `moeray chaos kill-attention 0`, turns
        4–5 (the replacement starts with an empty cache): the answers are the fault-free cluster's.
        Then `moeray scale attention 2` restores the shape."""
        url = k3.url
        rng = random.Random(12)
        conv = [rng.randrange(1, 700) for _ in range(110)]
        asked, answers = [], []
        for turn in range(5):
            if turn == 2:
                k3.cli("scale", "attention", "1")
            if turn == 3:
                k3.cli("chaos", "kill-attention", "0")
            if turn:
                conv = conv + answers[-1] + [rng.randrange(1, 700) for _ in range(8)]
            ids, _ = _turn(url, "k3", conv, SEEDED)
            asked.append((conv, SEEDED))
            answers.append(ids)
        assert len(_status(url)["attention"]) == 1
        assert answers == _reference(k3.path, asked)
        out, _ = k3.cli("scale", "attention", "2")  # as found
        assert f"1 attention × 2 expert actors → {SHAPE}" in out, out


# ==== the colocated layout (issue 33) ==================================================================
# Each app: 2 workers, each an attention replica and half the routed experts. Small on purpose: prefills
# chunked (32 tokens a step; K3 128), and 32 blocks of 16 per worker (K3 24) hold fewer of the parity
# prompts than are sent at once, so sequences are preempted and recomputed.
WORKERS = "2 workers (attention + experts each)"
COLOCATED = dict(layout="colocated", workers=2, max_tokens_per_step=32, num_blocks=32, hang_floor_s=2.0,
                 heartbeat_timeout_s=1.5)
PARITY_TOKENS = 80
# K3's 24 blocks a worker are preempted at 48 tokens as well (the parity prompts then need ~67 of its 48
# blocks; asserted: the preemptions grow)
K3_PARITY_TOKENS = 48
PARITY_PROMPTS = [[(i * 41 + j * 13) % 700 + 11 for j in range(10 + 9 * i)] for i in range(10)]  # 10 to 91 tokens
STREAM_TOKENS = 450  # outlives the changes made while it runs (asserted; 360 ran out before the last once, at niceness 0); with the chat stream's 55-token prompt it must fit one worker's 32 blocks of 16
STREAM_PROMPTS = [[(i * 29 + j * 3) % 700 + 13 for j in range(8 + 5 * i)] for i in range(4)]


def _preemptions(url) -> float:
    return metrics(url)["moeray:num_preemptions_total"]


def _equal_at_2_and_3_workers(app: App) -> None:
    """The parity prompts, all at once, equal the single process with 2 workers and, after `moeray scale
    workers 3`, with 3 (preemptions counted: the small cache did preempt); then back to 2 (as found)."""
    url = app.url
    before = _preemptions(url)
    assert finish(start_streams(url, app.name, PARITY_PROMPTS, app.parity_tokens)) == app.expected["parity"]
    assert _preemptions(url) > before, "the cache was not small enough to preempt"
    st = _status(url)
    assert st["layout"] == "colocated" and [w["index"] for w in st["workers"]] == [0, 1]
    assert len({w["node"] for w in st["workers"]}) == 2  # spread over the nodes
    shown = moeray("status", "--url", url, "--api-key", KEY)  # a row per worker, both halves
    assert shown.returncode == 0 and WORKERS in shown.stdout, shown.stderr
    for i in (0, 1):
        row = next(line for line in shown.stdout.splitlines() if f"worker[{i}]" in line)
        assert "attention: 0 sequences, cache" in row and "experts: experts" in row and "tokens" in row, row
    out, _ = app.cli("scale", "workers", "3")
    assert f"{WORKERS} → 3 workers (attention + experts each)" in out, out
    st = _status(url)
    assert len({w["node"] for w in st["workers"]}) == 3 and st["shape"] == "3 workers (attention + experts each)"
    assert finish(start_streams(url, app.name, PARITY_PROMPTS, app.parity_tokens)) == app.expected["parity"]
    out, _ = app.cli("scale", "workers", "2")  # as found
    assert f"3 workers (attention + experts each) → {WORKERS}" in out, out


def _status_between_steps(url, deadline: float) -> dict:
    """/status, asked again while it answers 503: it is read on the engine thread between steps, and
    while the engine finds a hung worker, has it killed and starts its replacement, no step ends for
    longer than the route waits (it says so with a 503)."""
    while True:
        r = httpx.get(f"{url}/status", headers=AUTH, timeout=30)
        if r.status_code == 200:
            return r.json()
        assert r.status_code == 503 and time.monotonic() < deadline, (r.status_code, r.text)
        time.sleep(0.2)


def _worker_pids() -> list[int]:
    return [a["Pid"] for a in _alive("ColocatedWorker")]


@pytest.fixture(scope="class")
def ck2(serve_port):
    """kimi-k2-tiny in the colocated layout, 2 workers, with speculative decoding (suffix, 4 drafts):
    its streams must equal the single process's (no drafts) through scaling, kills and a hang."""
    path = preset("kimi-k2-tiny", seed=8)
    oracles = {"parity": oracle_soon(path, PARITY_PROMPTS, PARITY_TOKENS),
               "streams": oracle_soon(path, STREAM_PROMPTS, STREAM_TOKENS)}
    url = deploy(serve_port, path, "ck2", speculative={"method": "suffix", "num_speculative_tokens": 4}, **COLOCATED)
    try:
        yield App("ck2", url, path, ADMIN, {k: o.result() for k, o in oracles.items()})
    finally:
        serve.delete("ck2")


class TestColocatedK2:
    @pytest.fixture(autouse=True)
    def as_found(self, ck2):
        _as_found(ck2, WORKERS)
        yield
        _as_found(ck2, WORKERS)

    def test_two_and_three_workers_equal_the_single_process(self, ck2):
        _equal_at_2_and_3_workers(ck2)

    def test_scale_2_3_2_a_killed_and_a_stopped_worker_while_5_streams_run(self, ck2):
        """4 greedy streams and a grammar-constrained chat stream run while, one after another: `moeray
        scale workers 3`, `moeray chaos kill-worker 1` (recovered: its sequences re-prefilled elsewhere,
        its shard reloaded), a worker SIGSTOPped (found hung by the watchdog, killed, replaced), `moeray
        scale workers 2`. Every stream outlives every change and equals the single process's (the
        constrained one its fault-free answer); the failure and hang counters move by one each. The
        streams are closed 16 tokens past the last change and compared as far as they went (as in
        TestK2's changes)."""
        url = ck2.url
        before = _status(url)
        streams = start_streams(url, "ck2", STREAM_PROMPTS, STREAM_TOKENS,
                                [Stream(url, "ck2", None, STREAM_TOKENS, CONSTRAINED)])
        assert sum(w["attention"]["sequences"] for w in _status(url)["workers"]) == 5  # each stream on a worker
        out, _ = ck2.cli("scale", "workers", "3")
        assert f"{WORKERS} → 3 workers (attention + experts each)" in out, out
        _kill(ck2, "worker", 1)
        epoch = _status(url)["epoch"]
        pid = _worker_pids()[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 90
            while (st := _status_between_steps(url, deadline))["epoch"] == epoch:  # found hung, killed, replaced
                assert time.monotonic() < deadline, "the stopped worker was never replaced"
                time.sleep(0.2)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)  # a process Ray has not killed yet would stay stopped
            except ProcessLookupError:
                pass
        assert st["last_change"]["kind"] == "recovery" and pid not in _worker_pids()
        out, last = ck2.cli("scale", "workers", "2")  # as found
        assert f"3 workers (attention + experts each) → {WORKERS}" in out and "sequences moved" in out, out
        assert all(s.ended is None for s in streams), "a stream ended before the last change"
        close_after(streams, 16)
        expected = ck2.expected["streams"]
        constrained = chat_reference(url, "ck2", len(streams[-1].pieces), CONSTRAINED)
        for s, want in zip(streams, [*expected, constrained]):
            text = "".join(s.pieces)  # one chunk per token, nothing repeated or skipped
            assert text and want.startswith(text), (len(s.pieces), text[-80:], want[len(text) - 80: len(text) + 20])
        assert constrained.startswith("[")
        after = _status(url)
        assert _delta(after["failures"], before["failures"]) == {"worker": 2}, (after["failures"], before["failures"])
        assert _delta(after["hangs"], before["hangs"]) == {"worker": 1}, (after["hangs"], before["hangs"])
        assert after["epoch"] == before["epoch"] + 4
        # the streams ran with drafts, accepted and rejected (the greedy random model repeats itself)
        spec, was = after["speculative"], before["speculative"]
        assert spec["accepted_tokens"] > was["accepted_tokens"], spec
        assert spec["draft_tokens"] - was["draft_tokens"] > spec["accepted_tokens"] - was["accepted_tokens"], spec
        bad = moeray("chaos", "kill-worker", "7", "--url", url, "--admin-key", ADMIN)
        assert bad.returncode == 2 and "there is no worker[7]" in bad.stderr, bad.stderr
        refused = moeray("scale", "experts", "3", "--url", url, "--admin-key", ADMIN)
        assert refused.returncode != 0 and "colocated" in refused.stderr, refused.stderr


@pytest.fixture(scope="class")
def ck3(serve_port):
    """kimi-k3-tiny (hybrid: KDA state re-prefilled) in the colocated layout, 2 workers, the router's
    rebalance window 16 steps."""
    path = preset("kimi-k3-tiny", seed=9)
    oracles = {"parity": oracle_soon(path, PARITY_PROMPTS, K3_PARITY_TOKENS), "skewed": oracle_soon(path, SKEWED, 12)}
    # a step budget of 128 (prompts sent together still prefill in chunks): one under K3's snapshot grid
    # (64) would take no KDA snapshot, so nothing to hit; 24 blocks a worker, so that its sequences are preempted
    url = deploy(serve_port, path, "ck3", rebalance_window_steps=16,
                 **(COLOCATED | {"max_tokens_per_step": 128, "num_blocks": 24}))
    try:
        yield App("ck3", url, path, ADMIN, {k: o.result() for k, o in oracles.items()}, parity_tokens=K3_PARITY_TOKENS)
    finally:
        serve.delete("ck3")


class TestColocatedK3:
    @pytest.fixture(autouse=True)
    def as_found(self, ck3):
        _as_found(ck3, WORKERS)
        yield
        _as_found(ck3, WORKERS)

    def test_two_and_three_workers_equal_the_single_process(self, ck3):
        _equal_at_2_and_3_workers(ck3)

    def test_rebalance_with_redundant_slots_lowers_the_imbalance_and_keeps_the_tokens(self, ck3):
        url = ck3.url
        epoch = _status(url)["epoch"]
        out, _ = ck3.cli("scale", "workers", "3")  # a new epoch, so the gauge below sees this mix alone
        assert finish(start_streams(url, "ck3", SKEWED, 12)) == ck3.expected["skewed"]
        before = _imbalance(url)
        out, _ = ck3.cli("rebalance", "--redundant-slots", "2")
        assert "imbalance (max/mean tokens per expert actor" in out and "→" in out, out
        st = _status(url)
        assert st["epoch"] == epoch + 2 and any(r for e in st["experts"] for r in e["replicas"].values())
        assert finish(start_streams(url, "ck3", SKEWED, 12)) == ck3.expected["skewed"]  # re-placed experts
        assert 0 < _imbalance(url) < before
        out, _ = ck3.cli("scale", "workers", "2")  # as found: contiguous shards, the replicas gone
        assert f"3 workers (attention + experts each) → {WORKERS}" in out, out

    def test_prefix_caching_equals_a_cluster_without_it(self, ck3):
        _five_turns(ck3, grid=64)  # K3's cache grid: its KDA snapshots'


# ---- a colocated exchange larger than the socket buffers ---------------------------------------------------
# Two prompts of 2,400 tokens in one request, on kimi-k2-small's rows (hidden 1,024, fp32: 4,160 bytes a row): a
# step budget of 5,000 prefills both in one step, one on each worker, so each worker sends the other
# 2,400 rows, 10 MB, while the other sends it as much — over twice the socket buffers (tcp_wmem's 4 MiB).
# Its width is what matters here (a row's bytes: the hidden size, top-k), not its depth nor its compute: two
# layers (a dense one and one MoE layer, one exchange), 16 experts, 4 heads and narrow MLPs, which cost the
# three prefills (two workers and the single process) about a twentieth of the full preset's eight layers
# (the exchange itself at 32 MiB: tests/actors/test_wire.py).
WIDE = (("num_hidden_layers", 2), ("n_routed_experts", 16), ("num_attention_heads", 4), ("num_key_value_heads", 4),
        ("intermediate_size", 256), ("moe_intermediate_size", 64))
WIDE_PROMPTS = [[(i * 37 + j * 11) % 700 + 11 for j in range(2400)] for i in range(2)]


def test_a_colocated_step_exchanging_10_mb_each_way_answers(serve_port):
    """Both prompts' prefills cross in one step and the answer equals the single process's, token for
    token. Before the exchange read its receives while its sends were leaving, each worker sat blocked
    sending to the other until the collective timeout, the step failed every retry, and the request
    was dropped."""
    path = preset("kimi-k2-small", seed=3, overrides=WIDE)
    # the single process's answer first, not beside the app's prefills: two 2,400-token prefills of this
    # model in the workers and a third here at once, beside the other test worker's cluster, took the
    # machine past Ray's memory threshold (95 %) and its monitor killed actors of this session's apps
    expected = oracle_soon(path, WIDE_PROMPTS, 4).result()
    url = deploy(serve_port, path, "wide", layout="colocated", workers=2, max_tokens_per_step=5000,
                 num_blocks=160, max_num_seqs=4)
    try:
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                       json={"model": "wide", "prompt": WIDE_PROMPTS, "max_tokens": 4, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert _admitted(url) == [1, 1]  # one prompt on each worker
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == expected
    finally:
        serve.delete("wide")
