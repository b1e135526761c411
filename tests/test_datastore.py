"""The datastore of the target's own phrases: what it keeps, how it drafts, its file, and that its drafts never
change output (greedy: the same tokens; sampled: the target's distribution)."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.datastore import FILE, Datastore, load_beside, pack
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.sampling import Sampler
from dflash_torch.decoding.speculative import Stats, generate_tokens

from .conftest import make_drafter
from .test_lossless import clear_case
from .test_sampling import SAMPLES, K, _chi2_pvalue, _exact_joint


def test_build_keeps_only_confident_contexts():
    # "1 2" is followed by 3 three times and by 4 once: kept (3/4 >= 0.5, 3 >= 2); "5 6" by 7 and 8 once
    # each: not kept (1 < min_count); "2 3" by 9 twice and 1 twice: a tie, the lower id wins
    replies = [[1, 2, 3, 9], [1, 2, 3, 9], [1, 2, 3, 1], [1, 2, 4], [5, 6, 7], [5, 6, 8], [0, 2, 3, 1]]
    s = Datastore.build(replies, max_n=2)
    assert s.next[2][pack([1, 2])] == 3
    assert pack([5, 6]) not in s.next[2]
    assert s.next[2][pack([2, 3])] == 1
    strict = Datastore.build(replies, max_n=2, min_share=0.8)
    assert pack([1, 2]) not in strict.next[2]  # 3/4 < 0.8


def test_teacher_forced_text_counts_the_targets_choices():
    # text "4 5 6 4 5 7": the target would have written 9 after "4 5" both times (not the text's 6 and 7)
    s = Datastore.build([], [([1, 4, 5, 6, 4, 5, 7], 1, [2, 3, 9, 8, 3, 9])], max_n=2)
    assert s.next[2][pack([4, 5])] == 9
    assert pack([5, 6]) not in s.next[2]  # seen once
    with pytest.raises(ValueError, match="past the end"):
        Datastore.build([], [([1, 2], 1, [3, 4])])


def test_draft_chains_backs_off_and_stops():
    s = Datastore({2: {pack([1, 2]): 3, pack([2, 3]): 4, pack([3, 4]): 5}, 3: {pack([7, 2, 3]): 8}})
    assert s.draft([9, 1, 2], 10) == [3, 4, 5]  # chained; stops where no context is kept ("4 5")
    assert s.draft([9, 1, 2], 2) == [3, 4]  # the limit
    assert s.draft([7, 2, 3], 10) == [8]  # the longest kept context decides ("7 2 3" -> 8, not "2 3" -> 4)
    assert s.draft([6, 2, 3], 10) == [4, 5]  # "6 2 3" is not kept: its tail "2 3" is
    assert s.draft([5], 4) == [] and s.draft([], 4) == []


def test_file_round_trip_and_bad_files(tmp_path):
    s = Datastore.build([[random.Random(i).randrange(50) for _ in range(300)] for i in range(20)], min_count=1)
    assert len(s) > 0
    s.save(tmp_path / FILE)
    t = load_beside(tmp_path)
    assert t.next == s.next and (t.min_n, t.max_n) == (s.min_n, s.max_n)
    assert load_beside(tmp_path / "none") is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / FILE).write_bytes(b"not a datastore")
    with pytest.raises(ValueError, match="not a datastore"):
        load_beside(tmp_path / "bad")
    with pytest.raises(ValueError, match="token ids"):
        Datastore.build([[1, 2, -3]])
    with pytest.raises(ValueError, match="min_share"):
        Datastore.build([[1, 2, 3]], min_share=0)


@pytest.fixture(scope="module")
def llama_and_drafter(tiny_models, tmp_path_factory):
    path = tiny_models["llama"]
    target = loading.load_target(path, torch.device("cpu"), torch.float32)
    drafter = load_drafter(make_drafter(path, tmp_path_factory.mktemp("ds") / "d", block_size=16))
    assert drafter.datastore is None  # none beside it
    return target, drafter


def test_datastore_greedy_equals_target_only(llama_and_drafter):
    """A datastore of the target's own greedy replies to other prompts: output equals target-only output with
    and without the drafter, at several widths and with stops mid-draft, and its drafts were taken and kept."""
    target, drafter = llama_and_drafter
    vocab = target.config.vocab_size
    rng = random.Random(3)
    # the target's replies to 40 random prompts: a tiny random model repeats its own phrases across them
    replies = [list(generate_tokens(target, [rng.randrange(vocab - 1) for _ in range(rng.randint(2, 12))],
                                    max_new_tokens=40)) for _ in range(40)]
    drafter.datastore = Datastore.build(replies)
    try:
        kept = checked = 0
        for i in range(16):
            prompt, n, ref = clear_case(  # no near-tie, which may round either way
                target, lambda: ([rng.randrange(vocab - 1) for _ in range(rng.randint(2, 12))], rng.randint(20, 50)))
            stops = (ref[len(ref) * 2 // 3],) if i % 3 == 0 else ()
            want = ref[: ref.index(stops[0]) + 1] if stops else ref
            for kw in ({}, {"block_size": 4}):
                stats = Stats()
                got = list(generate_tokens(target, prompt, max_new_tokens=n, drafter=drafter, lookup=True,
                                           stop_token_ids=stops, stats=stats, **kw))
                assert got == want, (i, kw)
                assert sum(stats.acceptance_lengths) == len(want) - 1
                assert stats.datastore_accepted <= stats.datastore_drafted
                assert stats.as_dict()["datastore_cycles"] == stats.datastore_cycles
                kept += stats.datastore_accepted
                checked += 1
        assert checked == 32
        assert kept > 100  # the datastore drafted and was kept, so the equality above tested its path
        stats = Stats()
        list(generate_tokens(target, prompt, max_new_tokens=20, drafter=drafter, stats=stats))
        assert stats.datastore_cycles == 0  # a part of lookup: off with it
    finally:
        drafter.datastore = None


def test_datastore_sampling_matches_target_distribution(small_vocab):
    """Datastore drafts are a one-hot proposal: sampling through them keeps the target's distribution."""
    target, drafter = small_vocab
    prompt = [1, 3, 0, 2]
    settings = {"temperature": 1.0}
    exact = _exact_joint(target, prompt, Sampler(**settings))
    drafter.datastore = Datastore({2: {pack([a, b]): (a + b) % 5 for a in range(5) for b in range(5)}})
    try:
        n, counts, cycles, kept, drafted = SAMPLES, {}, 0, 0, 0
        for i in range(n):
            stats = Stats()
            ids = tuple(generate_tokens(target, prompt, max_new_tokens=K, drafter=drafter, block_size=4, lookup=True,
                                        sampler=Sampler(**settings, seed=i), stats=stats))
            counts[ids] = counts.get(ids, 0) + 1
            cycles += stats.datastore_cycles
            kept, drafted = kept + stats.datastore_accepted, drafted + stats.datastore_drafted
    finally:
        drafter.datastore = None
    assert cycles > n // 5 and 0.05 < kept / drafted < 0.95  # both accept and reject paths ran
    assert _chi2_pvalue(counts, exact, n) > 1e-3
