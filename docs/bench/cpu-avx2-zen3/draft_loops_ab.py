"""A/B of draft_stack's plain loops (each layer's q/k norms, rotations and cache writes) against its operators, in one
process: the operators' arm gives the drafter's rotary tables as strided views (the same values), which draft_stack
sends through the operators. The drafter alone at a fixed width, held-out prompts (2 per kind, 96 tokens, no stop
token), arms alternating prompt by prompt (their order reversed every round); median time of a whole draft.

    python docs/bench/cpu-avx2-zen3/draft_loops_ab.py [--width 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from dflash_torch import data
from dflash_torch.decoding import proposers, speculative
from dflash_torch.generate import load


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in rows twice as far apart."""
    return torch.zeros(*t.shape[:-1], 2 * t.shape[-1]).narrow(-1, 0, t.shape[-1]).copy_(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    p = load(quantize="auto", quiet=True)
    prompts = [data.encode_chat(p.tokenizer, x) for kind in data.heldout_prompts(2, 2, 2).values() for x in kind]
    rot = p.drafter.rotary
    rot._table(4096, torch.float32)  # (long enough for every prompt here: never grown, so never replaced)
    key = (torch.float32, rot.inv_freq.device)
    tables = {"loops": rot._tables[key]}
    tables["ops"] = tables["loops"][:2] + tuple(strided(t) for t in tables["loops"][2:])
    times: dict[str, list[float]] = collections.defaultdict(list)
    arm = ["loops"]
    draft = proposers.DrafterProposer._draft_tree

    def timed(self, *args, **kw):
        t = time.perf_counter()
        out = draft(self, *args, **kw)
        times[arm[0]].append(time.perf_counter() - t)
        return out

    proposers.DrafterProposer._draft_tree = timed
    for r in range(a.rounds):
        for ids in prompts:
            for name in ("ops", "loops") if r % 2 == 0 else ("loops", "ops"):
                arm[0] = name
                rot._tables[key] = tables[name]
                for _ in speculative.generate_tokens(p.target, ids, max_new_tokens=a.tokens, stop_token_ids=[],
                                                     drafter=p.drafter, block_size=a.width):
                    pass
    print(f"width {a.width}, {len(prompts)} prompts x {a.rounds} rounds, {a.tokens} tokens; ms per draft:")
    for name in ("ops", "loops"):
        v = sorted(times[name])
        print(f"{name:5s} {len(v)} drafts: median {v[len(v) // 2] * 1e3:.3f}, quartiles {v[len(v) // 4] * 1e3:.3f} / "
              f"{v[3 * len(v) // 4] * 1e3:.3f}")


if __name__ == "__main__":
    main()
