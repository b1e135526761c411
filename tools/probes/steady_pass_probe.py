"""A steady loop of the default target's passes over R positions after 128 cached ones (a decode step at
R = 1, a verify pass above), for a sampling profiler to attach to once the model has loaded:

    python tools/probes/steady_pass_probe.py --rows 1 --seconds 25 --quantize q4_0 &
    sleep 9; perf record -e cpu-clock -F 4000 -p $! -o perf.data -- sleep 8
    perf script -i perf.data -F tid,dso | sort | uniq -c | sort -rn | head    # samples per thread and library

(cpu-clock: a VM without hardware counters still has it). Prints the mean time per pass at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))
from dflash_torch.generate import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--quantize", default="q4_0")
    ap.add_argument("--context", type=int, default=128, help="cached positions before the pass")
    args = ap.parse_args()
    target = load(None, None, "auto", "auto", quantize=args.quantize).target
    context = args.context
    prompt = torch.randint(0, target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(context + args.rows + 1)
    with torch.inference_mode():
        target(prompt, cache, logits="last")
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            cache.crop(context)
            target(prompt[:, : args.rows], cache, logits="all" if args.rows > 1 else "last")
            n += 1
    print(f"{args.rows} rows: {(time.perf_counter() - t0) / n * 1e3:.2f} ms per pass over {n} passes")


if __name__ == "__main__":
    main()
