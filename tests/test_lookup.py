"""Prompt lookup: its index and draft width, and that drafts from it never change output."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.lookup import PromptLookup
from dflash_torch.decoding.sampling import Sampler
from dflash_torch.decoding.speculative import Stats, generate_tokens

from .conftest import make_drafter
from .test_lossless import clear_case
from .test_sampling import SAMPLES, K, _chi2_pvalue, _exact_joint


def test_match_copies_the_continuation_of_the_longest_ngram():
    lk = PromptLookup([5, 6, 7, 8, 1, 2, 6, 7, 9, 3, 5, 6, 7], min_n=2, max_n=4)
    # tail "5 6 7" occurred at the start (followed by 8 1 2); "6 7" alone last occurred before 9
    assert lk.match(3) == [8, 1, 2]
    lk.extend([4])
    assert lk.match(5) == []  # "7 4" never occurred


def test_match_extends_a_loop_past_the_end():
    lk = PromptLookup([1, 2, 3, 1, 2, 3, 1, 2])
    assert lk.match(7) == [3, 1, 2, 3, 1, 2, 3]
    assert lk.match(100) == [3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]  # max_draft (15)


def test_draft_length_follows_acceptance_and_cost():
    lk = PromptLookup([1, 2, 3, 1, 2])
    lk.observe_cost(1, 1.0)
    for w in range(2, 17):
        lk.observe_cost(w, 1.0 + 0.2 * (w - 1))  # each drafted position costs a fifth of a step
    for _ in range(30):  # loops: every drafted token kept
        lk.observe(15, 15)
    assert lk.draft_length(15) == 15
    for _ in range(30):  # now every first token is wrong
        lk.observe(15, 0)
    assert lk.draft_length(15) == 0  # a plain step beats any draft
    assert PromptLookup([1, 2]).match(4) == []


def test_draft_length_skips_a_width_that_measures_slow():
    lk = PromptLookup([1, 2, 3])
    for w, t in {1: 1.0, 2: 2.5, 3: 3.5, 4: 1.5, 5: 1.2}.items():  # odd widths slow, as CPU kernels can be
        lk.observe_cost(w, t)
    for _ in range(30):
        lk.observe(4, 4)
    assert lk.draft_length(4) == 4
    assert lk.draft_length(2) == 0  # widths 2-3 cost more than the 2-3 tokens they can give


def test_draft_length_is_the_width_with_the_most_tokens_per_second():
    """draft_length (a running sum over widths) picks what its definition does: the narrowest width w in
    1 .. available + 1 with the largest expected_tokens(w) / cost(w), less one; over random acceptance
    histories, measured and unmeasured widths, ties included."""
    rng = random.Random(7)
    for trial in range(300):
        lk = PromptLookup([1, 2, 3], max_draft=rng.choice([4, 15]))
        for w in rng.sample(range(1, lk.max_draft + 2), rng.randint(0, lk.max_draft + 1)):
            lk.observe_cost(w, rng.choice([1.0, 1.5, 2.0, rng.uniform(0.8, 3.0)]))
        for _ in range(rng.randint(0, 12)):
            checked = rng.randint(1, lk.max_draft)
            lk.observe(checked, rng.randint(0, checked), drafted=rng.random() < 0.7)
        for available in range(lk.max_draft + 1):
            want = max(range(1, available + 2), key=lambda w: lk.expected_tokens(w) / lk.cost(w)) - 1
            assert lk.draft_length(available) == want, (trial, available)


def test_a_width_priced_out_by_one_slow_pass_is_tried_again():
    """A width measured once at a slow moment is not priced out for good: after STALE_PASSES passes without one
    of its width its cost is forgotten, the width is priced from those measured since, and drafted again; a plain
    dict (no record of when) keeps the old price, as before."""
    from dflash_torch.decoding.lookup import STALE_PASSES, VerifyCosts

    for costs, forgets in ((VerifyCosts(), True), ({}, False)):
        lk = PromptLookup([1, 2, 3])
        lk.costs = costs
        lk.observe_cost(1, 1.0)
        lk.observe_cost(3, 9.0)  # one 3-wide pass at a busy moment: 9 plain steps
        for _ in range(30):
            lk.observe(2, 2)  # both drafted tokens kept half the time
            lk.observe(2, 0)
        assert lk.draft_length(2) == 0  # 2 tokens for 9 steps (1.5 for 5): a plain step is better
        for _ in range(STALE_PASSES + 1):  # plain steps only: nothing re-measures width 3
            lk.observe_cost(1, 1.0)
        assert (3 in lk.costs) is not forgets
        assert lk.draft_length(2) == (2 if forgets else 0)  # priced like a plain step again (from width 1)
    carried = VerifyCosts({1: 1.0, 4: 3.0})  # a server's table, carried to the next request
    assert carried.seen == {1: 0, 4: 0} and dict(carried) == {1: 1.0, 4: 3.0}


@pytest.fixture(scope="module")
def llama_and_drafter(tiny_models, tmp_path_factory):
    path = tiny_models["llama"]
    target = loading.load_target(path, torch.device("cpu"), torch.float32)
    drafter = load_drafter(make_drafter(path, tmp_path_factory.mktemp("lk") / "d", block_size=16))
    return target, drafter


def _run(target, prompt, n, **kw):
    stats = Stats()
    return list(generate_tokens(target, prompt, max_new_tokens=n, stats=stats, **kw)), stats


def test_lookup_greedy_equals_target_only(llama_and_drafter):
    """Repetitive and random prompts, with and without the drafter, several block sizes, stops mid-block:
    output equals target-only output, and lookup drafts were actually taken and kept."""
    target, drafter = llama_and_drafter
    vocab = target.config.vocab_size
    rng = random.Random(1)
    lookup_kept = checked = 0
    for i in range(24):
        def draw(copying: bool = i % 2 == 1):
            if copying:
                unit = [rng.randrange(vocab - 1) for _ in range(rng.randint(2, 6))]
                prompt = (unit * 8)[: rng.randint(8, 30)]  # a pattern that invites copying
            else:
                prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(2, 20))]
            return prompt, rng.randint(20, 60)

        prompt, n, ref = clear_case(target, draw)  # no near-tie, which may round either way
        stops = (ref[len(ref) * 2 // 3],) if i % 3 == 0 else ()
        want = ref[: ref.index(stops[0]) + 1] if stops else ref
        for kw in ({"lookup": True}, {"lookup": True, "drafter": drafter},
                   {"lookup": True, "drafter": drafter, "block_size": 4}, {"lookup": True, "block_size": 3}):
            got, stats = _run(target, prompt, n, stop_token_ids=stops, **kw)
            assert got == want, (i, kw)
            assert sum(stats.acceptance_lengths) == len(want) - 1
            assert stats.lookup_accepted <= stats.accepted_tokens
            lookup_kept += stats.lookup_accepted
            checked += 1
    assert checked == 96  # every case: 24 prompts x 4 settings
    assert lookup_kept > 50  # the lookup path ran and kept tokens, so the equality above tested it


def test_lookup_modes_and_stats(llama_and_drafter):
    target, drafter = llama_and_drafter
    prompt = [3, 4, 5, 6] * 6
    _, s = _run(target, prompt, 30, lookup=True)
    assert s.mode == "lookup" and s.lookup_cycles > 0
    assert s.as_dict()["lookup_drafted"] == s.lookup_drafted >= s.lookup_accepted
    _, s = _run(target, prompt, 30, lookup=True, drafter=drafter)
    assert s.mode == "dflash+lookup"
    _, s = _run(target, prompt, 30, drafter=drafter)
    assert s.mode == "dflash" and s.lookup_cycles == 0


def test_lookup_sampling_matches_target_distribution(small_vocab):
    """Lookup drafts are a one-hot proposal; rejection sampling keeps the target's distribution."""
    target, _ = small_vocab
    prompt = [1, 3, 0, 2, 1, 3, 0, 2, 1, 3]  # tail "1 3" recurs: lookup proposes from the first token on
    settings = {"temperature": 1.0}
    exact = _exact_joint(target, prompt, Sampler(**settings))
    n, counts, looked = SAMPLES, {}, 0
    kept = drafted = 0
    for i in range(n):
        stats = Stats()
        ids = tuple(generate_tokens(target, prompt, max_new_tokens=K, sampler=Sampler(**settings, seed=i),
                                    stats=stats, lookup=True))
        counts[ids] = counts.get(ids, 0) + 1
        looked += stats.lookup_cycles
        kept, drafted = kept + stats.lookup_accepted, drafted + stats.lookup_drafted
    assert looked > n // 5 and 0.05 < kept / drafted < 0.95  # both accept and reject paths ran
    assert _chi2_pvalue(counts, exact, n) > 1e-3


