"""A/B of a DFlash2 selector's chances for a tree draft: kernels/selector.cpp against the same formula in torch
operators (kernels/reference.py, what `CandidateSelector.transitions` ran before), in one process. The drafter alone at
a fixed width, held-out prompts (2 per kind, 96 tokens, no stop token), arms alternating prompt by prompt (their order
reversed every round); median time of `transitions` and of a whole draft.

    python docs/bench/cpu-avx2-zen3/selector_ab.py [--width 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from dflash_torch import data, kernels
from dflash_torch.decoding import dflash2, proposers, speculative
from dflash_torch.generate import load
from dflash_torch.kernels import reference


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
    paths = {"torch": reference.selector_chances, "kernel": kernels.selector_chances}
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    arm = ["kernel"]

    def timer(what, fn):
        def timed(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            times[arm[0], what].append(time.perf_counter() - t)
            return out
        return timed

    dflash2.CandidateSelector.transitions = timer("transitions", dflash2.CandidateSelector.transitions)
    proposers.DrafterProposer._draft_tree = timer("draft", proposers.DrafterProposer._draft_tree)
    for r in range(a.rounds):
        for ids in prompts:
            for name in ("torch", "kernel") if r % 2 == 0 else ("kernel", "torch"):
                arm[0] = name
                dflash2.kernels.selector_chances = paths[name]
                for _ in speculative.generate_tokens(p.target, ids, max_new_tokens=a.tokens, stop_token_ids=[],
                                                     drafter=p.drafter, block_size=a.width):
                    pass
    print(f"width {a.width}, {len(prompts)} prompts x {a.rounds} rounds, {a.tokens} tokens; ms, median:")
    for name in ("torch", "kernel"):
        t, d = sorted(times[name, "transitions"]), sorted(times[name, "draft"])
        print(f"{name:6s} transitions {t[len(t) // 2] * 1e3:.3f}, whole draft {d[len(d) // 2] * 1e3:.3f} "
              f"({len(d)} drafts)")


if __name__ == "__main__":
    main()
