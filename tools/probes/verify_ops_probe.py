"""Where a verify pass's time goes: the heaviest operators of the target's forward pass over R positions
after a 128-token context (torch.profiler, 40 passes), for the default model with its drafter's taps.

    python tools/probes/verify_ops_probe.py [--quantize q4_0] [--rows 1,4,16]

The profiler records the calling thread's operators; a kernel's other threads work inside its call, so
the per-call times are wall times of the calls. Its own overhead (~1 us per operator) is in the numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path.cwd()))
from dflash_torch.generate import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default="q4_0")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--passes", type=int, default=40)
    args = ap.parse_args()
    pipe = load(None, "auto", "cpu", "auto", quantize=args.quantize, quiet=True)
    target, taps, context = pipe.target, pipe.drafter.target_layer_ids, 128
    ids = torch.randint(0, target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(context + 20)
    with torch.inference_mode():
        target(ids, cache, logits="last", taps=taps)
        for rows in (int(r) for r in args.rows.split(",")):
            def step(rows=rows):
                cache.crop(context)
                target(ids[:, :rows], cache, logits="all" if rows > 1 else "last", taps=taps)

            for _ in range(5):
                step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.passes):
                    step()
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in events) / args.passes
            print(f"{rows} rows: {total / 1e3:.2f} ms per pass (profiled), torch {torch.__version__}, "
                  f"threads {torch.get_num_threads()}")
            for e in events[:10]:
                per_pass = e.self_cpu_time_total / args.passes
                print(f"  {e.key:<28} {per_pass / 1e3:7.3f} ms/pass {100 * per_pass / total:5.1f}%  "
                      f"{e.count // args.passes:4d} calls  {e.self_cpu_time_total / e.count:8.2f} us/call")


if __name__ == "__main__":
    main()
