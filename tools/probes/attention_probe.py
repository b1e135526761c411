"""Two ways to make long-context attention cheaper for quantized targets, and why neither is used.
(docs/performance.md, "Long contexts")

1. A bfloat16 KV cache would halve the bytes read per step: times 30 layers of one-query attention
   (this model's shapes: 9 query heads over 3 kv heads, head dim 64) and a 16-query verify done one
   query at a time, in float32 and bfloat16.
2. One batched attention pass for all queries of a verify would read the cache once: checks whether a
   float32 matmul gives a row the same bits when other rows are computed with it (it must, for a
   batched verify to reproduce decode steps exactly).

    python tools/probes/attention_probe.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def _time_us(fn, n: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    for keys in (128, 1000, 2000):
        for dtype in (torch.float32, torch.bfloat16):
            k = torch.randn(30, 1, 3, keys + 40, 64, generator=g).to(dtype)  # [L, B, Hkv, S, D]
            v = torch.randn(30, 1, 3, keys + 40, 64, generator=g).to(dtype)
            q = torch.randn(1, 9, 1, 64, generator=g).to(dtype)

            def attend(i, end, k=k, v=v, q=q):
                F.scaled_dot_product_attention(q, k[i][:, :, :end], v[i][:, :, :end], scale=0.125, enable_gqa=True)

            def decode(keys=keys):
                for i in range(30):
                    attend(i, keys)

            def verify(keys=keys):
                for i in range(30):
                    for j in range(16):
                        attend(i, keys - 15 + j)

            name = str(dtype).removeprefix("torch.")
            print(f"keys {keys:4d} {name:8s}: decode (30 layers) {_time_us(decode, 30):7.0f} us,"
                  f" verify 16 one query at a time {_time_us(verify, 5):8.0f} us")
    differ, worst, total = 0, 0.0, 0
    for keys in (64, 128, 192, 512, 1024, 1088, 2048):
        for rows in (6, 12, 48, 96):
            q = torch.randn(3, rows, 64, generator=g)
            k = torch.randn(3, keys, 64, generator=g)
            together = q @ k.transpose(-1, -2)
            alone = q[:, :3] @ k.transpose(-1, -2)
            total += 1
            if not torch.equal(alone, together[:, :3]):
                differ += 1
                worst = max(worst, (alone - together[:, :3]).abs().max().item())
    print(f"scores of the first 3 rows computed alone vs with the others: {differ} of {total} shapes differ "
          f"(largest difference {worst:.1e})")


if __name__ == "__main__":
    main()
