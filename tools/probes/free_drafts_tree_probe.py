"""Whether one verify pass over a TREE of free drafts would keep more than the loop's single chain: over fixed target
replies (free_drafts_replay.py's `--replies` file), each cycle gathers candidate chains (prompt lookup at the longest
matching n-gram's latest occurrences, optionally at shorter n-grams too; the datastore's chain, optionally the chains
from its shorter contexts), cuts each to `depth` tokens, joins them into a trie of at most `nodes` drafted tokens
(first chains first) and keeps the longest prefix of the reply the trie holds. Every cycle pays its width's verify
cost in decode steps (`--costs`, as free_drafts_replay.py). A fixed policy, no pricing: it shows what diversity of
free candidates could add, not what a tuned policy would reach.

    python tools/probes/free_drafts_tree_probe.py --replies runs/replies512_0_3.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash_torch.decoding.datastore import Datastore, pack  # noqa: E402
from dflash_torch.registry import SHIPPED  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from free_drafts_replay import parse_costs, steps  # noqa: E402

MAX_N = 8  # prompt lookup's longest n-gram (lookup.PromptLookup's default)


def candidates(tokens: list[int], store: Datastore, depth: int, occurrences: int, shorter: bool,
               store_tails: bool) -> list[list[int]]:
    out, n_tok = [], len(tokens)
    for n in range(min(MAX_N, n_tok - 1), 1, -1):
        tail, found = tokens[-n:], []
        for j in range(n_tok - n - 1, -1, -1):  # latest occurrence first
            if tokens[j : j + n] == tail:
                found.append(j + n)
                if len(found) >= occurrences:
                    break
        for start in found:
            chain: list[int] = []
            for i in range(depth):  # past the end the copy continues from itself, as PromptLookup's
                k = start + i
                chain.append(tokens[k] if k < n_tok else chain[k - n_tok])
            out.append(chain)
        if found and not shorter:
            break
    chain = store.draft(tokens, depth)
    if chain:
        out.append(chain)
    if store_tails:
        for n in (2, 1):
            nxt = store.next.get(n, {}).get(pack(tokens[-n:]))
            if nxt is not None:
                out.append([nxt] + store.draft(tokens + [nxt], depth - 1))
    return out


def replay(replies: list[dict], store: Datastore, costs: dict[int, float], depth: int, occurrences: int,
           shorter: bool, store_tails: bool, nodes: int) -> tuple[float, float]:
    speeds, kept_tokens, passes = [], 0, 0
    for r in replies:
        reply, tokens = r["reply"], list(r["prompt"]) + [r["reply"][0]]
        p, paid, n_pass = 1, 0.0, 0
        while p < len(reply):
            left = len(reply) - p
            trie: set[tuple[int, ...]] = set()
            for chain in candidates(tokens, store, depth, occurrences, shorter, store_tails):
                chain = chain[: min(depth, left - 1)]
                for k in range(len(chain), 0, -1):  # the longest prefix of it that fits the budget
                    grown = trie | {tuple(chain[: i + 1]) for i in range(k)}
                    if len(grown) <= nodes:
                        trie = grown
                        break
                if len(trie) >= nodes:
                    break
            kept = 0
            while kept < left - 1 and tuple(reply[p : p + kept + 1]) in trie:
                kept += 1
            paid += steps(costs, len(trie) + 1)
            n_pass += 1
            new = reply[p : p + kept + 1]
            tokens += new
            p += len(new)
        speeds.append((len(reply) - 1) / paid)
        kept_tokens += len(reply) - 1
        passes += n_pass
    return statistics.median(speeds), kept_tokens / passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", required=True, help="free_drafts_replay.py's replies file (generate it there)")
    ap.add_argument("--costs", default="1:1,2:1.095,3:1.15,4:1.18,8:1.45,16:2.35")
    a = ap.parse_args()
    replies = json.loads(Path(a.replies).read_text())
    store = Datastore.load(SHIPPED / "smollm2-135m-instruct" / "datastore.npz")
    costs = parse_costs(a.costs)
    print(f"{len(replies)} replies; verify costs in decode steps {costs}")
    print("depth, lookup occurrences, shorter n-grams, datastore tails, nodes: median speed over target-only, "
          "tokens per pass")
    for cfg in [(3, 1, False, False, 3), (4, 1, False, False, 4), (6, 1, False, False, 6), (4, 1, False, False, 8),
                (4, 2, False, False, 8), (4, 3, True, False, 8), (4, 3, True, True, 8), (3, 3, True, True, 8),
                (6, 3, True, True, 12), (4, 4, True, True, 15)]:
        speed, per_pass = replay(replies, store, costs, *cfg)
        print(f"  {cfg}: {speed:.3f}x, {per_pass:.3f}", flush=True)


if __name__ == "__main__":
    main()
