"""Draft tokens for speculative decoding, made from text already seen (docs/architecture.md
"Speculative decoding").

Two proposers, both in the engine's process, beside the scheduler that asks them:

- ``ngram`` (prompt lookup, vLLM's ``method: ngram``): the most recent earlier occurrence of the
  sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and the
  tokens that followed it.
- ``suffix`` (SuffixDecoding, vLLM's ``method: suffix``): a depth-limited suffix trie with counts
  over the sequence's own prompt and output, and one over a bounded window of recent requests'
  outputs; the longest suffix of the context found in a trie is followed by its most frequent
  continuation while the path's estimated probability stays above ``min_token_prob`` (the
  per-sequence confidence cut); the trie whose path expects more accepted tokens wins.

Finished outputs are shared only within a ``cache_salt`` (the scheduler passes each call the
sequence's salt; unsalted requests share one pool, and None and "" are different salts, as in the
prefix cache's block hashes): an accepted draft shows in latency, so drafting from another tenant's
outputs would tell, by timing, what was recently generated for it — the side channel the salt
closes for the prefix cache. The window is one, over all salts (``max_cached_requests`` outputs in
all, the oldest leaving first, whatever its salt), each output in its own salt's trie, and a salt's
trie goes when its last output leaves: memory stays bounded however many salts come.

How many drafts a decoding sequence carries is :class:`DraftPolicy`'s: the adaptive length's batch
half (:meth:`~cluster.config.SpeculativeConfig.draft_length`) times the sequence's recent acceptance,
resting a sequence whose drafts keep failing, never past its limits. The scheduler asks it while
planning a step and tells it what each step accepted.

Owns: the proposer, per sequence its index (built incrementally: each token is indexed once,
O(depth) work, never a scan of the sequence) and its recent acceptance rate, and the window of
finished outputs, per salt. Never: allocates cache or decides which sequences run (the scheduler
does), or sees a tensor.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from model.runner import Sequence, banned_ids

if TYPE_CHECKING:
    from model.config import ModelConfig

    from .config import EngineConfig, SpeculativeConfig
    from .stats import EngineStats

DRAFT_FLOOR = 0.15  # a sequence whose drafts' acceptance rate is below this drafts nothing for a while
DRAFT_PROBE = 0.02  # … its rate climbing back by this each step, so that it tries again


class Drafter(Protocol):
    """``salt``: the sequence's ``cache_salt``; what one salt's sequences leave is never proposed
    to another's."""

    def propose(self, seq_id: int, token_ids: list[int], k: int, salt: str | None = None) -> list[int]: ...

    def finished(self, seq_id: int, token_ids: list[int], num_prompt_tokens: int, salt: str | None = None) -> None: ...


@dataclass
class _NgramIndex:
    tables: list[dict]  # per n: n-gram → the end position of its latest occurrence
    indexed: int = 0  # n-grams ending before this position are in the tables


@dataclass
class _SuffixIndex:
    trie: "SuffixTrie"
    active: list = field(default_factory=list)  # its open suffixes (the trie's nodes, deepest last)
    indexed: int = 0  # tokens added to the trie


class NgramDrafter:
    """Prompt lookup: per sequence, each n-gram's latest end position (n in [lo, hi])."""

    def __init__(self, lo: int = 2, hi: int = 5):
        if not 1 <= lo <= hi:
            raise ValueError(f"ngram: prompt_lookup_min ({lo}) must be >= 1 and <= prompt_lookup_max ({hi})")
        self.lo, self.hi = lo, hi
        self._index: dict[int, _NgramIndex] = {}

    def propose(self, seq_id: int, token_ids: list[int], k: int, salt: str | None = None) -> list[int]:
        if k <= 0 or len(token_ids) < self.lo + 1:
            return []
        ix = self._index.get(seq_id)
        if ix is None:
            ix = self._index[seq_id] = _NgramIndex([{} for _ in range(self.hi - self.lo + 1)])
        tables, L = ix.tables, len(token_ids)
        # index every n-gram ending before the last token, so the lookup finds an earlier occurrence
        for end in range(max(ix.indexed, self.lo - 1), L - 1):
            for n in range(self.lo, min(self.hi, end + 1) + 1):
                tables[n - self.lo][tuple(token_ids[end - n + 1 : end + 1])] = end
        ix.indexed = max(ix.indexed, L - 1)
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            end = tables[n - self.lo].get(tuple(token_ids[L - n :]))
            if end is not None:
                return token_ids[end + 1 : end + 1 + k]
        return []

    def finished(self, seq_id: int, token_ids: list[int], num_prompt_tokens: int, salt: str | None = None) -> None:
        self._index.pop(seq_id, None)  # (its own tokens only: nothing is shared, salted or not)


