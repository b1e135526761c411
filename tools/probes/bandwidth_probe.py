"""How close a decode step is to this machine's memory bandwidth.

Times a float32 sum over buffers as large as the default model's weights (torch's reduction, 1 and 2
threads, three buffers cycled so none stays in cache), then a decode step of the default model, and prints
the bytes its block-format weights take (every one of them is read once per step) over the step's time.

    python tools/probes/bandwidth_probe.py
    python tools/probes/bandwidth_probe.py --quantize q4_0
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch.generate import load


def sum_gbs(nbytes: int, threads: int, rounds: int = 30) -> tuple[float, float]:
    """(ms, GB/s) of torch.sum over a float32 buffer of `nbytes`, three buffers cycled."""
    torch.set_num_threads(threads)
    bufs = [torch.ones(nbytes // 4, dtype=torch.float32) for _ in range(3)]
    for b in bufs:
        b.sum()
    times = []
    for i in range(rounds):
        t0 = time.perf_counter()
        bufs[i % 3].sum()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    return dt * 1e3, nbytes / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    target = load(None, None, "auto", "auto", quiet=True, quantize=args.quantize).target
    weights = sum(b.numel() * b.element_size() for name, b in target.named_buffers() if name.endswith("packed"))
    for n in sorted({1, threads}):
        ms, gbs = sum_gbs(weights, n)
        print(f"torch.sum over {weights / 2**20:.0f} MiB of float32, {n} thread(s): {ms:.2f} ms, {gbs:.1f} GB/s")
    torch.set_num_threads(threads)
    prompt = torch.randint(0, target.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(130)
    times = []
    with torch.inference_mode():
        target(prompt, cache, logits="last")
        for _ in range(args.steps):
            cache.crop(128)
            t0 = time.perf_counter()
            target(prompt[:, :1], cache, logits="last")
            times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    print(f"decode step ({threads} threads): {dt * 1e3:.2f} ms for {weights / 2**20:.0f} MiB of packed weights, "
          f"{weights / dt / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
