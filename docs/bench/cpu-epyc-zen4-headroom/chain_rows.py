"""In-cache time of the block matmul at 8 and 16 rows (one thread, one 1536 x 576 matrix called again and again),
for comparing builds or switches in alternating processes (chain1.patch: DFLASH_CHAIN1=1 against unset)."""

from __future__ import annotations

import os
import time

import torch

from dflash_torch import kernels
from dflash_torch.kernels import pack

kernels.ensure()
torch.set_num_threads(1)
n, k = 1536, 576
gen = torch.Generator().manual_seed(0)
w = torch.randn(n, k, generator=gen)
cells = []
for fmt in ("q4_0", "q4_1", "q8_0"):
    packed = pack.pack(pack.quantize(w, fmt), fmt)
    code = pack.FORMATS.index(fmt)
    for m in (8, 16):
        x = torch.randn(m, k, generator=gen)
        for _ in range(20):
            torch.ops.dflash.block_mm(x, packed, code, n, -1)
        best = float("inf")
        for _ in range(9):
            t0 = time.perf_counter()
            for _ in range(200):
                torch.ops.dflash.block_mm(x, packed, code, n, -1)
            best = min(best, (time.perf_counter() - t0) / 200)
        cells.append(f"{fmt} M{m} {best * 1e6:.1f}")
print(f"DFLASH_CHAIN1={os.environ.get('DFLASH_CHAIN1', '')!r:5}", " | ".join(cells), flush=True)
