"""Training the model in ``model/`` (autograd through the same code that serves; no second
implementation): next-token loss, the MTP layer's own loss on the token after next, and DeepSeek-V3's
aux-loss-free balancing of the routers (the selection bias moves against each expert's load after
every step). Used by scripts/train_preset.py.

A batch is ``B`` windows of ``T`` tokens cut from the concatenated documents; each window attends
causally within itself through the model's own MLA path (one cache block per window, fresh per step).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from model.cache import build_attn_meta
from model.model import CausalLM, init_random_weights
from model.moe import Gate


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 8  # windows per step
    seq_len: int = 512  # tokens per window
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.01
    clip: float = 1.0
    mtp_weight: float = 0.3  # DeepSeek-V3's λ for the first 10 T tokens
    bias_rate: float = 2e-4  # γ of the aux-loss-free bias update
    seed: int = 0


def windows(docs: list[list[int]], seq_len: int, weights: list[list[float]] | None = None):
    """The documents end to end, cut into [N, seq_len] (the tail that does not fill a window dropped);
    with per-token ``weights``, (ids, weights) both so cut."""
    flat = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    n = flat.numel() // seq_len
    if n == 0:
        raise ValueError(f"{flat.numel()} tokens do not fill one window of {seq_len}")
    ids = flat[: n * seq_len].view(n, seq_len)
    if weights is None:
        return ids
    w = torch.tensor([x for d in weights for x in d], dtype=torch.float32)
    return ids, w[: n * seq_len].view(n, seq_len)


def padded_rows(docs: list[list[int]], seq_len: int, weights: list[list[float]], pad_id: int):
    """Each document a row of its own, cut to ``seq_len`` or padded with ``pad_id`` (weight 0):
    (ids, weights), both [len(docs), seq_len]."""
    ids = torch.full((len(docs), seq_len), pad_id, dtype=torch.long)
    w = torch.zeros(len(docs), seq_len)
    for i, (d, dw) in enumerate(zip(docs, weights)):
        n = min(len(d), seq_len)
        ids[i, :n] = torch.tensor(d[:n])
        w[i, :n] = torch.tensor(dw[:n])
    return ids, w


def assistant_weights(ids: list[int], begin: int, middle: int, end: int, other: float, *,
                      arguments: tuple[int, int] | None = None, argument_weight: float = 1.0,
                      quotes: frozenset[int] = frozenset(), quote_weight: float = 1.0) -> list[float]:
    """Per-token loss weight as a target: 1 inside an assistant turn (after ``<|im_assistant|>…
    <|im_middle|>``, up to and including its ``<|im_end|>``: the calls, arguments and answers the
    model must write), ``other`` elsewhere (tool declarations, user turns, tool results, text). With
    ``arguments`` = (``<|tool_call_argument_begin|>``, ``<|tool_call_end|>``) ids, a call's argument
    tokens up to its end mark weigh ``argument_weight`` (the entities copied from the request). A
    token of ``quotes`` (e.g. the number and city ids) that an assistant's text writes and that
    occurred outside the assistant's turns since its last answer (a turn without a call: the user's
    request, the tool's result) weighs ``quote_weight``: what an answer quotes from them."""
    arg_begin, arg_end = arguments if arguments is not None else (None, None)
    out, state = [], 0  # 0 outside, 1 in the assistant header, 2 in its content, 3 in a call's arguments
    seen: set[int] = set()  # quotable ids since the last answer
    called = False  # the assistant turn under way calls a tool
    for t in ids:
        if state == 3:
            out.append(argument_weight)
            state = 2 if t == arg_end else 3
            continue
        if state == 2:
            out.append(quote_weight if t in seen else 1.0)
            if t == end:
                state = 0
                if not called:
                    seen.clear()
            elif t == arg_begin:
                state, called = 3, True
            continue
        out.append(other)
        if t in quotes:
            seen.add(t)
        if t == begin:
            state, called = 1, False
        elif state == 1 and t == middle:
            state = 2
    return out


