"""Adaptive block sizes: lossless, and the widths they choose from measured costs, at short and long
contexts; calibration."""

from __future__ import annotations

import torch

from dflash_torch import loading
from dflash_torch.decoding.adaptive import AdaptiveBlockSize, calibrate
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.generate import Pipeline
from dflash_torch.profile import profile_pipeline

from . import fast_support
from .fast_support import _gen
from .test_lossless import OracleDrafter

pair = fast_support.pair  # the shared module-scoped fixture: this module gets its own


def test_adaptive_block_size_is_lossless_and_adapts(pair):
    path, dpath = pair
    target = loading.load_target(path, torch.device("cpu"), torch.float32)
    # verify+draft cost grows with the block: a perfect drafter should still use wide blocks,
    # a useless one should drop to plain steps.
    costs = {1: 1.0, 2: 1.2, 4: 1.4, 8: 1.8}
    prompt = [5, 6, 7]
    ref, _ = _gen(target, prompt, 120)
    truth, _ = _gen(target, prompt, 140)

    class Frozen(AdaptiveBlockSize):  # costs fixed, so the test does not depend on timing
        def observe(self, block_size, committed, seconds):
            super().observe(block_size, committed, self.costs[block_size] if block_size in self.costs else seconds)

    good = Frozen(dict(costs), 8)
    out, stats = _gen(target, prompt, 120, OracleDrafter(truth, 3, 256, 0.0, 8), good, bs=8)
    assert out == ref
    assert good.history.count(8) > 0.8 * len(good.history)
    # the stats count the widths that ran (the last cycle may be clipped by the tokens left)
    assert sum(stats.widths.values()) == len(good.history) and stats.widths[8] >= good.history.count(8) - 1

    bad = Frozen(dict(costs), 8)
    out, stats = _gen(target, prompt, 120, OracleDrafter(truth, 3, 256, 1.0, 8), bad, bs=8)
    assert out == ref
    assert bad.history.count(1) > 0.7 * len(bad.history)


def test_adaptive_full_block_tries_cost_what_they_are_allowed_to():
    """Where a full block costs several plain steps and the drafter keeps nothing, the adaptive width
    still tries the full block now and then, but the time those tries lose stays within probe_budget;
    a drafter that keeps everything gets the full block every cycle."""
    costs = {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0, 16: 7.0}  # a CPU-like verify: 16 wide = 7 plain steps
    a = AdaptiveBlockSize(dict(costs), 16)
    spent = tokens = 0.0
    for _ in range(2000):
        b = a.block_size(None)
        a.observe(b, 1, costs[b])  # nothing kept: one token per cycle whatever the width
        spent, tokens = spent + costs[b], tokens + 1
    tries = a.history.count(16)
    assert 5 <= tries <= 40 and a.history[-50:].count(1) >= 45
    assert spent <= 1.06 * tokens * costs[1]  # what the tries lost: about probe_budget (5%) of the time
    eager = AdaptiveBlockSize(dict(costs), 16, probe_budget=1.0)
    for _ in range(2000):
        b = eager.block_size(None)
        eager.observe(b, 1, costs[b])
    assert eager.history.count(16) > 2 * tries  # a larger budget tries more often
    good = AdaptiveBlockSize(dict(costs), 16)
    for _ in range(200):
        b = good.block_size(None)
        good.observe(b, b, costs[b])  # every draft kept
    assert good.history[-100:] == [16] * 100


def test_calibrate_measures_each_block_size(pair, monkeypatch):
    from dflash_torch.decoding import drafter as drafter_module

    path, dpath = pair
    target = loading.load_target(path, torch.device("cpu"), torch.float32)
    costs = calibrate(target, load_drafter(dpath), context=16, repeats=1)
    assert sorted(costs) == [1, 2, 4, 8] and all(t > 0 for t in costs.values())
    windowed = load_drafter(dpath)
    monkeypatch.setattr(drafter_module, "WINDOW_SLACK", 4)
    windowed.set_window(8, 2)  # a context longer than the window: the drafter holds fewer slots than positions
    costs = calibrate(target, windowed, context=40, repeats=1)
    assert sorted(costs) == [1, 2, 4, 8] and all(t > 0 for t in costs.values())

    pipe = Pipeline(target=target, tokenizer=None, stop_token_ids=[], model_path=path, name="t", drafter=windowed)
    assert sorted(profile_pipeline(pipe, [2, 4], context=40, repeats=1)["draft_s"]) == [2, 4]


