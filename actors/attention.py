"""AttentionWorker: one attention data-parallel replica.

Owns: the embedding, every layer's attention (MLA, KDA), norms, gates, shared experts, dense
layers and the lm_head — but no routed experts; the paged latent cache and KDA slots of the
sequences the engine pinned here, their sampling params (sent once, with a sequence's first chunk
here, kept until the engine releases it), and the logits processors' per-sequence histories (penalties,
grammar matchers: :class:`model.logits.LogitsState`, fed with every chunk's tokens, so they are
rebuilt wherever a sequence is prefilled again). Draws are stateless (seeds derive from the
request's seed and the context length). An epoch change (:meth:`enter_epoch`)
swaps the process group and the dispatch table only.
Never: decides which sequences run, which blocks or slots they use (the engine's scheduler does
and sends them in :class:`~actors.messages.SeqChunk`), or talks to Ray per layer — MoE layers
exchange tokens with the expert actors through the process group.

A plain class: :mod:`actors.remote` makes it a Ray actor.
"""

from __future__ import annotations

import logging
import time

import torch

from model.cache import build_attn_meta, read_blocks, write_blocks
from model.loader import load_model, parse_dtype
from model.logits import LogitsState, grammars_for, stateful
from model.moe import COMBINE, Dispatch, run_stages
from model.sampling import SamplingParams, draw_seed, sample, top_logprobs
from model.threads import release_openmp_pool
from model.timing import StepTimes

from .device import choose_device
from .kv_tier import block_key, snapshot_key, tier_key
from .channel import ServesSteps, StepServer
from .group import exchange_device, join_group, leave_group, open_store
from .dispatch import DistDispatcher, LocalExchange
from .messages import (AHEAD, GroupInfo, PlacementTable, SampledToken, SeqChunk, StepRequest, StepResult,
                       refuse_ahead)
from .progress import LoadProgress

log = logging.getLogger(__name__)


