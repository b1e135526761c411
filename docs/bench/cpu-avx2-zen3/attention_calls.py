"""One attention call at a draft's shapes (T queries of 9 heads, 3 kv heads, head size 64, over S keys): PyTorch's
scaled_dot_product_attention against kernels/attention.cpp's causal_attention tiles (full_attention runs the same
tiles), 2 threads, best of 3 rounds of 300 calls each, alternating.

    python docs/bench/cpu-avx2-zen3/attention_calls.py
"""

import time

import torch
import torch.nn.functional as F

from dflash_torch import kernels

kernels.ensure()
torch.set_num_threads(2)
print("T S: microseconds per call")
for t, s in [(2, 200), (3, 303), (4, 320), (16, 336)]:
    q, k, v = torch.randn(t, 9, 64), torch.randn(3, s, 64), torch.randn(3, s, 64)

    def sdpa(q=q, k=k, v=v):
        return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                              scale=0.125, enable_gqa=True)

    def tiles(q=q, k=k, v=v, t=t, s=s):
        return torch.ops.dflash.causal_attention(q, k, v, s - t, 0.125)

    best = {}
    for f in (sdpa, tiles):
        for _ in range(50):
            f()
    for _ in range(3):
        for f in (sdpa, tiles):
            t0 = time.perf_counter()
            for _ in range(300):
                f()
            us = (time.perf_counter() - t0) / 300 * 1e6
            best[f.__name__] = min(best.get(f.__name__, us), us)
    print(f"{t} {s}: sdpa {best['sdpa']:.1f}, tiles {best['tiles']:.1f}")
