"""Teacher-forced acceptance of several drafters on the held-out records of each data directory (the records
`dflash train` holds out: `train.split_records`), the same blocks for every drafter: what `tf_accept` in a run's
log measures, for drafters that were not trained in that run. Directories joined by "+" are one set, held out as
`dflash train --data a,b` holds them out (its log's `tf_accept`).

    python tools/probes/tf_accept_probe.py --data runs/tf-data,runs/sel-data --draft runs/shipped6,runs/export-s8-tf
    python tools/probes/tf_accept_probe.py --data runs/tf-data6+runs/data8+runs/sel-data --draft runs/export-s11
"""

from __future__ import annotations

import argparse

import torch

from dflash_torch import loading, train
from dflash_torch.decoding.drafter import load_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="data directories, comma-separated (each apart; a+b: one set)")
    ap.add_argument("--draft", required=True, help="drafter directories, comma-separated")
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="under bf16 autocast, as `dflash train` evaluates by default")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    drafts = args.draft.split(",")
    print("data".ljust(44) + "".join(d.ljust(28) for d in drafts))
    for d in args.data.split(","):
        records, feats, meta = train.load_data(d.split("+"))
        target = loading.load_target(loading.resolve_model(meta["model"]), device, torch.float32)
        cols = torch.arange(feats.shape[1])
        _, val = train.split_records(records)
        row = []
        for path in drafts:
            drafter = load_drafter(path, dtype=torch.float32)
            row.append(train.tf_acceptance(drafter, target, val, feats, cols, device, n_blocks=args.blocks,
                                           bf16=args.bf16))
        print(f"{d} ({len(val)} held out)".ljust(44) + "".join(f"{v:.4f}".ljust(28) for v in row), flush=True)


if __name__ == "__main__":
    main()
