"""How many steps a model takes to learn to copy: the induction task (training/train.py
``induction_rows``: a span of 8-26 random ids repeated until the row ends, a different period in each
row), trained alone, with the copy accuracy on held-out rows printed as it goes. Issue 35's trained
preset has to copy the user's city into a tool call, and copying is this skill; this script measures
when it forms, in this repository's model (K2's architecture, through model/) and, for comparison, in
a standard transformer of torch's own layers (learned positions, biases, LayerNorm, no final norm).

    python scripts/probe_induction.py --model mini --steps 1500      # the kimi-k2-mini shape
    python scripts/probe_induction.py --model smoke --steps 2500     # the smoke shape
    python scripts/probe_induction.py --reference --width 256 --layers 6
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ORDINARY = 768  # the shipped tokenizer's ordinary ranks (the rest are K2's special and reserved ids)


def reference_model(vocab: int, length: int, width: int, layers: int, heads: int, positions: bool):
    """A pre-LN transformer of ``torch.nn.TransformerEncoderLayer`` (biases, LayerNorm, ReLU, 4× FFN),
    learned absolute positions (``positions``), no final norm, an output layer with a bias."""
    import torch
    from torch import nn

    class Reference(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.pos = nn.Embedding(length, width) if positions else None
            layer = nn.TransformerEncoderLayer(width, heads, 4 * width, 0.0, batch_first=True, norm_first=True)
            self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.out = nn.Linear(width, vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            if self.pos is not None:
                h = h + self.pos(torch.arange(ids.shape[1]))
            mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
            return self.out(self.layers(h, mask=mask, is_causal=True))

    return Reference()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("mini", "smoke"), default="mini",
                    help="this repository's model at the kimi-k2-mini shape or its smoke shape (default mini)")
    ap.add_argument("--reference", action="store_true", help="train the standard transformer instead")
    ap.add_argument("--width", type=int, default=256, help="the reference's width (default 256)")
    ap.add_argument("--layers", type=int, default=6, help="the reference's layers (default 6)")
    ap.add_argument("--no-positions", action="store_true", help="the reference without position embeddings")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--rows", type=int, default=16, help="rows per step (default 16)")
    ap.add_argument("--length", type=int, default=80, help="ids per row (default 80)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate, after 30 steps of warm-up")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--stop-at", type=float, default=0.9, help="stop once held-out copy accuracy reaches this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)

    import torch

    from model.config import parse_config
    from model.model import CausalLM
    from model.presets import KIMI_K2_MINI_SMOKE, kimi_k2_mini
    from training.train import all_logits, copy_accuracy, induction_rows, init_for_training, weighted_ce

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.reference:
        model = reference_model(ORDINARY, args.length, args.width, args.layers, 4, not args.no_positions)
        forward = model
    else:
        raw = kimi_k2_mini() | (KIMI_K2_MINI_SMOKE if args.model == "smoke" else {})
        model = CausalLM(parse_config(raw, where=args.model))
        init_for_training(model, args.seed)

        def forward(ids):
            return all_logits(model, ids)[0]

    g = torch.Generator().manual_seed(args.seed + 1)
    held_out = induction_rows(64, args.length, ORDINARY, g)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    t0 = time.monotonic()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():
                acc = copy_accuracy(forward(held_out[0]), *held_out)
            print(json.dumps({"step": step, "copy_accuracy": round(acc, 3),
                              "seconds": round(time.monotonic() - t0, 1)}), flush=True)
            if acc >= args.stop_at or step == args.steps:
                break
        ids, mask = induction_rows(args.rows, args.length, ORDINARY, g)
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 30)
        logits = forward(ids)
        loss = weighted_ce(logits[:, :-1], ids[:, 1:], mask[:, 1:].float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
