"""The verify pass's LM head on the rows the loop reads (speculative.HEAD_FIRST_ROWS first, the rest only when
every draft among them is kept) against the head on every row, alternating in one process: the drafter alone at
block 16 (greedy, no lookup, fallback or adaptive width) on the bench's chat, code and math prompts, each
output checked equal between the two.

    python tools/probes/deferred_head_probe.py --quantize q4_0 --prompts 6 --tokens 128 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))
from dflash_torch.decoding import speculative  # noqa: E402
from dflash_torch.generate import load  # noqa: E402

PROMPTS = Path("dflash_torch/prompts")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default="q4_0")
    ap.add_argument("--prompts", type=int, default=6, help="taken in turn from chat, code and math")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()
    pipe = load(None, "auto", "auto", "auto", quantize=args.quantize, quiet=True)
    kinds = [[json.loads(line)["prompt"] for line in open(PROMPTS / f"{k}.jsonl")] for k in ("chat", "code", "math")]
    prompts = [kinds[i % 3][i // 3] for i in range(args.prompts)]
    first = speculative.HEAD_FIRST_ROWS
    rates: dict[str, list[float]] = {"every row": [], f"first {first} rows": []}
    for r in range(args.rounds):
        for i, text in enumerate(prompts):
            ids = pipe.encode(text)
            outs = []
            for name in (rates if r % 2 == 0 else list(rates)[::-1]):
                speculative.HEAD_FIRST_ROWS = first if name != "every row" else 1 << 30  # 1 << 30: never defer
                stats = speculative.Stats()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = list(speculative.generate_tokens(
                        pipe.target, ids, max_new_tokens=args.tokens, drafter=pipe.drafter, stats=stats,
                        block_size=args.block, lookup=False))
                rates[name].append(len(out) / (time.perf_counter() - t0))
                outs.append(out)
            assert outs[0] == outs[1], f"prompt {i}: the outputs differ"
            print(f"round {r} prompt {i}: accept {stats.acceptance_length_mean:.2f}, "
                  + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()), flush=True)
    speculative.HEAD_FIRST_ROWS = first
    for k, v in rates.items():
        print(f"{k}: median {statistics.median(v):.1f} tok/s over {len(v)} runs")
    ratio = statistics.median(a / b for a, b in zip(rates[f"first {first} rows"], rates["every row"]))
    print(f"median ratio per run: {ratio:.3f}; every output equal")


if __name__ == "__main__":
    main()
