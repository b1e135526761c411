"""The KV cache in float16 against float32 (block-format targets): decode-step time by context length.

Loads the embedded default model as `dflash serve` runs it (`--quantize auto`: the file's Q4_1 blocks),
fills one cache of each dtype with the same 2,048-token context, then times decode steps at several
context lengths, the two caches in alternating rounds (so that the machine's drift falls on both alike):
minima and medians per step (docs/performance.md, "The KV cache in float16"). --rows N times passes of N
positions instead (a verify pass of N rows).

    python tools/probes/kv_cache_probe.py [--contexts 64,512,1024,2048] [--rounds 10] [--rows 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch.generate import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", default="auto")
    p.add_argument("--contexts", default="64,512,1024,2048")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=1, help="positions per pass (default 1: a decode step)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    target = load(None, None, "cpu", "float32", quantize=args.quantize, quiet=True).target
    if getattr(target, "cache_dtype", None) is None:
        raise SystemExit(f"--quantize {args.quantize}: this target keeps no float16 cache")
    n = args.rows
    ids = torch.randint(0, target.config.vocab_size, (1, max(contexts) + n), generator=torch.Generator().manual_seed(0))
    caches, kept = {}, target.cache_dtype
    with torch.inference_mode():
        for dtype in (torch.float32, kept):
            target.cache_dtype = None if dtype == torch.float32 else dtype
            caches[dtype] = target.new_cache(max(contexts) + n + 1)
            target(ids[:, : max(contexts)], caches[dtype])
        target.cache_dtype = kept
        times: dict = {}
        for _ in range(args.rounds):
            for ctx in contexts:
                for dtype, cache in caches.items():
                    t0 = time.perf_counter()
                    for _ in range(5):
                        cache.crop(ctx)
                        target(ids[:, ctx : ctx + n], cache, logits="all" if n > 1 else "last")
                    times.setdefault((ctx, dtype), []).append((time.perf_counter() - t0) / 5 * 1e3)
    print(f"threads {args.threads}, torch {torch.__version__}, --quantize {args.quantize}; ms per pass of {n} "
          f"position{'s' if n > 1 else ''}")
    print(f"{'context':>8} {'float32 min':>12} {'median':>7} {'float16 min':>12} {'median':>7} {'change':>7}")
    for ctx in contexts:
        a, b = times[(ctx, torch.float32)], times[(ctx, kept)]
        print(f"{ctx:8d} {min(a):12.2f} {statistics.median(a):7.2f} {min(b):12.2f} {statistics.median(b):7.2f} "
              f"{statistics.median(b) / statistics.median(a) - 1:+7.1%}")


if __name__ == "__main__":
    main()
