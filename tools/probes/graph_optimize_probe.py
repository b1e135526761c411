"""TorchScript's optimizing passes on and off, timed in alternation on the default model's scripted decode
plan (docs/performance.md, "Memory"; `flat.script` turns them off):

    .venv/bin/python tools/probes/graph_optimize_probe.py

Two plans of the same target, each first run under one setting (the graph executor reads it then), timed
round by round on passes of 1, 4 and 16 tokens after a 128-token context; medians in ms, and whether the
logits of the two are the same bits.
"""

from __future__ import annotations

import importlib
import statistics
import time

import torch


def main() -> None:
    generate = importlib.import_module("dflash_torch.generate")
    target = generate.load(None, quiet=True, quantize="auto", draft=None).target
    context = 128
    prompt = torch.randint(0, target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(context + 20)
    with torch.inference_mode():
        target(prompt, cache, logits="last")
        plans = {}
        for optimize in (True, False):
            torch._C._set_graph_executor_optimize(optimize)
            target._plan = {True: target._decode_plan()}
            for _ in range(3):  # the executor specializes on its first runs
                for b in (1, 16):
                    cache.crop(context)
                    target(prompt[:, :b], cache, logits="all" if b > 1 else "last")
            plans[optimize] = target._plan
        times = {(o, b): [] for o in plans for b in (1, 4, 16)}
        logits = {}
        for _ in range(40):
            for optimize, plan in plans.items():
                target._plan = plan
                for b in (1, 4, 16):
                    cache.crop(context)
                    t0 = time.perf_counter()
                    logits[(optimize, b)] = target(prompt[:, :b], cache, logits="all" if b > 1 else "last").logits
                    times[(optimize, b)].append(time.perf_counter() - t0)
    for b in (1, 4, 16):
        on, off = (statistics.median(times[(o, b)]) * 1e3 for o in (True, False))
        same = torch.equal(logits[(True, b)], logits[(False, b)])
        print(f"{b:2d} tokens: optimizing passes on {on:.2f} ms, off {off:.2f} ms, same bits {same}")


if __name__ == "__main__":
    main()
