"""How much of the context the drafter should attend to: acceptance by context length, whole context
against windows (`DFlashDrafter.set_window`). The drafter alone proposes (no prompt lookup, fixed block
16, greedy, int4 weights as `dflash generate` loads the default model), over held-out prompts (two per
kind) and 1,024 new tokens each. Prints each prompt's acceptance length and, per window, the drafted
tokens kept per cycle by the context length at which the cycle ran.

    python tools/probes/draft_window_probe.py                     # whole context, then 512, 256, 128 (64 sinks)
    python tools/probes/draft_window_probe.py --windows 0,256 --sinks 4
"""

from __future__ import annotations

import argparse

import torch

from dflash_torch import data
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default="0,512,256,128", help="window sizes to compare (0: the whole context)")
    ap.add_argument("--sinks", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--per-kind", type=int, default=2, help="held-out prompts per kind (chat, code, math)")
    ap.add_argument("--segment", type=int, default=256, help="context lengths grouped in steps of this many")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load(quantize="int4", quiet=True, draft_window=0)
    prompts = [(kind, chat) for kind, chats in data.heldout_prompts(*[args.per_kind] * 3).items() for chat in chats]
    table = {}
    for window in [int(w) for w in args.windows.split(",")]:
        pipe.drafter.set_window(window or None, args.sinks)
        name = "whole context" if not window else f"window {window}, sinks {args.sinks}"
        segments, lengths = {}, []
        for kind, chat in prompts:
            ids = pipe.encode_messages(chat)
            stats, cycles, n = Stats(), [], len(ids)
            record = stats.record_cycle

            def log(drafted, accepted, committed, stats=stats, cycles=cycles, record=record, n=n):
                cycles.append((n + stats.generated_tokens, accepted))  # the context this cycle ran at
                record(drafted, accepted, committed)

            stats.record_cycle = log
            with torch.inference_mode():
                for _ in generate_tokens(pipe.target, ids, max_new_tokens=args.tokens, drafter=pipe.drafter,
                                         block_size=16, stop_token_ids=[], stats=stats, lookup=False):
                    pass
            for context, accepted in cycles:
                s = segments.setdefault(context // args.segment, [0, 0])
                s[0], s[1] = s[0] + accepted, s[1] + 1
            lengths.append(stats.acceptance_length_mean)
            print(f"{name}: {kind} prompt of {len(ids)} tokens: acceptance length "
                  f"{stats.acceptance_length_mean:.3f}", flush=True)
        table[name] = (sum(lengths) / len(lengths), segments)
    print()
    keys = sorted({k for _, segs in table.values() for k in segs})
    print("| drafter attends to | mean acceptance length | " + " | ".join(
        f"context {k * args.segment}-{(k + 1) * args.segment}" for k in keys) + " |")
    print("|---|--:|" + "--:|" * len(keys))
    for name, (mean, segs) in table.items():
        cells = [f"{segs[k][0] / segs[k][1]:.3f}" if k in segs else "" for k in keys]
        print(f"| {name} | {mean:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
