"""Verify passes of the default model (R rows after C cached positions), alternating 5 at a time between two
values of an environment variable in one process, for a build whose C++ reads that variable on every call
(an experiment's patch here):

    python docs/bench/cpu-avx2-zen3/verify_ab.py VAR A,B ROWS CONTEXT ROUNDS [--quantize q4_0]
    # avx2_rows_per_call.patch: verify_ab.py DFLASH_AVX2_ROWS 64,8 6,9,12,16,32 128 30

Prints per row count the median pass under each value, their ratio (B over A), the quartiles of the ratios
pair by pair, and whether the two gave the same logits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dflash_torch.generate import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("var")
    ap.add_argument("values")
    ap.add_argument("rows")
    ap.add_argument("context", type=int)
    ap.add_argument("rounds", type=int)
    ap.add_argument("--quantize", default="q4_0")
    args = ap.parse_args()
    va, vb = args.values.split(",")
    target = load(None, None, "auto", "auto", quantize=args.quantize).target
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (1, args.context), generator=gen)
    for rows in (int(r) for r in args.rows.split(",")):
        cache = target.new_cache(args.context + rows)
        block = torch.randint(0, target.config.vocab_size, (1, rows), generator=gen)
        times: dict[str, list[float]] = {va: [], vb: []}
        logits = {}
        with torch.inference_mode():
            target(prompt, cache, logits="last")
            for _ in range(args.rounds):
                for v in (va, vb):
                    os.environ[args.var] = v
                    t0 = time.perf_counter()
                    for _ in range(5):
                        cache.crop(args.context)
                        out = target(block, cache, logits="all")
                    times[v].append((time.perf_counter() - t0) / 5)
                    logits[v] = out.logits
        ma, mb = statistics.median(times[va]), statistics.median(times[vb])
        q = statistics.quantiles([b / a for a, b in zip(times[va], times[vb])], n=4)
        print(f"rows {rows} after {args.context}: {args.var}={va} {ma * 1e3:.2f} ms, {args.var}={vb} "
              f"{mb * 1e3:.2f} ms, ratio {mb / ma:.3f} (pairs q1-q3 {q[0]:.3f}-{q[2]:.3f}), same logits "
              f"{torch.equal(logits[va], logits[vb])}", flush=True)


if __name__ == "__main__":
    main()
