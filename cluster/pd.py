"""Prefill/decode disaggregation: a prefill engine computes a long prompt's cache, a decode engine
decodes it (docs/architecture.md, "Prefill/decode disaggregation").

:class:`Disaggregated` coordinates two :class:`~cluster.engine.Engine` s serving one model. Each
request goes to the decode engine; what decides its route (:meth:`Disaggregated.route`) is how much of
its prompt the decode engine would have to compute itself — the prompt less the longest prefix its own
prefix cache holds on any replica:

- at least ``min_uncached_tokens`` (selective PD): the prefill engine computes the prompt's full blocks
  up to the deepest point a prefix hit can reach (its own prefix cache serving what it has seen), the
  blocks — MLA latents of every layer, and on hybrid models the KDA state snapshot at their end — cross
  once, as one :class:`~cluster.kv_transfer.KVBlocks`, to the decode replica the request will run on, are
  checked there (fingerprint, shapes, checksum) and enter that replica's prefix cache, registered under
  the same chained hashes; the decode engine then admits the request as a prefix hit and computes only
  the rest (less than a block, or a snapshot-grid step on hybrid models: at least the last prompt token,
  whose logits give the first token — sampled where the stream's sampling state lives);
- otherwise (``local``): the decode engine prefills it as a single engine does.

Exactly what a single engine with a warm prefix cache computes, so the tokens are the single process's
(tests/cluster/test_pd.py). A transfer that fails — the prefill engine lost the blocks, the blocks do not
fit (a :class:`~cluster.kv_transfer.TransferError`), no room on decode — is counted by reason and the
request prefilled on decode: slower, never wrong.

Accounting: the prefill engine's blocks are held under a lease (:class:`Leases`) from when they are read
until the decode engine has them (or the lease expires), and the decode engine's arrivals are held until
their request is queued — then cached, evictable like any cached block (held until admission, a request
waiting for room on its replica could wait on blocks held for another: the fault harness found that
deadlock); both counts return to 0 when nothing is in flight (:meth:`Disaggregated.status`). A request
aborted at any point (its client gone, or past the deadline) lets go of everything it held.

Owns: the routes, the transfers, the leases. Never: schedules a step of either engine, or touches a
cache's tensors or its pools directly (the engines' executors and prefix caches do).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from model.sampling import SamplingParams

from .engine import Engine
from .kv_transfer import TRANSPORTS, Fingerprint, KVBlocks, TransferError, TransportError, fingerprint, mismatch
from .prefix_cache import Moved
from .seq import Seq

ROUTES = ("pd", "local", "aborted")


class PrefillError(RuntimeError):
    """The prefill engine did not make a prompt's blocks (it failed the request, or ran past its time)."""


class LeaseExpired(LookupError):
    """The prefill engine's lease on a transfer's blocks ran out before the decode engine had them."""


# a transfer's failures, each a local prefill: lost blocks or an expired lease, a broken read or write, blocks
# that do not fit, no room on decode
FAILURES = (LookupError, TransportError, TransferError, MemoryError)
# as counted; the async front adds the prefill engine failing a prompt, and an engine's part overdue
FAILURE_KINDS = ("LookupError", "LeaseExpired", "TransportError", "TransferError", "MemoryError", "PrefillError",
                 "TimeoutError", "Error")


@dataclass
class Route:
    """How one request was served."""

    kind: str  # "pd" (its prompt's blocks came from the prefill engine), "local", or "aborted" (its client went away)
    reason: str  # why, in words (a failed transfer's error among them)
    tokens: int = 0  # prompt tokens whose blocks crossed
    nbytes: int = 0  # their bytes
    written: int = 0  # prompt tokens whose blocks were written on decode (the rest it cached already)
    seconds: float = 0.0  # the transfer's: from pinning the blocks on prefill to their registration on decode
    hit: int | None = None  # prompt tokens the decode engine found cached when it admitted the request


