"""Does carrying prompt lookup's measured verify costs from one request to the next pay? (docs/performance.md)

Int4 default model, prompt lookup alone, 128-token replies to the first three prompts of each bench suite,
twice over; each prompt runs once with fresh costs (every generation measures its widths again, as
`dflash generate` does) and once with the costs shared across generations (as `dflash serve` does),
alternating, so both see the same machine load. Prints pooled decode tok/s of each and whether the
outputs agree.

    python tools/probes/lookup_costs_probe.py
"""

from __future__ import annotations

import torch

from dflash_torch.bench_prompts import collect_prompts, encode
from dflash_torch.decoding.lookup import VerifyCosts
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load


def main() -> None:
    torch.set_num_threads(2)
    pipe = load(None, None, "cpu", "float32", quiet=True, quantize="int4")
    prompts = [encode(pipe, p) for ps in collect_prompts("all", None, 3).values() for p in ps]
    shared = VerifyCosts()

    def run(ids: list[int], costs: dict | None, n: int = 128) -> tuple[list[int], float]:
        stats = Stats()
        out = list(generate_tokens(pipe.target, ids, max_new_tokens=n, stats=stats, lookup=True,
                                   lookup_costs=costs))
        return out, stats.decode_s

    run(prompts[0], shared, 256)  # a first request fills the shared costs (and warms up)
    tokens, seconds, same = {"fresh": 0, "shared": 0}, {"fresh": 0.0, "shared": 0.0}, True
    for _ in range(2):
        for ids in prompts:
            a, sa = run(ids, None)
            b, sb = run(ids, shared)
            same &= a == b
            for k, out, s in (("fresh", a, sa), ("shared", b, sb)):
                tokens[k] += len(out) - 1
                seconds[k] += s
    for k in ("fresh", "shared"):
        print(f"{k:6s} costs: {tokens[k] / seconds[k]:.1f} tok/s")
    print(f"same outputs: {same}; {len(prompts)} prompts x 2")


if __name__ == "__main__":
    main()
