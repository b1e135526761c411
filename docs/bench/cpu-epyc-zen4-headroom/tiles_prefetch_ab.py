"""Decode steps of the default model after C positions, alternating 20 at a time between DFLASH_TPF=0 and 1 in one
process (tiles_prefetch.patch reads the switch on every call): the tiles' prefetch of the next block of keys and
values, as the split has it, against none. With the patch applied:

    python docs/bench/cpu-epyc-zen4-headroom/tiles_prefetch_ab.py 150,300,450 40
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from dflash_torch.generate import load


def main() -> None:
    target = load(None, None, "auto", "auto", quantize="auto").target
    torch.set_grad_enabled(False)
    for context in (int(c) for c in sys.argv[1].split(",")):
        prompt = torch.randint(0, target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
        cache = target.new_cache(context + 4)
        with torch.inference_mode():
            target(prompt, cache, logits="last")
            times: dict[str, list[float]] = {"0": [], "1": []}
            outs = {}
            for _ in range(int(sys.argv[2])):
                for v in ("0", "1"):
                    os.environ["DFLASH_TPF"] = v
                    t0 = time.perf_counter()
                    for _ in range(20):
                        cache.crop(context)
                        o = target(prompt[:, :1], cache, logits="last")
                    times[v].append((time.perf_counter() - t0) / 20)
                    outs[v] = o.logits.clone()
        a, b = statistics.median(times["0"]), statistics.median(times["1"])
        pairs = sorted(y / x for x, y in zip(times["0"], times["1"]))
        q = [pairs[len(pairs) * i // 4] for i in (1, 2, 3)]
        print(f"context {context}: decode step {a * 1e3:.3f} ms, with the tiles' prefetch {b * 1e3:.3f} ms, ratio of "
              f"medians {b / a:.3f}, pairwise quartiles {q[0]:.3f}/{q[1]:.3f}/{q[2]:.3f}, same logits "
              f"{torch.equal(outs['0'], outs['1'])}", flush=True)


if __name__ == "__main__":
    main()
