"""Fused against separate projections: bit equality and time per pass.

Loads the embedded default model twice with the same weights, once with q/k/v and gate/up fused (what
`--quantize` does) and once with them kept apart (`fuse=False`), checks whether a prefill,
decode steps and a 16-token verify give bit-identical logits, then times a decode step and verify
passes after a 128-token context, alternating the two models so that both see the same machine load
(docs/performance.md).

    python tools/probes/decode_probe.py --quantize int4
    python tools/probes/decode_probe.py --quantize none    # float32 weights, fused by hand (not shipped)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch.generate import load
from dflash_torch.models.quantize import fuse_projections, quantize_int4, quantize_int8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", default="int4", choices=["int8", "int4", "none"])
    p.add_argument("--sizes", default="1,4,8,16", help="tokens per pass (1 = a decode step)")
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quantize == "none":
        models = [load(None, None, "cpu", "float32", quiet=True).target for _ in range(2)]
        fuse_projections(models[1])
    else:
        quantizer = quantize_int4 if args.quantize == "int4" else quantize_int8
        models = [quantizer(load(None, None, "cpu", "float32", quiet=True).target, fuse=f) for f in (False, True)]
    ids = torch.randint(0, 49152, (1, 128), generator=torch.Generator().manual_seed(0))

    with torch.inference_mode():
        logits = []
        for m in models:
            cache = m.new_cache(256)
            out = [m(ids, cache, logits="all").logits]
            out += [m(ids[:, i : i + 1], cache, logits="all").logits for i in range(8)]
            out.append(m(ids[:, 8:24], cache, logits="all").logits)
            logits.append(torch.cat(out, dim=1))
        same = torch.equal(logits[0], logits[1])
        print(f"{args.quantize}: fused logits == separate logits: {same}"
              + ("" if same else f" (max difference {(logits[0] - logits[1]).abs().max().item():.2e})"))

        for size in [int(s) for s in args.sizes.split(",")]:
            passes = []
            for m in models:
                cache = m.new_cache(256)
                m(ids, cache, logits="last")

                def one(m=m, cache=cache, size=size):
                    cache.crop(128)
                    m(ids[:, :size], cache, logits="all" if size > 1 else "last")

                one()
                passes.append(one)
            times: list[list[float]] = [[], []]
            for _ in range(args.repeats):
                for j in (0, 1):
                    t0 = time.perf_counter()
                    passes[j]()
                    times[j].append(time.perf_counter() - t0)
            sep, fused = (statistics.median(t) * 1e3 for t in times)
            print(f"tokens {size:2d}: separate {sep:6.2f} ms, fused {fused:6.2f} ms ({(sep - fused) / sep:+.1%})")


if __name__ == "__main__":
    main()
