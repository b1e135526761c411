"""Passes of the default model, R rows after C cached positions, alternating 5 at a time between values of an
environment variable the C++ reads on every pass (DFLASH_ROWS_BY_THREAD), in one process:

    python docs/bench/cpu-epyc-zen4-direct/rows_ab.py DFLASH_ROWS_BY_THREAD 0,9 8,9,12,16 128 30 [q4_0|auto]

Prints the decode step first, then per row count the median pass under each value, their ratio, the quartiles of
the ratios pair by pair, and whether the logits were the same.
"""
import os, sys, time, statistics, torch
os.environ.setdefault("DFLASH_ROWS_BY_THREAD", "0")
from dflash_torch.generate import load
var, vals, rows_s, ctx, rounds = sys.argv[1], sys.argv[2].split(","), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
target = load(None, None, "auto", "auto", quantize=sys.argv[6] if len(sys.argv) > 6 else "q4_0").target
gen = torch.Generator().manual_seed(0)
prompt = torch.randint(0, target.config.vocab_size, (1, ctx), generator=gen)
os.environ[var] = vals[0]
with torch.inference_mode():
    c1 = target.new_cache(ctx + 1); target(prompt, c1, logits="last")
    t0 = time.perf_counter()
    for _ in range(50): c1.crop(ctx); target(prompt[:, :1], c1, logits="last")
    dec = (time.perf_counter() - t0) / 50
print(f"decode {dec*1e3:.2f} ms", flush=True)
for rows in (int(r) for r in rows_s.split(",")):
    cache = target.new_cache(ctx + rows)
    block = torch.randint(0, target.config.vocab_size, (1, rows), generator=gen)
    times = {v: [] for v in vals}; logits = {}; kv = {}
    with torch.inference_mode():
        target(prompt, cache, logits="last")
        for _ in range(rounds):
            for v in vals:
                os.environ[var] = v
                t0 = time.perf_counter()
                for _ in range(5):
                    cache.crop(ctx)
                    out = target(block, cache, logits="all")
                times[v].append((time.perf_counter() - t0) / 5)
                logits[v] = out.logits.clone()
    med = {v: statistics.median(times[v]) for v in vals}
    q = statistics.quantiles([b / a for a, b in zip(times[vals[0]], times[vals[1]])], n=4)
    print(f"rows {rows} after {ctx}: " + ", ".join(f"{var}={v} {med[v]*1e3:.2f} ms" for v in vals) +
          f"; ratio {med[vals[1]]/med[vals[0]]:.3f} (q1-q3 {q[0]:.3f}-{q[2]:.3f}); same logits {all(torch.equal(logits[vals[0]], logits[v]) for v in vals)}", flush=True)
