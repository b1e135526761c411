"""Draft passes with and without the shipped drafter's draft vocabulary (docs/performance.md).

Loads the embedded default model and its drafter, then times draft passes of each width after a
128-token context (steady state: a few new context features, as in a running loop), with the LM head's
draft-vocabulary rows and with the whole head, taking the two in turn pass by pass so that both see
the same machine load. It also counts how often the two pick the same draft token.

    python tools/probes/draft_vocab_probe.py --quantize int4
    python tools/probes/draft_vocab_probe.py --quantize auto    # int4 layers, int8 LM head
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch.generate import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", default="int4", choices=["auto", "int8", "int4", "none"])
    p.add_argument("--sizes", default="2,4,8,16", help="draft block widths")
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load(None, "auto", "cpu", "float32", quantize=None if args.quantize == "none" else args.quantize,
                quiet=True)
    target, drafter = pipe.target, pipe.drafter
    vocab = drafter.draft_vocab
    if vocab is None:
        raise SystemExit("the drafter has no draft vocabulary (draft_vocab.json)")
    print(f"quantize {args.quantize} (LM head {pipe.lm_head or 'float32'}), draft vocabulary {len(vocab)} of "
          f"{target.config.vocab_size} tokens, threads {args.threads}")
    ids = torch.randint(0, target.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = target.new_cache(256)
        feats = target(ids, cache, logits="last", taps=drafter.target_layer_ids).hidden  # [1, 128, F]
        for width in [int(s) for s in args.sizes.split(",")]:
            dcache = drafter.new_cache(128 + width + 1)
            block = torch.full((1, width), drafter.mask_token_id, dtype=torch.long)
            block[0, 0] = ids[0, -1]
            drafter.propose(target, block, feats[:, :124], dcache)  # the context, cached once
            times, picks = {"draft vocabulary": [], "whole head": []}, {}
            for i in range(2 * (args.repeats + 5)):
                name = "draft vocabulary" if i % 2 == 0 else "whole head"
                drafter.draft_vocab = vocab if i % 2 == 0 else None  # the built sub-head stays (same vocabulary)
                dcache.crop(124)
                t0 = time.perf_counter()
                logits = drafter.propose(target, block, feats[:, 124:], dcache)
                token = logits.argmax(-1)
                dt = time.perf_counter() - t0
                if i >= 10:
                    times[name].append(dt)
                picks[name] = token
            drafter.draft_vocab = vocab
            same = int((picks["draft vocabulary"] == picks["whole head"]).sum())
            ms = ", ".join(f"{k} {statistics.median(v) * 1e3:.2f} ms" for k, v in times.items())
            print(f"width {width:2d}: {ms}; same draft tokens {same} of {width - 1}")


if __name__ == "__main__":
    main()