def test_far_positions_never_look_better_than_the_first():
    """Plain steps check only the first position: its misses cap the far ones, whose own record stays."""
    lk = PromptLookup([1, 2, 3, 1, 2])
    for w in range(1, 17):
        lk.observe_cost(w, 1.0 + 0.05 * (w - 1))
    lk.observe(15, 1)  # one wide draft: the first token kept, the second not
    for _ in range(20):
        lk.observe(1, 1, drafted=False)  # then many plain steps whose first token the match had right
    assert lk.expected_tokens(16) == pytest.approx(2.0, abs=0.01)  # position 1 is still known to miss
    for _ in range(20):
        lk.observe(1, 0, drafted=False)
    assert lk.expected_tokens(16) < 1.05 and lk.draft_length(15) == 0
    lk.observe(3, 3)  # a fully kept draft: the positions past it are tried again
    assert lk.expected_tokens(16) > 2


def test_unchecked_positions_are_valued_geometrically():
    """An untested wide draft is not valued as a flat run of even chances: where a wide verify costs
    several steps the first draft is narrow, and a loop that keeps being kept whole (the bonus token
    checking one position further each time) widens it to the full width."""
    from dflash_torch.decoding.lookup import UNSEEN_RATIO

    lk = PromptLookup([1, 2, 3])
    for w in range(1, 17):
        lk.observe_cost(w, 1.0 + 0.25 * (w - 1))  # a 16-wide verify costs 4.75 plain steps
    assert lk.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.5 * UNSEEN_RATIO)
    widths = []
    for _ in range(12):
        k = lk.draft_length(15)
        widths.append(k)
        lk.observe(k + 1, k + 1)  # the k drafted tokens and the bonus position all kept
    assert 0 < widths[0] < 4 and widths[-1] == 15 and widths == sorted(widths)


