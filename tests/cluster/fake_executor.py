"""A fake executor: the engine's seam (:class:`cluster.executor.Executor`) carried out in one process,
without Ray, torch models or sockets, so the engine's own logic — scheduling, async scheduling,
stop handling, recovery decisions, epoch sequencing — is tested fast and exactly.

Its "model" keeps what the real actors keep and can get wrong:
- each attention replica has a latent cache addressed through the block table (position →
  block → slot) that remembers, per position, the token and a hash of every token up to it (what
  a real latent depends on); reading a position whose content is not this sequence's prefix (a
  wrong ``num_cached``, a block table that lost a block, stale data, a prefix-cache hit on
  another prefix) raises :class:`FakeCacheError` — a hit on the same prefix is allowed;
- on hybrid models a per-slot recurrent state folds every token computed since the last reset,
  exactly once: a step redone without a reset folds its tokens twice and changes every later token;
  a chunk may instead load a snapshot (prefix caching), which is the state saved by an earlier
  chunk: a snapshot of the wrong boundary changes every later token;
- the next token is a hash of the sequence's history (MLA models: read back from the cache; hybrid
  models: the recurrent state), so any token written at the wrong place changes the output;
- an :data:`AHEAD` token is what this replica sampled last for the sequence, as the real worker does;
- a step must carry the epoch the fake runs in, and one step request per attention replica.

:func:`expected` is the oracle: the same hash run one sequence at a time with the engine's stop rules.
Faults are scheduled by step number (:meth:`FakeExecutor.fail_step`); capacity and preparation
failures by flags. Every call is logged in :attr:`FakeExecutor.log` for sequencing tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.messages import AHEAD, ExpertStep, ExpertStepResult, PlacementTable, SampledToken, StepRequest
from cluster.errors import EngineError, NoCapacity, StepFailed
from model.runner import Sequence, check_stop
from model.sampling import SamplingParams

MOD = (1 << 61) - 1


def fold(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 1) % MOD


def next_token(h: int, vocab: int) -> int:
    return (h >> 7) % vocab


def fold_all(tokens) -> int:
    h = 0
    for t in tokens:
        h = fold(h, t)
    return h


def expected(prompt: list[int], params: SamplingParams, *, vocab: int, stop_ids: frozenset[int],
             max_context: int) -> list[int]:
    """The oracle: the fake model's output for one prompt, alone, with the engine's stop rules."""
    seq = Sequence(0, list(prompt), len(prompt), params)
    while True:
        seq.token_ids.append(next_token(fold_all(seq.token_ids), vocab))
        if check_stop(seq, stop_ids, max_context):
            return seq.output_ids


class FakeCacheError(AssertionError):
    """A replica read a cache position its sequence never wrote."""


@dataclass
class FakeReplica:
    """One attention replica's cache, recurrent state and last samples."""

    num_blocks: int
    block_size: int
    hybrid: bool
    cache: dict = field(default_factory=dict)  # physical slot → (position, token, hash of tokens 0..position)
    state: dict = field(default_factory=dict)  # KDA slot → folded tokens
    snapshots: dict = field(default_factory=dict)  # snapshot → folded tokens
    last: dict = field(default_factory=dict)  # seq_id → last sampled token
    guesses: list = field(default_factory=list)  # this step's MTP guesses: (seq_id, context length, token)

    def _slot(self, chunk, pos: int) -> int:
        block = chunk.block_table[pos // self.block_size]
        assert 0 <= block < self.num_blocks, f"block {block} outside the cache"
        return block * self.block_size + pos % self.block_size

    def run(self, req: StepRequest, vocab: int) -> list[SampledToken]:
        out, self.guesses = [], []
        for c in req.chunks:
            tokens = [self.last[c.seq_id] if t == AHEAD else t for t in c.token_ids]
            history = self._read(c, c.num_cached)  # the context, checked: it must be this sequence's prefix
            h = fold_all(history)
            for k, t in enumerate(tokens):
                h = fold(h, t)
                self.cache[self._slot(c, c.num_cached + k)] = (c.num_cached + k, t, h)
            if self.hybrid and c.reset_state:
                self.state[c.state_slot] = 0 if c.restore is None else self.snapshots[c.restore]
            state = self.state[c.state_slot] if self.hybrid else 0
            known = len(tokens) - c.draft
            for k, t in enumerate(tokens[:known]):
                state = fold(state, t)
            if c.sample:  # the token after the known ones, then after each draft while the drafts are right
                for k in range(c.draft + 1):
                    history = self._read(c, c.num_cached + known + k)
                    h = state if self.hybrid else fold_all(history)
                    tok = next_token(h, vocab)
                    out.append(SampledToken(c.seq_id, tok))
                    if k == c.draft or tokens[known + k] != tok:
                        break
                    state = fold(state, tok)  # an accepted draft: the state takes it, as the real worker's does
                self.last[c.seq_id] = tok
                # an MTP layer that always guesses right: the token after the one just sampled
                self.guesses.append((c.seq_id, c.num_cached + known + k + 1, next_token(fold(h, tok), vocab)))
            if self.hybrid:
                self.state[c.state_slot] = state
        for c in req.chunks:  # after the step, as the real worker
            if c.snapshot is not None:
                self.snapshots[c.snapshot] = self.state[c.state_slot]
        return out

    # ---- cached blocks (prefill/decode disaggregation) ------------------------------------------
    def read_blocks(self, blocks: list[int], snapshot: int | None, layout) -> dict:
        """What ``blocks`` (and ``snapshot``) hold, in the real transfer's tensors (``layout``: the
        engine's :class:`~cluster.kv_transfer.Fingerprint`): each slot's (position, token, hash) as three
        int64 in the first six float32 lanes of the first latent row (position -1: never written), the
        snapshot's folded state in the first two lanes of the recurrent state — bit patterns, copied
        exactly."""
        import torch

        bs, never = self.block_size, (-1, -1, -1)
        rows = torch.tensor([[self.cache.get(b * bs + j, never) for j in range(bs)] for b in blocks],
                            dtype=torch.int64).reshape(len(blocks), bs, 3)
        latent = torch.zeros(layout.latent[0], len(blocks), bs, layout.latent[1])
        latent[0, :, :, :6] = rows.view(torch.float32)
        parts = {"latent": latent}
        if snapshot is not None:
            recurrent = torch.zeros(layout.recurrent)
            recurrent.view(-1)[:2] = torch.tensor([self.snapshots[snapshot]], dtype=torch.int64).view(torch.float32)
            parts["conv"], parts["recurrent"] = torch.zeros(layout.conv), recurrent
        return parts

    def write_blocks(self, blocks: list[int], snapshot: int | None, parts: dict) -> None:
        import torch

        bs = self.block_size
        rows = parts["latent"][0, :, :, :6].contiguous().view(torch.int64).tolist()  # [n, bs, 3]
        for i, b in enumerate(blocks):
            for j in range(bs):
                pos, token, h = rows[i][j]
                if pos < 0:
                    self.cache.pop(b * bs + j, None)
                else:
                    self.cache[b * bs + j] = (pos, token, h)
        if snapshot is not None:
            self.snapshots[snapshot] = int(parts["recurrent"].reshape(-1)[:2].contiguous().view(torch.int64)[0])

    def _read(self, chunk, n: int) -> list[int]:
        """The first ``n`` tokens of ``chunk``'s sequence as its cache holds them; each position's
        content must continue the prefix read so far."""
        history, h = [], 0
        for pos in range(n):
            at, t, ph = self.cache.get(self._slot(chunk, pos), (None, None, None))
            if at != pos or ph != fold(h, t):
                raise FakeCacheError(f"seq {chunk.seq_id} read position {pos}, which holds another prefix's cache")
            h = ph
            history.append(t)
        return history


class FakeExecutor:
    """The :class:`~cluster.executor.Executor` protocol in one process (see the module docstring)."""

    def __init__(self, *, num_blocks: int, block_size: int, hybrid: bool, vocab: int, num_experts: int):
        self.num_blocks, self.block_size, self.hybrid = num_blocks, block_size, hybrid
        self.vocab, self.num_experts = vocab, num_experts
        self.table: PlacementTable | None = None
        self.replicas: list[FakeReplica] = []
        self.pending: dict[int, list[StepRequest]] = {}
        self.faults: dict[int, list[tuple[str, int]]] = {}  # step → members that die in it
        self.failing: tuple[int, list] = (0, [])  # (how many more collected steps fail, members that die)
        self.hangs: set[int] = set()  # steps whose dead members were found hung (silent) rather than gone
        self.on_lost_node: list[tuple[str, int]] = []  # members whose node is found down when probed
        self.no_capacity = 0  # this many replace() calls raise NoCapacity
        self.ready_after = 0  # a prepared change is ready after this many polls
        self.fail_prepare = False  # ready() raises: the new actors never came up
        self.fail_commit: list[tuple[str, int]] | None = None  # commit() raises: these died while regrouping
        self.routing = None  # token → expert for the statistics (default: token % experts)
        self.dead_now: list[tuple[str, int]] = []  # what failed_members() reports next
        self.mtp = False  # results carry MTP guesses (always right: the token after each one sampled)
        self.log: list[tuple] = []

    def _replica(self) -> FakeReplica:
        return FakeReplica(self.num_blocks, self.block_size, self.hybrid)

    # ---- lifecycle -----------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.table is not None

    @property
    def kind(self) -> str:
        """The member kind that holds an attention replica: a worker in the colocated layout."""
        return "worker" if self.table is not None and self.table.colocated else "attention"

    def start(self, table: PlacementTable) -> None:
        self.table = table
        self.replicas = [self._replica() for _ in range(table.num_attention)]
        self.log.append(("start", table.epoch, table.shape()))

    def shutdown(self) -> None:
        self.log.append(("shutdown",))
        self.table, self.replicas = None, []

    # ---- faults ----------------------------------------------------------------------------------
    def fail_step(self, step: int, *dead: tuple[str, int]) -> None:
        """Step ``step`` fails with ``dead`` members gone (their caches lost); the others answer with an
        error. (Steps sent ahead take step numbers too.)"""
        self.faults[step] = list(dead)

    def fail_next(self, count: int, *dead: tuple[str, int]) -> None:
        """The next ``count`` steps collected fail as :meth:`fail_step` says."""
        self.failing = (count, list(dead))

    # ---- cached blocks (prefill/decode disaggregation) ------------------------------------------
    layout = None  # the engine's kv_transfer.Fingerprint (set by the test): the shapes blocks travel in
    fail_reads = 0  # this many read_blocks calls fail (the replica holding the blocks died mid-transfer)
    fail_writes = 0  # this many write_blocks calls fail (the transport broke)
    on_read = None  # called after each read (a test's clock moves here)

    def read_blocks(self, replica: int, blocks: list[int], snapshot: int | None = None, via: str = "channel") -> dict:
        from cluster.kv_transfer import TransportError

        if self.fail_reads:
            self.fail_reads -= 1
            raise TransportError(f"read_blocks on attention replica {replica} failed: it died")
        parts = self.replicas[replica].read_blocks(blocks, snapshot, self.layout)
        if self.on_read is not None:
            self.on_read()
        return parts

    def write_blocks(self, replica: int, blocks: list[int], snapshot: int | None, parts: dict,
                     via: str = "channel") -> None:
        from cluster.kv_transfer import TransportError

        if self.fail_writes:
            self.fail_writes -= 1
            raise TransportError(f"write_blocks on attention replica {replica} failed: the connection broke")
        self.replicas[replica].write_blocks(blocks, snapshot, parts)

    # ---- the step ------------------------------------------------------------------------------
    def launch(self, reqs: list[StepRequest], expert_req: ExpertStep) -> list:
        assert len(reqs) == len(self.replicas), f"{len(reqs)} step requests for {len(self.replicas)} replicas"
        for r in reqs:
            assert r.epoch == self.table.epoch, f"step {r.step} carries epoch {r.epoch}, the actors run {self.table.epoch}"
        assert expert_req.epoch == self.table.epoch and expert_req.step == reqs[0].step
        # every replica (worker or attention actor) is told every replica's tokens per micro-batch, as the chunks
        # say and as the expert side has them (the mailbox exchange, actors/board.py, decides and sizes by them)
        for r in reqs:
            assert r.peer_tokens == expert_req.tokens, (r.peer_tokens, expert_req.tokens)
        assert [sum(m[i] for m in expert_req.tokens) for i in range(len(reqs))] == \
            [sum(len(c.token_ids) for c in r.chunks) for r in reqs], "peer tokens that are not the chunks'"
        self.pending[expert_req.step] = list(reqs)
        self.log.append(("launch", expert_req.step, expert_req.epoch, expert_req.ahead))
        return [(f"{self.kind}[{i}]", i) for i in range(len(reqs))]

    def collect(self, step_no: int, sent: list) -> tuple[list, list]:
        reqs = self.pending.pop(step_no)
        if self.failing[0] > 0:
            self.failing = (self.failing[0] - 1, self.failing[1])
            self.faults[step_no] = self.failing[1]
        if step_no in self.faults:
            dead = self.faults.pop(step_no)
            for i, (replica, req) in enumerate(zip(self.replicas, reqs)):
                if (self.kind, i) not in dead:
                    replica.run(req, self.vocab)  # it got as far as its caches and state: half a step
            self.pending.clear()  # a step sent ahead is refused by actors whose previous step failed
            others = [(self.kind, i) for i in range(len(reqs)) if (self.kind, i) not in dead]
            hung = dead if step_no in self.hangs else []
            raise StepFailed(f"step {step_no} failed: {dead} {'hung' if hung else 'died'}", dead, others, hung)
        attn = []
        for i, (replica, req) in enumerate(zip(self.replicas, reqs)):
            tokens = replica.run(req, self.vocab)
            attn.append(_result(step_no, i, req, tokens, self.table, self.routing or (lambda t: t % self.num_experts),
                                drafts=replica.guesses if self.mtp else ()))
        expert = [ExpertStepResult(step_no, f"expert[{j}]") for j in range(self.table.num_actors)]
        return attn, expert

    # ---- shape changes ---------------------------------------------------------------------------
    def prepare(self, kind: str, table: PlacementTable) -> dict:
        self.log.append(("prepare", kind, table.epoch))
        return {"kind": kind, "table": table, "polls": 0}

    def ready(self, prepared: dict) -> bool:
        prepared["polls"] += 1
        if self.fail_prepare:
            self.abort(prepared)
            raise EngineError(f"epoch {prepared['table'].epoch}: the new actors did not start")
        return prepared["polls"] > self.ready_after

    def commit(self, prepared: dict) -> tuple[float, int]:
        assert not self.pending, f"commit with steps in flight: {sorted(self.pending)}"
        if self.fail_commit is not None:
            self.dead_now, self.fail_commit = self.fail_commit, None
            self.abort(prepared)
            raise EngineError(f"entering epoch {prepared['table'].epoch}: an actor died: {self.dead_now}")
        table = prepared["table"]
        self.replicas = self.replicas[: table.num_attention]
        self.replicas += [self._replica() for _ in range(table.num_attention - len(self.replicas))]
        self.table = table
        self.log.append(("commit", table.epoch, table.shape()))
        return 0.0, 0

    def progress(self, prepared: dict) -> dict:
        return {"epoch": prepared["table"].epoch, "kind": prepared["kind"], "polls": prepared["polls"]}

    def abort(self, prepared: dict) -> None:
        self.log.append(("abort", prepared["table"].epoch))

    def failed_members(self) -> list[tuple[str, int]]:
        dead, self.dead_now = self.dead_now, []
        self.log.append(("failed members", tuple(dead)))
        return dead

    def lost(self, suspects: list[tuple[str, int]]) -> list[tuple[str, int]]:
        self.log.append(("probe", tuple(suspects)))
        return list(self.on_lost_node)

    def replace(self, dead: list[tuple[str, int]], table: PlacementTable) -> tuple[float, float, int]:
        if self.no_capacity:
            self.no_capacity -= 1
            self.log.append(("no capacity", tuple(dead)))
            raise NoCapacity(f"no room for a replacement of {dead}")
        for kind, i in dead:
            if kind in ("attention", "worker"):
                self.replicas[i] = self._replica()  # its cache and state are gone
        self.table = table
        self.pending.clear()
        self.log.append(("replace", table.epoch, tuple(dead)))
        return 0.0, 0.0, 0

    def kill(self, kind: str, index: int) -> str:
        raise NotImplementedError("the fake has no processes: schedule a fault with fail_step")

    def describe(self) -> dict:
        return {"attention": [{"node": "fake"} for _ in self.replicas],
                "experts": [{"node": "fake"} for _ in range(self.table.num_actors)], "standby": 0, "weight_bytes": []}


def _result(step: int, i: int, req: StepRequest, tokens: list[SampledToken], table: PlacementTable, route,
            drafts=()):
    """An attention replica's step result with routing counts: every computed token goes to expert
    ``route(token)`` in every MoE layer (top-1), on the expert's first copy."""
    from actors.messages import StepResult

    layers, experts = len(table.moe_layers), table.num_experts
    counts = [[0] * experts for _ in range(layers)]
    slots = [[[0] * table.max_local for _ in range(table.num_actors)] for _ in range(layers)]
    per_expert: dict[int, int] = {}
    for c in req.chunks:
        for t in c.token_ids:
            e = route(t if t != AHEAD else 0)
            per_expert[e] = per_expert.get(e, 0) + 1
    for e, n in per_expert.items():  # (counted per expert, not per token: the PD fault harness runs ~10^5 steps)
        for li in range(layers):
            counts[li][e] += n
            actor = next(j for j, ids in enumerate(table.slots[li]) if e in ids)
            slots[li][actor][table.slots[li][actor].index(e)] += n
    return StepResult(step, f"attention[{i}]", tokens=tuple(tokens), drafts=tuple(drafts),
                      expert_tokens=tuple(map(tuple, counts)),
                      slot_tokens=tuple(tuple(map(tuple, a)) for a in slots))
