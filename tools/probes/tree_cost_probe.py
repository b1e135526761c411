"""What a verify pass over a tree costs against one over a chain of the same width, in decode steps, on the
weights `dflash generate` runs (`--quantize auto`): each width's tree is the one the loop would draft from the
rank frequencies given (`trees.best_shape`; by default those measured by tools/probes/tree_probe.py for the
shipped drafter), after `--context` positions, logits on every row and the drafter's taps, median of `--repeats`.

    python tools/probes/tree_cost_probe.py --context 300 --repeats 25
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch.decoding import trees
from dflash_torch.generate import load

# tools/probes/tree_probe.py, the shipped drafter on 12 held-out prompts (positions 1-4, ranks 0-7)
FREQ = [[0.380, 0.141, 0.064, 0.037, 0.028, 0.018, 0.020, 0.014],
        [0.215, 0.101, 0.074, 0.045, 0.034, 0.026, 0.019, 0.020],
        [0.130, 0.079, 0.069, 0.047, 0.040, 0.029, 0.030, 0.023],
        [0.102, 0.073, 0.058, 0.046, 0.039, 0.042, 0.026, 0.022]]


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--widths", default="2,3,4,6,8,12,16")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    p = load(quantize=args.quantize, quiet=True)
    target, taps = p.target, p.drafter.target_layer_ids
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (1, args.context), generator=gen)
    cache = target.new_cache(args.context + 40)
    target(prompt, cache, logits=None)

    def once(block: torch.Tensor, **kw) -> float:
        cache.crop(args.context)
        t0 = time.perf_counter()
        target(block, cache, logits="all", taps=taps, **kw)
        return time.perf_counter() - t0

    print(f"context {args.context}, {torch.get_num_threads()} threads; ms (decode steps), medians over rounds "
          "that run the three passes in turn")
    for w in (int(x) for x in args.widths.split(",")):
        shape = trees.best_shape(FREQ, w - 1)
        block = torch.randint(0, target.config.vocab_size, (1, w), generator=gen)
        kinds = {"decode": (block[:, :1], {}), "chain": (block, {}), "tree": (block, {"parents": shape.parents})}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.repeats + 5):  # the first 5 warm up
            for name, (b, kw) in kinds.items():
                t = once(b, **kw)
                if r >= 5:
                    times[name].append(t)
        decode, chain, tree = (statistics.median(times[k]) for k in kinds)
        chain_rows = 1  # rows attending as a chain (the kernel's batched path); the rest one by one
        while chain_rows < w and shape.parents[chain_rows] == chain_rows - 1:
            chain_rows += 1
        print(f"width {w:2d}: decode {decode * 1e3:6.2f}  chain {chain * 1e3:6.2f} ({chain / decode:.2f})  "
              f"tree {tree * 1e3:6.2f} ({tree / decode:.2f})  side rows {w - chain_rows}, depth {shape.depth}",
              flush=True)


if __name__ == "__main__":
    main()
