"""In-process A/B of a greedy tree draft's parts: the drafter alone at a fixed width, held-out prompts (2 per kind,
96 tokens, no stop token), the two arms alternating prompt by prompt (their order reversed every round); the median
time of a whole draft (`DrafterProposer._draft_tree`: block, pass, candidates, tree) and of the selector's chances
(`CandidateSelector.transitions`). --compare picks the arms:

  attention  PyTorch's attention in draft_stack (`sdpa`: DFLASH_DRAFT_SDPA set, which only a build with
             `draft_attention_sdpa.patch` applied reads) against kernels/attention.cpp's full_attention (`kernel`)
  python     revision --rev's `_draft_tree` and `draft_hidden` (`old`; default 3a0baeb: a top-k and a logsumexp for
             the candidates, the signed sines made each pass) against the working tree's (`new`)
  loops      draft_stack's operators (`ops`: the rotary tables as strided views of the same values, which send it down
             that path) against its plain loops for the q/k norms, rotations and cache writes (`loops`)
  selector   the selector's chances in torch operators (`torch`: kernels/reference.py) against kernels/selector.cpp

    python docs/bench/cpu-avx2-zen3/draft_ab.py --compare attention|python|loops|selector [--width 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import time
from pathlib import Path

import torch

from dflash_torch import data, kernels
from dflash_torch.decoding import dflash2, drafter, proposers, speculative
from dflash_torch.generate import load
from dflash_torch.kernels import reference

ROOT = Path(__file__).resolve().parents[3]


def old_method(rev: str, module, cls: str, name: str):
    """`cls.name` as revision `rev`'s source of `module` defines it, compiled in the current module's namespace."""
    rel = Path(module.__file__).resolve().relative_to(ROOT)
    src = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    ns = dict(vars(module))
    exec(compile(src, f"{rev}:{rel}", "exec"), ns)
    return getattr(ns[cls], name)


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in rows twice as far apart."""
    return torch.zeros(*t.shape[:-1], 2 * t.shape[-1]).narrow(-1, 0, t.shape[-1]).copy_(t)


def arms(compare: str, pipe, rev: str) -> dict:
    """Two arms: name -> a function that switches the process to that arm (and returns the `_draft_tree` it runs)."""
    tree, hidden = proposers.DrafterProposer._draft_tree, drafter.DFlashDrafter.draft_hidden
    if compare == "attention":
        def env(on):
            def switch():
                if on:
                    os.environ["DFLASH_DRAFT_SDPA"] = "1"
                else:
                    os.environ.pop("DFLASH_DRAFT_SDPA", None)
                return tree
            return switch
        return {"sdpa": env(True), "kernel": env(False)}
    if compare == "python":
        old_tree = old_method(rev, proposers, "DrafterProposer", "_draft_tree")
        old_hidden = old_method(rev, drafter, "DFlashDrafter", "draft_hidden")

        def methods(t, h):
            def switch():
                drafter.DFlashDrafter.draft_hidden = h
                return t
            return switch
        return {"old": methods(old_tree, old_hidden), "new": methods(tree, hidden)}
    if compare == "loops":
        rot = pipe.drafter.rotary
        rot._table(4096, torch.float32)  # (long enough for every prompt here: never grown, so never replaced)
        key = (torch.float32, rot.inv_freq.device)
        tables = {"loops": rot._tables[key]}
        tables["ops"] = tables["loops"][:2] + tuple(strided(t) for t in tables["loops"][2:])

        def table(name):
            def switch():
                rot._tables[key] = tables[name]
                return tree
            return switch
        return {"ops": table("ops"), "loops": table("loops")}
    if compare == "selector":
        def path(fn):
            def switch():
                dflash2.kernels.selector_chances = fn
                return tree
            return switch
        return {"torch": path(reference.selector_chances), "kernel": path(kernels.selector_chances)}
    raise SystemExit(f"unknown --compare {compare!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", required=True, choices=("attention", "python", "loops", "selector"))
    ap.add_argument("--rev", default="3a0baeb", help="--compare python: the old arm's revision")
    ap.add_argument("--width", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    p = load(quantize="auto", quiet=True)
    prompts = [data.encode_chat(p.tokenizer, x) for kind in data.heldout_prompts(2, 2, 2).values() for x in kind]
    switches = arms(a.compare, p, a.rev)
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    now = {"arm": "", "tree": proposers.DrafterProposer._draft_tree}
    chances = dflash2.CandidateSelector.transitions

    def timed_tree(self, *args, **kw):
        t = time.perf_counter()
        out = now["tree"](self, *args, **kw)
        times[now["arm"], "draft"].append(time.perf_counter() - t)
        return out

    def timed_chances(self, *args, **kw):
        t = time.perf_counter()
        out = chances(self, *args, **kw)
        times[now["arm"], "transitions"].append(time.perf_counter() - t)
        return out

    proposers.DrafterProposer._draft_tree = timed_tree
    dflash2.CandidateSelector.transitions = timed_chances
    names = list(switches)
    for r in range(a.rounds):
        for ids in prompts:
            for name in names if r % 2 == 0 else names[::-1]:
                now["arm"], now["tree"] = name, switches[name]()
                for _ in speculative.generate_tokens(p.target, ids, max_new_tokens=a.tokens, stop_token_ids=[],
                                                     drafter=p.drafter, block_size=a.width):
                    pass
    print(f"--compare {a.compare}: width {a.width}, {len(prompts)} prompts x {a.rounds} rounds, {a.tokens} tokens; "
          "medians in ms")
    for name in names:
        d, c = sorted(times[name, "draft"]), sorted(times[name, "transitions"])
        chance = f", the selector's chances {c[len(c) // 2] * 1e3:.3f}" if c else ""
        print(f"{name:7s} whole draft {d[len(d) // 2] * 1e3:.3f} (quartiles {d[len(d) // 4] * 1e3:.3f} / "
              f"{d[3 * len(d) // 4] * 1e3:.3f}, {len(d)} drafts){chance}")


if __name__ == "__main__":
    main()
