"""Losing the Ray head node, with and without GCS fault tolerance (issue 38): `moeray up --nodes 3` on this
machine (kimi-k2-tiny, 1 attention + 2 expert actors), a client sending short completions one after
another and 4 greedy streams of 96 tokens in flight, then

- GCS FT (a Redis this script starts): the GCS killed; then the whole head node killed (its GCS, raylet,
  agents and every process under them);
- no GCS FT (the raylets' reconnect timeout set to --timeout-s): the GCS killed.

Per fault: requests sent and failed (by kind), the time from the kill to the first success after the
restart (with GCS FT) or to the first 503 (without), the longest wait of a request, and how many streams
equal their fault-free run. Usage: python bench/bench_head_loss.py [--timeout-s 15]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy import owned  # noqa: E402
from tests.deploy.headloss import MODEL, PROMPTS, Up, _exe, _free_port, _streams_through  # noqa: E402


class Client(threading.Thread):
    """Short completions back to back: (seconds after start, status or error kind, seconds taken)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.log, self.stop = url, [], threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                r = httpx.post(f"{self.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                               timeout=150)
                what = str(r.status_code)
            except httpx.TransportError as e:
                what = type(e).__name__
            self.log.append((t - self.t0, what, time.monotonic() - t))
            time.sleep(0.1)


def fault_run(up: Up, expected: list[str], kill, *, until) -> dict:
    """The client and the 4 streams through ``kill()``; the client runs until ``until(client)``."""
    client = Client(up.url)
    client.start()
    time.sleep(1.0)
    t_kill = []

    def fault():
        t_kill.append(time.monotonic() - client.t0)
        kill()

    streams = _streams_through(up, fault, cut_ok=True)
    deadline = time.monotonic() + 240
    while not until(client) and time.monotonic() < deadline:
        time.sleep(0.2)
    client.stop.set()
    client.join(timeout=200)
    after = [(t - t_kill[0], w, d) for t, w, d in client.log if t >= t_kill[0]]
    failed = {}
    for _, what, _ in after:
        if what != "200":
            failed[what] = failed.get(what, 0) + 1
    ok_after = [t + d for t, w, d in after if w == "200"]
    first_503 = min((t + d for t, w, d in after if w == "503"), default=None)
    return {"requests": len(client.log), "failed": failed, "first_ok_after_kill_s": min(ok_after, default=None),
            "first_503_after_kill_s": first_503,
            "longest_wait_s": max((d for _, _, d in client.log), default=0.0),
            "streams_identical": sum(a == b for a, b in zip(streams, expected)),
            "streams_cut": streams.count(None)}


def kill_pids(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def with_ft(tmp: Path) -> dict:
    port = _free_port()
    redis = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                              "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    up = None
    try:
        up = Up(tmp / "ft", "--gcs-redis", f"127.0.0.1:{port}")
        expected = _streams_through(up)
        [gcs] = [p for p, _ in owned.alive(up.records()) if _exe(p) == "gcs_server"]
        n_log = len(up.log.read_text())
        out = {"gcs": fault_run(up, expected, lambda: kill_pids([gcs]),
                                until=lambda c: "started it again" in up.log.read_text()[n_log:]
                                and time.monotonic() - c.t0 > 8)}
        head = owned.with_descendants([p for p, _ in owned.alive(up.records("head_pids"))])
        n_log = len(up.log.read_text())
        out["head"] = fault_run(up, expected, lambda: kill_pids(head),
                                until=lambda c: "connections go through again" in up.log.read_text()[n_log:]
                                and c.log and c.log[-1][1] == "200")
        return out
    finally:
        if up is not None:
            up.close()
        redis.terminate()
        redis.wait(timeout=10)


def without_ft(tmp: Path, timeout_s: float) -> dict:
    up = Up(tmp / "noft", env={"RAY_gcs_rpc_server_reconnect_timeout_s": str(int(timeout_s))})
    try:
        expected = _streams_through(up)
        started = owned.alive(up.records())
        [gcs] = [p for p, _ in started if _exe(p) == "gcs_server"]
        res = fault_run(up, expected, lambda: kill_pids([gcs]),
                        until=lambda c: c.log and c.log[-1][1] == "503")
        t0 = time.monotonic()
        down = up.down()
        res["down_s"] = round(time.monotonic() - t0, 1)
        res["down_ok"] = down.returncode == 0
        res["left_running"] = len(owned.alive(started))
        return res
    finally:
        up.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-s", type=float, default=15.0,
                    help="RAY_gcs_rpc_server_reconnect_timeout_s of the run without GCS FT (Ray's default: 60)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-head-") as d:
        tmp = Path(d)
        results = {"no GCS FT, GCS killed": without_ft(tmp, args.timeout_s)}
        ft = with_ft(tmp)
        results["GCS FT, GCS killed"] = ft["gcs"]
        results["GCS FT, whole head killed"] = ft["head"]
    print("\n| fault | requests | failed | first success after the kill | longest wait | streams identical | "
          "streams cut |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        first = "-" if r["first_ok_after_kill_s"] is None else f"{r['first_ok_after_kill_s']:.1f} s"
        print(f"| {name} | {r['requests']} | {r['failed'] or 0} | {first} | {r['longest_wait_s']:.1f} s | "
              f"{r['streams_identical']}/{len(PROMPTS)} | {r['streams_cut']} |")
    noft = results["no GCS FT, GCS killed"]
    print(f"\nno GCS FT: the first 503 (the lost-cluster answer) {noft['first_503_after_kill_s']:.1f} s after the "
          f"GCS kill (the raylets' reconnect timeout: {args.timeout_s:g} s); `moeray down` took {noft['down_s']} s "
          f"(ok: {noft['down_ok']}), "
          f"{noft['left_running']} of the processes `up` started left running")


if __name__ == "__main__":
    main()
