"""A target pass right after another against one after the process sat idle (docs/performance.md, "A pass
after an idle gap").

A server's first pass of a request follows however long the last request left it idle; a chat's next turn
(a prefill of its few new tokens) is exactly that pass. Runs the default model as `dflash serve` runs it
(`--quantize auto`, prefills one query at a time) in the main thread: a prefill of 200 positions, then passes
of `--rows` rows on top of it (the cache's length reset before each, so every pass sees the same context),
ten back to back and then `--repeats` after each idle gap (`time.sleep`). Prints the median and the slowest
per gap. Run it with and without `OMP_WAIT_POLICY=ACTIVE` (idle OpenMP threads spin instead of sleeping);
`--beat S`: during each gap, a tiny parallel region (a 64k-element multiply and sum) every S seconds.

    python tools/probes/idle_probe.py [--rows 1,14] [--gaps 0.01,0.1,0.3,1,3] [--repeats 6] [--beat 0.1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dflash_torch.generate import load
from dflash_torch.models.quantize import exact_prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,14", help="rows per pass (a decode step; a short turn's new tokens)")
    ap.add_argument("--gaps", default="0.01,0.1,0.3,1,3", help="idle seconds before a pass")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--beat", type=float, default=0.0, help="a tiny parallel region every this many idle seconds")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    pipe = load(quantize="auto", quiet=True)
    exact_prefill(pipe.target)
    target = pipe.target
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, {a.threads} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}" + (f", a beat every {a.beat} s of a gap" if a.beat else ""))
    pulse = torch.ones(1 << 16)

    def idle(gap: float) -> None:
        end = time.perf_counter() + gap
        while (left := end - time.perf_counter()) > 0:
            time.sleep(min(a.beat, left) if a.beat else left)
            if a.beat:
                torch.mul(pulse, 2.0).sum()  # a parallel region of this thread's OpenMP team
    with torch.inference_mode():
        cache = target.new_cache(1024)
        gen = torch.Generator().manual_seed(0)
        target(torch.randint(0, 40000, (1, 200), generator=gen), cache, logits="last")
        base = cache.length

        def ms(rows: int) -> float:
            cache.length = base  # the same 200 positions before every pass
            ids = torch.randint(0, 40000, (1, rows), generator=gen)
            t0 = time.perf_counter()
            target(ids, cache, logits="last")
            return 1e3 * (time.perf_counter() - t0)

        print(f"{'rows':>4}  {'idle before':>12}  {'median ms':>9}  {'slowest ms':>10}")
        for rows in (int(r) for r in a.rows.split(",")):
            hot = [ms(rows) for _ in range(10)][2:]
            print(f"{rows:>4}  {'none':>12}  {statistics.median(hot):>9.2f}  {max(hot):>10.2f}")
            for gap in (float(g) for g in a.gaps.split(",")):
                xs = []
                for _ in range(a.repeats):
                    idle(gap)
                    xs.append(ms(rows))
                print(f"{rows:>4}  {gap:>10.2f} s  {statistics.median(xs):>9.2f}  {max(xs):>10.2f}", flush=True)


if __name__ == "__main__":
    main()
