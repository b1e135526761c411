"""Passes of the default target with its block weights where loading left them (4 KB pages) against the same bytes
moved by `models.hugepages.move_blocks` (one 2 MB-aligned MADV_HUGEPAGE mapping), alternating in one process, the
order swapped every round; the logits of both are compared first.

    python docs/bench/cpu-avx2-zen3/hugepages_ab.py --quantize auto --context 300 --rows 1,2,4 --rounds 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from dflash_torch.generate import load  # noqa: E402
from dflash_torch.models import hugepages  # noqa: E402
from dflash_torch.models.quantize import BlockLinear, forget_plans  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=20, help="passes timed together per round and arm")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    shipped = hugepages.available
    hugepages.available = lambda: False  # load as before: the weights in the loader's own allocations
    p = load(None, None, "auto", "auto", quantize=a.quantize, quiet=True)
    hugepages.available = shipped
    t = p.target
    layers = [m for m in t.modules() if isinstance(m, BlockLinear)]
    small = {m: m.packed for m in layers}  # kept alive: both placements exist side by side
    moved = hugepages.move_blocks(t)
    if not moved:
        sys.exit("no transparent huge pages here")
    huge = {m: m.packed for m in layers}
    meminfo = [line.split() for line in Path("/proc/meminfo").read_text().splitlines() if "AnonHugePages" in line]
    print(f"{len(layers)} block layers, {moved / 2**20:.1f} MiB moved; AnonHugePages {meminfo[0][1]} kB")

    def use(which):
        for m in layers:
            m.packed = which[m]
        forget_plans(t)

    ids = torch.randint(0, t.config.vocab_size, (1, a.context + 16), generator=torch.Generator().manual_seed(0))
    cache = t.new_cache(a.context + 17)
    t(ids[:, : a.context], cache, logits="last")
    for rows in [int(r) for r in a.rows.split(",")]:
        def step(rows=rows):
            out = t._flat(ids[:, a.context : a.context + rows], cache, "last" if rows == 1 else "all", ())
            cache.crop(a.context)
            return out.logits

        use(small)
        first = step()
        use(huge)
        assert torch.equal(first, step()), "the moved weights gave other logits"
        times: dict[str, list[float]] = {"4 KB": [], "huge": []}
        for r in range(a.rounds):
            arms = (("4 KB", small), ("huge", huge)) if r % 2 == 0 else (("huge", huge), ("4 KB", small))
            for name, which in arms:
                use(which)
                step()
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    step()
                times[name].append((time.perf_counter() - t0) / a.calls)
        before, after = statistics.median(times["4 KB"]), statistics.median(times["huge"])
        pairs = statistics.median(h / s for s, h in zip(times["4 KB"], times["huge"]))
        print(f"after {a.context} positions, {rows} row(s): 4 KB pages {before * 1e3:.3f} ms, huge pages "
              f"{after * 1e3:.3f} ms: {after / before:.3f} of the time (median of the rounds' ratios {pairs:.3f}); "
              "same logits", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
