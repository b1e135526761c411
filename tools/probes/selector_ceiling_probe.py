"""How far any candidate selector could take the shipped drafter's chains: the drafter alone at block 16 (chains, no
lookup, no fallback, no adaptive width; the default Q4_1 weights, greedy, the held-out prompts), each cycle's top-k
candidates per position (over the draft vocabulary) beside the target's own tokens at those positions (the final
output, which greedy decoding makes the same whatever drafts). A perfect selector picks the target's token wherever
it is among the k candidates, so a cycle keeps the positions up to the first one where it is not:

  top-k everywhere       a selector that could also change position 1's pick (DFlash2's selector sees the anchor,
                         which the drafter already has as its block's first token)
  top-1, then top-k      position 1 as the drafter picks it, a perfect choice among k from position 2 on

Tokens per verify pass (bonus included) as a per-prompt mean, the figure of docs/training.md's held-out table;
top-1 everywhere is the drafter's own chain.

    python tools/probes/selector_ceiling_probe.py [--per-kind 4] [--tokens 256]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflash_torch import data
from dflash_torch.decoding import proposers
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load

KS = (1, 2, 4, 8)


def kept(truth: list[int], cand: list[list[int]], k: int, first: int) -> int:
    """Tokens of a cycle under a perfect selector: 1 + the positions until the target's token is not among the
    candidates (the first `first` of them at position 1, the first k after)."""
    n = 0
    while n < min(len(truth), len(cand)) and truth[n] in cand[n][: first if n == 0 else k]:
        n += 1
    return 1 + n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(2)
    p = load(quantize="auto", quiet=True)
    proposers.TREES = False
    d, propose = p.drafter, p.drafter.propose
    vocab = d.draft_vocab
    cycles: list[tuple[int, list[list[int]]]] = []  # (tokens emitted before the draft, candidates [bs - 1][8])
    stats = Stats()

    def recording(target, block, ctx, cache, full=True):
        logits = propose(target, block, ctx, cache, full)
        top = logits[0].float().topk(max(KS), dim=-1).indices  # [bs - 1, 8]
        cycles.append((stats.generated_tokens, (top if vocab is None else vocab[top]).tolist()))
        return logits

    d.propose = recording
    loop, every, later = [], {k: [] for k in KS}, {k: [] for k in KS}
    for chats in data.heldout_prompts(args.per_kind, args.per_kind, args.per_kind).values():
        for msgs in chats:
            cycles.clear()
            stats = Stats()
            ids = data.encode_chat(p.tokenizer, msgs)
            out = list(generate_tokens(p.target, ids, max_new_tokens=args.tokens, drafter=d, block_size=16,
                                       stop_token_ids=p.stop_token_ids, stats=stats))
            loop.append(stats.acceptance_length_mean)
            for k in KS:  # the block's first token is out[n - 1]; its drafts stand for out[n:]
                every[k].append(statistics.mean(kept(out[n : n + 15], c, k, k) for n, c in cycles))
                later[k].append(statistics.mean(kept(out[n : n + 15], c, k, 1) for n, c in cycles))
    d.propose = propose
    print(f"{len(loop)} prompts; the loop's chain: {statistics.mean(loop):.3f} tokens per pass")
    for k in KS:
        print(f"perfect selector among {k}: top-{k} everywhere {statistics.mean(every[k]):.3f}; "
              f"top-1, then top-{k} {statistics.mean(later[k]):.3f}")


if __name__ == "__main__":
    main()
