"""Decode steps of the default model after C positions, alternating 20 at a time between two values of an environment
variable in one process, for a build whose C++ reads that variable on every call (an experiment's patch here):

    python docs/bench/cpu-epyc-zen4-headroom/switch_ab.py VAR A,B CONTEXTS ROUNDS
    # tiles_prefetch.patch: switch_ab.py DFLASH_TPF 0,1 150,300,450 40
    # decode_split.patch:   switch_ab.py DFLASH_DSPLIT 512,128 130,200,300,400,500 40

Prints the median step under each value, their ratio (B over A), the quartiles of the ratios pair by pair, and
whether the two gave the same logits.
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
    var, values, contexts, rounds = sys.argv[1], sys.argv[2].split(","), sys.argv[3], int(sys.argv[4])
    va, vb = values
    for context in (int(c) for c in contexts.split(",")):
        prompt = torch.randint(0, target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
        cache = target.new_cache(context + 4)
        with torch.inference_mode():
            target(prompt, cache, logits="last")
            times: dict[str, list[float]] = {va: [], vb: []}
            outs = {}
            for _ in range(rounds):
                for v in (va, vb):
                    os.environ[var] = v
                    t0 = time.perf_counter()
                    for _ in range(20):
                        cache.crop(context)
                        o = target(prompt[:, :1], cache, logits="last")
                    times[v].append((time.perf_counter() - t0) / 20)
                    outs[v] = o.logits.clone()
        a, b = statistics.median(times[va]), statistics.median(times[vb])
        pairs = sorted(y / x for x, y in zip(times[va], times[vb]))
        q = [pairs[len(pairs) * i // 4] for i in (1, 2, 3)]
        print(f"context {context}: decode step {var}={va} {a * 1e3:.3f} ms, {var}={vb} {b * 1e3:.3f} ms, ratio of "
              f"medians {b / a:.3f}, pairwise quartiles {q[0]:.3f}/{q[1]:.3f}/{q[2]:.3f}, same logits "
              f"{torch.equal(outs[va], outs[vb])}", flush=True)


if __name__ == "__main__":
    main()
