"""Later turns of ShareGPT conversations as drafter-training prompts (a JSONL for `python -m dflash_torch.data
--prompts`): each line is a conversation's first user turn, its first assistant turn as ShareGPT has it, and its
second user turn, so the target's reply continues a conversation rather than opening one. The first turns alone are
nearly used up by the shipped drafter's stages (9,428 of the train split's 9,475).

Left out: conversations whose first turn is in the held-out split (`data.heldout_key`, as the first-turn prompts
are split) and the multi-turn conversations `dflash bench --replay` and the long-context suite read first.

    python tools/sharegpt_turns.py --out runs/turn2.jsonl [--max-chars 600] [--max-reply-chars 800]
"""

from __future__ import annotations

import argparse
import json

from dflash_torch.bench_longctx import conversations, sharegpt_multiturn
from dflash_torch.data import heldout_key

REPLAY_RESERVE = 16  # the first multi-turn conversations, kept for the replay bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-chars", type=int, default=600, help="longest user turn")
    ap.add_argument("--max-reply-chars", type=int, default=800, help="longest first assistant turn")
    args = ap.parse_args()
    reserved = {c["id"].removeprefix("sharegpt:") for c in sharegpt_multiturn(REPLAY_RESERVE)}
    n = 0
    with open(args.out, "w") as f:
        for cid, turns in conversations():
            if cid in reserved or len(turns) < 3 or [r for r, _ in turns[:3]] != ["user", "assistant", "user"]:
                continue
            (_, u1), (_, a1), (_, u2) = turns[:3]
            u1, a1, u2 = u1.strip(), a1.strip(), u2.strip()
            if (not (u1 and a1 and u2) or heldout_key(u1) or max(len(u1), len(u2)) > args.max_chars
                    or len(a1) > args.max_reply_chars):
                continue
            msgs = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
                    {"role": "user", "content": u2}]
            f.write(json.dumps({"messages": msgs}) + "\n")
            n += 1
    print(f"{n} prompts -> {args.out}")


if __name__ == "__main__":
    main()
