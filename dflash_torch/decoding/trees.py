"""Tree drafts: a verify pass over several candidates per block position instead of one chain.

A DFlash drafter scores every block position in one pass. Its first choice at position 1 is the target's
token about 38% of the time (the shipped SmolLM2 drafter on held-out prompts), its second choice another
14%, its third 6%: a chain verifies only the first. A tree verifies the paths most likely to be the
target's: a *shape* is a list of rank paths, e.g. (0,), (1,), (0, 0), (2,), .. where (1, 0) means "the
drafter's second choice at position 1, then its first choice at position 2" (a DFlash drafter's position 2
does not depend on which token fills position 1, so every node at one depth picks from the same list).
The verify pass runs each node as a row attending to its own ancestors (`Model.forward(parents=...)`,
the same bits as decode steps along that path); the loop keeps the longest path whose every token is
the target's choice after its parent, plus the target's next token, as a chain keeps its prefix.

Which paths: each cycle, the likeliest under the drafter's own probabilities of its candidates, as many as the
cycle's width allows (`best_shape`): deep where the drafter is sure, wide where it is not. The rank
frequencies measured over the cycles (`RankStats`, learnt from every cycle's committed tokens) price each
width for the adaptive controller. Replayed on held-out prompts (`tools/probes/tree_probe.py`): tokens per
verify pass 1.50 for the chain of 15; for trees of 3 / 7 / 15 nodes 1.60 / 1.79 / 1.94 with the paths
fixed by measured rank frequencies, 1.65 / 1.85 / 2.02 with each cycle's own likeliest paths.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

KMAX = 8  # candidates per position a tree may take


@dataclass
class Shape:
    """A tree of rank paths: paths[i] is row i + 1 of the verify pass (row 0 is the last committed token)."""

    paths: list[tuple[int, ...]]
    parents: list[int] = field(init=False)  # per row, its parent row (-1 for row 0)
    depth: int = field(init=False)  # the longest path: block positions the drafter must fill

    def __post_init__(self) -> None:
        row = {p: i + 1 for i, p in enumerate(self.paths)}
        self.parents = [-1] + [row[p[:-1]] if len(p) > 1 else 0 for p in self.paths]
        self.depth = max((len(p) for p in self.paths), default=0)

    @property
    def chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents) if i)

    def tokens(self, root: int, top: list[list[int]]) -> list[int]:
        """The pass's tokens: root, then each path's last rank at its depth from top[depth - 1] (candidate
        token ids per position, best first)."""
        return [root] + [top[len(p) - 1][p[-1]] for p in self.paths]


def probability(freq: list[list[float]], path: tuple[int, ...]) -> float:
    """The chance that every rank of `path` is the target's, taking the positions as independent."""
    p = 1.0
    for k, r in enumerate(path):
        p *= freq[k][r] if k < len(freq) and r < len(freq[k]) else 0.0
    return p


def best_shape(freq: list[list[float]], nodes: int, trans: list[list[list[float]]] | None = None) -> Shape:
    """The `nodes` likeliest rank paths, each after its prefix, the chain of each node's likeliest child first
    (rows that attend as a chain cost least; for ranks by probability, the all-first-choices chain).

    freq[k][r]: the chance that the target's token at position k + 1 is the drafter's rank r there. With
    `trans` (a drafter whose positions depend on each other: a candidate selector), position k + 1 > 1 takes
    trans[k - 1][q][r] instead: the chance of rank r there given rank q at position k."""
    kmax = max((len(f) for f in freq), default=1)
    heap = [(-freq[0][r], (r,)) for r in range(len(freq[0]))] if freq else []
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    first_child: dict[tuple[int, ...], tuple[int, ...]] = {}
    while heap and len(chosen) < nodes:
        negp, path = heapq.heappop(heap)  # a prefix is at least as likely as its extensions: popped first
        chosen.append(path)
        first_child.setdefault(path[:-1], path)  # popped in order of probability: its parent's likeliest
        k = len(path)
        if k < len(freq):
            row = trans[k - 1][path[-1]] if trans is not None else freq[k]
            for r in range(min(kmax, len(row))):
                heapq.heappush(heap, (negp * row[r], path + (r,)))
    spine, node = [], ()
    while node in first_child:
        node = first_child[node]
        spine.append(node)
    taken = set(spine)
    return Shape(spine + [p for p in chosen if p not in taken])