@dataclass
class Lease:
    """Blocks the prefill engine holds for a transfer, until the decode engine has them or ``expires``."""

    moved: Moved
    expires: float
    key: int | None = None  # the request's (the async front ends a lease by it: cluster/apd.py)


class Leases:
    """The prefill engine's holds for transfers in flight: granted when its blocks are pinned, ended when the
    decode engine acknowledges them, on a failure, or past their time (:meth:`expire`)."""

    def __init__(self, engine: Engine, lease_s: float, clock=time.monotonic):
        self.cache, self.lease_s, self.clock = engine.scheduler.cache, lease_s, clock
        self.live: list[Lease] = []
        self.expired = 0

    def grant(self, moved: Moved, key: int | None = None) -> Lease:
        lease = Lease(moved, self.clock() + self.lease_s, key)
        self.live.append(lease)
        return lease

    def end_key(self, key: int) -> None:
        """End request ``key``'s lease, if it holds one."""
        for lease in [lease for lease in self.live if lease.key == key]:
            self.end(lease)

    def end(self, lease: Lease) -> None:
        """Let the lease's blocks go (idempotent: an expired lease was let go already)."""
        if lease in self.live:
            self.live.remove(lease)
            self.cache.unpin(lease.moved)

    def expire(self) -> int:
        """End every lease past its time; returns how many."""
        now = self.clock()
        late = [lease for lease in self.live if lease.expires <= now]
        for lease in late:
            self.end(lease)
        self.expired += len(late)
        return len(late)

    @property
    def blocks_held(self) -> int:
        return sum(len(lease.moved.blocks) for lease in self.live)