class AttentionWorker(ServesSteps):
    ROLE = "attention"  # its name's kind: attention[i] (a colocated worker: worker[i])

    def __init__(self, model_path: str, *, index: int | None, table: PlacementTable, num_blocks: int,
                 block_size: int = 16, num_slots: int = 64, dtype: str = "float32", impl: str = "absorbed",
                 threads: int | None = 1, exchange: str = "auto", num_snapshots: int = 0,
                 local_experts: bool = False, mtp: bool = False, compile: str = "off", max_batch: int = 256,
                 tier: dict | None = None):
        """``local_experts``: hold every routed expert too, for :meth:`use_local_experts` (the
        in-process executor); an attention actor holds none. ``mtp``: hold the checkpoint's MTP
        layer too (its routed experts on the expert actors) and draft with it each step
        (speculative decoding's ``method: mtp``). ``compile``: "decode" compiles the decode step for
        batches up to ``max_batch`` now (model/compiled.py), before the actor serves. ``tier``: the KV tier
        (cluster/kv_transfer.py ``tier_spec``: its directories, sizes and this cache's layout), or None."""
        super().__init__()
        if threads:
            torch.set_num_threads(threads)
        self.index, self.name = index, f"{self.ROLE}[standby]" if index is None else f"{self.ROLE}[{index}]"
        self.table, self.impl, self.block_size = table, impl, block_size
        self.exchange_format = exchange  # the exchange's wire format: auto, dense or sparse (actors/dispatch.py)
        self.dtype = parse_dtype(dtype)
        self.placement = choose_device(self.name)  # the GPU Ray assigned, if any
        self.device = torch.device(self.placement.device)
        self.progress = LoadProgress(self.name)
        self.model = load_model(model_path, dtype=self.dtype, experts=None if local_experts else range(0),
                                progress=False, on_progress=self.progress.update, mtp=mtp).to(self.device)
        self.cfg = self.model.cfg
        self.cache = self.model.make_cache(num_blocks, block_size, num_slots, self.dtype, self.device,
                                           num_snapshots=num_snapshots if self.cfg.kda_layers else 0)
        if compile == "decode":
            s = self.model.compile_decode(self.cache, impl, max_batch=max_batch, whole=False).compile_s
            log.info("%s: decode step compiled in %.1f s", self.name, s)
        elif compile != "off":
            raise ValueError(f"compile must be 'off' or 'decode', got {compile!r}")
        self.tier = None  # the KV tier (actors/tier.py): blocks written through, entries loaded
        if tier is not None:
            from .tier import ActorTier

            self.tier = ActorTier(tier, self.cache)
        self.cache.times = StepTimes()  # the step's compute per layer kind (the per-token profile)
        self._route_s = 0.0  # the step's time in the exchange's issue and collect calls
        self._moe = self.model.moe_blocks()  # the MTP layer's too, with mtp
        self.moe_layers = sorted(self._moe)
        self.mtp_layer = self.model.mtp.index if self.model.mtp is not None else None
        self.dispatcher: DistDispatcher | LocalExchange | None = None  # set by enter_epoch
        self.completed = -1  # the last step that completed here
        self.sampled: dict[int, int] = {}  # seq id → the token that step sampled (AHEAD chunks read it)
        # seq id → its sampling params (None: a refresh job, never samples): they come with the sequence's
        # first chunk here (reset_state) and stay until the engine releases it
        self.params: dict[int, SamplingParams | None] = {}
        # penalties' and grammars' per-sequence histories, fed with every chunk's tokens
        self.logits_state = LogitsState(self.cfg.vocab_size, self.device, lambda: grammars_for(model_path,
                                                                                              self.cfg.vocab_size))
        self._store = None  # the rendezvous store this actor opened for an epoch where it is rank 0
        release_openmp_pool()  # the steps run on another thread: leave it the only OpenMP pool (model/threads.py)

    # ---- control plane -----------------------------------------------------------------
    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def rendezvous(self) -> tuple[str, int]:
        """The address and port of the next epoch's rendezvous store, opened (and listening) here,
        where this actor is rank 0 of that epoch."""
        import ray

        ip = ray.util.get_node_ip_address()
        self._store = open_store(ip)
        return ip, self._store.port

    def enter_epoch(self, info: GroupInfo, table: PlacementTable, index: int) -> None:
        """Leave the old process group and join the epoch's as attention rank ``index``, dispatching
        by the epoch's table. The cache and KDA state are untouched."""
        with self.busy:  # never beside a step (a step runs on the step channel's thread)
            leave_group()
            self.index, self.name, self.table = index, f"attention[{index}]", table
            store = self._store if index == 0 and self._store is not None and self._store.port == info.port else None
            join_group(info, index, table.world_size, store, num_attention=table.num_attention)
            self.dispatcher = DistDispatcher(self.name, table, self.cfg.expert_hidden_size, self.dtype,
                                             self.cfg.num_experts_per_tok, self.exchange_format,
                                             device=exchange_device(info, self.device))

    def use_local_experts(self, table: PlacementTable) -> None:
        """The in-process executor (cluster/inprocess.py): no process group; every MoE layer runs on
        this worker's own routed experts (built with ``local_experts``), by ``table``'s epoch."""
        self.table = table
        self.dispatcher = LocalExchange(table, self._moe, self.cfg.expert_hidden_size, self.dtype,
                                        self.cfg.num_experts_per_tok, device=self.device)

    def shutdown(self) -> None:
        self.close_channel()
        self.close_blocks_channel()
        if self.tier is not None:
            self.tier.close()
        leave_group()

    # ---- prefill/decode disaggregation: moving cached blocks (cluster/pd.py) ---------------------
    _blocks_server: StepServer | None = None

    def open_blocks_channel(self, token: bytes) -> tuple[str, int]:
        """Serve :meth:`read_blocks` and :meth:`write_blocks` to the engine that holds ``token`` over a direct
        connection of their own (a step channel's kind, beside the steps' own: its calls never take a step's
        number), replacing any earlier one; returns where it listens."""
        from .group import node_ip

        self.close_blocks_channel()
        self._blocks_server = StepServer(node_ip(), token, self._serve_blocks, f"{self.name} blocks")
        return self._blocks_server.address

    def _serve_blocks(self, request: tuple, received_at: float = 0.0):
        op, *args = request
        if op in ("read", "write"):
            return self.read_blocks(*args) if op == "read" else self.write_blocks(*args)
        if op not in ("tier_probe", "tier_probes", "tier_load", "tier_fetch", "tier_names", "tier_flush", "tier_status"):
            raise ValueError(f"{self.name}: no blocks operation {op!r}")
        if self.tier is None:
            raise RuntimeError(f"{self.name} has no KV tier (kv_offloading_size is 0)")
        if op == "tier_load":  # (items, and where another node's tier holds some: (its actor, [(kind, hash)], wait))
            from .tier import fetch_from

            fetched = fetch_from(*args[1], name=self.name) if len(args) > 1 and args[1] else {}
            with self.busy:  # into the cache: never beside a step
                return self.tier.load([(k, i, tier_key(k, h)) for k, i, h in args[0]], fetched)
        if op == "tier_fetch":
            return self.tier_fetch(args[0])
        if op == "tier_names":
            return self.tier.names(*args)
        if op in ("tier_probe", "tier_probes"):  # one (blocks, snapshots), or a list of them
            probes = [args] if op == "tier_probe" else args[0]
            answers = [self.tier.probe([block_key(h) for h in b], [snapshot_key(h) for h in s]) for b, s in probes]
            return answers[0] if op == "tier_probe" else answers
        return self.tier.flush(*args) if op == "tier_flush" else self.tier.status()

    def tier_fetch(self, want: list[tuple[str, bytes]]) -> list[bytes]:
        """[(kind, hash)] → their entries as this node's tier stores them, up to the first it does not hold whole:
        for another node's actor to load (it calls this itself: actors/tier.py ``fetch_from``)."""
        if self.tier is None:
            raise RuntimeError(f"{self.name} has no KV tier (kv_offloading_size is 0)")
        return self.tier.fetch([tier_key(k, h) for k, h in want])

    def close_blocks_channel(self) -> None:
        if self._blocks_server is not None:
            self._blocks_server.close()
            self._blocks_server = None

    def read_blocks(self, blocks: list[int], snapshot: int | None = None) -> dict[str, torch.Tensor]:
        """Copies of cache ``blocks`` (and KDA ``snapshot``): :func:`model.cache.read_blocks`, never beside a step."""
        with self.busy:
            return read_blocks(self.cache, blocks, snapshot)

    def write_blocks(self, blocks: list[int], snapshot: int | None, parts: dict[str, torch.Tensor]) -> None:
        """Write ``parts`` into cache ``blocks`` (and KDA ``snapshot``): :func:`model.cache.write_blocks`."""
        with self.busy:
            write_blocks(self.cache, blocks, snapshot, parts)

    # ---- data plane ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, req: StepRequest) -> StepResult:
        d = self.dispatcher
        assert d is not None, f"{self.name}: step before enter_epoch"
        if req.epoch != self.table.epoch:
            raise RuntimeError(f"{self.name}: step {req.step} is for epoch {req.epoch}, this actor is in "
                               f"epoch {self.table.epoch}")
        refuse_ahead(self.name, req.step, req.ahead, self.completed)
        if req.tier_writes and self.tier is not None:  # before this step may reuse their rows
            self.tier.copy_out([(k, i, tier_key(k, h)) for k, i, h in req.tier_writes])
        self.logits_state.release(req.release)
        for seq_id in req.release:
            self.params.pop(seq_id, None)
        for c in req.chunks:
            if c.reset_state:
                self.params[c.seq_id] = c.params
        self.logits_state.prepare(c.params for c in req.chunks if c.reset_state)  # compiles beside the forward
        d.begin_step(req.step, req.peer_tokens)
        if self.cache.kda is not None:
            self.cache.kda.drop_kept()  # what a failed step with drafts kept
        times = self.cache.times
        times.reset()
        self._route_s = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        micro = req.micro or (len(req.chunks),)
        bounds = [sum(micro[:m]) for m in range(len(micro) + 1)]
        batches = [req.chunks[a:b] for a, b in zip(bounds, bounds[1:])]
        compiled = self.model.compiled
        before = compiled.tally() if compiled is not None else None
        out = self._forward(batches)
        for c in req.chunks:  # after every micro-batch: a snapshot restored this step is read first
            if c.snapshot is not None and self.cache.kda is not None:
                self.cache.kda.save(c.state_slot, c.snapshot)
        t1 = time.perf_counter()
        forward_exchange_s = d.exchange_s
        # the exchange's calls: its collectives (exchange), the local experts' rows, and its own packing
        parts = {**times.seconds, "experts": d.expert_s, "pack": self._route_s - d.exchange_s - d.expert_s}
        tokens = self._sample(req.chunks, [o[0] if o is not None else None for o in out]) if req.chunks else ()
        drafts = self._mtp(batches, out, tokens) if self.mtp_layer is not None and self.mtp_layer not in req.skip else ()
        sample_s, cpu_s = time.perf_counter() - t1, time.thread_time() - c0
        self.completed, self.sampled = req.step, {t.seq_id: t.token_id for t in tokens}
        stats = step_stats(d) if req.chunks else {}
        return StepResult(step=req.step, actor=self.name, tokens=tokens, drafts=drafts, **stats,
                          forward_s=t1 - t0, exchange_s=d.exchange_s, sample_s=sample_s,
                          dispatch_s=d.phase_s["counts"] + d.phase_s["dispatch"], combine_s=d.phase_s["combine"],
                          cpu_s=cpu_s, received_at=self.received_at, started_at=t0, replied_at=time.perf_counter(),
                          forward_exchange_s=forward_exchange_s, forward_parts=tuple(parts.items()),
                          compiled=compiled.since(before) if compiled is not None else (),
                          tier=self.tier.changed() if self.tier is not None else None)

    def _forward(self, batches: list[tuple[SeqChunk, ...]]) -> list:
        """Every micro-batch's forward, interleaved at the MoE exchanges (ping-pong): while one
        micro-batch's tokens are with the expert actors, the next one computes. Each generator
        runs until it waits for a combine; the exchanges are posted layer-major, micro-batch minor,
        as the expert actors serve them. Returns (hidden states, attention meta) per micro-batch."""
        d = self.dispatcher
        gens = [self._stages(chunks) for chunks in batches]
        out, pending = [None] * len(gens), [None] * len(gens)

        def advance(m: int, value) -> bool:  # run micro-batch m to its next wait; False once done
            while True:
                try:
                    req = gens[m].send(value)
                except StopIteration as stop:
                    out[m] = stop.value
                    return False
                if isinstance(req, Dispatch):
                    t = time.perf_counter()
                    pending[m], value = d.issue(req.moe.layer, req.x, req.topk_idx, req.topk_w), None
                    self._route_s += time.perf_counter() - t
                else:
                    return True

        def collect(m: int):
            t = time.perf_counter()
            rows = d.collect(pending[m])
            self._route_s += time.perf_counter() - t
            return rows

        live = [m for m in range(len(gens)) if advance(m, None)]
        while live:
            live = [m for m in live if advance(m, collect(m))]
        return out

    def _stages(self, chunks: tuple[SeqChunk, ...]):
        """One micro-batch's forward as stages (:meth:`CausalLM.stages`); with no chunks, just its
        part in every MoE layer's exchange."""
        if not chunks:
            for layer in self.moe_layers:
                if layer != self.mtp_layer:  # (the MTP layer's exchange comes after sampling: _mtp)
                    yield Dispatch(self._moe[layer], *self.dispatcher.empty())
                    yield COMBINE
            return None
        t_in = time.perf_counter()
        for c in chunks:
            if c.reset_state and self.cache.kda is not None:
                if c.restore is None:
                    self.cache.kda.reset(c.state_slot)
                else:
                    self.cache.kda.restore(c.restore, c.state_slot)
        known = [[self._known(c.seq_id) if t == AHEAD else t for t in c.token_ids] for c in chunks]
        for c, toks in zip(chunks, known):
            toks = toks[: len(toks) - c.draft]  # drafts join the history as they are accepted (_verify)
            if c.prefix:  # the tokens found cached, for the sequence's new history
                self.logits_state.feed(c.seq_id, c.prompt_len, 0, list(c.prefix) + toks, self._params(c))
            else:
                self.logits_state.feed(c.seq_id, c.prompt_len, c.num_cached, toks, self._params(c))
        ids = torch.tensor([t for toks in known for t in toks], device=self.device)
        drafts = [c.draft for c in chunks]
        meta = build_attn_meta(
            [len(c.token_ids) for c in chunks], [c.num_cached + len(c.token_ids) for c in chunks],
            [list(c.block_table) for c in chunks], self.block_size, device=self.device,
            state_slots=[c.state_slot for c in chunks] if self.cache.kda is not None else None,
            verify=[d > 0 for d in drafts] if any(drafts) else None)
        self.cache.times.add("inputs", time.perf_counter() - t_in)
        h = yield from self.model.stages(ids, meta, self.cache, self.impl)
        keep = (h, meta, known) if self.mtp_layer is not None else None  # what the MTP layer reads (_mtp)
        if not any(drafts):
            return h[meta.last_token_index.to(h.device)], keep  # each chunk's last token
        ends = meta.last_token_index.tolist()  # with drafts: each chunk's last 1 + draft tokens
        rows = torch.tensor([e - d + i for e, d in zip(ends, drafts) for i in range(d + 1)], device=h.device)
        return h[rows], keep

    def _mtp(self, batches: list[tuple[SeqChunk, ...]], out: list, tokens: tuple[SampledToken, ...]) -> tuple:
        """The MTP layer over every position of this step's chunks (its own latent cache, its MoE
        exchange after the main layers', micro-batch by micro-batch), each position with the token
        after it (the chunk's next, the scheduler's ``lookahead`` after a prefill chunk, or what was
        sampled here: the accepted drafts and the token after them). Returns (sequence, context
        length, draft token) per sampling chunk: the greedy guess of the token after its new last
        token, from the position of its last accepted token."""
        got: dict[int, list[int]] = {}
        for t in tokens:
            got.setdefault(t.seq_id, []).append(t.token_id)
        drafts = []
        for chunks, o in zip(batches, out):
            if not chunks:
                self._exchange_alone(self._empty_mtp())
                continue
            h, meta, known = o[1]
            nxt, pick = [], []  # the token after each position; (chunk, row) of each draft
            for c, toks in zip(chunks, known):
                n = len(toks)
                mine = got.get(c.seq_id, []) if c.sample else []
                if mine:
                    after = toks[1 : n - c.draft] + mine
                    after += [after[-1]] * (n - len(after))  # past a rejected draft: overwritten later
                    i = n - 1 - c.draft + len(mine) - 1  # its last accepted position in the chunk
                    pick.append((c, len(nxt) + i, i))
                else:
                    after = toks[1:] + [max(c.lookahead, 0)]
                nxt += after[:n]
            rows = torch.tensor([r for _, r, _ in pick], dtype=torch.long, device=h.device)
            logits = self._exchange_alone(self.model.mtp_stages(
                torch.tensor(nxt, device=h.device), h, meta, self.cache, self.impl, rows))
            if pick:
                best = logits.argmax(-1).tolist()
                drafts += [(c.seq_id, c.num_cached + i + 2, tok) for (c, _, i), tok in zip(pick, best)]
        return tuple(drafts)

    def _empty_mtp(self):
        yield Dispatch(self._moe[self.mtp_layer], *self.dispatcher.empty())
        yield COMBINE

    def _exchange_alone(self, gen):
        """Run one stage generator to its end, each exchange issued and collected in turn."""
        d = self.dispatcher
        return run_stages(gen, lambda req: d.issue(req.moe.layer, req.x, req.topk_idx, req.topk_w), d.collect)

    def _params(self, chunk: SeqChunk) -> SamplingParams | None:
        """The sampling params of ``chunk``'s sequence, as its first chunk here brought them."""
        try:
            return self.params[chunk.seq_id]
        except KeyError:
            raise RuntimeError(f"{self.name}: sequence {chunk.seq_id} has a chunk at position {chunk.num_cached}, "
                               "but its first chunk here (with its params) never came") from None

    def _known(self, seq_id: int) -> int:
        """The token the last step sampled here for ``seq_id`` (an AHEAD chunk's input)."""
        try:
            return self.sampled[seq_id]
        except KeyError:
            raise RuntimeError(f"{self.name}: sequence {seq_id} was sent ahead, but step {self.completed} "
                               f"sampled no token for it here") from None

    def _sample(self, chunks: tuple[SeqChunk, ...], last: list) -> tuple[SampledToken, ...]:
        if any(c.draft for c in chunks):
            return self._verify(chunks, last)
        rows = [b for b, c in enumerate(chunks) if c.sample]
        if not rows:
            return ()
        h = torch.cat([x for x in last if x is not None])
        logits = self.model.logits(h[rows])  # [R, V] stays on the device
        params = [self._params(chunks[b]) for b in rows]
        seq_ids = [chunks[b].seq_id for b in rows]
        seeds = [draw_seed(p, chunks[b].num_cached + len(chunks[b].token_ids)) for p, b in zip(params, rows)]
        shaped = self.logits_state.apply(logits, seq_ids, params, [chunks[b].banned for b in rows])
        next_ids = sample(shaped, params, seeds)
        return self._package(seq_ids, logits, next_ids, params)

    def _verify(self, chunks: tuple[SeqChunk, ...], last: list) -> tuple[SampledToken, ...]:
        """Sample after each chunk's known tokens and after each of its drafts, and keep the samples
        up to the first one that differs from the draft at its position: the drafts accepted, then
        one token of the model's own. Each position samples exactly what decoding without drafts
        would there (its history holds the drafts before it; its seed is its context length's), so
        greedy and seeded outputs are identical with speculation on and off, and an unseeded draw
        keeps its distribution: with a proposed token q = δ(draft), accepting the draft when the
        sample equals it (probability p(draft)) and else keeping the sample (distributed as p
        without the draft, renormalised) is rejection sampling. Rows of sequences whose logits do
        not depend on their history are sampled all at once; the others position by position, each
        accepted draft fed to the history before the next. On hybrid models the KDA state of a
        sequence with rejected drafts goes back to its last accepted token."""
        h = torch.cat([x for x in last if x is not None])
        rows, items = [], []  # items: (chunk, position) per sampled row
        at = 0
        for b, c in enumerate(chunks):
            if c.sample:
                rows += range(at, at + c.draft + 1)
                items += [(b, i) for i in range(c.draft + 1)]
            at += c.draft + 1
        logits = self.model.logits(h[torch.tensor(rows, device=h.device)])  # [N, V] stays on the device
        params = [self._params(chunks[b]) for b, _ in items]
        seq_ids = [chunks[b].seq_id for b, _ in items]
        # position i samples after num_cached + (known tokens) + i tokens
        seeds = [draw_seed(p, chunks[b].num_cached + len(chunks[b].token_ids) - chunks[b].draft + i)
                 for p, (b, i) in zip(params, items)]
        banned = [chunks[b].banned if i == 0 else () for b, i in items]
        next_ids = torch.empty(len(items), dtype=torch.long, device=logits.device)
        free = [r for r, p in enumerate(params) if not stateful(p)]
        if free:
            sel = torch.tensor(free, device=logits.device)
            fp = [params[r] for r in free]
            shaped = self.logits_state.apply(logits.index_select(0, sel), [seq_ids[r] for r in free], fp,
                                             [banned[r] for r in free])
            next_ids.index_copy_(0, sel, sample(shaped, fp, [seeds[r] for r in free]))
        chosen = next_ids.tolist()
        first = {}  # chunk → its first row
        for r, (b, i) in enumerate(items):
            first.setdefault(b, r)
        tied = [b for b in first if stateful(params[first[b]])]
        alive, pos = set(tied), 0
        while alive:  # history-dependent rows: one position at a time, drafts accepted fed in between
            rs = [first[b] + pos for b in sorted(alive)]
            sel = torch.tensor(rs, device=logits.device)
            ps = [params[r] for r in rs]
            shaped = self.logits_state.apply(logits.index_select(0, sel), [seq_ids[r] for r in rs], ps,
                                             [banned[r] for r in rs])
            for r, t in zip(rs, sample(shaped, ps, [seeds[r] for r in rs]).tolist()):
                chosen[r] = t
                b = items[r][0]
                c = chunks[b]
                if pos < c.draft and t == c.token_ids[len(c.token_ids) - c.draft + pos]:
                    self.logits_state.feed(c.seq_id, c.prompt_len, c.num_cached + len(c.token_ids) - c.draft + pos,
                                           [t], params[r])
                else:
                    alive.discard(b)
            pos += 1
        keep, accepted = [], {}
        for b, r0 in first.items():
            c = chunks[b]
            drafts = c.token_ids[len(c.token_ids) - c.draft:]
            a = 0
            while a < c.draft and chosen[r0 + a] == drafts[a]:
                a += 1
            keep += range(r0, r0 + a + 1)
            if c.draft:
                accepted[b] = a
        if self.cache.kda is not None and accepted:
            self.cache.kda.accept({chunks[b].state_slot: a for b, a in accepted.items()})
        sel = torch.tensor(keep, device=logits.device)
        return self._package([seq_ids[r] for r in keep], logits.index_select(0, sel),
                             next_ids.new_tensor([chosen[r] for r in keep]), [params[r] for r in keep])

    @staticmethod
    def _package(seq_ids, logits, next_ids, params) -> tuple[SampledToken, ...]:
        """Token ids and the requested logprobs to the host (only those: never the logits)."""
        k = max((p.logprobs or 0) for p in params)
        if any(p.logprobs is not None for p in params):
            chosen, top_ids, top_vals = (t.tolist() for t in top_logprobs(logits, next_ids, k))
        out = []
        for i, (sid, tok, p) in enumerate(zip(seq_ids, next_ids.tolist(), params)):
            if p.logprobs is None:
                out.append(SampledToken(sid, tok))
                continue
            top = tuple(zip(top_ids[i][: p.logprobs], top_vals[i][: p.logprobs]))
            out.append(SampledToken(sid, tok, chosen[i], top))
        return tuple(out)


def step_stats(d: DistDispatcher | LocalExchange) -> dict:
    """The step's routing statistics for its :class:`StepResult`: two host arrays (one host sync),
    never Python lists — at Kimi K2 scale they hold 23k and 23k counts. numpy, not torch: Ray
    serialises a numpy array out of band, and a torch tensor through its pickle reducer (about
    0.2 ms more per step and actor here)."""
    expert, slot = d.take_stats()
    return {"expert_tokens": expert.numpy(), "slot_tokens": slot.numpy()}
