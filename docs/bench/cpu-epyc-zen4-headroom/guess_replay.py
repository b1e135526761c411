"""free_drafts_replay.py's replay of the 12 replies (prompt lookup and the shipped datastore), with one more proposer
for the cycles where neither offers: the most frequent next token after the last N tokens (N..1, backing off) in the
target's own replies (runs/gen9, gen10, gen11: `response_ids`), verified in a 2-row pass. Prints the median and mean
speed over target-only under the cost table, without and with the guesses, and how many guesses were kept.

    python docs/bench/cpu-epyc-zen4-headroom/guess_replay.py [N] [MIN_COUNT] [MIN_SHARE]
"""

from __future__ import annotations

import collections
import glob
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "tools" / "probes"))
from free_drafts_replay import parse_costs, steps  # noqa: E402

from dflash_torch.decoding.datastore import Datastore  # noqa: E402
from dflash_torch.decoding.proposers import DatastoreProposer, LookupProposer, plain_step, ranked  # noqa: E402
from dflash_torch.decoding.sampling import Sampler  # noqa: E402
from dflash_torch.registry import SHIPPED  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 3
MIN_COUNT = int(sys.argv[2]) if len(sys.argv) > 2 else 2
MIN_SHARE = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
COSTS = parse_costs("1:1,2:1.095,3:1.15,4:1.18,8:1.45,16:2.35")  # free_drafts_replay.py's default table


def ngram_tables() -> dict[int, dict]:
    tables = {n: collections.defaultdict(collections.Counter) for n in range(1, N + 1)}
    for d in ("runs/gen9", "runs/gen10", "runs/gen11"):
        for f in sorted(glob.glob(d + "/*.jsonl")):
            for line in open(f):
                try:
                    s = json.loads(line)["response_ids"]
                except (ValueError, KeyError):
                    continue
                for i in range(1, len(s)):
                    for n in range(1, min(N, i) + 1):
                        tables[n][tuple(s[i - n : i])][s[i]] += 1
    return tables


def guess(tables: dict[int, dict], ctx: list[int]) -> int | None:
    for n in range(N, 0, -1):
        c = tables[n].get(tuple(ctx[-n:]))
        if c and sum(c.values()) >= MIN_COUNT:
            token, count = c.most_common(1)[0]
            if count / sum(c.values()) >= MIN_SHARE:
                return token
    return None


def replay(store, tables, prompt: list[int], reply: list[int], use_guess: bool) -> tuple[float, int, int]:
    sampler, first = Sampler(), reply[0]
    lookup = LookupProposer([*prompt, first], 15, sampler, 1 << 21, None, {})
    proposers = [lookup, DatastoreProposer(store, [*prompt, first], 15, sampler, 1 << 21, None, lookup.finder.costs)]
    p, token, paid, guessed, kept_guesses, ctx = 1, first, 0.0, 0, 0, [*prompt, first]
    while p < len(reply):
        remaining = len(reply) - p
        draft = None
        for offer in ranked([q.offer(remaining) for q in proposers]):
            draft = offer.proposer.draft(token, remaining, "cpu")
            break
        g = guess(tables, ctx) if draft is None and use_guess and remaining > 1 else None
        if g is not None:  # a 2-row pass: the guess kept or not, one token from the target either way
            guessed += 1
            kept_guesses += g == reply[p]
            new, cost = reply[p : p + (2 if g == reply[p] else 1)], steps(COSTS, 2)
            for q in proposers:
                q.observe(plain_step(token, "cpu"), 0, new, None, cost)
        else:
            draft = draft or plain_step(token, "cpu")
            drafted = draft.block[0, 1:].tolist()
            kept = 0
            while kept < len(drafted) and drafted[kept] == reply[p + kept]:
                kept += 1
            new, cost = reply[p : p + kept + 1], steps(COSTS, draft.width)
            for q in proposers:
                q.observe(draft, kept, new, None, cost)
        paid += cost
        p += len(new)
        ctx += new
        token = new[-1]
    return (len(reply) - 1) / paid, guessed, kept_guesses


def main() -> None:
    tables = ngram_tables()
    store = Datastore.load(str(SHIPPED / "smollm2-135m-instruct" / "datastore.npz"))
    replies = json.loads(Path("runs/replies512_0_3.json").read_text())
    for use in (False, True):
        rs = [replay(store, tables, r["prompt"], r["reply"], use) for r in replies]
        speed = [r[0] for r in rs]
        print(f"{'with guesses' if use else 'free drafts '} (N {N}, min count {MIN_COUNT}, min share {MIN_SHARE}): "
              f"median {statistics.median(speed):.3f}x, mean {statistics.mean(speed):.3f}x; "
              f"guesses {sum(r[1] for r in rs)}, kept {sum(r[2] for r in rs)}")


if __name__ == "__main__":
    main()
