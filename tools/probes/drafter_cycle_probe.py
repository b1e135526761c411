"""What a cycle of the drafter alone costs in the loop: the drafter at a fixed width (trees where the target verifies
them, as the loop drafts), no prompt lookup, no fallback, against target-only decoding of the same prompts, alternating
prompt by prompt (held-out prompts, 2 per kind, no stop token). A cycle's cost in decode steps is its tokens per cycle
over its speed ratio: what a draft pass plus a verify pass plus the loop around them take against one plain step.

    python tools/probes/drafter_cycle_probe.py [--widths 2,3] [--tokens 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash_torch import data  # noqa: E402
from dflash_torch.decoding import speculative  # noqa: E402
from dflash_torch.generate import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="2,3")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    p = load(quantize="auto", quiet=True)
    prompts = [data.encode_chat(p.tokenizer, x) for kind in data.heldout_prompts(2, 2, 2).values() for x in kind]
    widths = [int(w) for w in a.widths.split(",")]

    def go(width: int, ids: list[int]) -> tuple[float, int, int]:  # (seconds, tokens, cycles) for one prompt
        st, n, t0 = speculative.Stats(), 0, time.perf_counter()
        for _ in speculative.generate_tokens(p.target, ids, max_new_tokens=a.tokens, stop_token_ids=[], stats=st,
                                             drafter=p.drafter if width > 1 else None, block_size=width):
            n += 1
        return time.perf_counter() - t0, n, st.cycles

    arms = [1, *widths]
    for w in arms:  # warm-up
        go(w, prompts[0])
    for r in range(a.rounds):
        total = {w: [0.0, 0, 0] for w in arms}
        for i, ids in enumerate(prompts):  # the arms in rotating order, prompt by prompt
            for w in arms[i % len(arms):] + arms[: i % len(arms)]:
                total[w] = [x + y for x, y in zip(total[w], go(w, ids))]
        base = total[1][1] / total[1][0]
        parts = []
        for w in widths:
            speed, per = total[w][1] / total[w][0], total[w][1] / max(total[w][2], 1)
            parts.append(f"width {w}: {per:.2f} tokens a cycle, {speed / base:.3f}x target-only, a cycle "
                         f"{per * base / speed:.2f} decode steps")
        print(f"round {r + 1}: target-only {base:.1f} tok/s; " + "; ".join(parts), flush=True)

if __name__ == "__main__":
    main()
