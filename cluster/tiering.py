"""The engine's side of the KV tier (cluster/kv_tier.py; docs/architecture.md, "The KV tier"): the blocks and
KDA snapshots the prefix cache registers are written through as they fill (:meth:`PrefixCache.take_tier_writes`
rides each step to its replica), and before a step is planned a waiting request whose prefix its replica's device
pool misses is looked up in that replica's tiers and what is there loaded and registered, so the scheduler admits
it as a prefix hit — after a restart, an eviction or a dead replica alike.

A lookup asks the actor which of the prompt's next block keys (and, on hybrid models, snapshot keys at grid
boundaries) its node's tiers hold, then adopts room for them (:meth:`PrefixCache.adopt`) and has the actor load
them; the actor checks each entry whole (key, layout, checksum) and stops at the first that is not. What loaded
is registered (:meth:`PrefixCache.commit`) and left cached; the rest is given back. On hybrid models a load counts
only whole (a hit needs the KDA state at its end). A request is looked up once per length (a recovered or
preempted one again), at most ``max_per_step`` per step, the pass's probes asked ahead in one round trip per replica
(:meth:`TierLoads._prefetch`); every failure is a miss: the request is prefilled. It
loads only while loading has measured cheaper per token than prefilling (steps of many tokens say what a prefill
costs; the loads so far what a load does): a tier slower than the devices' compute is left alone.

Owns: the lookups' bookkeeping and counters. Never: decides admission (the scheduler does, by the hits it finds),
or touches an entry's bytes (the actors do).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from actors.kv_tier import block_key, entry_name

from .kv_transfer import tier_spec

log = logging.getLogger(__name__)


class TierLoads:
    def __init__(self, engine, max_per_step: int = 4):
        self.engine, self.max_per_step = engine, max_per_step
        self.tried: set[tuple[int, int]] = set()  # (seq id, its tokens) looked up already
        # (seq id, its tokens) → (replica, its room then): the tiers held more than the replica had room for
        self.short_of_room: dict[tuple[int, int], tuple[int, int]] = {}
        self.lookups = self.found_blocks = self.loaded_blocks = self.loaded_snapshots = self.missed = 0
        self.loaded_tokens = 0
        self.queried_tokens = 0  # prompt tokens past a device hit looked up in the tiers
        self.load_s = 0.0
        self.actors: dict[int, dict] = {}  # each replica's tier counters, as its last step result carried them
        # seconds per token, measured (moving averages): loading from the tiers, and prefilling (steps of at least
        # PREFILL_TOKENS tokens); a lookup loads only while loading is the cheaper (``skipped``: when it was not)
        self.load_cost: float | None = None
        self.prefill_cost: float | None = None
        self.skipped = 0
        self.probe_calls = 0  # probe round trips to the actors (a pass asks each replica once: _prefetch)
        # entries may come from another node's tier (through one of its replicas), where the index says it holds them
        self.remote = True
        self.remote_blocks = 0  # blocks loaded that way
        # what each node's tier holds, as this engine knows it: the blocks it sent to be written there (and not
        # since found absent), by prefix hash, least recently written first; placement prefers those nodes
        # (keyed by the entries' file names, actors/kv_tier.py ``entry_name``: at the first lookup each node's tier
        # lists what it holds, so the index outlives the engine as the tier does)
        self.index: dict[str, OrderedDict[str, None]] = {}
        self.layout = tier_spec(engine.config, engine.model_cfg)["layout"]
        self.listed: set[str] = set()  # the nodes whose tiers were listed into the index (or could not say)
        self._names: dict[bytes, str] = {}  # (a pass's memo of prefix hash → entry name)
        self._reserved: dict[int, int] = {}  # (per pass of before_schedule: see there)
        self._planned: dict[int, int] = {}
        self._probed: dict[int, tuple[dict, dict]] = {}  # (per pass: see there)
        self._chains: dict[tuple[int, int], list[bytes]] = {}

    PREFILL_TOKENS = 32  # a step this large is mostly prefill: its time per token is the prefill cost
    SMOOTHING = 0.2

    def observe(self, results, tokens: int = 0, seconds: float = 0.0) -> None:
        """A finished step: keep the tier counters its attention results carry (by replica index), and with
        ``tokens`` computed in ``seconds`` measure what prefilling costs."""
        for i, r in enumerate(results):
            if getattr(r, "tier", None) is not None:
                self.actors[i] = r.tier
        if tokens >= self.PREFILL_TOKENS and seconds > 0:
            self.prefill_cost = self._average(self.prefill_cost, seconds / tokens)

    INDEX_MAX = 1 << 20  # hashes remembered per node

    def wrote(self, replica: int, items) -> None:
        """A step carries these ("block" | "snapshot", id, hash) to ``replica``'s actor to be written through."""
        known = self.index.setdefault(self.engine.executor.node_of(replica), OrderedDict())
        for kind, _, h in items:
            if kind == "block":
                name = self._name(h)
                known[name] = None
                known.move_to_end(name)
        while len(known) > self.INDEX_MAX:
            known.popitem(last=False)

    def _indexed(self, replica: int, chain: list[bytes], first: int) -> int:
        """How many of ``chain``'s blocks from ``first`` on the index says ``replica``'s node holds, in order."""
        known = self.index.get(self.engine.executor.node_of(replica))
        n = 0
        while known and first + n < len(chain) and self._name(chain[first + n]) in known:
            n += 1
        return n

    def _name(self, h: bytes) -> str:
        name = self._names.get(h)
        if name is None:
            name = self._names[h] = entry_name(self.layout, block_key(h))
        return name

    def _list(self) -> None:
        """Index what the tier of each node not listed yet holds (its entries' names, most recently used first) —
        at the first lookup, and for a node a scale change or a replacement brought — asking one replica of it:
        what the engine writes from then on is indexed as it goes."""
        executor = self.engine.executor
        for q in range(len(self.engine.scheduler.cache.blocks)):
            node = executor.node_of(q)
            if node in self.listed:
                continue
            self.listed.add(node)
            try:
                names = executor.tier(q, "tier_names", self.INDEX_MAX)
            except Exception:  # noqa: BLE001 — a node that cannot say is indexed as it is written to
                log.warning("KV tier: replica %d could not list its node's tier", q, exc_info=True)
                continue
            known = self.index.setdefault(node, OrderedDict())
            listed = OrderedDict((n, None) for n in reversed(names) if n not in known)
            listed.update(known)  # (what this engine wrote since is the more recent)
            self.index[node] = listed

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)

    def cheaper_to_load(self) -> bool:
        """Loading from the tiers costs less per token than prefilling, as measured (so far unknown: yes)."""
        return self.load_cost is None or self.prefill_cost is None or self.load_cost <= self.prefill_cost

    def before_schedule(self) -> None:
        """Between steps (nothing in flight): look up the first waiting requests not looked up yet — or looked up
        and short of room on their replica then, once it has more."""
        sched = self.engine.scheduler
        if sched.waiting:
            try:
                self._list()
            except Exception:  # noqa: BLE001 — the index is a hint: the probes still find what a tier holds
                log.warning("KV tier: listing the nodes' tiers failed", exc_info=True)
        self._names = {}
        self._reserved: dict[int, int] = {}  # per replica: blocks the requests loaded for this step will take
        self._planned: dict[int, int] = {}  # per replica: requests looked up for it in this pass
        self._probed: dict[int, tuple[dict, dict]] = {}  # replica → what its tier holds (block, snapshot hash → bool)
        self._chains = {}  # (seq id, its tokens) → its prompt's block chain, hashed once a pass
        todo = []
        for seq in list(sched.waiting):
            if len(todo) >= self.max_per_step or len(sched.running) + len(todo) >= sched.max_num_seqs:
                break  # (what it loads for a request the scheduler cannot admit now, others would evict first)
            mark = (seq.seq_id, len(seq.token_ids))
            if seq.is_refresh or mark in self.tried:
                continue
            short = self.short_of_room.get(mark)
            if short is not None and self._room(short[0]) <= short[1]:
                continue
            todo.append((seq, mark))
        if len(todo) > 1:
            self._prefetch([seq for seq, _ in todo])
        for seq, mark in todo:
            try:
                room = self._look_up(seq)
            except Exception:  # noqa: BLE001 — a lookup that fails is a miss: the request is prefilled
                self.missed += 1
                log.warning("KV tier: a lookup failed; the request is prefilled", exc_info=True)
                room = None
            self.short_of_room.pop(mark, None)
            if room is None:
                self.tried.add(mark)
            else:  # the tier holds more of it than its replica had room for: again when there is more room
                self.short_of_room[mark] = room
        self._probed, self._chains = {}, {}  # (answers for this pass only: the tiers change between steps)
        if len(self.tried) > 4 * max(len(sched.seqs), 1024):
            self.tried = {m for m in self.tried if m[0] in sched.seqs}
            self.short_of_room = {m: v for m, v in self.short_of_room.items() if m[0] in sched.seqs}

    def _room(self, replica: int) -> int:
        """Blocks ``replica`` could still hand out, less those the requests loaded for this step will take."""
        pools = self.engine.scheduler.cache.blocks
        return pools[replica].num_available - self._reserved.get(replica, 0) if replica < len(pools) else 0

    def _look_up(self, seq) -> tuple[int, int] | None:
        """Load what the tiers hold of ``seq``'s prompt past its device hit, as far as its replica has room; None
        when done, or (replica, its room now) when the tiers hold more than there was room for."""
        cache, executor = self.engine.scheduler.cache, self.engine.executor
        bs = cache.block_size
        placed = self._place(seq)
        if placed is None:
            return None
        r, have, deepest, chain = placed
        first = have // bs  # blocks the device holds of it
        room, need = self._room(r), self._need(seq, first)
        if room < need:
            return r, room  # no room for all of it now: loaded, its blocks would be evicted before it is admitted
        t0 = time.perf_counter()
        self.lookups += 1
        self.queried_tokens += deepest - have
        held = self._held(r, chain, have, deepest)
        found, depth = held.usable(), held.usable(first + max(room - first, 0))
        more = (r, room) if depth < found else None  # (the device's own prefix may come out of the LRU)
        if depth <= have:
            return more
        if not self.cheaper_to_load():
            self.skipped += 1
            return None
        moved = cache.adopt(r, list(chain[:depth // bs]))
        if moved is None:
            return (r, room)  # no room after all (a KDA snapshot, say)
        items = [("block", b, h) for b, h in zip(moved.blocks[moved.fresh:], moved.hashes[moved.fresh:])]
        if moved.new_snapshot:
            items.append(("snapshot", moved.snapshot, moved.hashes[-1]))
        ours = set(moved.hashes)
        fetched = [k for k in self._wanted(held, chain, depth) if k[1] in ours]
        try:
            loaded = executor.tier(r, "tier_load", items, self._source_of(held, fetched))
        except BaseException:
            cache.unpin(moved)
            raise
        if loaded < len(items):
            self.missed += 1
            if moved.snapshot is not None or loaded == 0:
                cache.unpin(moved)
                return None
            moved = cache.trim(moved, moved.fresh + loaded)
            more = None
        cache.commit(moved)
        cache.unpin(moved)  # cached now, at the LRU's recent end: the scheduler admits the request as a hit
        self._reserved[r] = self._reserved.get(r, 0) + need
        self.engine.scheduler.rehome(seq, r)
        fetched = set(fetched)
        came = [i for i in items[:loaded] if (i[0], i[2]) in fetched]
        self.remote_blocks += sum(i[0] == "block" for i in came)
        self.wrote(r, came)  # (the actor files them in its own node's tier too)
        self.loaded_blocks += len(moved.blocks) - moved.fresh
        self.loaded_snapshots += moved.new_snapshot and loaded == len(items)
        self.loaded_tokens += (len(moved.blocks) - moved.fresh) * bs
        spent = time.perf_counter() - t0
        self.load_s += spent
        if len(moved.blocks) > moved.fresh:
            self.load_cost = self._average(self.load_cost, spent / ((len(moved.blocks) - moved.fresh) * bs))
        return more

    def _place(self, seq) -> tuple[int, int, int, list[bytes]] | None:
        """The replica a lookup of ``seq`` takes — the scheduler's placement rule, its load counting the requests
        looked up for it before in this pass (counted now), a hit counting what the index says its node's tier
        holds too — with the tokens its device holds, the deepest hit there could be and the prompt's block
        chain; None when there is nothing to look up (a prompt under a block, or held whole)."""
        cache, sched = self.engine.scheduler.cache, self.engine.scheduler
        bs, tokens, salt = cache.block_size, seq.token_ids, seq.cache_salt
        deepest = cache.deepest(len(tokens))
        if deepest < bs:
            return None
        hits = cache.probe(tokens, salt)
        load = [sched.load(i) + self._planned.get(i, 0) for i in range(len(hits))]
        key = (seq.seq_id, len(tokens))  # (a pass's prefetch places it before its lookup does)
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = cache.chain_of(tokens, salt, deepest)
        held = [min(deepest, max(h.tokens, (h.tokens // bs + self._indexed(i, chain, h.tokens // bs)) * bs))
                for i, h in enumerate(hits)]
        r = max(range(len(hits)), key=lambda i: (held[i] - sched.load_weight * load[i], -load[i], self._room(i)))
        if seq.home is not None and seq.home < len(hits):
            r = seq.home  # a PD arrival's replica (cluster/pd.py)
        self._planned[r] = self._planned.get(r, 0) + 1
        have = hits[r].tokens
        return None if have >= deepest else (r, have, deepest, chain)

    def _need(self, seq, first: int) -> int:
        """Blocks ``seq`` takes on a replica whose device holds its first ``first``: the rest of its prompt and one."""
        return -(-len(seq.token_ids) // self.engine.scheduler.cache.block_size) + 1 - first

    def _prefetch(self, seqs: list) -> None:
        """Ask each replica's actor once for what its node's tier holds of every request of this pass that its
        lookup will probe there (the placement decided as the lookups will, in order), and then each source node's
        actor once for what its tier holds past that, instead of a round trip per request each (``_probed``; a
        lookup whose probe was not asked ahead, or whose answer failed, asks on its own as before)."""
        cache = self.engine.scheduler.cache
        bs, asks = cache.block_size, {}
        for seq in seqs:
            try:
                placed = self._place(seq)
            except Exception:  # noqa: BLE001 — its lookup will fail (or not) on its own
                continue
            if placed is None:
                continue
            r, have, deepest, chain = placed
            if self._room(r) < self._need(seq, have // bs):
                continue  # (its lookup stops before probing)
            asks.setdefault(r, []).append(self._probe_keys(chain, have, deepest, have // bs))
        self._planned = {}  # (the lookups count their own)
        self._ask(asks)
        if not self.remote:
            return
        further = {}
        for r, keys in asks.items():
            for blocks, snaps, chain in keys:
                if r not in self._probed:
                    continue
                i = len(chain) - len(blocks) + self._probe(r, list(blocks), list(snaps))[0]  # where the local tier stops
                q = self._source(r, chain, i) if i < len(chain) else None
                if q is not None:
                    further.setdefault(q, []).append((tuple(chain[i:]), snaps, chain))
        self._ask(further)

    def _probe_keys(self, chain: list[bytes], have: int, deepest: int, first: int) -> tuple:
        """A probe past ``first`` blocks of ``chain``: (the blocks' hashes, the snapshots' hashes at the grid
        boundaries from a hit of ``have`` tokens to ``deepest``, the chain)."""
        bs = self.engine.scheduler.cache.block_size
        return tuple(chain[first:]), tuple(chain[b // bs - 1] for b in self._bounds(have, deepest)), chain

    def _bounds(self, have: int, deepest: int) -> list[int]:
        """The grid boundaries past a hit of ``have`` tokens up to ``deepest`` (hybrid models' snapshots: hits sit
        on the grid); none without a grid."""
        grid = self.engine.scheduler.cache.grid
        return list(range(have + grid, deepest + 1, grid)) if grid else []

    def _ask(self, asks: dict[int, list[tuple]]) -> None:
        """One ``tier_probes`` round trip per replica in ``asks`` (replica → [(blocks, snapshots, chain)]), what
        each answer says of every entry kept in ``_probed``; a replica that fails answers none of them here."""
        for q, keys in asks.items():
            try:
                answers = self.engine.executor.tier(q, "tier_probes", [(list(b), list(s)) for b, s, _ in keys])
            except Exception:  # noqa: BLE001 — each lookup asks (and fails, or not) on its own
                log.warning("KV tier: replica %d's probes failed", q, exc_info=True)
                continue
            self.probe_calls += 1
            blocks, snaps = self._probed.setdefault(q, ({}, {}))
            for (b, s, _), (n, held) in zip(keys, answers):
                blocks.update(dict.fromkeys(b[:n], True))
                if n < len(b):
                    blocks[b[n]] = False  # (a probe stops at the first absent)
                snaps.update(zip(s, held))

    def _probe(self, q: int, blocks: list[bytes], snaps: list[bytes]) -> tuple[int, list[bool]]:
        """What replica ``q``'s node's tier holds of ``blocks`` (how many, in order) and ``snaps``: from what this
        pass asked ahead where that says (a lookup after another's load may start further along the same chain),
        else asked now."""
        known = self._probed.get(q)
        if known is not None:
            n = 0
            while n < len(blocks) and known[0].get(blocks[n]):
                n += 1
            if (n == len(blocks) or blocks[n] in known[0]) and all(h in known[1] for h in snaps):
                return n, [known[1][h] for h in snaps]
        self.probe_calls += 1
        return self.engine.executor.tier(q, "tier_probe", blocks, snaps)

    def _held(self, r: int, chain: list[bytes], have: int, deepest: int) -> "Held":
        """What the tiers hold of ``chain`` past a device hit of ``have`` tokens on replica ``r``: first its own
        node's, then — where the index says another node's tier holds the next blocks — that node's, through one
        of its replicas (a failing one holds nothing)."""
        cache = self.engine.scheduler.cache
        bs = cache.block_size
        first = have // bs
        bounds = self._bounds(have, deepest)
        blocks, snap_keys, _ = self._probe_keys(chain, have, deepest, first)
        snap_keys = list(snap_keys)
        n, snaps = self._probe(r, list(blocks), snap_keys)
        self.found_blocks += n
        self._forget(r, chain, first + n)
        held = Held(bs, cache.grid, first, n, bounds, [r if ok else None for ok in snaps])
        q = self._source(r, chain, first + n) if self.remote and first + n < len(chain) else None
        if q is not None:
            try:
                m, qsnaps = self._probe(q, list(chain[first + n:]), snap_keys)
            except Exception:  # noqa: BLE001 — another node that cannot say holds nothing
                log.warning("KV tier: replica %d's probe failed; its node's tier is left out", q, exc_info=True)
                return held
            self.found_blocks += m
            self._forget(q, chain, first + n + m)
            held.remote, held.source = m, q
            held.snapshots = [s if s is not None else (q if ok else None) for s, ok in zip(held.snapshots, qsnaps)]
        return held

    def _forget(self, r: int, chain: list[bytes], i: int) -> None:
        """``r``'s node's tier lacks ``chain[i]``: the index forgets it there."""
        if i < len(chain):
            self.index.get(self.engine.executor.node_of(r), {}).pop(self._name(chain[i]), None)

    def _source(self, r: int, chain: list[bytes], i: int) -> int | None:
        """A replica of the node whose tier the index says holds the most of ``chain`` from block ``i`` on, other
        than ``r``'s node; None when none does."""
        executor, replicas = self.engine.executor, range(len(self.engine.scheduler.cache.blocks))
        home = executor.node_of(r)
        best, most = None, 0
        for node, known in list(self.index.items()):  # (PD's route asks from its own thread)
            n = 0
            while node != home and i + n < len(chain) and self._name(chain[i + n]) in known:
                n += 1
            if n > most:
                best, most = node, n
        return next((q for q in replicas if q != r and executor.node_of(q) == best), None) if best else None

    def _wanted(self, held: "Held", chain: list[bytes], depth: int) -> list[tuple[str, bytes]]:
        """The entries a load to ``depth`` tokens takes from another node's tier (``held.source``'s): (kind, hash)."""
        bs = held.block_size
        blocks = [("block", h) for h in chain[held.first + held.local:depth // bs]]
        snap = held.snapshot_at(depth)
        return blocks + ([("snapshot", chain[depth // bs - 1])] if snap is not None and snap == held.source else [])

    def _source_of(self, held: "Held", want: list[tuple[str, bytes]]):
        """Where the loading actor reads ``want`` itself (none: nothing from another node): the source replica's
        actor (executor ``peer``) and how long to wait for it — under half the load's own timeout, so that a
        source that does not answer costs the entries it holds (they are prefilled), never the loading replica."""
        if not want:
            return None
        faults = self.engine.config.faults
        wait = min(faults.step_timeout_s / 2, faults.hang_floor_s + faults.heartbeat_timeout_s)
        return self.engine.executor.peer(held.source), want, wait

    def covers(self, r: int, tokens: list[int], salt: str | None, have: int) -> int:
        """How far a hit on replica ``r`` could reach with what its tiers hold (at least ``have``, its device hit):
        selective PD asks, so that a prompt its decode node's tier holds is loaded there rather than sent."""
        cache = self.engine.scheduler.cache
        deepest = cache.deepest(len(tokens))
        if have >= deepest or deepest < cache.block_size:
            return have
        try:
            found = self._held(r, cache.chain_of(tokens, salt, deepest), have, deepest).usable()
        except Exception:  # noqa: BLE001 — the tier cannot say: as if it held nothing
            log.warning("KV tier: a probe failed", exc_info=True)
            return have
        return max(have, found)

    def status(self) -> dict:
        return {"lookups": self.lookups, "probe_calls": self.probe_calls, "queried_tokens": self.queried_tokens,
                "found_blocks": self.found_blocks,
                "loaded_blocks": self.loaded_blocks, "loaded_snapshots": self.loaded_snapshots,
                "loaded_tokens": self.loaded_tokens, "missed": self.missed, "load_s": self.load_s,
                "skipped": self.skipped, "remote_blocks": self.remote_blocks, "load_us_per_token": _us(self.load_cost),
                "prefill_us_per_token": _us(self.prefill_cost),
                "actors": {str(k): v for k, v in sorted(dict(self.actors).items())}}  # (a copy: read off-thread)


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e6, 2)


class Held:
    """What the tiers hold of a prompt's block chain past a device hit of ``first`` blocks: ``local`` blocks on the
    replica's own node, then ``remote`` more on replica ``source``'s node; ``snapshots``: for each grid boundary in
    ``bounds`` (hybrid models), the replica whose node holds its KDA snapshot, or None."""

    def __init__(self, block_size: int, grid: int, first: int, local: int, bounds: list[int], snapshots: list):
        self.block_size, self.grid, self.first, self.local = block_size, grid, first, local
        self.bounds, self.snapshots = bounds, snapshots
        self.remote, self.source = 0, None

    def usable(self, max_blocks: int | None = None, cap: int | None = None) -> int:
        """The prompt tokens a hit can reach with them (within ``max_blocks`` blocks, and ``cap``): on hybrid
        models only to a boundary whose snapshot is held."""
        blocks = self.first + self.local + self.remote
        blocks = min([blocks, *(b for b in (max_blocks, cap) if b is not None)])
        if not self.grid:
            return blocks * self.block_size
        return max((b for b, s in zip(self.bounds, self.snapshots) if s is not None and b <= blocks * self.block_size),
                   default=0)

    def snapshot_at(self, tokens: int):
        """The replica holding the snapshot at ``tokens`` (a boundary), or None."""
        return next((s for b, s in zip(self.bounds, self.snapshots) if b == tokens), None)
