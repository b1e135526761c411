"""The drafter's layers in one call (kernels/draft.cpp, `draft_stack`) against the scripted FlatDraft.

Loads the default model and drafter as `--quantize q4_0` does, checks that a draft pass gives the same
logits and cache with `drafter.native` on and off, then times steady-state draft passes (a handful of new
context features after a 128-token context, over the draft vocabulary as a greedy cycle drafts), the two
paths in alternating rounds: medians and minima per pass (docs/performance.md, "The drafter quantized
with the target").

    python tools/probes/native_draft_probe.py [--widths 2,4,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch.generate import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", default="q4_0")
    p.add_argument("--widths", default="2,4,16")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load(None, "auto", "cpu", "float32", quantize=args.quantize, quiet=True)
    target, drafter = pipe.target, pipe.drafter
    ctx = 128
    prompt = torch.randint(0, target.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(0))
    full = drafter.draft_vocab is None
    print(f"threads {args.threads}, torch {torch.__version__}, --quantize {args.quantize}; ms per draft pass")
    with torch.inference_mode():
        out = target(prompt, target.new_cache(ctx + 1), logits="last", taps=drafter.target_layer_ids)
        for width in [int(w) for w in args.widths.split(",")]:
            dcache = drafter.new_cache(ctx + width + 1)
            block = torch.full((1, width), drafter.mask_token_id)
            drafter.propose(target, block, out.hidden, dcache)
            steady, seen = out.hidden[:, :4], dcache.length
            got = []
            for native in (False, True):
                drafter.native = native
                dcache.crop(seen - 4)
                logits = drafter.propose(target, block, steady, dcache, full=full)
                end = seen + width
                got.append((logits, dcache.k[:, :, :, :end].clone(), dcache.v[:, :, :, :end].clone()))
            same = all(torch.equal(a, b) for a, b in zip(*got))
            times: dict = {False: [], True: []}
            for _ in range(args.rounds):
                for native in (False, True):
                    drafter.native = native
                    t0 = time.perf_counter()
                    for _ in range(10):
                        dcache.crop(seen - 4)
                        drafter.propose(target, block, steady, dcache, full=full)
                    times[native].append((time.perf_counter() - t0) / 10 * 1e3)
            a, b = statistics.median(times[False]), statistics.median(times[True])
            print(f"width {width:2d}: same bits {same}; FlatDraft, scripted {a:.3f} (min {min(times[False]):.3f}), "
                  f"one call {b:.3f} (min {min(times[True]):.3f}): {b / a - 1:+.1%}")
        drafter.native = True  # the default


if __name__ == "__main__":
    main()