def induction_rows(n: int, length: int, vocab: int, generator: torch.Generator,
                   period: tuple[int, int] = (8, 26)) -> tuple[torch.Tensor, torch.Tensor]:
    """The induction task (scripts/probe_induction.py): ``n`` rows of ``length`` random ids below
    ``vocab``, each a span whose length is drawn from ``period`` (inclusive) repeated until the row
    ends. → (ids [n, length], mask [n, length]): the mask marks each repeat's ids after its first,
    the targets only copying predicts (the repeat's first id follows the span's last, which nothing
    foretells). The period differs from row to row, so a head reading the id a fixed distance back
    does not solve it: only one that finds the current id's earlier occurrence and reads the id
    after it (an induction head)."""
    ids = torch.randint(0, vocab, (n, length), generator=generator)
    mask = torch.zeros(n, length, dtype=torch.bool)
    spans = torch.randint(period[0], period[1] + 1, (n,), generator=generator).tolist()
    for i, p in enumerate(spans):
        pos = torch.arange(p, length)
        ids[i, p:] = ids[i, pos % p]
        mask[i, p:] = (pos % p) != 0
    return ids, mask


def _greedy_hits(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """(greedy next tokens of ``logits`` [B, T, V] equal to ``ids``' at the targets ``mask`` [B, T]
    marks, targets marked)."""
    m = mask[:, 1:]
    return ((logits[:, :-1].argmax(-1) == ids[:, 1:]) & m).sum().item(), m.sum().item()


@torch.no_grad()
def copy_accuracy(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Greedy next-token accuracy of ``logits`` [B, T, V] at the targets ``mask`` [B, T] marks."""
    hits, targets = _greedy_hits(logits, ids, mask)
    return hits / max(1, targets)


def init_for_training(model: CausalLM, seed: int) -> None:
    """Seeded random weights with the routers' selection bias at zero, as training from scratch starts."""
    init_random_weights(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.zero_()


def share_mtp_embeddings(model: CausalLM) -> None:
    """The MTP layer's embedding and output head made the main model's, as DeepSeek-V3 trains them
    (V3 report §2.2): one parameter each, trained by both losses. ``to_hf_tensors`` then names each
    once; :func:`model.mtp.mtp_shared_names` gives the MTP layer's checkpoint names for them."""
    model.mtp.embed_tokens = model.model.embed_tokens
    model.mtp.shared_head.head = model.lm_head


class RouterLoad:
    """Tokens per expert of every MoE router, counted by forward hooks while it is attached."""

    def __init__(self, model: CausalLM):
        self.gates = {name: m for name, m in model.named_modules() if isinstance(m, Gate)}
        self.counts = {name: torch.zeros(g.weight.shape[0], dtype=torch.long) for name, g in self.gates.items()}
        self._hooks = [g.register_forward_hook(self._hook(name)) for name, g in self.gates.items()]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            idx, _ = output
            self.counts[name] += torch.bincount(idx.flatten(), minlength=self.counts[name].numel())
        return hook

    def reset(self) -> None:
        for c in self.counts.values():
            c.zero_()

    def imbalance(self) -> float:
        """max / mean tokens per expert, averaged over the routers (1.0: perfectly even)."""
        vals = [c.max().item() / c.float().mean().item() for c in self.counts.values() if c.sum() > 0]
        return sum(vals) / len(vals) if vals else 1.0

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """Aux-loss-free balancing: each router's selection bias rises for under-loaded experts and
        falls for over-loaded ones by ``rate`` (DeepSeek-V3 §2.1.2)."""
        for name, g in self.gates.items():
            load = self.counts[name].float()
            g.e_score_correction_bias += rate * torch.sign(load.mean() - load)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def weighted_ce(logits: torch.Tensor, target: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    if w is None:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
    w = w.flatten()
    return (ce * w).sum() / w.sum()


def all_logits(model: CausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [B, T] → (next-token logits [B, T, V], the MTP layer's logits for the token after next
    [B, T, V] or None without one; the last position's MTP logits have no input and are unused)."""
    B, T = ids.shape
    cache = model.make_cache(B, T, 0, model.model.embed_tokens.weight.dtype)
    meta = build_attn_meta([T] * B, [T] * B, [[b] for b in range(B)], T)
    h = model(ids.flatten(), meta, cache)  # [B·T, H]
    logits = model.logits(h).view(B, T, -1)
    if model.mtp is None:
        return logits, None
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1).flatten()  # t_{i+1}
    return logits, model.mtp_logits(nxt, h, meta, cache).view(B, T, -1)


def losses(model: CausalLM, ids: torch.Tensor,
           weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [B, T] → (next-token loss, MTP loss on the token after next or None without an MTP layer);
    ``weights`` [B, T] weighs each token as a target (None: all alike)."""
    logits, mtp = all_logits(model, ids)
    main = weighted_ce(logits[:, :-1], ids[:, 1:], None if weights is None else weights[:, 1:])
    if mtp is None:
        return main, None
    return main, weighted_ce(mtp[:, :-2], ids[:, 2:], None if weights is None else weights[:, 2:])


@torch.no_grad()
def evaluate(model: CausalLM, data: torch.Tensor, batch: int,
             mask: torch.Tensor | None = None) -> tuple[float, float | None, float | None]:
    """Over the windows ``data`` [N, T]: mean (next-token loss, MTP loss, greedy accuracy of the
    next token at the targets ``mask`` [N, T] marks, or None without a mask)."""
    model.eval()
    tot, tot_mtp, n, hits, targets = 0.0, 0.0, 0, 0, 0
    for i in range(0, data.shape[0], batch):
        ids = data[i: i + batch]
        logits, mtp = all_logits(model, ids)
        k = ids.shape[0]
        tot += weighted_ce(logits[:, :-1], ids[:, 1:], None).item() * k
        if mtp is not None:
            tot_mtp += weighted_ce(mtp[:, :-2], ids[:, 2:], None).item() * k
        if mask is not None:
            h, t = _greedy_hits(logits, ids, mask[i: i + batch])
            hits, targets = hits + h, targets + t
        n += k
    model.train()
    return (tot / n, tot_mtp / n if model.mtp is not None else None,
            hits / targets if mask is not None and targets else None)


@torch.no_grad()
def mtp_agreement(model: CausalLM, data: torch.Tensor, batch: int) -> float:
    """How often the MTP layer's greedy guess of the token after next (from position i's hidden state
    and token i+1) equals the main model's greedy token at position i+1, over the windows ``data``
    [N, T]: the acceptance rate of a one-token MTP draft under greedy decoding."""
    hits = total = 0
    for i in range(0, data.shape[0], batch):
        logits, mtp = all_logits(model, data[i: i + batch])
        if mtp is None:
            raise ValueError("the model has no MTP layer")
        same = mtp[:, :-2].argmax(-1) == logits[:, 1:-1].argmax(-1)
        hits, total = hits + same.sum().item(), total + same.numel()
    return hits / total


@torch.no_grad()
def routing_imbalance(model: CausalLM, data: torch.Tensor, batch: int) -> float:
    """max / mean tokens per routed expert over the windows ``data`` [N, T], averaged over the MoE
    layers (1.0: perfectly even)."""
    load = RouterLoad(model)
    try:
        for i in range(0, data.shape[0], batch):
            all_logits(model, data[i: i + batch])
        return load.imbalance()
    finally:
        load.close()


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, p)))


def _held_out_row(model: CausalLM, held_out: torch.Tensor, mask: torch.Tensor | None, batch: int,
                  load: RouterLoad) -> dict:
    load.reset()
    ev, ev_mtp, acc = evaluate(model, held_out, batch, mask)
    return ({"held_out": round(ev, 4)} | ({"held_out_mtp": round(ev_mtp, 4)} if ev_mtp is not None else {})
            | ({"argument_accuracy": round(acc, 4)} if acc is not None else {}) | {"imbalance": round(load.imbalance(), 3)})


class _Batches:
    """Seeded batches of rows of ``data`` (and its weights), reshuffled at each pass."""

    def __init__(self, data: torch.Tensor, weights: torch.Tensor | None, batch: int, g: torch.Generator):
        self.data, self.weights, self.batch, self.g = data, weights, batch, g
        self.order, self.pos = torch.randperm(data.shape[0], generator=g), 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.pos + self.batch > self.order.numel():
            self.order, self.pos = torch.randperm(self.data.shape[0], generator=self.g), 0
        pick = self.order[self.pos: self.pos + self.batch]
        self.pos += self.batch
        return self.data[pick], None if self.weights is None else self.weights[pick]


def train(model: CausalLM, train_data: torch.Tensor, held_out: torch.Tensor, cfg: TrainConfig, *,
          eval_every: int = 100, log: Callable[[dict], None] = lambda row: None,
          train_weights: torch.Tensor | None = None, held_out_mask: torch.Tensor | None = None,
          rows: tuple[torch.Tensor, torch.Tensor] | None = None, rows_batch: int = 0,
          first_step: int = 0) -> list[dict]:
    """AdamW over ``train_data`` windows (shuffled, seeded); returns the log rows: step 0 (the
    untrained model's held-out losses; only when ``first_step`` is 0), then each step's training
    losses, with the held-out losses and the routers' imbalance on them at every ``eval_every`` and
    the last step (and, with
    ``held_out_mask``, the greedy accuracy at the targets it marks: the held-out call arguments).
    With ``rows`` (ids and weights of a second set, of its own length), every step also trains on
    ``rows_batch`` of them, their loss added to the windows'. Steps are logged from ``first_step``
    (a second stage of training goes on counting); ``seconds`` from this call's start."""
    g = torch.Generator().manual_seed(cfg.seed + first_step)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    load = RouterLoad(model)
    log_rows: list[dict] = []
    windows_, rows_ = _Batches(train_data, train_weights, cfg.batch, g), None
    if rows is not None and rows_batch:
        rows_ = _Batches(rows[0], rows[1], rows_batch, g)
    def with_mtp(main: torch.Tensor, mtp: torch.Tensor | None) -> torch.Tensor:
        return main if mtp is None else main + cfg.mtp_weight * mtp

    t0 = time.monotonic()
    try:
        if first_step == 0:
            log_rows.append({"step": 0} | _held_out_row(model, held_out, held_out_mask, cfg.batch, load))  # untrained
            log(log_rows[-1])
        model.train()
        for step in range(cfg.steps):
            ids, w = windows_.next()
            for group in opt.param_groups:
                group["lr"] = _lr(cfg, step)
            load.reset()
            main, mtp = losses(model, ids, w)
            loss = with_mtp(main, mtp)
            if rows_ is not None:
                main_r, mtp_r = losses(model, *rows_.next())
                loss = loss + with_mtp(main_r, mtp_r)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            if cfg.bias_rate:
                load.balance(cfg.bias_rate)
            row = {"step": first_step + step + 1, "loss": round(main.item(), 4), "lr": round(_lr(cfg, step), 6),
                   "seconds": round(time.monotonic() - t0, 1)}
            if mtp is not None:
                row["mtp_loss"] = round(mtp.item(), 4)
            if rows_ is not None:
                row["rows_loss"] = round(main_r.item(), 4)
            if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
                row |= _held_out_row(model, held_out, held_out_mask, cfg.batch, load)
            log_rows.append(row)
            log(row)
    finally:
        load.close()
    return log_rows
