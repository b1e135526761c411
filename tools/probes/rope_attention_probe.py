"""rope_attention's own work beside the attention it calls: the rotation of q and k and the cache writes
(a float16 cache, as block-format targets keep) for a verify pass of the default model's shape (16
positions, 9 query heads, 3 kv heads, head size 64, 128 cached positions), as the difference between one
rope_attention call and one causal_attention call on the same shapes; best of 5 rounds of 2,000 calls.

    python tools/probes/rope_attention_probe.py LABEL [--rows 16]

To compare two revisions, run it alternately from each (the old one from a `git worktree` with its own
DFLASH_HOME, so that its kernels build apart) and compare the medians: this host drifts between runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))
from dflash_torch import kernels  # noqa: E402
from dflash_torch.models import flat  # noqa: E402


def best_us(fn, calls: int = 2000, rounds: int = 5) -> float:
    """The best per-call time of `rounds` rounds of `calls` calls, in microseconds."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label")
    ap.add_argument("--rows", type=int, default=16)
    args = ap.parse_args()
    kernels.ensure()
    torch.set_num_threads(2)
    t, h, hkv, d, start = args.rows, 9, 3, 64, 128
    qkv = torch.randn(t, (h + 2 * hkv) * d)  # [T, (H + 2 Hkv) * D]
    angles = torch.randn(t, 1, d)
    cos, signed = angles.cos(), flat.signed(angles.sin())
    k, v = (torch.zeros(hkv, 512, d, dtype=torch.float16) for _ in range(2))  # [Hkv, S, D]
    q = torch.randn(t, h, d)
    fused = best_us(lambda: torch.ops.dflash.rope_attention(qkv, cos, signed, k, v, start, h, hkv, d**-0.5))
    alone = best_us(lambda: torch.ops.dflash.causal_attention(q, k, v, start, d**-0.5, -1))
    print(f"{args.label}: rope_attention {fused:.1f} us, causal_attention {alone:.1f} us, "
          f"rotation and cache writes {fused - alone:.1f} us ({t} rows, {torch.backends.cpu.get_cpu_capability()})")


if __name__ == "__main__":
    main()