def walk(parents: list[int], tokens: list[int], choice: list[int]) -> tuple[list[int], int]:
    """Acceptance in a tree: from row 0, step to the child whose token is the target's choice at the current
    row, while there is one. -> (the rows of the kept path, root first; the target's next token)."""
    children: dict[tuple[int, int], int] = {}
    for i in range(1, len(parents)):
        children.setdefault((parents[i], tokens[i]), i)
    rows = [0]
    while (rows[-1], choice[rows[-1]]) in children:
        rows.append(children[rows[-1], choice[rows[-1]]])
    return rows, choice[rows[-1]]


def shared_ranks(drafter) -> RankStats:
    """The drafter's rank statistics, kept on it across generations (a server's requests learn together)."""
    ranks = getattr(drafter, "tree_ranks", None)
    if ranks is None:
        ranks = drafter.tree_ranks = RankStats(drafter.block_size - 1)
    return ranks


class RankStats:
    """How often the target's token is the drafter's rank r at block position k, learnt from each cycle
    (the committed tokens are the target's choices; position k's are known when the first k - 1 were kept,
    so depth k's frequencies are those given that the tree held the path to it), from a prior of a few
    cycles' weight. `shape(nodes)` is cached and rebuilt as the counts move."""

    PRIOR_WEIGHT = 8.0
    REBUILD_EVERY = 16

    def __init__(self, depth: int, kmax: int = KMAX) -> None:
        self.depth, self.kmax = depth, kmax
        # prior: the first choice kept a third of the time at position 1, less further on, ranks halving
        self.counts = [[self.PRIOR_WEIGHT * 0.35 * 0.75**k * 0.5**r for r in range(kmax)] for k in range(depth)]
        self.totals = [self.PRIOR_WEIGHT] * depth
        self.shapes: dict[int, Shape] = {}
        # expected_tokens per width, until the counts move: the adaptive width prices every width each cycle the
        # drafter might run (16 widths, each a sum over its shape's paths: 0.3-0.5 ms a cycle on AMD Zen 3, "The Python
        # around a pass" in docs/performance.md),
        # and between two drafter cycles nothing it reads changes
        self.expected: dict[int, float] = {}
        self.seen = 0

    def freq(self) -> list[list[float]]:
        return [[c / t for c in row] for row, t in zip(self.counts, self.totals)]

    def shape(self, nodes: int) -> Shape:
        if nodes not in self.shapes:
            self.shapes[nodes] = best_shape(self.freq(), nodes)
        return self.shapes[nodes]

    def expected_tokens(self, width: int) -> float:
        """Tokens a verify pass of `width` rows is expected to commit: 1 + each node's chance to be kept."""
        if width < 2:
            return 1.0
        e = self.expected.get(width)
        if e is None:
            freq = self.freq()
            e = self.expected[width] = 1.0 + sum(probability(freq, p) for p in self.shape(width - 1).paths)
        return e

    def observe(self, top: list[list[int]], new: list[int]) -> None:
        """top[k]: the candidates drafted for position k + 1 (best first); new: the tokens committed after the
        root (new[k] the target's at position k + 1)."""
        for k in range(min(len(top), len(new), self.depth)):
            cands = top[k]
            if new[k] in cands:
                self.counts[k][cands.index(new[k])] += 1.0
            self.totals[k] += 1.0
        self.expected.clear()
        self.seen += 1
        if self.seen % self.REBUILD_EVERY == 0:
            self.shapes.clear()
