"""How many tokens a verify pass would commit if it checked a tree of the drafter's candidates instead of
one chain: the drafter's top-k at each block position, the tree's nodes chosen by their estimated chance
of being on the target's path.

For each held-out prompt (the ones `dflash train --eval` uses) the target's greedy reply is generated, the
drafter's block is computed at every anchor of it (teacher-forced, the context features of one target pass
over prompt + reply: the loop computes the same drafts, tools/probes/seen_prompts_probe.py), and the rank of
the target's token among the drafter's logits is kept for every block position. A tree is a set of rank
paths closed under prefixes; at an anchor it keeps the longest path whose ranks are all the target's ranks.
Then the loop is replayed: anchor -> anchor + kept + 1. The trees: the chain (what the loop verifies today)
and, for each size, the nodes of highest probability under the ranks' frequencies measured per position
(over the same prompts: an upper estimate for a tree fixed in advance), and per anchor, the nodes of highest
probability under the drafter's own probabilities of its candidates at that anchor ("dynamic").

    python tools/probes/tree_probe.py --per-kind 4 --sizes 3,7,15
"""

from __future__ import annotations

import argparse
import heapq
import statistics

import torch
from seen_prompts_probe import anchor_logits, load_float32  # (this folder: a script's own is on the path)

from dflash_torch import data
from dflash_torch.decoding.speculative import generate_tokens


@torch.no_grad()
def anchor_ranks(target, drafter, toks: list[int], p: int, depth: int, kmax: int = 8):
    """({anchor: [rank of the target's token at block position 1 .. depth]}, {anchor: the drafter's own
    probabilities of its top kmax candidates per position [depth][kmax]}) over reply toks[p:]."""
    n, out, probs = len(toks), {}, {}
    vocab = getattr(drafter, "draft_vocab", None)
    for part, logits in anchor_logits(target, drafter, toks, p):  # [A, B - 1, V']
        top = logits[:, :depth].float().softmax(-1).topk(kmax, dim=-1).values  # [A, depth, kmax]
        for j, a in enumerate(part):
            probs[a] = top[j].tolist()
            ranks = []
            for k in range(min(depth, n - 1 - a)):
                true = toks[a + 1 + k]
                row = logits[j, k]
                if vocab is not None:  # the drafter's logits over its own vocabulary
                    hit = (vocab == true).nonzero()
                    if len(hit) == 0:
                        ranks.append(10**6)
                        continue
                    score = row[hit[0, 0]]
                else:
                    score = row[true]
                ranks.append(int((row > score).sum()))  # ties counted in the token's favour
            out[a] = ranks
    return out, probs


def best_tree(freq: list[list[float]], size: int, kmax: int) -> list[tuple[int, ...]]:
    """The `size` rank paths of highest probability (position ranks independent, frequencies freq[pos][rank])."""
    heap = [(-freq[0][r], (r,)) for r in range(kmax)]
    heapq.heapify(heap)
    tree = []
    while heap and len(tree) < size:
        negp, path = heapq.heappop(heap)
        tree.append(path)
        if len(path) < len(freq):
            for r in range(kmax):
                heapq.heappush(heap, (negp * freq[len(path)][r], path + (r,)))
    return tree


def kept(tree: set[tuple[int, ...]], ranks: list[int]) -> int:
    d = 0
    while d < len(ranks) and tuple(ranks[: d + 1]) in tree:
        d += 1
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="dflash_torch/drafters/smollm2-135m-instruct")
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--sizes", default="3,7,15", help="tree sizes (drafted tokens per pass) to try")
    ap.add_argument("--kmax", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok, stops, drafter = load_float32(args.drafter)
    depth = drafter.block_size - 1
    replies = []
    for kind, chats in data.heldout_prompts(args.per_kind, args.per_kind, args.per_kind).items():
        for msgs in chats:
            ids = data.encode_chat(tok, msgs)
            out = [int(t) for t in generate_tokens(target, ids, max_new_tokens=args.tokens, stop_token_ids=stops)]
            ranks, probs = anchor_ranks(target, drafter, ids + out, len(ids), depth, args.kmax)
            replies.append((kind, len(ids), ranks, len(ids + out), probs))
            print(f"{kind}: {len(out)} tokens", flush=True)
    freq = [[0.0] * args.kmax for _ in range(depth)]
    for _, _, ranks, _, _ in replies:
        for r in ranks.values():
            for k, x in enumerate(r):
                if x < args.kmax:
                    freq[k][x] += 1
    for k in range(depth):
        total = sum(len(r) > k for _, _, ranks, _, _ in replies for r in ranks.values())
        freq[k] = [f / max(total, 1) for f in freq[k]]
    print("rank frequencies at positions 1..4 (ranks 0..kmax-1):")
    for k in range(4):
        print(f"  pos {k + 1}: " + " ".join(f"{f:.3f}" for f in freq[k]))
    trees = {"chain-15": {tuple([0] * d) for d in range(1, depth + 1)}}
    for d in (3, 7):
        trees[f"chain-{d}"] = {tuple([0] * i) for i in range(1, d + 1)}
    for s in (int(x) for x in args.sizes.split(",")):
        trees[f"tree-{s}"] = set(best_tree(freq, s, args.kmax))
    sizes = [int(x) for x in args.sizes.split(",")]
    for name, tree in [*trees.items(), *((f"dynamic-{s}", s) for s in sizes)]:
        per_kind: dict[str, list[float]] = {}
        for kind, p, ranks, n, probs in replies:
            a, cycles = p, 0
            while a < n - 1:
                # dynamic: this anchor's likeliest paths under the drafter's own probabilities
                t = set(best_tree(probs[a], tree, args.kmax)) if isinstance(tree, int) else tree
                a += kept(t, ranks[a]) + 1
                cycles += 1
            per_kind.setdefault(kind, []).append((n - 1 - p) / cycles)
        means = {k: statistics.mean(v) for k, v in per_kind.items()}
        allm = statistics.mean(x for v in per_kind.values() for x in v)
        shape = "" if not name.startswith("tree") else " " + " ".join("".join(map(str, q)) for q in sorted(tree, key=len))  # noqa: E501
        print(f"{name:9s} " + " ".join(f"{k} {v:.3f}" for k, v in means.items()) + f"  mean {allm:.3f}{shape}",
              flush=True)


if __name__ == "__main__":
    main()
