"""Sampling under a grammar through DFlash is distributed exactly as target-only sampling under it (apart from
test_sampling.py so that the two files' thousands of generations can run on two test workers at once)."""

from __future__ import annotations

import pytest
import torch

from dflash_torch.decoding.sampling import Sampler
from dflash_torch.decoding.speculative import Stats, generate_tokens

from .test_sampling import SAMPLES, VOCAB, K, _chi2_pvalue, _exact_joint


class NoRepeat:
    """A grammar for the loop's constraint hooks (structured.Constraint's interface): a token may not
    follow itself. Drafts are proposed unmasked, so refused drafts reach the verify pass."""

    def __init__(self, last: int) -> None:
        self.last, self.stops = last, set()

    def mask(self, drafts: list[int], rows: int) -> torch.Tensor:
        out, prev = torch.ones(rows, VOCAB, dtype=torch.bool), self.last
        for i in range(rows):  # row i follows drafts[:i]
            out[i, prev] = False
            prev = drafts[i] if i < len(drafts) else prev
        return out

    def draft(self, draft_logits, sampler):
        return sampler.draft(draft_logits)

    def forced(self, limit: int) -> list[int]:
        return []  # this grammar never leaves a single choice

    def allowed_prefix(self, tokens: list[int]) -> int:
        prev, n = self.last, 0
        for t in tokens:
            if t == prev:
                break
            prev, n = t, n + 1
        return n

    def commit(self, tokens: list[int]) -> None:
        self.last = tokens[-1]


class ZeroThenOne(NoRepeat):
    """NoRepeat, and after a 0 only a 1: a forced token, which the loop drafts for free."""

    def mask(self, drafts: list[int], rows: int) -> torch.Tensor:
        out, prev = super().mask(drafts, rows), self.last
        for i in range(rows):
            if prev == 0:
                out[i] = False
                out[i, 1] = True
            prev = drafts[i] if i < len(drafts) else prev
        return out

    def forced(self, limit: int) -> list[int]:
        return [1][:limit] if self.last == 0 else []

    def allowed_prefix(self, tokens: list[int]) -> int:
        n = super().allowed_prefix(tokens)
        prev = self.last
        for i, t in enumerate(tokens[:n]):
            if prev == 0 and t != 1:
                return i
            prev = t
        return n


@pytest.mark.parametrize("grammar", [NoRepeat, ZeroThenOne], ids=lambda g: g.__name__)
def test_sampling_under_a_grammar_matches_target_distribution(small_vocab, grammar):
    """Sampling under a grammar through DFlash (drafter, lookup and, for ZeroThenOne, forced drafts):
    distributed exactly as target-only sampling under it."""
    target, drafter = small_vocab
    prompt, n = [1, 3, 0, 2], SAMPLES
    exact = _exact_joint(target, prompt, Sampler(1.0), grammar=grammar)
    counts, accepted, forced = {}, 0, 0
    for i in range(n):
        stats = Stats()
        ids = tuple(generate_tokens(target, prompt, max_new_tokens=K, drafter=drafter, block_size=4, lookup=True,
                                    sampler=Sampler(1.0, seed=i), stats=stats, constraint=grammar(prompt[-1])))
        counts[ids] = counts.get(ids, 0) + 1
        accepted, forced = accepted + stats.accepted_tokens, forced + stats.forced_cycles
    assert all(a != b for ids in counts for a, b in zip((prompt[-1],) + ids, ids))  # the grammar held
    assert accepted > 0 and (forced > 0) == (grammar is ZeroThenOne)
    assert _chi2_pvalue(counts, exact, n) > 1e-3
