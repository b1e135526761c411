"""What small operators cost right after a pass (its matmuls have streamed the weights through the caches), and what
nn.Module's call and Model.forward's checks add to a pass over its flat path, in one process, alternating call by
call (the default model and drafter, `--quantize auto`, 300 cached positions).

    python tools/probes/after_pass_probe.py [--rounds 300] [--context 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash_torch.generate import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--context", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(2)
    p = load(draft="auto", quantize="auto", quiet=True)
    t, n = p.target, a.context
    taps = list(p.drafter.target_layer_ids)
    with torch.inference_mode():
        cache = t.new_cache(n + 8)
        t(torch.randint(0, t.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)), cache, logits=None)
        v = torch.zeros(8)
        ops = {"torch.tensor([[1234]])": lambda: torch.tensor([[1234]]), "v[0]": lambda: v[0],
               "v + 1": lambda: v + 1, "v.tolist()": v.tolist, "v * 2": lambda: v * 2,
               "a Python loop of 1,000": lambda: sum(range(1000))}
        first = {k: [] for k in ops}
        again = {k: [] for k in ops}
        for _ in range(a.rounds):
            cache.crop(n)
            t(torch.tensor([[5]]), cache, logits="last", taps=taps)
            for times in (first, again):
                for k, f in ops.items():
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
        print(f"after a decode step ({n} positions), each operator in turn, then all of them again (median us):")
        for k in ops:
            print(f"  {k:24s} {statistics.median(first[k]) * 1e6:6.1f}  then {statistics.median(again[k]) * 1e6:6.1f}")
        for name, ids, logits, tp in (("decode step", [[1234]], "last", []), ("3-row verify pass", [[1234, 55, 66]],
                                                                              "all", taps)):
            calls = {"target(...)": lambda b, lg=logits, tp=tp: t(b, cache, logits=lg, taps=tp),
                     "target.forward(...)": lambda b, lg=logits, tp=tp: t.forward(b, cache, logits=lg, taps=tp),
                     "target._flat(...)": lambda b, lg=logits, tp=tp: t._flat(b, cache, lg, tp)}
            r = {k: [] for k in calls}
            for i in range(a.rounds):
                for k, f in calls.items() if i % 2 else reversed(list(calls.items())):
                    b = torch.tensor(ids)
                    cache.crop(n)
                    t0 = time.perf_counter()
                    f(b)
                    r[k].append(time.perf_counter() - t0)
            base = statistics.median(r["target._flat(...)"])
            print(f"{name}: _flat {base * 1e6:.1f} us; " + ", ".join(
                f"{k} {(statistics.median(x) - base) * 1e6:+.1f}" for k, x in r.items() if k != "target._flat(...)"))


if __name__ == "__main__":
    main()
