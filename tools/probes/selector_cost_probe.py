"""What a DFlash2 candidate selector costs per draft against the argmax it replaces (docs/training.md).

    .venv/bin/python tools/probes/selector_cost_probe.py DRAFTER_DIR [--positions 15] [--repeats 50]

DRAFTER_DIR: a DFlash2 drafter (e.g. the export of `dflash train --selector`). One thread, whole-vocabulary
logits of random values: the selector's sequential pass does the same work whatever the values are.
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.sampling import Sampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("drafter")
    p.add_argument("--positions", type=int, default=15)
    p.add_argument("--repeats", type=int, default=50)
    a = p.parse_args()
    torch.set_num_threads(1)
    d = load_drafter(a.drafter, dtype=torch.float32)
    if not hasattr(d, "select"):
        raise SystemExit(f"{a.drafter} has no candidate selector (not a DFlash2 drafter)")
    g = torch.Generator().manual_seed(0)
    d.last_hidden = torch.randn(a.positions, d.config["hidden_size"], generator=g)  # as a propose() leaves it
    logits = torch.randn(a.positions, d.config["vocab_size"], generator=g)
    sampler = Sampler()

    def ms(fn) -> float:
        for _ in range(3):
            fn()
        t = time.perf_counter()
        for _ in range(a.repeats):
            fn()
        return (time.perf_counter() - t) / a.repeats * 1e3

    print(f"selector over {a.positions} positions: {ms(lambda: d.select(logits, 5, sampler)):.2f} ms per draft")
    print(f"argmax over {a.positions} positions:   {ms(lambda: logits.argmax(-1)):.2f} ms per draft")


if __name__ == "__main__":
    main()