def test_lookup_costs_carry_over_between_generations(llama_and_drafter):
    """`lookup_costs` is shared and updated: what one generation measured steers the next one's widths
    (a server measures verify widths once, not per request); output is unchanged either way."""
    target, _ = llama_and_drafter
    prompt = [3, 4, 5, 6] * 6
    want, _ = _run(target, prompt, 30)
    costs: dict[int, float] = {}
    out, s = _run(target, prompt, 30, lookup=True, lookup_costs=costs)
    assert out == want and s.lookup_cycles > 0 and 1 in costs and len(costs) > 1  # measured, in the shared dict
    known = {1: 1e-3} | {w: 1e3 for w in range(2, 17)}  # drafts priced out: every cycle is a plain step
    out, s = _run(target, prompt, 30, lookup=True, lookup_costs=known)
    assert out == want and s.lookup_cycles == 0 and known[2] == 1e3


def test_untried_widths_are_priced_from_the_measured_ones_around_them():
    """An untried width costs what the measured widths around it say (interpolated; past the widest, at
    the last two's cost per row), not as much as the nearest one: a 9-wide pass is not a 3-wide one."""
    lk = PromptLookup([1, 2, 3])
    assert lk.cost(9) == 1.0  # nothing measured: all alike, so the first match is tried
    lk.observe_cost(1, 1.0)
    assert lk.cost(9) == 1.0  # one width: nothing to say how the cost grows
    lk.observe_cost(3, 1.4)
    assert abs(lk.cost(9) - (1.4 + 0.2 * 6)) < 1e-12 and lk.cost(2) == 1.2
    lk.observe_cost(16, 6.0)
    assert abs(lk.cost(9) - (1.4 + 4.6 * 6 / 13)) < 1e-12 and lk.cost(3) == 1.4
