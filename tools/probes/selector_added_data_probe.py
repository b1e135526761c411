"""A selector trained on a run's cached drafter passes plus passes on more data: `dflash train --selector` computes the
passes of every block it trains on (most of its time), so this reuses an earlier run's `examples.pt` and adds the
drafter's passes on new data directories only, then trains one selector (`train_selector.fit`, the run's settings)
on the union and exports it as a DFlash2 drafter. Prints teacher-forced acceptance, the drafter's argmax against the
selector, on the held-out blocks of the cached run, of the added data, and of both.

    python tools/probes/selector_added_data_probe.py --cache runs/sel18/examples.pt --data runs/gen11 \
        --blocks 120000 --out runs/sel20 --export runs/sel20/drafter
"""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import torch

from dflash_torch import loading
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.train import load_data, position_weights, split_records
from dflash_torch.train_selector import chains, examples, export_dflash2, fit, tf_accept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", required=True, help="examples.pt of an earlier `dflash train --selector` run")
    ap.add_argument("--data", required=True, help="data directories to add (comma-separated)")
    ap.add_argument("--blocks", type=int, default=100_000, help="training blocks drawn from the added data")
    ap.add_argument("--init-from", default="dflash_torch/drafters/smollm2-135m-instruct",
                    help="the drafter the cached passes are of")
    ap.add_argument("--out", required=True)
    ap.add_argument("--export", default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ex0, vx0 = torch.load(args.cache)
    K, top_k = ex0["cand"].shape[1], ex0["cand"].shape[2]
    records, feats, meta = load_data(args.data.split(","))
    target = loading.load_target(loading.resolve_model(meta["model"]), torch.device("cpu"), torch.float32)
    added = out / "examples_added.pt"
    if added.is_file():
        ex1, vx1 = torch.load(added)
    else:
        drafter = load_drafter(args.init_from, device=torch.device("cpu"), dtype=torch.float32).eval()
        h, cached = target.config.hidden_size, meta["taps"]
        cols = torch.cat([torch.arange(cached.index(t) * h, (cached.index(t) + 1) * h)
                          for t in drafter.target_layer_ids])
        train_recs, val_recs = split_records(records, val_every=10)
        print(f"added data: {len(train_recs)} training records, {len(val_recs)} held out")
        kw = dict(positions=K, top_k=top_k, seed=args.seed)
        cpu = torch.device("cpu")
        ex1 = examples(drafter, target, train_recs, feats, cols, cpu, blocks=args.blocks, **kw)
        vx1 = examples(drafter, target, val_recs, feats, cols, cpu, blocks=max(256, args.blocks // 10), **kw)
        torch.save((ex1, vx1), added)
    ex = {k: torch.cat([ex0[k], ex1[k]]) for k in ex0}
    vx = {k: torch.cat([vx0[k], vx1[k]]) for k in vx0}
    weights = position_weights(K + 1, args.gamma)
    rows = torch.arange(len(vx["labels"]))
    base = round(tf_accept(chains(None, vx, rows), vx["labels"]), 4)
    a = types.SimpleNamespace(selector_rank=args.rank, lr=args.lr, weight_decay=args.weight_decay,
                              selector_epochs=args.epochs)
    sel, epoch = fit(a, target.embed_tokens.weight, ex, vx, weights, base, seed=args.seed, log_file=out / "log.jsonl")
    print(f"{len(ex['labels'])} training blocks ({len(ex1['labels'])} added), best epoch {epoch}")
    with torch.no_grad():
        for name, v in (("cached run's held-out blocks", vx0), ("added data's held-out blocks", vx1), ("both", vx)):
            r = torch.arange(len(v["labels"]))
            print(f"{name} ({len(r)}): argmax {tf_accept(chains(None, v, r), v['labels']):.4f}, "
                  f"selector {tf_accept(chains(sel, v, r), v['labels']):.4f}")
    if args.export:
        export_dflash2(args.init_from, sel, args.export, top_k, "bfloat16")
        print(f"wrote {args.export}")


if __name__ == "__main__":
    main()
