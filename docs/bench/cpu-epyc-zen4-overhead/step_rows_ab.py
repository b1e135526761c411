# passes of several rows through Model.forward (logits all, taps), row counts alternating; the stack timed inside.
# usage: python step_rows_ab.py CONTEXTS ROWS   (run from a checkout's root)
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from dflash_torch.generate import load

torch.set_num_threads(2)
p = load(draft="auto", quantize="auto", quiet=True)
t = p.target
taps = list(p.drafter.target_layer_ids)
real = torch.ops.dflash.decoder_stack
inner = []


class Wrap:
    def __call__(self, *a):
        t0 = time.perf_counter()
        r = real(*a)
        inner.append(time.perf_counter() - t0)
        return r


torch.ops.dflash.decoder_stack = Wrap()
ROWS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 3, 4, 8]
with torch.inference_mode():
    for n in [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "300").split(",")]:
        cache = t.new_cache(n + 20)
        t(torch.randint(0, t.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)), cache, logits=None)
        T = {r: [] for r in ROWS}
        S = {r: [] for r in ROWS}
        for _it in range(200):
            for rows in ROWS:
                blk = torch.tensor([[1234] * rows])
                cache.crop(n)
                inner.clear()
                t0 = time.perf_counter()
                out = t(blk, cache, logits="all", taps=taps)
                T[rows].append(time.perf_counter() - t0)
                S[rows].append(inner[-1])
        d = statistics.median(T[1])
        s = statistics.median(S[1])
        parts = []
        for r in ROWS:
            fwd, stk = statistics.median(T[r]), statistics.median(S[r])
            parts.append(f"{r} rows fwd {fwd * 1e3:.2f} ({fwd / d:.3f}) stack {stk * 1e3:.2f} ({stk / s:.3f})")
        print(f"context {n}: " + "; ".join(parts), flush=True)
