"""Chain against tree drafts in the real loop, on the weights `dflash generate` runs (`--quantize auto` by default):
held-out acceptance (tokens per verify pass) and decode tok/s, the drafter alone (no lookup, no fallback), at a
fixed width (`--block`, as `--no-adaptive`) or with the adaptive width (`--adaptive`), alternating chain and tree
prompt by prompt; every output compared with the other's.

    python tools/probes/tree_eval_probe.py --per-kind 4 --block 16
    python tools/probes/tree_eval_probe.py --per-kind 4 --adaptive
    python tools/probes/tree_eval_probe.py --per-kind 4 --block 16 --draft runs/sel8/drafter   # another drafter
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dflash_torch import data
from dflash_torch.decoding import proposers
from dflash_torch.decoding.adaptive import AdaptiveBlockSize, calibrated
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--draft", default="auto", help="the drafter (default: the model's registered one)")
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--adaptive", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    p = load(draft=args.draft, quantize=args.quantize, quiet=True)
    rows = []
    for kind, chats in data.heldout_prompts(args.per_kind, args.per_kind, args.per_kind).items():
        for i, msgs in enumerate(chats):
            ids = data.encode_chat(p.tokenizer, msgs)
            outs = {}
            for tree in (False, True):
                proposers.TREES = tree
                stats = Stats()
                ctrl = AdaptiveBlockSize(calibrated(p), p.drafter.block_size) if args.adaptive else None
                out = list(generate_tokens(p.target, ids, max_new_tokens=args.tokens, drafter=p.drafter,
                                           block_size=args.block, stop_token_ids=p.stop_token_ids, stats=stats,
                                           controller=ctrl))
                outs[tree] = (out, stats)
            (a, sa), (b, sb) = outs[False], outs[True]
            row = {"kind": kind, "prompt": i, "tokens": len(a), "equal": a == b,
                   "chain_accept": round(sa.acceptance_length_mean, 4),
                   "tree_accept": round(sb.acceptance_length_mean, 4),
                   "chain_tok_s": round(sa.decode_tok_s, 1), "tree_tok_s": round(sb.decode_tok_s, 1),
                   "tree_cycles": sb.tree_cycles, "tree_side_kept": sb.tree_side_kept,
                   "tree_widths": sb.as_dict()["verify_widths"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for key in ("chain_accept", "tree_accept", "chain_tok_s", "tree_tok_s"):
        by = {k: statistics.mean(r[key] for r in rows if r["kind"] == k) for k in ("chat", "code", "math")}
        print(f"{key:13s} " + " ".join(f"{k} {v:.3f}" for k, v in by.items())
              + f"  mean {statistics.mean(r[key] for r in rows):.3f}", flush=True)
    print(f"median tok/s ratio tree/chain {statistics.median(r['tree_tok_s'] / r['chain_tok_s'] for r in rows):.3f}; "
          f"all outputs equal: {all(r['equal'] for r in rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
