"""Time of one training step, two ways in turn on the same batches (docs/training.md).

Loads cached training data (`python -m dflash_torch.data` output) and the shipped drafter, builds
batches as `dflash train` does, and times forward + backward of the same batches. `--compare mask`:
the dense mask (`block_logits(dense=True)`, the reference) against `drafter.Blocks`; `--compare
vocab`: block by block, the LM head's draft-vocabulary rows (the drafter's draft_vocab.json) against
the whole head:

    python tools/probes/train_step_probe.py --data runs/data0,runs/data1 --anchors 32,64 --threads 1
    python tools/probes/train_step_probe.py --data runs/data0,runs/data1 --anchors 32,64 --threads 1 --compare vocab
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import dflash_torch
from dflash_torch import loading
from dflash_torch import train as T
from dflash_torch.decoding.drafter import load_drafter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="comma-separated data directories")
    p.add_argument("--anchors", default="32,64", help="anchors per sequence, one setting per value")
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--loss-positions", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="batches per setting and mode")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compare", choices=("mask", "vocab"), default="mask")
    p.add_argument("--drafter", default=str(Path(dflash_torch.__file__).parent / "drafters" / "smollm2-135m-instruct"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    records, feats, meta = T.load_data(args.data.split(","))
    target = loading.load_target(loading.resolve_model(meta["model"]), torch.device("cpu"), torch.float32)
    target.requires_grad_(False)
    drafter = load_drafter(args.drafter, dtype=torch.float32)
    vocab = drafter.draft_vocab
    if args.compare == "vocab" and vocab is None:
        raise SystemExit(f"{args.drafter} has no draft vocabulary (draft_vocab.json)")
    names = ("dense mask", "block by block") if args.compare == "mask" else ("whole head", "draft vocabulary")
    train_recs, _ = T.split_records(records)
    cols, weights = torch.arange(feats.shape[1]), T.position_weights(drafter.block_size, 7.0)
    for anchors in [int(a) for a in args.anchors.split(",")]:
        times = {True: [], False: []}
        for i in range(2 * args.steps):
            first = i % 2 == 0
            dense = first and args.compare == "mask"
            if args.compare == "vocab":
                drafter.set_draft_vocab(None if first else vocab)
            batch = T.make_batch(train_recs, feats, cols, torch.Generator().manual_seed(100 + i // 2), seqs=args.seqs,
                                 anchors=anchors, block_size=drafter.block_size, mask_token_id=drafter.mask_token_id)
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = T.block_logits(drafter, drafter, target, batch, torch.device("cpu"), args.loss_positions,
                                        dense=dense)
                loss, _ = T.block_loss(logits, drafter.draft_labels(batch["labels"]), weights)
            drafter.zero_grad()
            loss.backward()
            times[first].append(time.perf_counter() - t0)
        a, b = statistics.median(times[True]), statistics.median(times[False])
        print(f"{args.seqs} x {anchors} blocks, loss on {args.loss_positions} positions: {names[0]} "
              f"{a:.2f} s per step, {names[1]} {b:.2f} s")


if __name__ == "__main__":
    main()
