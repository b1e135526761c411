"""A decode step run by the thread that loaded the model, and by another thread of the same process.

libgomp keeps a team of threads per thread that starts parallel regions. Once the process's teams hold more
threads than there are CPUs, it stops spinning between regions and puts idle threads to sleep, so every
parallel region of a step then waits for one to wake up. `dflash serve` loads and runs everything in its
one worker thread; a program that loads a pipeline in one thread and generates in another (as the replay
bench once served from threads of its own process) pays this on every pass.

    python tools/probes/thread_probe.py                  # the default model, --quantize auto
    python tools/probes/thread_probe.py --quantize q4_0 --steps 400
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from dflash_torch.generate import load


def decode_ms(target, steps: int, context: int = 128) -> float:
    """Median ms of a decode step after `context` cached positions, in the calling thread."""
    prompt = torch.randint(0, target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(context + 2)
    times = []
    with torch.inference_mode():
        target(prompt, cache, logits="last")
        for _ in range(steps):
            cache.crop(context)
            t0 = time.perf_counter()
            target(prompt[:, :1], cache, logits="last")
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def in_thread(fn, *args):
    out = []
    th = threading.Thread(target=lambda: out.append(fn(*args)))
    th.start()
    th.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print(f"threads {torch.get_num_threads()}, CPUs {len(__import__('os').sched_getaffinity(0))}")

    def loaded_here() -> float:  # load and run in one thread, the main thread never running a region
        return decode_ms(load(None, None, "auto", "auto", quiet=True, quantize=args.quantize).target, args.steps)

    print(f"loaded and run in one other thread (the main thread idle): {in_thread(loaded_here):.2f} ms")
    target = load(None, None, "auto", "auto", quiet=True, quantize=args.quantize).target
    print(f"loaded and run in the main thread:                       {decode_ms(target, args.steps):.2f} ms")
    print(f"loaded in the main thread, run in another thread:        {in_thread(decode_ms, target, args.steps):.2f} ms")


if __name__ == "__main__":
    main()
