"""Prompt lookup: a second, free proposer beside the drafter.

Models repeat themselves: code echoes the prompt's identifiers, lists repeat their scaffolding, and
a small model at length falls into loops. When the last n committed tokens occurred earlier in the
context, the tokens that followed that occurrence are a draft that costs no forward pass. The
speculative loop verifies it exactly like a drafter's block, so output is unchanged.

The draft width is chosen like the adaptive block size: from the running acceptance per draft
position and the measured seconds of a verify pass per width, the width with the most expected
tokens per second (width 1 = no draft). On a CPU a wide verify costs several decode steps and
some widths cost more than wider ones (matmul kernels tile rows), so the costs are measured, not
assumed; a wrong guess then costs a narrow verify while a loop is copied at full width.
"""

from __future__ import annotations

from collections.abc import Iterable

UNSEEN_RATIO = 0.85  # prior: P(keep position k + 1 | kept k) for positions not yet checked
# A verify width's measured cost is forgotten after this many passes without one of its width, so that it is priced
# from the widths measured since (and tried again where that pays). Without it, one slow pass (a host's busy moment,
# a collection) priced its width out for good: nothing re-measures a width that is never drafted (docs/performance.md,
# "What a pass costs around its kernels").
STALE_PASSES = 256


class VerifyCosts(dict):
    """Seconds per verify width (a dict of width -> seconds) that remembers when each width was last measured, for
    `DraftPricing`: prompt lookup and the datastore share one, and a server carries it from request to request."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.passes = 0  # passes observed
        self.seen: dict[int, int] = {w: 0 for w in self}  # width -> `passes` at its last measurement

    def measure(self, width: int, seconds: float, decay: float) -> None:
        """One pass of `width`: its moving average, then the widths not measured for STALE_PASSES passes forgotten
        (a plain step's width 1 is measured whenever nothing drafts, and stays)."""
        self.passes += 1
        old = self.get(width)
        self[width] = seconds if old is None else decay * old + (1 - decay) * seconds
        self.seen[width] = self.passes
        for w in [w for w, at in self.seen.items() if w != 1 and self.passes - at > STALE_PASSES]:
            del self[w], self.seen[w]


class DraftPricing:
    """How far to draft a free draft (one that costs no forward pass): the running acceptance per draft
    position and the measured seconds of a verify pass per width. A source of such drafts adds
    `match(limit)` and `extend(tokens)` (PromptLookup below, datastore.StoreLookup).

    max_draft: most tokens per draft. decay: weight kept by old acceptance counts and costs per observation.
    """

    def __init__(self, max_draft: int = 15, decay: float = 0.8) -> None:
        if max_draft < 1:
            raise ValueError("max_draft must be >= 1")
        self.max_draft, self.decay = max_draft, decay
        self.accepted = [0.0] * max_draft  # [k]: decayed count of drafts whose first k + 1 tokens were kept
        self.checked = [0.0] * max_draft
        self.costs: dict[int, float] = VerifyCosts()  # verify width -> seconds per cycle (moving average)

    def expected_tokens(self, width: int) -> float:
        """Expected committed tokens of a verify pass of `width` positions with a lookup draft."""
        total = 1.0
        for r in self._kept_odds(width - 1):
            total += r
        return total

    def _kept_odds(self, n: int):
        """For draft positions k = 0 .. n - 1: the chance that the first k + 1 drafted tokens are all kept."""
        r = 1.0
        for k in range(n):
            if self.checked[k] > 0.5:
                # never above the position before: keeping k + 1 tokens needs the first k kept
                r = min(r, self.accepted[k] / self.checked[k])
            else:
                # a position rarely checked: a prior, so it gets tried. The first gets an even
                # chance; each later one keeps UNSEEN_RATIO of the one before, so an untested wide
                # draft is not valued as a flat run of coin flips (on a CPU where a 16-wide verify
                # costs several steps, that flat prior kept paying for wide drafts that missed).
                r = min(r, 0.5) if k == 0 else r * UNSEEN_RATIO
            yield r

    def cost(self, width: int) -> float:
        """Seconds of a verify pass of `width` positions: measured; else interpolated between the measured
        widths around it, or past the widest one at the last two's cost per row (never cheaper than the
        widest), so an untried width is tried once and then known. (Taking the nearest measured width
        instead priced a 9-wide pass as a 3-wide one after a long prompt, where it cost 2.5 times as much:
        docs/performance.md, "Adaptive block size by default".)"""
        c = self.costs
        if not c:
            return 1.0
        at = between(c, width)
        if at is not None:
            return at
        if width < min(c):
            return c[min(c)]
        lo = max(c)
        below = [w for w in c if w < lo]
        per_row = max(0.0, (c[lo] - c[max(below)]) / (lo - max(below))) if below else 0.0
        return c[lo] + per_row * (width - lo)

    def draft_length(self, available: int) -> int:
        """How many of `available` matched tokens to draft: the verify width with the most expected
        tokens per second, less one (0 when no draft beats a plain step; the narrowest of equals). Each
        width's expected tokens are expected_tokens(width)'s sum, kept running from width to width: every
        cycle asks this of prompt lookup and the datastore, and width by width from scratch it cost tens of
        microseconds a cycle in Python."""
        best, rate, total = 0, 1.0 / self.cost(1), 1.0
        for k, r in enumerate(self._kept_odds(min(available, self.max_draft))):
            total += r
            if total / self.cost(k + 2) > rate:
                best, rate = k + 1, total / self.cost(k + 2)
        return best

    def observe(self, checked: int, kept: int, drafted: bool = True) -> None:
        """A draft whose first `checked` tokens were compared with the target's and whose first
        `kept` of them matched; drafted=False: a match that was not used, checked against the new
        tokens as far as they go."""
        # Only the positions checked learn: a plain step's counterfactual checks the first position
        # alone and must not wash out what is known of the far ones.
        for k in range(min(checked, self.max_draft)):
            self.accepted[k] = self.decay * self.accepted[k] + (k < kept)
            self.checked[k] = self.decay * self.checked[k] + 1
        if drafted and kept == checked:  # a draft kept whole: the positions past it may be better now
            for k in range(checked, self.max_draft):
                self.accepted[k] = self.checked[k] = 0.0

    def observe_cost(self, width: int, seconds: float) -> None:
        """Seconds of one verify pass of `width` positions (plain steps are width 1). A `VerifyCosts` table also
        forgets the widths not measured for STALE_PASSES passes; a plain dict keeps every width's last average."""
        if isinstance(self.costs, VerifyCosts):
            self.costs.measure(width, seconds, self.decay)
            return
        old = self.costs.get(width)
        self.costs[width] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds


class PromptLookup(DraftPricing):
    """An n-gram index over the committed tokens, proposing continuations of the longest match.

    min_n / max_n: n-gram lengths tried, longest first; max_draft, decay: `DraftPricing`'s.
    """

    def __init__(self, tokens: Iterable[int] = (), *, min_n: int = 2, max_n: int = 8, max_draft: int = 15,
                 decay: float = 0.8) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        super().__init__(max_draft, decay)
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # index[n][ngram] = where the continuation of that n-gram's latest occurrence starts
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens to the index."""
        for tok in tokens:
            self.tokens.append(tok)
            j = len(self.tokens) - 1  # the n-gram ending just before j is now followed by tok
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self.index[n][tuple(self.tokens[j - n : j])] = j

    def match(self, limit: int) -> list[int]:
        """Up to `limit` tokens continuing the longest matched n-gram; [] when the context's tail
        occurred nowhere before."""
        toks = self.tokens
        k = min(limit, self.max_draft)
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            start = self.index[n].get(tuple(toks[-n:]))
            if start is None or k < 1:
                continue
            draft: list[int] = []
            for i in range(k):
                j = start + i
                # past the end of the context the copy continues from itself: a loop of period
                # len(toks) - start is proposed in full
                draft.append(toks[j] if j < len(toks) else draft[j - len(toks)])
            return draft
        return []


def between(table: dict[int, float], x: int) -> float | None:
    """table[x], else linear between the keys around x; None where x lies outside the keys (the caller's
    extrapolation). For costs and growths per verify width (here and in adaptive.py)."""
    if x in table:
        return table[x]
    lower, upper = [k for k in table if k < x], [k for k in table if k > x]
    if not (lower and upper):
        return None
    lo, hi = max(lower), min(upper)
    return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
