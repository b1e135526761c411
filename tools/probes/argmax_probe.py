"""Row-wise argmax of vocabulary-wide float32 logits: PyTorch's CPU kernel against argmax.cpp
(`kernels.argmax`), 1 and 16 rows of 49,152 (the default model's vocabulary), same indices checked.

    python tools/probes/argmax_probe.py [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def best(fn, reps: int = 200, rounds: int = 5) -> float:
    fn()
    out = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out = min(out, (time.perf_counter() - t0) / reps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from dflash_torch import kernels

    kernels.ensure()
    torch.set_num_threads(args.threads)
    for rows in (1, 16):
        x = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(kernels.argmax(x), x.argmax(-1))
        t_torch, t_ours = best(lambda x=x: x.argmax(-1)), best(lambda x=x: kernels.argmax(x))
        print(f"{rows:>2} rows: torch.argmax {t_torch * 1e6:.0f} us, argmax.cpp {t_ours * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
