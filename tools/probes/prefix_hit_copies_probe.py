"""The two copies a prefix-cache hit paid before its first token (default model, --quantize auto), timed:

- joining the cached positions' tap features to the new ones (what `speculative._prefill` did; it now keeps
  them as parts),
- moving a conversation that outgrew its cache into one twice the size: a zero-filled cache (what
  `KVCache` allocated before; it now leaves a CPU cache's slots unwritten) against the cache as allocated now,
  and `prefix_cache.moved` as a whole.

    python tools/probes/prefix_hit_copies_probe.py
    python tools/probes/prefix_hit_copies_probe.py --cached 1952 --capacity 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch.decoding.prefix_cache import moved
from dflash_torch.generate import load


def ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", type=int, default=1952, help="positions the hit holds")
    ap.add_argument("--new", type=int, default=23, help="new prompt tokens")
    ap.add_argument("--capacity", type=int, default=4096, help="the bigger cache's positions")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    pipe = load(None, "auto", "auto", "auto", quiet=True, quantize="auto")
    target, width = pipe.target, len(pipe.drafter.target_layer_ids) * pipe.target.config.hidden_size
    old, new = torch.randn(1, args.cached, width), torch.randn(1, args.new, width)
    join = ms(lambda: torch.cat([old, new], 1), args.rounds)
    print(f"join of tap features [1, {args.cached} + {args.new}, {width}] float32 "
          f"({(args.cached + args.new) * width * 4 / 2**20:.0f} MiB): {join:.2f} ms")
    c = target.new_cache(args.capacity)
    shape, dtype = c.k.shape, c.k.dtype
    nbytes = 2 * c.k.nbytes
    zeros = ms(lambda: (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)), args.rounds)
    print(f"a {args.capacity}-position cache ({nbytes / 2**20:.0f} MiB): zero-filled {zeros:.2f} ms, "
          f"as allocated now {ms(lambda: target.new_cache(args.capacity), args.rounds):.2f} ms")
    src = target.new_cache(args.capacity // 2)
    src.length = args.cached
    move = ms(lambda: moved(target, src, args.cached, args.capacity), args.rounds)
    print(f"prefix_cache.moved of {args.cached} positions into it: {move:.2f} ms")


if __name__ == "__main__":
    main()
