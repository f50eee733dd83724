"""Train the kimi-k2-mini preset: K2's architecture and checkpoint format at laptop size, with one MTP
layer, on a seeded offline corpus of agent transcripts (training/corpus.py), through the model code in
model/ (training/train.py). Writes a complete checkpoint directory (bf16, the preset's K2-format
tokenizer kimi-mini and K2's template), a JSON log of the losses, and preset.safetensors: the same
weights without the MTP layer's copies of the embedding and output head it shares with the main model
(what model/assets/presets/kimi-k2-mini/model.safetensors holds; build_preset writes the copies back).

    python scripts/train_preset.py --out /tmp/kimi-k2-mini            # the full run
    python scripts/train_preset.py --out /tmp/mini --tiny --lookup-steps 20 --steps 20 --docs 60 --call-rows 200  # a smoke run
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=300, help="second-stage steps, on the transcripts (default 300)")
    ap.add_argument("--docs", type=int, default=8000, help="training transcripts (default 8000)")
    ap.add_argument("--held-out-docs", type=int, default=40, help="held-out transcripts (default 40)")
    ap.add_argument("--lookup-steps", type=int, default=250,
                    help="first stage: steps on single requests alone, --lookup-rows a step (default 250)")
    ap.add_argument("--lookup-rows", type=int, default=64, help="single requests per first-stage step (default 64)")
    ap.add_argument("--rows-per-step", type=int, default=32,
                    help="single requests trained beside the windows in every later step (default 32)")
    ap.add_argument("--row-len", type=int, default=128, help="tokens per single-request row (default 128)")
    ap.add_argument("--call-rows", type=int, default=20000,
                    help="single requests generated for each stage (default 20000)")
    ap.add_argument("--lookup-varied", action="store_true",
                    help="first stage on varied single requests too (default: the corpus's first version, one "
                         "result shape a tool, where the lookups form; the second stage's are varied)")
    ap.add_argument("--batch", type=int, default=8, help="windows per step (default 8)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    ap.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps (default 100)")
    ap.add_argument("--other-weight", type=float, default=0.2,
                    help="loss weight of tokens outside assistant turns (default 0.2; assistant tokens weigh 1)")
    ap.add_argument("--argument-weight", type=float, default=3.0,
                    help="loss weight of a tool call's argument tokens, the entities copied from the request (default 3)")
    ap.add_argument("--quote-weight", type=float, default=4.0,
                    help="loss weight of a number or city an answer writes that the request or the tool's result "
                         "gave: the quoted value (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--tiny", action="store_true", help="a much smaller model of the same architecture (smoke runs)")
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    from model.config import parse_config
    from training.corpus import CITIES, call_rows, documents
    from model.model import CausalLM, to_hf_tensors
    from model.mtp import with_shared_mtp_tensors
    from model.presets import KIMI_K2_MINI_SMOKE, kimi_k2_mini, stored_tensors, write_model_dir
    from model.tokenizer import SHIPPED_DIR, Tokenizer
    from training.train import (TrainConfig, assistant_weights, init_for_training, padded_rows, share_mtp_embeddings,
                                train, windows)

    if args.threads:
        torch.set_num_threads(args.threads)
    raw = kimi_k2_mini() | (KIMI_K2_MINI_SMOKE if args.tiny else {})
    cfg = parse_config(raw, where="kimi-k2-mini")
    tok = Tokenizer.from_dir(SHIPPED_DIR / "kimi-mini")
    t0 = time.monotonic()
    docs = documents(args.seed, args.docs, tok)
    marks = [tok.token_to_id(t) for t in ("<|im_assistant|>", "<|im_middle|>", "<|im_end|>")]
    arguments = (tok.token_to_id("<|tool_call_argument_begin|>"), tok.token_to_id("<|tool_call_end|>"))
    # the number ids (the tokenizer's digits and 10-99) and the city ids (each city one id): what an answer
    # quotes from the request and the tool's result
    cities = {ids[0] for c in CITIES if len(ids := tok.encode(c)) == 1}
    quotes = frozenset(i for i in range(tok.vocab_size) if tok.decode([i]).strip().isdigit()) | cities

    def weights(ds: list[list[int]], other: float = args.other_weight, argument_weight: float = args.argument_weight,
                quote_weight: float = args.quote_weight):
        return [assistant_weights(d, *marks, other=other, arguments=arguments, argument_weight=argument_weight,
                                  quotes=quotes, quote_weight=quote_weight) for d in ds]

    train_data, train_weights = windows(docs, args.seq_len, weights(docs))
    pad = tok.token_to_id("[PAD]")
    singles = call_rows(args.seed + 20_000, args.call_rows, tok, max_len=args.row_len)
    row_ids, row_w = padded_rows(singles, args.row_len, weights(singles), pad)
    if args.lookup_varied:
        first_ids, first_w = row_ids, row_w
    else:  # the corpus's first version, as the run before the variety had it (rows cut at --row-len)
        first = call_rows(args.seed + 20_000, args.call_rows, tok, varied=False)
        first_ids, first_w = padded_rows(first, args.row_len, weights(first), pad)
    held_docs = documents(args.seed + 10_000, args.held_out_docs, tok)
    # the held-out argument tokens (weight 2): the copying accuracy
    held_out, held_args = windows(held_docs, args.seq_len, weights(held_docs, other=0.0, argument_weight=2.0,
                                                                    quote_weight=1.0))
    print(f"corpus: {train_data.numel()} training tokens ({train_data.shape[0]} windows), {row_ids.shape[0]} "
          f"single requests, {held_out.numel()} held out, in {time.monotonic() - t0:.1f}s", flush=True)
    torch.manual_seed(args.seed)
    model = CausalLM(cfg, mtp=True)
    init_for_training(model, args.seed)
    share_mtp_embeddings(model)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e6:.2f} M parameters (MTP layer included)", flush=True)
    # Stage 1, the lookup: single requests alone, many a step, at a constant rate. Finding the entity the
    # user named (one token of its kind among a few dozen) is learned in a phase change that needs many
    # examples in every step; packed among transcripts it does not come within the budget. So is
    # finding the number an answer quotes, and that forms where the result has one shape (the corpus's
    # first version): on varied shapes from the start it did not form in the budget, while heads
    # formed on one shape carry over to the varied ones in stage 2 (docs/trained_preset.md).
    stage1 = TrainConfig(steps=args.lookup_steps, batch=args.lookup_rows, seq_len=args.row_len, lr=args.lr,
                         min_lr=args.lr, seed=args.seed, warmup=min(30, max(1, args.lookup_steps // 10)))
    # Stage 2: the transcripts, with (varied) single requests beside them in every step so the lookup stays.
    tcfg = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                       warmup=min(50, max(1, args.steps // 10)))

    def log(row: dict) -> None:
        if "held_out" in row or row["step"] % 10 == 0:
            print(json.dumps(row), flush=True)

    rows = train(model, first_ids, held_out, stage1, eval_every=args.eval_every, log=log, train_weights=first_w,
                 held_out_mask=held_args == 2.0) if args.lookup_steps else []
    rows += train(model, train_data, held_out, tcfg, eval_every=args.eval_every, log=log,
                  train_weights=train_weights, held_out_mask=held_args == 2.0, rows=(row_ids, row_w),
                  rows_batch=args.rows_per_step, first_step=args.lookup_steps)
    raw = dict(raw, torch_dtype="bfloat16")
    tensors = to_hf_tensors(model)  # the shared embedding and head once, under the main model's names
    write_model_dir(with_shared_mtp_tensors(tensors, cfg.num_hidden_layers), raw, args.out, tokenizer="kimi-mini",
                    generation={"moeray_preset": "kimi-k2-mini", "seed": args.seed,
                                "trained_steps": args.lookup_steps + args.steps})
    save_file({k: v.contiguous() for k, v in stored_tensors(tensors, raw["torch_dtype"]).items()},
              args.out / "preset.safetensors")
    (args.out / "train_log.json").write_text(json.dumps(rows))
    print(f"wrote {args.out} after {time.monotonic() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
