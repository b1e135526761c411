# prefetch_next.patch applied: decode steps with the switch off and in each mode, alternating call by call.
# usage: python prefetch_next_ab.py CONTEXTS MODE:LIMIT,...   (mode 1: o, 2: gate/up, 3: both)
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from dflash_torch.generate import load

torch.set_num_threads(2)
p = load(draft=None, quantize="auto", quiet=True)
t = p.target
modes = [(0, 1 << 30)] + [tuple(map(int, m.split(":"))) for m in sys.argv[2].split(",")]
with torch.inference_mode():
    for n in [int(x) for x in sys.argv[1].split(",")]:
        cache = t.new_cache(n + 8)
        t(torch.randint(0, t.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)), cache, logits=None)
        R = {m: [] for m in modes}
        for it in range(300):
            for m in modes if it % 2 else modes[::-1]:
                torch.ops.dflash.set_prefetch_next(*m)
                cache.crop(n)
                t0 = time.perf_counter()
                t(torch.tensor([[1234]]), cache, logits="last")
                R[m].append(time.perf_counter() - t0)
        b = statistics.median(R[modes[0]])
        print(
            f"context {n}: off {b * 1e6:.1f} us; "
            + "; ".join(f"{m} {statistics.median(R[m]) / b:.3f}" for m in modes[1:]),
            flush=True,
        )
