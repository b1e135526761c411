"""A/B of a greedy tree draft's Python around the draft pass: `DrafterProposer._draft_tree` and
`DFlashDrafter.draft_hidden` as revision REV has them (default 3a0baeb: a top-k and a logsumexp for the candidates,
the signed sines made per pass) against the working tree's (argmax.cpp's top_probs, the rotary table's signed sines),
in one process, arms alternating prompt by prompt (their order reversed every round). The drafter alone at a fixed
width, held-out prompts (2 per kind, 96 tokens, no stop token); median time of a whole draft.

    python docs/bench/cpu-avx2-zen3/draft_python_ab.py [--rev 3a0baeb] [--width 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import time
from pathlib import Path

import torch

from dflash_torch import data
from dflash_torch.decoding import drafter, proposers, speculative
from dflash_torch.generate import load

ROOT = Path(__file__).resolve().parents[3]


def old_method(rev: str, module, cls: str, name: str):
    """`cls.name` as revision `rev`'s source of `module` defines it, compiled in the current module's namespace."""
    rel = Path(module.__file__).resolve().relative_to(ROOT)
    src = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    ns = dict(vars(module))
    exec(compile(src, f"{rev}:{rel}", "exec"), ns)
    return getattr(ns[cls], name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="3a0baeb")
    ap.add_argument("--width", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    p = load(quantize="auto", quiet=True)
    prompts = [data.encode_chat(p.tokenizer, x) for kind in data.heldout_prompts(2, 2, 2).values() for x in kind]
    arms = {
        "old": {(proposers.DrafterProposer, "_draft_tree"): old_method(a.rev, proposers, "DrafterProposer",
                                                                       "_draft_tree"),
                (drafter.DFlashDrafter, "draft_hidden"): old_method(a.rev, drafter, "DFlashDrafter", "draft_hidden")},
        "new": {(proposers.DrafterProposer, "_draft_tree"): proposers.DrafterProposer._draft_tree,
                (drafter.DFlashDrafter, "draft_hidden"): drafter.DFlashDrafter.draft_hidden},
    }
    times: dict[str, list[float]] = collections.defaultdict(list)
    arm = ["new"]

    def timed(self, *args, **kw):
        t = time.perf_counter()
        out = arms[arm[0]][(proposers.DrafterProposer, "_draft_tree")](self, *args, **kw)
        times[arm[0]].append(time.perf_counter() - t)
        return out

    for r in range(a.rounds):
        for ids in prompts:
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                arm[0] = name
                drafter.DFlashDrafter.draft_hidden = arms[name][(drafter.DFlashDrafter, "draft_hidden")]
                proposers.DrafterProposer._draft_tree = timed
                for _ in speculative.generate_tokens(p.target, ids, max_new_tokens=a.tokens, stop_token_ids=[],
                                                     drafter=p.drafter, block_size=a.width):
                    pass
    print(f"width {a.width}, {len(prompts)} prompts x {a.rounds} rounds, {a.tokens} tokens; ms per draft "
          f"(old: {a.rev}'s _draft_tree and draft_hidden):")
    for name in ("old", "new"):
        v = sorted(times[name])
        print(f"{name:4s} {len(v)} drafts: median {v[len(v) // 2] * 1e3:.3f}, quartiles {v[len(v) // 4] * 1e3:.3f} / "
              f"{v[3 * len(v) // 4] * 1e3:.3f}")


if __name__ == "__main__":
    sys.exit(main())
