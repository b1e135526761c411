"""What a decode step costs around its decoder stack (kernels/layers.cpp), in one process, alternating call by
call: the same step through `Model.forward` (rotary rows, the embedding row, the taps, the stack) and as a bare
`decoder_stack` call on prepared inputs; then the bare call right after other work on the calling thread (an
elementwise torch operator, a numpy operator, our own RMSNorm, a 100 us sleep, a zero sleep, a plain system call),
each minus the bare call; last, the operators Model.forward adds around the stack, each timed alone.

    python tools/probes/around_stack_probe.py [--rounds 300] [--context 300] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path.cwd()))
from dflash_torch.generate import load  # noqa: E402
from dflash_torch.models import flat  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.rounds < 1 or args.context < 1 or args.threads < 1:
        sys.exit("around_stack_probe: --rounds, --context and --threads must be positive")
    torch.set_num_threads(args.threads)
    p = load(draft="auto", quantize="auto", quiet=True)
    t, n = p.target, args.context
    taps = list(p.drafter.target_layer_ids) if p.drafter is not None else []
    ids = torch.tensor([[1234]])
    with torch.inference_mode():
        cache = t.new_cache(n + 2)
        t(torch.randint(0, t.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)), cache,
          logits=None)
        plan = t._plan[(True, True)]
        f = plan.layers
        x = t.model.embed_tokens(ids[0])
        cos, sin = t.rotary.span(n, n + 1, torch.float32)
        cos, signed = cos[:, None], flat.signed(sin[:, None])
        w, arr, row = torch.ones(x.shape[-1]), np.ones(x.shape[-1], dtype=np.float32), x.clone()

        def bare(before=None):
            def run():
                cache.crop(n)
                if before is not None:
                    before()
                torch.ops.dflash.decoder_stack(x, cos, signed, n, cache.k, cache.v, taps, plan.norms, plan.packed,
                                               plan.codes, plan.biases, f.eps, f.h, f.hkv, f.scale, f.act, [])
            return run

        def step():
            cache.crop(n)
            t(ids, cache, logits=None, taps=taps)

        calls = {"bare stack": bare(), "Model.forward": step, "after torch add_": bare(lambda: row.add_(0.0)),
                 "after numpy multiply": bare(lambda: arr * 2), "after dflash rms_norm":
                 bare(lambda: torch.ops.dflash.rms_norm(row, w, 1e-5, -1)),
                 "after a 100 us sleep": bare(lambda: time.sleep(1e-4)),
                 "after time.sleep(0)": bare(lambda: time.sleep(0)), "after os.getpid()": bare(os.getpid)}
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.rounds):
            for k, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        # the operators Model.forward adds around the stack, each alone (many calls in a row, the mean)
        outs = [x] * len(taps)
        pieces = {"rotary rows": lambda: t.rotary.span(n, n + 1, torch.float32),
                  "embedding row": lambda: t.model.embed_tokens(ids[0]),
                  "signed sine": lambda: flat.signed(sin[:, None]),
                  "taps joined": lambda: torch.cat(outs, dim=-1)[None]}
        alone = {}
        for k, fn in pieces.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(2000):
                fn()
            alone[k] = (time.perf_counter() - t0) / 2000
    base = statistics.median(times["bare stack"])
    print(f"threads {args.threads}, context {n}, {args.rounds} rounds; bare stack {base * 1e6:.1f} us (median)")
    for k, v in times.items():
        if k != "bare stack":
            print(f"  {k:22s} {statistics.median(v) * 1e6:8.1f} us  ({(statistics.median(v) - base) * 1e6:+.1f})")
    print("alone: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in alone.items())
          + f"; together {sum(alone.values()) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
