"""Later turns of ShareGPT conversations as drafter-training prompts (a JSONL for `python -m dflash_torch.data
--prompts`): each line is a conversation up to its Nth user turn (`--turn N`, default 2), earlier assistant turns as
ShareGPT has them, so the target's reply continues a conversation rather than opening one. The first turns alone are
nearly used up by the shipped drafter's stages (9,428 of the train split's 9,475).

Left out: conversations whose first turn is in the held-out split (`data.heldout_key`, as the first-turn prompts
are split) and the multi-turn conversations `dflash bench --replay` and the long-context suite read first.

    python tools/sharegpt_turns.py --out runs/turn2.jsonl [--turn 2] [--max-chars 600] [--max-reply-chars 800]
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
    ap.add_argument("--max-reply-chars", type=int, default=800, help="longest earlier assistant turn")
    ap.add_argument("--turn", type=int, default=2, help="the user turn the prompt ends with (2 or later)")
    args = ap.parse_args()
    reserved = {c["id"].removeprefix("sharegpt:") for c in sharegpt_multiturn(REPLAY_RESERVE)}
    n = 0
    with open(args.out, "w") as f:
        for cid, turns in conversations():
            k = 2 * args.turn - 1  # user, assistant, ..., user
            roles = ["user", "assistant"] * (k // 2) + ["user"]
            if cid in reserved or len(turns) < k or [r for r, _ in turns[:k]] != roles:
                continue
            texts = [t.strip() for _, t in turns[:k]]
            limits = [args.max_chars if i % 2 == 0 else args.max_reply_chars for i in range(k)]
            if not all(texts) or heldout_key(texts[0]) or any(len(t) > m for t, m in zip(texts, limits)):
                continue
            msgs = [{"role": r, "content": t} for (r, _), t in zip(turns[:k], texts)]
            f.write(json.dumps({"messages": msgs}) + "\n")
            n += 1
    print(f"{n} prompts -> {args.out}")


if __name__ == "__main__":
    main()
