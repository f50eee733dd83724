"""A bounded soak of the embedded app (issue 9: load), loopback only.

    python bench/bench_soak.py [--streams 64] [--seconds 60] [--max-queue 32] [--port 8791]

Starts `moeray up --detach` (kimi-k2-tiny, one attention and one expert actor)
with a small request queue, then:
1. ``--streams`` concurrent clients stream completions back to back for ``--seconds``: every
   request must complete (finish_reason "length", all tokens) with zero errors; the engine
   replica's RSS is read from /proc at the start and the end.
2. Overload: a burst of 4 x max_queue requests at once: each must be a 200 or a clean 503 in
   OpenAI's error envelope with Retry-After — nothing else.
Stops the app with `moeray down` and prints a table and a JSON line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def one_stream(client: httpx.AsyncClient, url: str, tokens: int) -> tuple[bool, str]:
    body = {"model": "kimi-k2-tiny", "prompt": "The soak test says", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    n, finish = 0, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return False, f"status {r.status_code}"
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        return False, event["error"]["message"]
                    n += 1
                    finish = event["choices"][0]["finish_reason"] or finish
    except httpx.HTTPError as e:
        return False, repr(e)
    return (n == tokens and finish == "length"), f"{n} tokens, finish {finish}"


async def soak(url: str, streams: int, seconds: float) -> dict:
    end = time.monotonic() + seconds
    done, errors = 0, []

    async def client_loop(i: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(timeout=120) as client:
            while time.monotonic() < end:
                ok, what = await one_stream(client, url, 16 + i % 17)
                if ok:
                    done += 1
                else:
                    errors.append(what)

    await asyncio.gather(*(client_loop(i) for i in range(streams)))
    return {"completed": done, "errors": len(errors), "first_errors": errors[:3]}


async def overload(url: str, burst: int) -> dict:
    statuses: dict[str, int] = {}
    unclean = []

    async def one(client: httpx.AsyncClient) -> None:
        body = {"model": "kimi-k2-tiny", "prompt": "Overload", "max_tokens": 32, "ignore_eos": True}
        r = await client.post(f"{url}/v1/completions", json=body)
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
        if r.status_code == 503:
            err = r.json().get("error", {})
            if not (err.get("message") and err.get("type") and int(r.headers.get("Retry-After", "0")) >= 1):
                unclean.append(r.text[:200])
        elif r.status_code != 200:
            unclean.append(f"{r.status_code}: {r.text[:200]}")

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=burst)) as client:
        await asyncio.gather(*(one(client) for _ in range(burst)))
    return {"statuses": statuses, "unclean": len(unclean), "first_unclean": unclean[:3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-queue", type=int, default=32)
    ap.add_argument("--port", type=int, default=8791)
    args = ap.parse_args()
    moeray = str(Path(sys.executable).parent / "moeray")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MOERAY_CACHE_DIR": tmp}
        cfg = Path(tmp) / "serve.yaml"
        cfg.write_text(yaml.safe_dump({"model": "kimi-k2-tiny", "max_queue": args.max_queue, "max_num_seqs": 64, "port": args.port}))
        subprocess.run([moeray, "up", "--detach", "--config", str(cfg)], env=env, check=True)
        url = f"http://127.0.0.1:{args.port}"
        try:
            pid = httpx.get(f"{url}/status", timeout=30).json()["pid"]
            rss0 = rss_bytes(pid)
            t0 = time.monotonic()
            result = asyncio.run(soak(url, args.streams, args.seconds))
            result["seconds"] = time.monotonic() - t0
            result["rss_start_mib"], result["rss_end_mib"] = rss0 / 2**20, rss_bytes(pid) / 2**20
            result["overload"] = asyncio.run(overload(url, 4 * args.max_queue))
        finally:
            subprocess.run([moeray, "down"], env=env, check=False)
    print(f"soak: {args.streams} streams for {result['seconds']:.0f}s: {result['completed']} requests completed, "
          f"{result['errors']} errors; engine replica RSS {result['rss_start_mib']:.0f} → "
          f"{result['rss_end_mib']:.0f} MiB")
    o = result["overload"]
    print(f"overload burst of {4 * args.max_queue} (queue limit {args.max_queue}): statuses {o['statuses']}, "
          f"{o['unclean']} unclean")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