class _Position:
    """The two Stats fields the adaptive width reads: where a generation is."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens, self.generated_tokens = prompt_tokens, 0


def _simulate(a: AdaptiveBlockSize, stats: _Position, cycles: int, cost, accept: float, seed: int = 0) -> list[int]:
    """Cycles of a drafter whose drafts are each kept with probability `accept` (in a chain), timed by
    cost(width, position): the widths chosen."""
    import random

    rng, chosen = random.Random(seed), []
    for _ in range(cycles):
        b = a.block_size(stats)
        kept = 0
        while kept < b - 1 and rng.random() < accept:
            kept += 1
        a.observe(b, kept + 1, cost(b, stats.prompt_tokens + stats.generated_tokens))
        stats.generated_tokens += kept + 1
        chosen.append(b)
    return chosen


def test_adaptive_width_learns_what_a_long_context_adds():
    """Costs calibrated after 64 positions favour wide blocks; after a 6,000-token prompt every verify row
    attends to 6,000 keys and the wide passes cost far more. The adaptive width first measures a plain
    step there, learns each width's growth from the cycles it runs, and gets near the best rate at that
    context (the calibration's choice gets far less); near the calibration's context nothing changes."""
    base = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.5}
    accept = 0.9  # each draft kept with this probability, in a chain

    def cost(b, n):  # interpolated base; a plain step's attention grows 2e-3 per position, each more row 0.4 of it
        lo, hi = max(k for k in base if k <= b), min(k for k in base if k >= b)
        at = base[lo] if lo == hi else base[lo] + (base[hi] - base[lo]) * (b - lo) / (hi - lo)
        return at + 2e-3 * (1 + 0.4 * (b - 1)) * max(0, n - 64)

    def rate(b, n):  # expected tokens per second of width b at position n
        return sum(accept**k for k in range(b)) / cost(b, n)

    best = {n: max(range(1, 17), key=lambda b: rate(b, n)) for n in (64, 6000)}
    assert best[64] == 16 and best[6000] < 8  # the trade-off the test is about
    assert rate(16, 6000) < 0.8 * rate(best[6000], 6000)  # the calibration's choice there
    a = AdaptiveBlockSize(dict(base), 16)
    stats = _Position(6000)
    chosen = _simulate(a, stats, 300, cost, accept)
    assert chosen[0] == 1  # nothing learnt that far out: a plain step first
    assert 1 in a.slopes and abs(a.slopes[1] - 2e-3) < 1e-4
    got = sum(rate(b, 6000) for b in chosen[-100:]) / 100
    assert got > 0.9 * rate(best[6000], 6000), (chosen[-100:], best[6000])
    for b, s in a.slopes.items():  # the growth of every width it ran, as the costs had it (the context grew)
        assert abs(s - 2e-3 * (1 + 0.4 * (b - 1))) < 0.1 * 2e-3 * (1 + 0.4 * (b - 1)), (b, s)
    assert a.costs == base  # the calibration's context keeps its costs
    # the same controller back near the calibration's context prices every width as calibrated there
    a.locate(_Position(10))
    assert all(a.cost(b) == a.base(b) for b in range(1, 17)) and a.cost(16) == base[16]


def test_adaptive_width_does_not_time_a_generations_first_drafter_cycle():
    """The first drafter cycle of a generation also feeds the drafter the whole prompt: its time is not a
    cycle's cost (the same holds far out, where it would teach a growth)."""
    base = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8, 16: 3.0}
    for prompt in (10, 5000):
        a = AdaptiveBlockSize(dict(base), 16)
        a.slopes = {1: 1e-4}  # something learnt: no plain step first
        stats = _Position(prompt)
        b = a.block_size(stats)
        assert b > 1
        a.observe(b, 1, 100.0)  # the one-off
        assert a.costs == base and a.slopes == {1: 1e-4}
        b = a.block_size(stats)
        a.observe(b, 1, 1.5 * base[b] + 1e-4 * max(0, prompt - 64) * b)  # the next one is timed
        assert (a.costs != base, a.slopes != {1: 1e-4}) == ((True, False) if prompt < 64 + 512 else (False, True))


def test_adaptive_width_starts_narrow_where_wide_passes_cost_several_steps():
    """Nothing learnt yet: the drafts' acceptance is guessed as a chain of even odds, so the first cycle is
    not the drafter's full block where that costs several plain steps (a long context on a CPU); the full
    block still comes once drafts are kept (test_adaptive_block_size_is_lossless_and_adapts)."""
    costs = {1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0, 16: 3.5}
    a = AdaptiveBlockSize(dict(costs), 16)
    assert 2 <= a.block_size(None) <= 4
    assert abs(a.expected_tokens(16) - (2 - 0.5**15)) < 1e-9
    for _ in range(30):  # every draft kept: the guessed odds follow the kept ones, and the width grows
        b = a.block_size(None)
        a.observe(b, b, costs.get(b, a.cost(b)))
    assert a.history[-5:] == [16] * 5
