"""A/B of the drafter's attention in the real loop: the drafter alone at a fixed width (the tree a greedy cycle drafts),
held-out prompts (2 per kind, 96 tokens each, no stop token), arms alternating prompt by prompt (their order reversed
every round), median time of a whole draft (`DrafterProposer._draft_tree`: block, pass, top-k, tree). The arm `sdpa`
sets DFLASH_DRAFT_SDPA, which only a build with `draft_attention_sdpa.patch` reads (draft_stack's attention on
PyTorch's scaled_dot_product_attention, as before kernels/attention.cpp's full_attention served it).

    git apply docs/bench/cpu-avx2-zen3/draft_attention_sdpa.patch
    python docs/bench/cpu-avx2-zen3/draft_attention_ab.py [--width 3] [--rounds 3]
    git apply -R docs/bench/cpu-avx2-zen3/draft_attention_sdpa.patch
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch

from dflash_torch import data
from dflash_torch.decoding import proposers, speculative
from dflash_torch.generate import load


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
    times: dict[str, list[float]] = collections.defaultdict(list)
    arm = ["kernel"]
    draft = proposers.DrafterProposer._draft_tree

    def timed(self, *args, **kw):
        t = time.perf_counter()
        out = draft(self, *args, **kw)
        times[arm[0]].append(time.perf_counter() - t)
        return out

    proposers.DrafterProposer._draft_tree = timed
    for r in range(a.rounds):
        for ids in prompts:
            for name in ("sdpa", "kernel") if r % 2 == 0 else ("kernel", "sdpa"):
                arm[0] = name
                if name == "sdpa":
                    os.environ["DFLASH_DRAFT_SDPA"] = "1"
                else:
                    os.environ.pop("DFLASH_DRAFT_SDPA", None)
                for _ in speculative.generate_tokens(p.target, ids, max_new_tokens=a.tokens, stop_token_ids=[],
                                                     drafter=p.drafter, block_size=a.width):
                    pass
    print(f"width {a.width}, {len(prompts)} prompts x {a.rounds} rounds, {a.tokens} tokens; ms per draft:")
    for name, v in times.items():
        v = sorted(v)
        print(f"{name:7s} {len(v)} drafts: median {v[len(v) // 2] * 1e3:.3f}, quartiles {v[len(v) // 4] * 1e3:.3f} / "
              f"{v[3 * len(v) // 4] * 1e3:.3f}")


if __name__ == "__main__":
    main()
