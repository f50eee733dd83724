"""Prefill/decode disaggregation in the simulator: what a prefill pool and a decode pool serve together,
against one engine on all their devices (docs/simulate.md, "Prefill/decode disaggregation").

A request whose prompt is at least ``min_uncached_tokens`` long (the selective rule of cluster/pd.py, with
no prefix shared between the simulated prompts) goes to the prefill pool: a :class:`Simulator` of its shape
runs its prompt's full blocks up to the deepest point a prefix hit can reach, plus one token, as the real
prefill engine does. Its blocks then cross to the decode replica it is given (round robin), priced per
request: the latent of every MLA layer (and on hybrid models one KDA state) at ``link_gbps``, one transfer
at a time per decode replica (its NIC), plus a fixed latency. On the decode pool they enter that replica's
prefix cache through the real :class:`~cluster.prefix_cache.PrefixCache` (``adopt`` / ``commit``), so the
real scheduler admits the request there as a prefix hit and computes only the rest of its prompt; a shorter
request prefills on the decode pool, as one engine would. TTFT counts from the request's arrival to its first
token on the decode pool; the pools' devices add up.

The two pools are simulated one after the other: nothing the decode pool does delays the prefill pool
(leases are not held long enough to matter at these rates; a decode pool short of room evicts arrivals,
and the request is prefilled there: counted as ``evicted``).

Owns: the routes, the transfers' times, the pools' joint summary. Never: prices a step (the pools'
:class:`~cluster.capacity.stepcost.StepCost` s do) or schedules (the real scheduler does).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from model.config import ModelConfig
from model.params import cache_bytes_per_token, state_bytes_per_sequence

from ..scheduler import Scheduler
from .simulator import SimResult, Simulator, _pct
from .workload import SimRequest


@dataclass(frozen=True)
class Link:
    """The path a request's blocks take from a prefill device to its decode replica."""

    gbps: float = 400.0  # per decode replica (its NIC: one transfer at a time)
    latency_s: float = 50e-6  # per transfer (a handshake and the registration on decode)

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes * 8 / (self.gbps * 1e9)


def transfer_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int = 2) -> int:
    """What crosses for a prompt's first ``tokens`` tokens: every MLA layer's latent, and on hybrid models the
    KDA state at their end."""
    return tokens * cache_bytes_per_token(cfg, dtype_bytes)["latent"] + state_bytes_per_sequence(cfg, dtype_bytes)["total"]


class PDSimulator:
    """A prefill pool (``prefill``, a :class:`Simulator`) and a decode pool (``decode``) serving one workload."""

    def __init__(self, prefill: Simulator, decode: Simulator, *, min_uncached_tokens: int = 256, link: Link = Link()):
        if min_uncached_tokens < 1:
            raise ValueError(f"min_uncached_tokens must be >= 1, got {min_uncached_tokens}")
        self.prefill, self.decode, self.min_uncached_tokens, self.link = prefill, decode, min_uncached_tokens, link
        # the prompt tokens whose blocks would cross: the real prefix cache's deepest reach
        self._deepest = Scheduler.for_engine(decode.config, decode.cfg, 1).cache.deepest

    def run(self, workload: list[SimRequest]) -> dict:
        cfg, decode = self.decode.cfg, self.decode
        cuts = {i: self._deepest(r.prompt_tokens) for i, r in enumerate(workload)}
        pd = [i for i, r in enumerate(workload) if r.prompt_tokens >= self.min_uncached_tokens and cuts[i] > 0]
        ready: dict[int, float] = {}
        replica: dict[int, int] = {}
        transfer: dict[int, float] = {}
        if pd:
            pre = self.prefill.run([SimRequest(workload[i].arrival_s, cuts[i] + 1, 1) for i in pd])
            free = [0.0] * decode.shape.attention  # each decode replica's link, free from
            for k in sorted(range(len(pd)), key=lambda k: pre.first_s[k]):
                i = pd[k]
                r = replica[i] = k % decode.shape.attention
                start = max(pre.first_s[k], free[r])
                transfer[i] = self.link.seconds(transfer_bytes(cfg, cuts[i]))
                free[r] = ready[i] = start + transfer[i]
        routes = Counter()

        def admit(sched, seq):
            i = seq.seq_id
            if i not in ready:
                routes["local"] += 1
                sched.add(seq)
                return
            cache = sched.cache
            moved = cache.adopt(replica[i], cache.chain_of(list(seq.token_ids), None, cuts[i]))
            if moved is None:  # no room on that replica: prefilled there instead
                routes["no_room"] += 1
                sched.add(seq)
                return
            cache.commit(moved)
            routes["pd"] += 1
            sched.add(replace(seq, home=replica[i]))  # its first admission takes the replica its blocks went to
            cache.unpin(moved)  # queued: cached, evictable (cluster/pd.py)

        arrivals = [replace(r, arrival_s=ready.get(i, r.arrival_s)) for i, r in enumerate(workload)]
        res = decode.run(arrivals, admit=admit)
        ttft = [res.first_s[i] - r.arrival_s for i, r in enumerate(workload) if i in res.first_s]
        devices = self.prefill.shape.devices + decode.shape.devices
        out = _summary(res, devices) | {
            "layout": "pd", "prefill": _shape(self.prefill), "decode": _shape(decode),
            "prefill_gpus": self.prefill.shape.devices, "decode_gpus": decode.shape.devices,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "routes": dict(routes), "min_uncached_tokens": self.min_uncached_tokens,
            "transfer_p50_s": _pct(list(transfer.values()), 0.5),
            "transfer_bytes_mean": (sum(transfer_bytes(cfg, cuts[i]) for i in pd) / len(pd)) if pd else 0.0}
        out["evicted"] = sum(1 for i in pd if i in res.first_s and res.hit_tokens.get(i, 0) < cuts[i])
        return out


def _shape(sim: Simulator) -> str:
    s = sim.shape
    return f"{s.attention} colocated" if s.colocated else f"{s.attention}A×{s.experts}E"


def _summary(res: SimResult, devices: int) -> dict:
    s = res.summary()
    tps = s["tokens_per_s"]
    return s | {"gpus": devices, "tokens_per_s_per_gpu": tps / devices}
