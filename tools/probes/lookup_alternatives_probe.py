"""How often a second prompt-lookup continuation would find what the first misses: on the target's greedy
output for each suite's first prompt (`--quantize auto`, `--tokens` new tokens, no EOS), at every position
where the committed tokens' tail occurred before, whether the first token of the latest occurrence's
continuation (what `lookup.PromptLookup` drafts) is the target's next token, and whether it is for the best of
the first 2 or 3 continuations with distinct first tokens (older occurrences of the same n-gram, then shorter
n-grams). A tree pass could verify those alternatives beside the first (`Draft.parents`).

    python tools/probes/lookup_alternatives_probe.py --tokens 1024
"""

from __future__ import annotations

import argparse

import torch

from dflash_torch import bench_prompts
from dflash_torch.decoding.speculative import generate_tokens
from dflash_torch.generate import load


def continuations(toks: list[int], min_n: int = 2, max_n: int = 8, k: int = 15, alts: int = 3) -> list[list[int]]:
    """Up to `alts` continuations with distinct first tokens: the longest matching n-gram's occurrences, latest
    first, then shorter n-grams' (a continuation past the end repeats itself, as PromptLookup's does)."""
    out, firsts, n_toks = [], set(), len(toks)
    for n in range(min(max_n, n_toks - 1), min_n - 1, -1):
        tail = toks[-n:]
        for s in range(n_toks - n - 1, -1, -1):
            if toks[s : s + n] != tail:
                continue
            d: list[int] = []
            for i in range(k):
                j = s + n + i
                d.append(toks[j] if j < n_toks else d[j - n_toks])
            if d[0] not in firsts:
                firsts.add(d[0])
                out.append(d)
                if len(out) >= alts:
                    return out
    return out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--quantize", default="auto")
    args = ap.parse_args()
    p = load(quantize=args.quantize, quiet=True)
    for suite in ("chat", "code", "math", "humaneval"):
        prompt = bench_prompts.collect_prompts(suite, None, 1)[suite][0]
        ids = bench_prompts.encode(p, prompt)
        full = ids + list(generate_tokens(p.target, ids, max_new_tokens=args.tokens))
        matched, right = 0, [0, 0, 0]
        for pos in range(len(ids), len(full) - 1):
            cands = continuations(full[: pos + 1])
            if not cands:
                continue
            matched += 1
            for i in range(3):
                right[i] += any(c[0] == full[pos + 1] for c in cands[: i + 1])
        print(f"{suite:9s} positions with a match {matched} of {len(full) - 1 - len(ids)}; first token right: "
              f"latest {right[0]}, best of 2 {right[1]}, best of 3 {right[2]}", flush=True)


if __name__ == "__main__":
    main()
