"""The block matmul's two VNNI layouts on a CPU that takes the 256-bit one for a few rows (AMD Zen 4, `vnni_min_rows`
in kernels/blocks.cpp): the dispatch's choice (`isa=-1`: 8 columns a vector, one weight stream per thread) against
the 512-bit path named (`isa=2`: 16 columns a vector from two column groups read side by side), with the weights in
cache (one copy, called again and again) and from memory (copies cycled through `--mb` MB, past the L3), in
alternating rounds in one process. Prints microseconds per call (best of the rounds) and wide / narrow.

    python tools/probes/wide_narrow_probe.py [--threads 1,2] [--rows 1,2,4] [--mb 96]

Needs the block kernels' VNNI path (AVX-512 VNNI).
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_torch import kernels
from dflash_torch.kernels import pack

CELLS = [("gate 1536x576", 1536, 576, "q4_1"), ("down 576x1536", 576, 1536, "q4_1"), ("qkv-like 1536x576", 1536, 576,
         "q8_0"), ("lm_head 49152x576", 49152, 576, "q8_0")]


def best_call(fn, weights: list, reps: int) -> float:
    """Seconds per call of fn(w) over `reps` calls cycling through `weights`."""
    t0 = time.perf_counter()
    for r in range(reps):
        fn(weights[r % len(weights)])
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--mb", type=int, default=96, help="MB of weight copies cycled 'from memory'")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    kernels.ensure()
    if kernels.best_isa() not in ("vnni", "amx"):
        raise SystemExit("wide_narrow_probe: this CPU has no VNNI path")
    print(f"narrow rows below {kernels.narrow_rows()} (0: this CPU takes the 512-bit path at every row count)")
    print(f"{'threads':>7} {'matrix':>18} {'fmt':>5} {'M':>2} {'where':>7} {'narrow us':>10} {'wide us':>8} "
          f"{'wide/narrow':>11}")
    gen = torch.Generator().manual_seed(0)
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        for name, n, k, fmt in CELLS:
            w = torch.randn(n, k, generator=gen)
            packed = pack.pack(pack.quantize(w, fmt), fmt)
            code = pack.FORMATS.index(fmt)
            copies = max(2, a.mb * 10**6 // packed.numel())
            places = {"cache": [packed], "memory": [packed.clone() for _ in range(copies)]}
            for m in (int(r) for r in a.rows.split(",")):
                x = torch.randn(m, k, generator=gen)
                for where, ws in places.items():
                    reps = max(3 * len(ws), 200 if n * k < 10**7 else 20)
                    t = {-1: float("inf"), 2: float("inf")}
                    for _ in range(a.rounds):
                        for isa in t:
                            def fn(wt, x=x, code=code, n=n, isa=isa):
                                return torch.ops.dflash.block_mm(x, wt, code, n, isa)

                            t[isa] = min(t[isa], best_call(fn, ws, reps))
                    print(f"{threads:>7} {name:>18} {fmt:>5} {m:>2} {where:>7} {t[-1] * 1e6:10.1f} {t[2] * 1e6:8.1f} "
                          f"{t[2] / t[-1]:11.2f}", flush=True)


if __name__ == "__main__":
    main()