class Disaggregated:
    """A prefill engine and a decode engine serving one model (see the module docstring). Both must be
    started, cache prefixes, and share the model, dtype, block size and MTP setting."""

    def __init__(self, prefill: Engine, decode: Engine, *, min_uncached_tokens: int = 256, lease_s: float = 30.0,
                 clock=time.monotonic, transport: str = "channel"):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if min_uncached_tokens < 1:
            raise ValueError(f"min_uncached_tokens must be >= 1, got {min_uncached_tokens}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        for name, eng in (("prefill", prefill), ("decode", decode)):
            if not eng.config.cache.prefix_caching:
                raise ValueError(f"the {name} engine must cache prefixes (prefix_caching: true): the blocks that "
                                 "cross are found and kept by their prefix hashes")
        self.prefill, self.decode = prefill, decode
        self.fp = {name: self._fingerprint(eng) for name, eng in (("prefill", prefill), ("decode", decode))}
        problem = mismatch(self.fp["prefill"], self.fp["decode"])
        if problem:
            raise ValueError(f"the prefill and decode engines must serve the same cache layout: {problem}")
        self.min_uncached_tokens, self.transport = min_uncached_tokens, transport
        self.leases = Leases(prefill, lease_s, clock)
        self.arrived: dict[int, Moved] = {}  # decode-side arrivals, by request, held until it is queued
        self.routes: Counter = Counter()
        self.failures: Counter = Counter()  # failed transfers by reason (the kind of error)
        self.bytes_moved = 0
        self.transfer_s = 0.0
        self.io_s = {"read": 0.0, "write": 0.0}  # of which the actors' reads and writes (executor calls)
        self.evicted = 0  # transfers evicted on decode before their request was admitted (room ran short)
        self._lock = threading.Lock()  # the counters: the async front (cluster/apd.py) counts from two engine threads
        self.recovered: Counter = Counter()  # sequences re-prefilled after a decode failure, by where ("pd", "local")
        # a decode engine's recovery re-prefills its lost sequences through the prefill engine (:meth:`rewound`);
        # here both engines run on this thread (the async front sets its own)
        decode.on_rewound = lambda eng, seqs: self._rewound_here(seqs)

    @staticmethod
    def _fingerprint(eng: Engine) -> Fingerprint:
        c = eng.config
        return fingerprint(eng.model_cfg, c.dtype, c.cache.block_size, c.mtp)

    # ---- routes ----------------------------------------------------------------------------
    def route(self, prompt: list[int], salt: str | None = None, planned: Counter | None = None) -> tuple[Route, int, int]:
        """(the route, the prompt tokens whose blocks would cross, the decode replica they would go to: the
        scheduler's placement rule, counting ``planned`` requests per replica as load too)."""
        cache = self.decode.scheduler.cache
        cut = cache.deepest(len(prompt))
        hits = cache.probe(prompt, salt)
        sched, planned = self.decode.scheduler, planned or Counter()
        load = [sched.load(r) + planned[r] for r in range(len(hits))]
        replica = max(range(len(hits)), key=lambda r: (hits[r].tokens - sched.load_weight * load[r], -load[r],
                                                       cache.blocks[r].num_available))
        have = hits[replica].tokens
        tier = self.decode.tier
        if tier is not None and len(prompt) - have >= self.min_uncached_tokens and cut > have:
            held = tier.covers(replica, prompt, salt, have)  # its node's KV tier: loaded there, not sent
            if len(prompt) - held < self.min_uncached_tokens or cut <= held:
                return Route("local", f"the decode engine's KV tier holds {held - have} more prompt tokens"), 0, replica
        uncached = len(prompt) - have
        if uncached < self.min_uncached_tokens or cut <= have:
            return Route("local", f"{uncached} uncached prompt tokens < {self.min_uncached_tokens}"
                         if uncached < self.min_uncached_tokens else "the decode engine caches every full block"), 0, replica
        return Route("pd", f"{uncached} uncached prompt tokens >= {self.min_uncached_tokens}", cut), cut, replica

    def plan(self, prompts: list[tuple[list[int], str | None]]) -> list[tuple[Route, int, int]]:
        """:meth:`route` for requests arriving together ((prompt, salt) each), each counted as load on the
        replica chosen for the ones before it."""
        planned: Counter = Counter()
        out = []
        for p, salt in prompts:
            out.append(self.route(p, salt, planned))
            planned[out[-1][2]] += 1
        return out

    # ---- serving ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 cache_salt: str | None = None, *, deadline_s: float = 600.0,
                 aborted: Callable[[int], bool] | None = None) -> tuple[list[Seq | None], list[Route]]:
        """Serve ``prompts`` (both engines idle before and after); returns the decode engine's finished
        sequences and each request's :class:`Route`. ``aborted(i)``: request ``i``'s client went away
        (asked before and after its transfer, and between the decode engine's steps): it ends where it is,
        everything it held is let go, and its sequence is None. Past ``deadline_s`` every request still
        running is aborted and TimeoutError raised (nothing stays held)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        for p, sp in zip(prompts, plist):
            self.decode.validate(p, sp)  # a request refused here takes nothing on either engine
        deadline = time.monotonic() + deadline_s
        gone = aborted or (lambda i: False)
        self.leases.expire()
        plan = self.plan([(p, cache_salt) for p in prompts])
        pd = [i for i, (r, _, _) in enumerate(plan) if r.kind == "pd"]
        try:
            if pd:
                # the prompt's full blocks up to the cut, plus one token (a prefill samples one; it is not used)
                ids = [self.prefill.add_request(prompts[i][: plan[i][1] + 1], SamplingParams(max_tokens=1),
                                                cache_salt) for i in pd]
                self._drain(self.prefill, ids, deadline)
                for i in pd:
                    self._transfer(i, plan, prompts[i], cache_salt, gone)
            ids = {i: self.decode.add_request(p, sp, cache_salt, replica=rep if route.kind == "pd" else None)
                   for i, (p, sp, (route, _, rep)) in enumerate(zip(prompts, plist, plan)) if route.kind != "aborted"}
        finally:
            # queued: the arrivals are the decode engine's cache now — cached, so that a replica short of room
            # may evict them (held until admission, a request waiting for room could wait on its own blocks)
            for moved in list(self.arrived.values()):
                self.decode.scheduler.cache.unpin(moved)
            self.arrived = {}
        done = self._drain(self.decode, list(ids.values()), deadline, {seq_id: i for i, seq_id in ids.items()}, gone)
        seqs = [done.get(ids[i]) if i in ids else None for i in range(len(prompts))]
        routes = [r for r, _, _ in plan]
        for i, (route, seq) in enumerate(zip(routes, seqs)):
            if seq is None or seq.finish_reason == "abort":
                route.kind, seqs[i] = "aborted", None
            self.finished(route, seq.num_hit if seqs[i] is not None else None)
        return seqs, routes

    def finished(self, route: Route, hit: int | None) -> None:
        """Count a request's route once it ended (``hit``: the prompt tokens decode found cached)."""
        with self._lock:
            route.hit = hit
            self.evicted += route.kind == "pd" and (hit or 0) < route.tokens  # computed again on decode
            self.routes[route.kind] += 1

    def _transfer(self, i: int, plan: list, prompt: list[int], salt: str | None, gone) -> None:
        """Request ``i``'s blocks across (``plan[i]`` becomes its outcome): a failure leaves it local."""
        route, cut, replica = plan[i]
        if gone(i):
            plan[i] = (Route("aborted", "the client went away before its transfer"), 0, replica)
            return
        try:
            route.nbytes, route.written = self._move(i, prompt, salt, cut, replica)
        except FAILURES as e:
            plan[i] = (Route("local", f"transfer failed: {e}"), 0, replica)
            return
        if gone(i):  # after the blocks arrived: they stay cached on decode, the request is not queued
            self.release_arrival(i)
            plan[i] = (Route("aborted", "the client went away during its transfer"), 0, replica)

    def _drain(self, eng: Engine, ids: list[int], deadline: float, index: dict | None = None, gone=None) -> dict:
        """Run ``eng`` until it is idle; returns its finished sequences by id. Aborts a request whose
        client went away (``gone(index[id])``), and every one still running past ``deadline``."""
        while eng.busy:
            late = time.monotonic() > deadline
            for seq_id in ids:
                if late or (gone is not None and gone(index[seq_id])):
                    eng.abort(seq_id)
            if late:
                while eng.busy:  # the aborted requests' steps in flight come back and are dropped
                    eng.pipelined()
                for seq_id in ids:
                    eng.release(seq_id)
                raise TimeoutError(f"prefill/decode: {len(ids)} requests not done by their deadline (aborted)")
            eng.pipelined()
        out = {}
        for seq_id in ids:
            req = eng.release(seq_id)
            if req is not None:
                out[seq_id] = req.seq
        return out

    def _move(self, i: int, prompt: list[int], salt: str | None, cut: int, dst: int) -> tuple[int, int]:
        """The blocks of ``prompt``'s first ``cut`` tokens from the prefill engine (the replica that holds them)
        into the decode engine's replica ``dst`` for request ``i``; returns (their bytes, the tokens written
        there). Raises LookupError (the prefill engine no longer holds them, or their lease ran out),
        TransportError (reading or writing them failed), TransferError (they do not fit), MemoryError (no
        room on decode)."""
        t0 = time.perf_counter()
        lease, kv = self.read(prompt, salt, cut, i)
        try:
            written = self.accept(kv, dst, i, lease)
        finally:
            self.leases.end(lease)  # acknowledged, or failed: the prefill engine lets go either way
            self.leases.expire()
        self.timed(time.perf_counter() - t0)
        return kv.nbytes, written

    def _io(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.io_s[kind] += seconds

    def timed(self, seconds: float) -> None:
        with self._lock:
            self.transfer_s += seconds

    def read(self, prompt: list[int], salt: str | None, cut: int, key: int | None = None) -> tuple[Lease, KVBlocks]:
        """On the prefill engine's side (its thread): pin the blocks of ``prompt``'s first ``cut`` tokens on the
        replica that holds them, under a lease (request ``key``'s), and read them; leases past their time are
        ended first. Raises LookupError (it no longer holds them) or TransportError (the read failed; the
        lease is ended)."""
        self.leases.expire()
        cache = self.prefill.scheduler.cache
        hashes = cache.chain_of(prompt, salt, cut)
        moved = next((m for m in (cache.pin(r, hashes) for r in range(len(cache.blocks))) if m is not None), None)
        if moved is None:
            raise self._failed(LookupError(f"the prefill engine no longer holds the {len(hashes)} blocks of the prompt"))
        lease = self.leases.grant(moved, key)
        t0 = time.perf_counter()
        try:
            parts = self.prefill.executor.read_blocks(moved.replica, list(moved.blocks), moved.snapshot,
                                                        via=self.transport)
            self._io("read", time.perf_counter() - t0)
        except BaseException as e:
            self.leases.end(lease)
            raise self._failed(e)
        return lease, KVBlocks.of(self.fp["prefill"], hashes, parts)

    def accept(self, kv: KVBlocks, replica: int, key: int, lease: Lease) -> int:
        """On the decode engine's side (its thread, nothing in flight): :meth:`receive` ``kv`` unless its
        ``lease`` ran out first (LeaseExpired); returns the tokens written. Failures are counted."""
        try:
            if lease.expires <= self.leases.clock():  # (the prefill engine's side ends it: not this thread's)
                raise LeaseExpired(f"the lease on the prompt's blocks ran out ({self.leases.lease_s:g} s) before "
                                   "the decode engine had them")
            written = self.receive(kv, replica, key)
        except BaseException as e:
            raise self._failed(e)
        with self._lock:
            self.bytes_moved += kv.nbytes
        return written

    def _failed(self, e: BaseException) -> BaseException:
        """Count a failed transfer by its kind (a transfer's own failures; anything else is not counted)."""
        if isinstance(e, FAILURES):
            self.count_failure(type(e).__name__)
        return e

    def count_failure(self, kind: str) -> None:
        with self._lock:
            self.failures[kind] += 1

    def release_arrival(self, key: int) -> None:
        """On the decode engine's thread: let go of request ``key``'s arrival, if it holds one (queued or gone)."""
        moved = self.arrived.pop(key, None)
        if moved is not None:
            self.decode.scheduler.cache.unpin(moved)

    def receive(self, kv: KVBlocks, replica: int, key: int = 0) -> int:
        """Check ``kv`` and write it into the decode engine's replica ``replica``, registered in its prefix
        cache and held (as ``self.arrived[key]``) until its request is queued (the blocks it caches already
        are not written again); returns the tokens written. Between steps only (nothing in flight)."""
        if self.decode.inflight:
            raise RuntimeError("blocks are written into the decode engine between its steps only")
        kv.check(self.fp["decode"])
        cache = self.decode.scheduler.cache
        moved = cache.adopt(replica, list(kv.hashes))
        if moved is None:
            raise MemoryError(f"no room on decode replica {replica} for {len(kv.hashes)} blocks")
        try:
            parts = {}
            if "latent" in kv.parts:  # only the blocks not cached there already (a copy: not the whole storage)
                parts["latent"] = kv.parts["latent"][:, moved.fresh:].contiguous()
            snapshot = moved.snapshot if moved.new_snapshot else None
            if snapshot is not None:
                parts["conv"], parts["recurrent"] = kv.parts["conv"], kv.parts["recurrent"]
            t0 = time.perf_counter()
            self.decode.executor.write_blocks(replica, list(moved.blocks[moved.fresh:]), snapshot, parts,
                                              via=self.transport)
            self._io("write", time.perf_counter() - t0)
            cache.commit(moved)
        except BaseException:
            cache.unpin(moved)  # unwritten arrivals go back free, unregistered
            raise
        earlier = self.arrived.pop(key, None)
        if earlier is not None:  # (never while keys are unique; if one came twice, the first is let go)
            self.decode.scheduler.cache.unpin(earlier)
        self.arrived[key] = moved
        return (len(moved.blocks) - moved.fresh) * kv.fingerprint.block_size

    # ---- recovery through the prefill engine ----------------------------------------------
    def to_recover(self, seqs: list[Seq]) -> list[tuple[Seq, list[int], int, int]]:
        """Of the sequences a decode engine's recovery queued again for a whole re-prefill (their replica died,
        with its cache), those whose tokens — prompt plus generated — are at least ``min_uncached_tokens`` past
        what decode still caches: (sequence, its tokens, the tokens whose blocks would cross, their replica).
        On the decode engine's thread."""
        out = []
        planned: Counter = Counter()
        for seq in seqs:
            tokens = list(seq.token_ids)
            route, cut, replica = self.route(tokens, seq.cache_salt, planned)
            if route.kind == "pd":
                out.append((seq, tokens, cut, replica))
                planned[replica] += 1
        return out

    def recovered_by(self, kind: str, e: BaseException | None = None) -> None:
        """Count one recovered sequence (``kind``: "pd", or "local" after the failure ``e``)."""
        if e is not None and not isinstance(e, FAILURES):  # (a transfer's own failures were counted already)
            self.count_failure("PrefillError" if isinstance(e, PrefillError) else
                               "TimeoutError" if isinstance(e, TimeoutError) else "Error")
        with self._lock:
            self.recovered[kind] += 1

    def _rewound_here(self, seqs: list[Seq]) -> None:
        """Both engines on this thread: the sequences of :meth:`to_recover` are prefilled on the prefill engine
        together and each one's blocks brought to its replica before decode's recovery ends; each then computes
        only its tail there, exactly as a prefix hit. A failure leaves it to decode's own re-prefill, counted."""
        todo = self.to_recover(seqs)
        if not todo:
            return
        failed: BaseException | None = None
        ids: list[int] = []
        try:
            for seq, tokens, cut, _ in todo:
                ids.append(self.prefill.add_request(tokens[: cut + 1], SamplingParams(max_tokens=1), seq.cache_salt))
        except Exception as e:  # noqa: BLE001 — (the prefill engine refused one: none is sent)
            failed = PrefillError(f"{type(e).__name__}: {e}")
            for seq_id in ids:
                self.prefill.abort(seq_id)
                self.prefill.release(seq_id)
        if failed is None:
            try:
                self._drain(self.prefill, ids, time.monotonic() + self.leases.lease_s)
            except Exception as e:  # noqa: BLE001 — none of them: decode re-prefills them all
                failed = PrefillError(f"{type(e).__name__}: {e}")
        for seq, tokens, cut, replica in todo:
            key, salt = -1 - seq.seq_id, seq.cache_salt  # (requests' keys are >= 0)
            try:
                if failed is not None:
                    raise failed
                lease, kv = self.read(tokens, salt, cut, key)
                try:
                    self.accept(kv, replica, key, lease)
                finally:
                    self.leases.end(lease)
                self.decode.scheduler.rehome(seq, replica)
                self.recovered_by("pd")
            except Exception as e:  # noqa: BLE001 — counted; decode re-prefills it as it would alone
                self.recovered_by("local", e)
            finally:
                self.release_arrival(key)  # (queued already: the arrivals are cached)

    # ---- status ----------------------------------------------------------------------------
    def status(self) -> dict:
        """Routes taken, transfers (bytes, seconds, failures by reason), and what is held for them now: the
        prefill engine's leased blocks and the decode engine's arrivals not yet queued (0 when idle)."""
        with self._lock:
            return self._status()

    def _status(self) -> dict:
        return {"transport": self.transport, "routes": dict(self.routes), "failures": dict(self.failures),
                "bytes_moved": self.bytes_moved,
                "recovered": dict(self.recovered),
                "transfer_s": self.transfer_s, "read_s": self.io_s["read"], "write_s": self.io_s["write"],
                "evicted_before_admission": self.evicted, "leases": len(self.leases.live), "leases_expired": self.leases.expired,
                "prefill_blocks_leased": self.leases.blocks_held,
                "decode_blocks_arriving": sum(len(m.blocks) for m in list(self.arrived.values()))}
