"""The attention kernel's paths timed against each other on the default model's shapes (9 query heads
over 3 kv heads, head dim 64): `causal_attention` with isa 1 (AVX2 tiles) and 2 (AVX-512 tiles), a float16
and a float32 cache, T queries after `start` cached positions, in alternating rounds so that the
machine's drift falls on both. (docs/performance.md, "Attention in tiles")

    python tools/probes/attention_paths_probe.py [--rounds 7] [--starts 128,1008,4064]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200, help="calls per round and path")
    ap.add_argument("--starts", default="128,1008", help="cached positions before the queries")
    ap.add_argument("--queries", default="1,4,16", help="query positions T per call")
    ap.add_argument("--dtypes", default="float16,float32", help="cache dtypes")
    args = ap.parse_args()
    kernels.ensure()
    h, hkv, d = 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}; us per call, median of {args.rounds} rounds")
    print(f"{'cache':>8} {'start':>6} {'T':>3} {'avx2':>9} {'avx512':>9} {'avx512/avx2':>12}")
    for dtype in (getattr(torch, x) for x in args.dtypes.split(",")):
        for start in (int(x) for x in args.starts.split(",")):
            k = torch.randn(hkv, start + 32, d, generator=gen).to(dtype)
            v = torch.randn(hkv, start + 32, d, generator=gen).to(dtype)
            for t in (int(x) for x in args.queries.split(",")):
                q = torch.randn(t, h, d, generator=gen)
                calls = {isa: (lambda isa=isa, q=q, k=k, v=v, start=start: torch.ops.dflash.causal_attention(
                    q, k, v, start, d**-0.5, isa)) for isa in (1, 2)}
                assert torch.equal(calls[1](), calls[2]())  # the paths' bits agree (tests/test_kernels.py)
                times: dict[int, list[float]] = {1: [], 2: []}
                for _ in range(args.rounds):
                    for isa, fn in calls.items():
                        fn()
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            fn()
                        times[isa].append((time.perf_counter() - t0) / args.calls * 1e6)
                a, b = statistics.median(times[1]), statistics.median(times[2])
                print(f"{str(dtype).split('.')[1]:>8} {start:6d} {t:3d} {a:9.1f} {b:9.1f} {b / a:12.2f}")


if __name__ == "__main__":
    main()
