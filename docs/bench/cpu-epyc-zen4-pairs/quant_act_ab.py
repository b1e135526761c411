"""The activations' quantization alone (`torch.ops.dflash.quantize_act`, AVX2 path, one thread): a revision's
kernels against the working tree's, built side by side (tools/kernel_ab.py's build_old) and called in
alternation, best of 9 rounds. Both must give the same quants, scales and sums.

    python docs/bench/cpu-epyc-zen4-pairs/quant_act_ab.py REV
"""

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
import kernel_ab  # noqa: E402

from dflash_torch import kernels  # noqa: E402

kernels.ensure()
block_mm = kernel_ab.build_old(sys.argv[1])  # torch.ops.<its namespace>.block_mm
old = getattr(torch.ops, block_mm._qualified_op_name.split("::")[0]).quantize_act
new = torch.ops.dflash.quantize_act
torch.set_num_threads(1)
print("one thread; us per call (a call's own overhead, ~3 us, included), old -> new (ratio), best of 9 rounds")
for k in (576, 1536):
    for m in (1, 4, 64):
        x = torch.randn(m, k)
        for a, b in zip(old(x, 1), new(x, 1)):
            assert torch.equal(a, b), "the two builds quantize differently"
        reps = max(20, 20000 // m)
        t = {"old": [], "new": []}
        for _ in range(9):
            for key, op in (("old", old), ("new", new)):
                t0 = time.perf_counter()
                for _ in range(reps):
                    op(x, 1)
                t[key].append((time.perf_counter() - t0) / reps)
        a, b = min(t["old"]) * 1e6, min(t["new"]) * 1e6
        print(f"K={k} M={m}: {a:.2f} -> {b:.2f} us ({b / a:.2f})", flush=True)
