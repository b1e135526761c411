"""The loop's free proposers (prompt lookup and the drafter's datastore), replayed over fixed target replies
under a table of verify costs: how many tokens a pass commits and what that is worth, without timing a run.

The target's greedy replies (no stop token) to bench prompts are generated once and kept in `--replies`. Each
reply is then replayed through the real `LookupProposer` and `DatastoreProposer` (their matching, pricing and
ranking, as `speculative._speculate` calls them; no drafter, no fallback): a cycle drafts the best offer,
keeps the drafts that equal the reply, and pays the cost of its verify width in decode steps (`--costs`:
`dflash profile --json` output, or `W:steps,...`). The speed is committed tokens over the steps paid, that is
over target-only decoding under the same table. Tokens per pass come out as the real loop's (the free
proposers see the same tokens); the speed leaves out the loop's own costs (the drafter's cycles, the
fallback's probes, Python around the passes), so the real loop runs slower than this.

    python tools/probes/free_drafts_replay.py --replies runs/replies512.json --first 3 --limit 9
    python tools/probes/free_drafts_replay.py --replies runs/replies512.json --store runs/store.npz \
        --costs 1:1,2:1.095,3:1.15,4:1.18,8:1.45,16:2.35
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from dflash_torch.decoding.datastore import Datastore
from dflash_torch.decoding.lookup import between
from dflash_torch.decoding.proposers import DatastoreProposer, LookupProposer, plain_step, ranked
from dflash_torch.decoding.sampling import Sampler


def make_replies(path: Path, first: int, limit: int, tokens: int) -> list[dict]:
    """Target-only greedy replies (`tokens` each, no stop token) to prompts first..limit-1 of each bench suite."""
    import torch

    from dflash_torch.bench_prompts import collect_prompts, encode
    from dflash_torch.decoding.speculative import generate_tokens
    from dflash_torch.generate import load

    torch.set_grad_enabled(False)
    p = load(draft=None, quantize="auto", quiet=True)
    out = []
    for suite, prompts in collect_prompts("all", None, limit).items():
        for pr in prompts[first:limit]:
            ids = encode(p, pr)
            reply = list(generate_tokens(p.target, ids, max_new_tokens=tokens, stop_token_ids=[]))
            out.append({"suite": suite, "id": pr.id, "prompt": ids, "reply": reply})
            print(f"reply to {pr.id}: {len(reply)} tokens", flush=True)
    path.write_text(json.dumps(out))
    return out


def parse_costs(spec: str) -> dict[int, float]:
    """`dflash profile --json` output (decode steps from its seconds) or `W:steps,...` (1 must be there)."""
    try:
        if Path(spec).is_file():
            r = json.loads(Path(spec).read_text())
            costs = {1: 1.0, **{int(w): s / r["decode_s"] for w, s in r["verify_s"].items()}}
        else:
            costs = {int(w): float(s) for w, s in (x.split(":") for x in spec.split(","))}
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"free_drafts_replay: --costs {spec!r}: neither W:steps,... nor `dflash profile --json` "
                         f"output ({e})") from None
    if 1 not in costs:
        raise SystemExit("free_drafts_replay: the costs need width 1 (a plain step)")
    return costs


def steps(costs: dict[int, float], width: int) -> float:
    """Decode steps of a verify pass of `width` rows: the table, linear between its widths, past the widest at
    the last two widths' cost per row."""
    at = between(costs, width)
    if at is not None:
        return at
    hi = max(costs)
    lo = max([w for w in costs if w < hi], default=hi)
    per_row = (costs[hi] - costs[lo]) / (hi - lo) if hi > lo else 0.0
    return costs[hi] + per_row * (width - hi)


def replay(store: Datastore | None, prompt: list[int], reply: list[int], costs: dict[int, float],
           width: int = 15) -> dict:
    """One reply through prompt lookup and `store`: passes, steps paid, drafted and kept tokens per source."""
    sampler, first = Sampler(), reply[0]
    lookup = LookupProposer([*prompt, first], width, sampler, 1 << 21, None, {})
    proposers = [lookup]
    if store is not None:
        proposers.append(DatastoreProposer(store, [*prompt, first], width, sampler, 1 << 21, None,
                                           lookup.finder.costs))
    r = {"passes": 0, "steps": 0.0, "tokens": len(reply) - 1, "lookup": [0, 0], "datastore": [0, 0]}
    p, token = 1, first
    while p < len(reply):
        remaining = len(reply) - p
        draft = None
        for offer in ranked([q.offer(remaining) for q in proposers]):
            draft = offer.proposer.draft(token, remaining, "cpu")
            break
        draft = draft or plain_step(token, "cpu")
        drafted = draft.block[0, 1:].tolist()
        kept = 0
        while kept < len(drafted) and drafted[kept] == reply[p + kept]:
            kept += 1
        new = reply[p : p + kept + 1]
        cost = steps(costs, draft.width)
        for q in proposers:  # the seconds they learn from: the steps paid (same units throughout)
            q.observe(draft, kept, new, None, cost)
        if draft.source is not None:
            r[draft.source.name][0] += len(drafted)
            r[draft.source.name][1] += kept
        r["passes"] += 1
        r["steps"] += cost
        p += len(new)
        token = new[-1]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", required=True, help="a .json of replies: read if it exists, else generated there")
    ap.add_argument("--first", type=int, default=0, help="generating: from prompt FIRST of each suite")
    ap.add_argument("--limit", type=int, default=3, help="generating: up to prompt LIMIT (exclusive) of each suite")
    ap.add_argument("--tokens", type=int, default=512, help="generating: tokens per reply")
    ap.add_argument("--store", action="append", default=[],
                    help="a datastore .npz to replay with (repeatable; 'none' for prompt lookup alone; default: "
                         "none and the shipped drafter's)")
    ap.add_argument("--costs", default="1:1,2:1.095,3:1.15,4:1.18,8:1.45,16:2.35",
                    help="verify cost per width in decode steps (W:steps,...) or a `dflash profile --json` file "
                         "(default: `dflash profile --quantize auto --context 512` on the AMD EPYC Zen 4)")
    a = ap.parse_args()
    path = Path(a.replies)
    replies = json.loads(path.read_text()) if path.is_file() else make_replies(path, a.first, a.limit, a.tokens)
    costs = parse_costs(a.costs)
    if not a.store:
        from dflash_torch.registry import SHIPPED  # the shipped drafter's datastore

        a.store = ["none", str(SHIPPED / "smollm2-135m-instruct" / "datastore.npz")]
    print(f"{len(replies)} replies; verify costs in decode steps {costs}")
    for spec in a.store:
        try:
            store = None if spec == "none" else Datastore.load(spec)
        except ValueError as e:
            raise SystemExit(f"free_drafts_replay: {e}") from None
        rs = [replay(store, r["prompt"], r["reply"], costs) for r in replies]
        speed = [r["tokens"] / r["steps"] for r in rs]
        per_pass = sum(r["tokens"] for r in rs) / sum(r["passes"] for r in rs)
        ds = [sum(r["datastore"][i] for r in rs) for i in (0, 1)]
        lk = [sum(r["lookup"][i] for r in rs) for i in (0, 1)]
        print(f"{spec}: over target-only median {statistics.median(speed):.3f}x, geometric mean "
              f"{statistics.geometric_mean(speed):.3f}x; {per_pass:.3f} tokens per pass (after the first token); "
              f"lookup kept {lk[1]} of {lk[0]}, datastore {ds[1]} of {ds[0]}")


if __name__ == "__main__":
    main()
