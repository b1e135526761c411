"""Would an n-gram store built from other replies draft well? (docs/performance.md, "The target's stock phrases")

Teacher-forced, on the target's own replies in drafter training data (`python -m dflash_torch.data`
directories): replies are shuffled, 150 held out, and the others build a store of n-grams (n = 2..5) ->
next-token counts. At every position of a held-out reply it drafts up to 15 tokens from the store (the
most frequent continuation of the longest matching n-gram, while it holds at least half the count) and
from prompt lookup within the same prompt and reply (`lookup.py`'s idea: what followed the last earlier
occurrence of the last 4/3/2 tokens), and counts how many drafted tokens match the reply.

    python tools/probes/suffix_store_probe.py runs/data0 runs/data1 ...
"""

from __future__ import annotations

import argparse
import collections
import random

from dflash_torch import data

N = 5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", help="training data directories")
    p.add_argument("--held-out", type=int, default=150)
    args = p.parse_args()
    records = []
    for d in args.dirs:
        records += [(r["prompt_ids"], r["response_ids"]) for r in data.shard_index(d)[0]]
    random.Random(0).shuffle(records)
    held, train = records[: args.held_out], records[args.held_out :]
    store = collections.defaultdict(collections.Counter)
    for _, reply in train:
        for n in range(2, N + 1):
            for i in range(len(reply) - n):
                store[tuple(reply[i : i + n])][reply[i + n]] += 1

    def from_store(hist: list[int], k: int) -> list[int]:
        out, draft = list(hist), []
        while len(draft) < k:
            counts = next((store[key] for n in range(N, 1, -1) if (key := tuple(out[-n:])) in store), None)
            if not counts:
                break
            token, c = counts.most_common(1)[0]
            if c * 2 < sum(counts.values()):
                break
            draft.append(token)
            out.append(token)
        return draft

    def from_lookup(hist: list[int], k: int) -> list[int]:
        for n in (4, 3, 2):
            key = hist[-n:]
            for j in range(len(hist) - n - 1, -1, -1):
                if hist[j : j + n] == key:
                    return hist[j + n : j + n + k]
        return []

    totals = {"store": [0, 0], "lookup": [0, 0]}  # proposals, matching tokens
    positions = 0
    for prompt, reply in held:
        toks = prompt + reply
        for i in range(len(prompt), len(toks) - 1):
            positions += 1
            hist, truth = toks[: i + 1], toks[i + 1 : i + 16]
            for name, draft in (("store", from_store(hist, 15)), ("lookup", from_lookup(hist, 15))):
                if draft:
                    kept = next((j for j, (a, b) in enumerate(zip(draft, truth)) if a != b), min(len(draft),
                                                                                                 len(truth)))
                    totals[name][0] += 1
                    totals[name][1] += kept
    print(f"{len(train)} replies in the store, {len(held)} held out, {positions} positions")
    for name, (proposals, kept) in totals.items():
        print(f"{name:6s}: proposes at {proposals / positions:.0%} of positions, keeps {kept / max(proposals, 1):.2f} "
              "tokens per proposal")


if __name__ == "__main__":
    main()
