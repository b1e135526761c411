"""Build a drafter's datastore (dflash_torch/decoding/datastore.py) from the `.jsonl` records of drafter training
data: the target's own replies (`python -m dflash_torch.data`: `response_ids`), and teacher-forced text
(`tools/teacher_forced_data.py`: the text with `target_ids`, the target's greedy choice at each reply position,
which is what is counted there).

    python tools/build_datastore.py --data runs/data8,runs/sel-data,runs/tf-data \
        --out dflash_torch/drafters/smollm2-135m-instruct/datastore.npz
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_torch.decoding.datastore import Datastore


def records(dirs: list[str]) -> tuple[list[list[int]], list[tuple[list[int], int, list[int]]]]:
    """(the target's replies, teacher-forced (text, start, the target's choices)) of the data directories."""
    replies, forced = [], []
    for d in dirs:
        files = sorted(Path(d).glob("*.jsonl"))
        if not files:
            sys.exit(f"build_datastore: no .jsonl records in {d}")
        for f in files:
            for i, line in enumerate(f.open(), 1):
                try:
                    r = json.loads(line)
                    if not isinstance(r, dict) or not isinstance(r.get("response_ids"), list):
                        raise ValueError("no response_ids list")
                except ValueError as e:
                    sys.exit(f"build_datastore: {f}:{i} is not a data record ({e})")
                if "target_ids" in r:
                    forced.append((r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"]), r["target_ids"]))
                else:
                    replies.append(r["response_ids"])
    return replies, forced


def extend(base: Datastore, new: Datastore) -> Datastore:
    """`base` with `new`'s contexts added; where both keep a context, `new`'s next token."""
    tables = {n: dict(base.next.get(n, {})) for n in set(base.next) | set(new.next)}
    for n, table in new.next.items():
        tables[n].update(table)
    return Datastore(tables)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="comma-separated data directories")
    ap.add_argument("--out", required=True, help="the .npz to write (datastore.npz in the drafter's directory)")
    ap.add_argument("--min-n", type=int, default=2, help="shortest context kept, in tokens (1 to --max-n)")
    ap.add_argument("--max-n", type=int, default=3, help="longest context kept, in tokens (--min-n to 3)")
    ap.add_argument("--min-count", type=int, default=2, help="fewest occurrences of a context to keep it")
    ap.add_argument("--min-share", type=float, default=0.5, help="share of them its next token must have")
    ap.add_argument("--base", help="a datastore .npz to extend: its contexts are kept, and where the new data keeps "
                    "one too, the new data's next token replaces its own (for a store whose source data is gone)")
    a = ap.parse_args()
    replies, forced = records(a.data.split(","))
    try:
        store = Datastore.build(replies, forced, min_n=a.min_n, max_n=a.max_n, min_count=a.min_count,
                                min_share=a.min_share)
        if a.base:
            store = extend(Datastore.load(a.base), store)
    except ValueError as e:
        sys.exit(f"build_datastore: {e}")
    store.save(a.out)
    per_n = ", ".join(f"{len(t):,} of {n} tokens" for n, t in sorted(store.next.items()))
    print(f"{len(replies):,} replies ({sum(map(len, replies)):,} tokens) and {len(forced):,} teacher-forced texts "
          f"({sum(len(c) for _, _, c in forced):,} choices) -> {len(store):,} contexts ({per_n}); "
          f"{a.out}: {Path(a.out).stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
