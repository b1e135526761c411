"""The one-call decoder stack (kernels/layers.cpp) against the scripted flat layers: bits and time per pass.

Loads the embedded default model on the block kernels, checks that logits, tap features and cache of a
decode step and of wider passes are bit-identical with `Model.native` on and off, then times passes of
each width after a 128-token context, the two paths in alternating rounds (so that the machine's drift
falls on both alike): medians and minima (docs/performance.md, "The decoder layers in one call").

    python tools/probes/native_probe.py --quantize q4_0
    python tools/probes/native_probe.py --quantize auto     # the GGUF file's own Q4_1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch.generate import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", default="q4_0", choices=["auto", "q4_0", "q4_1", "q8_0"])
    p.add_argument("--sizes", default="1,4,16", help="tokens per pass (1 = a decode step)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load(None, "auto", "cpu", "float32", quantize=args.quantize, quiet=True)
    target, taps = pipe.target, pipe.drafter.target_layer_ids
    ctx = 128
    ids = torch.randint(0, target.config.vocab_size, (1, ctx + max(int(s) for s in args.sizes.split(","))),
                        generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(ids.shape[1] + 1)
    print(f"threads {args.threads}, torch {torch.__version__}, context {ctx}")
    with torch.inference_mode():
        target(ids[:, :ctx], cache, taps=taps)
        for width in [int(s) for s in args.sizes.split(",")]:
            block = ids[:, ctx : ctx + width]
            outs = []
            for native in (False, True):
                target.native = native
                cache.crop(ctx)
                out = target(block, cache, logits="all", taps=taps)
                outs.append((out.logits, out.hidden, cache.k[:, :, :, : ctx + width].clone(),
                             cache.v[:, :, :, : ctx + width].clone()))
            same = all(torch.equal(a, b) for a, b in zip(*outs))
            times: dict = {False: [], True: []}
            for _ in range(args.rounds):
                for native in (False, True):
                    target.native = native
                    t0 = time.perf_counter()
                    for _ in range(5):
                        cache.crop(ctx)
                        target(block, cache, logits="all", taps=taps)
                    times[native].append((time.perf_counter() - t0) / 5 * 1e3)
            old, new = statistics.median(times[False]), statistics.median(times[True])
            print(f"tokens {width:2d}: same bits {same}; flat, scripted {old:6.2f} ms (min {min(times[False]):.2f}), "
                  f"one call {new:6.2f} ms (min {min(times[True]):.2f}): {new / old - 1:+.1%}")
        target.native = True  # the default


if __name__ == "__main__":
    main()