class _Node:
    __slots__ = ("count", "children", "total", "best")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.total = 0  # the children's counts
        self.best: int | None = None  # the child of the highest count (None: to be found again)

    def best_child(self) -> tuple[int, "_Node"]:
        if self.best is None or self.best not in self.children:
            self.best = max(self.children, key=lambda t: self.children[t].count)
        return self.best, self.children[self.best]


class SuffixTrie:
    """Every substring of at most ``depth`` tokens of the texts added, with how often it occurred:
    a text is added token by token (:meth:`extend`), each token extending the suffixes that end
    before it (O(depth) per token)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()

    def extend(self, active: list[_Node], tokens, sign: int = 1) -> list[_Node]:
        """Add ``tokens`` after the text whose open suffixes are ``active`` (deepest last); returns
        the new open suffixes. ``sign`` -1 takes a text out again (the window's eviction)."""
        for t in tokens:
            nxt = []
            for node in [self.root] + active[-(self.depth - 1):] if self.depth > 1 else [self.root]:
                child = node.children.get(t)
                if child is None:
                    if sign < 0:
                        continue
                    child = node.children[t] = _Node()
                child.count += sign
                node.total += sign
                if sign < 0:
                    if node.best == t:
                        node.best = None
                    if child.count <= 0:
                        del node.children[t]
                        continue
                elif node.best is not None and child.count > node.children[node.best].count:
                    node.best = t
                nxt.append(child)
            active = nxt
        return active

    def continuation(self, context: list[int], k: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation of the longest suffix of ``context`` found here (at most
        ``k`` tokens, while the path's probability stays >= ``min_prob``), and its score: the
        expected number of those tokens accepted (the sum of the path's probabilities)."""
        for m in range(min(self.depth, len(context)), 0, -1):
            node = self.root
            for t in context[len(context) - m:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is None or not node.children:
                continue
            out, prob, score = [], 1.0, 0.0
            while node.children and len(out) < k:
                tok, child = node.best_child()
                prob *= child.count / node.total
                if prob < min_prob:
                    break
                out.append(tok)
                score += prob
                node = child
            return out, score
        return [], 0.0


class SuffixDrafter:
    """SuffixDecoding over each sequence's own tokens and a window of recent outputs of its salt."""

    PER_PROPOSAL = 2  # finished outputs added to the shared tries per proposal, at most

    def __init__(self, depth: int = 24, window: int = 1000, min_prob: float = 0.1):
        if depth < 2 or window < 0 or not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"suffix: max_tree_depth must be >= 2, max_cached_requests >= 0 and min_token_prob in "
                             f"[0, 1]; got {depth}, {window}, {min_prob}")
        self.depth, self.window, self.min_prob = depth, window, min_prob
        self.seqs: dict[int, _SuffixIndex] = {}
        self.shared: dict[str | None, SuffixTrie] = {}  # per salt (None: unsalted), the outputs in the window
        self.recent: deque[tuple[str | None, list[int]]] = deque()  # (salt, output) in the tries, oldest first
        # finished (salt, output)s not yet in a trie: added a few per proposal (PER_PROPOSAL), so a
        # busy engine that drafts nothing (a large batch) spends nothing on them
        self.pending: deque[tuple[str | None, list[int]]] = deque(maxlen=max(window, 1))

    def propose(self, seq_id: int, token_ids: list[int], k: int, salt: str | None = None) -> list[int]:
        if k <= 0:
            return []
        ix = self.seqs.get(seq_id)
        if ix is None:
            ix = self.seqs[seq_id] = _SuffixIndex(SuffixTrie(self.depth))
        # the last token stays out of the sequence's trie until the next call: the context's own
        # occurrence has no continuation yet, and every earlier one has
        if ix.indexed < len(token_ids) - 1:
            ix.active = ix.trie.extend(ix.active, token_ids[ix.indexed : len(token_ids) - 1])
            ix.indexed = len(token_ids) - 1
        for _ in range(min(self.PER_PROPOSAL, len(self.pending))):
            self._share(*self.pending.popleft())
        context = token_ids[-self.depth:]
        own, own_score = ix.trie.continuation(context, k, self.min_prob)
        shared = self.shared.get(salt)
        other, other_score = shared.continuation(context, k, self.min_prob) if shared is not None else ([], 0.0)
        return own if own_score >= other_score else other

    def finished(self, seq_id: int, token_ids: list[int], num_prompt_tokens: int, salt: str | None = None) -> None:
        self.seqs.pop(seq_id, None)
        out = token_ids[num_prompt_tokens:]
        if out and self.window:
            self.pending.append((salt, list(out)))

    def _share(self, salt: str | None, out: list[int]) -> None:
        trie = self.shared.get(salt)
        if trie is None:
            trie = self.shared[salt] = SuffixTrie(self.depth)
        trie.extend([], out)
        self.recent.append((salt, out))
        while len(self.recent) > self.window:
            old_salt, old = self.recent.popleft()
            old_trie = self.shared[old_salt]
            old_trie.extend([], old, sign=-1)
            if not old_trie.root.children:  # its salt's last output left the window
                del self.shared[old_salt]


class MtpDrafter:
    """The MTP layer's guesses: the attention actors run it each step and return, per sequence, the
    greedy guess of the token after its new last token (``StepResult.drafts``); a guess counts only
    for the context it was made after."""

    def __init__(self):
        self.guesses: dict[int, tuple[int, int]] = {}  # seq id → (context length, token)

    def record(self, drafts) -> None:
        for seq_id, context, token in drafts:
            self.guesses[seq_id] = (context, token)

    def propose(self, seq_id: int, token_ids: list[int], k: int, salt: str | None = None) -> list[int]:
        context, token = self.guesses.get(seq_id, (-1, 0))
        return [token] if k > 0 and context == len(token_ids) else []

    def finished(self, seq_id: int, token_ids: list[int], num_prompt_tokens: int, salt: str | None = None) -> None:
        self.guesses.pop(seq_id, None)


def make_drafter(spec) -> Drafter:
    """The proposer a :class:`~cluster.config.SpeculativeConfig` names."""
    if spec.method == "mtp":
        return MtpDrafter()
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        return SuffixDrafter(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                             spec.suffix_decoding_min_token_prob)
    raise ValueError(f"speculative: unknown method {spec.method!r}")


class DraftPolicy:
    """How many drafts each decoding sequence carries, and which (docs/architecture.md "Speculative
    decoding", "In the plan"): the scheduler asks :meth:`length` for the step's batch and
    :meth:`propose` for each sequence, reports each step's acceptance (:meth:`verified`) and each
    step a sequence decodes without drafts (:meth:`rest`, async scheduling's steps sent ahead), and
    hands it every finished sequence (:meth:`finished`)."""

    def __init__(self, speculative: SpeculativeConfig, stop_ids: frozenset[int], max_context: int):
        self.speculative, self.stop_ids, self.max_context = speculative, stop_ids, max_context
        self.drafter: Drafter = make_drafter(speculative)
        self.rates: dict[int, float] = {}  # seq id → its drafts' recent acceptance (a moving average; 1 at first)

    def length(self, decoding: int) -> int:
        """The most drafts one sequence may carry in a step where ``decoding`` sequences decode."""
        return self.speculative.draft_length(decoding)

    def may_draft(self, seqs: list[Sequence]) -> bool:
        """Whether some of ``seqs`` (the whole batch decoding) may carry drafts in their next step."""
        return self.length(len(seqs)) > 0 and any(self.rates.get(s.seq_id, 1.0) >= DRAFT_FLOOR for s in seqs)

    def propose(self, seq, k: int) -> list[int]:
        """Up to ``k`` draft tokens for ``seq``'s next step: fewer as its drafts were recently
        rejected (its acceptance rate's share of ``k``, at least one; none while it rests), none
        while its stop ids are banned (before ``min_tokens``), and never past its length limits (its
        token after the drafts counts). A decode chunk never ends at a KDA snapshot boundary (those
        are at or before its last known token), so drafts and snapshots never meet."""
        if k <= 0 or seq.is_refresh or self.rest(seq):
            return []
        k = min(k, max(1, math.ceil(k * self.rates.get(seq.seq_id, 1.0))),
                seq.params.max_tokens - len(seq.output_ids) - 1, self.max_context - len(seq.token_ids) - 1)
        if k <= 0 or banned_ids(seq, len(seq.token_ids), self.stop_ids):
            return []
        return self.drafter.propose(seq.seq_id, seq.token_ids, k, salt=seq.cache_salt)

    def rest(self, seq) -> bool:
        """Whether ``seq``'s drafts rest this step: they kept failing (its acceptance rate is under
        DRAFT_FLOOR), so it decodes without them, its rate climbing back by DRAFT_PROBE in each such
        step until it probes again. Every decode step of a sequence counts: those the scheduler
        plans and those async scheduling sends ahead."""
        rate = self.rates.get(seq.seq_id, 1.0)
        if rate < DRAFT_FLOOR:
            self.rates[seq.seq_id] = rate + DRAFT_PROBE
            return True
        return False

    def verified(self, seq, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` drafts of ``seq`` and the actor accepted ``accepted``."""
        self.rates[seq.seq_id] = 0.5 * self.rates.get(seq.seq_id, 1.0) + 0.5 * accepted / drafted

    def finished(self, seq) -> None:
        self.rates.pop(seq.seq_id, None)
        self.drafter.finished(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, salt=seq.cache_salt)


def check_speculative(mc: ModelConfig, config: EngineConfig, model: str) -> None:
    """ValueError when the speculative config cannot run on this model (MTP drafts need the
    checkpoint's MTP layer: DeepSeek-V3 ships one, Kimi K2 none)."""
    spec = config.speculative
    if spec is None or spec.method != "mtp":
        return
    if mc.num_nextn_predict_layers < 1 or mc.family != "deepseek_v3":
        raise ValueError(f"{model}: speculative method 'mtp' needs the checkpoint's multi-token-prediction layer "
                         f"(num_nextn_predict_layers is {mc.num_nextn_predict_layers}; Kimi K2 ships none): use "
                         "method suffix or ngram")
    if spec.num_speculative_tokens > mc.num_nextn_predict_layers:
        raise ValueError(f"{model}: speculative method 'mtp' drafts one token per MTP layer: num_speculative_tokens "
                         f"must be <= {mc.num_nextn_predict_layers}, got {spec.num_speculative_tokens}")


def speculative_status(spec: SpeculativeConfig | None, stats: EngineStats) -> dict | None:
    """Speculative decoding's method and acceptance so far, from the engine's statistics (None when
    it is off): what ``/status`` and ``moeray status`` show."""
    if spec is None:
        return None
    st = stats
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "drafts": st.spec_drafts, "draft_tokens": st.spec_draft_tokens, "accepted_tokens": st.spec_accepted_tokens,
            "acceptance_rate": st.spec_accepted_tokens / st.spec_draft_tokens if st.spec_draft_tokens else None,
            "mean_accepted_length": st.mean_accepted_length,
            "accepted_per_position": list(st.spec_accepted_per_pos)}
