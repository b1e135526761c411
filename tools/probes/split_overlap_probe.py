"""How many held-out records of a data set continue a conversation that has a training record: under a split by
each record's own key (`train.split_records` before it grouped a conversation's turns) and under
`train.split_records` as it is. A conversation is the records whose prompts share their first 96 tokens.

    python tools/probes/split_overlap_probe.py --data runs/gen9,runs/gen10 --val-every 10
"""

from __future__ import annotations

import argparse

from dflash_torch import train


def overlap(train_recs: list[dict], val_recs: list[dict], group_tokens: int) -> int:
    seen = {tuple(r["prompt_ids"][:group_tokens]) for r in train_recs}
    return sum(tuple(r["prompt_ids"][:group_tokens]) in seen for r in val_recs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="data directories, comma-separated (one set, as `dflash train`)")
    ap.add_argument("--val-every", type=int, default=20, help="20: `dflash train`'s split; 10: `--selector`'s")
    ap.add_argument("--group-tokens", type=int, default=96)
    a = ap.parse_args()
    records, _, _ = train.load_data(a.data.split(","))
    held = [not int(r["key"][:8], 16) % a.val_every for r in records]
    by_key = [r for r, h in zip(records, held) if not h], [r for r, h in zip(records, held) if h]
    grouped = train.split_records(records, a.val_every, a.group_tokens)
    for name, (tr, va) in (("split by each record's key", by_key),
                           ("split_records (a conversation on one side)", grouped)):
        print(f"{name}: {len(tr)} training, {len(va)} held-out records; held out, continuing a training "
              f"conversation: {overlap(tr, va, a.group_tokens)}")


if __name__ == "__main__":
    main()
