"""Tree verification: a verify pass over a tree of drafted tokens (`Model.forward(parents=...)`) gives every
row the bits of the decode steps along its own path, and the loop that drafts trees emits target-only
greedy output exactly."""

from __future__ import annotations

import json
import random

import pytest
import torch

from dflash_torch import kernels, loading
from dflash_torch.decoding import proposers, trees
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.models.llama import tree_depths
from dflash_torch.models.quantize import exact_prefill, quantize_blocks

from .conftest import make_drafter
from .test_exact import long_context_target

pytestmark = [pytest.mark.fastpath,
              pytest.mark.skipif(kernels.ensure() != "compiled", reason="tree passes run on the compiled kernels")]


def random_tree(rng: random.Random, t: int) -> list[int]:
    """parents of a random tree of t rows (each parent before its child)."""
    return [-1] + [rng.randrange(i) if rng.random() < 0.6 else i - 1 for i in range(1, t)]


def path_of(parents: list[int], r: int) -> list[int]:
    out = [r]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def check_tree(target, prompt: list[int], parents: list[int], tokens: list[int], taps, capacity: int) -> None:
    """Each row's logits and taps == decode steps along its path; keep_rows leaves that path's cache."""
    cache = target.new_cache(capacity)
    target(torch.tensor([prompt]), cache, logits=None)
    n = cache.length
    out = target(torch.tensor([tokens]), cache, logits="all", taps=taps, parents=parents)
    assert cache.length == n + len(tokens)
    for r in range(len(tokens)):
        path = path_of(parents, r)
        steps = target.new_cache(capacity)
        target(torch.tensor([prompt]), steps, logits=None)
        for i in path:
            step = target(torch.tensor([[tokens[i]]]), steps, logits="all", taps=taps)
        assert torch.equal(out.logits[0, r], step.logits[0, 0]), (r, path)
        assert torch.equal(out.hidden[0, r], step.hidden[0, 0]), (r, path)
        if r == len(tokens) - 1 or random.Random(r).random() < 0.3:  # the move of a kept path, now and then
            moved = target.new_cache(capacity)
            target(torch.tensor([prompt]), moved, logits=None)
            target(torch.tensor([tokens]), moved, logits=None, parents=parents)
            moved.keep_rows(n, path)
            m = n + len(path)
            assert torch.equal(moved.k[..., :m, :], steps.k[..., :m, :]), (r, path)
            assert torch.equal(moved.v[..., :m, :], steps.v[..., :m, :]), (r, path)


@pytest.fixture(scope="module")
def targets(tiny_models):
    out = {}
    for fmt in ("q4_0", "q8_0", "q4_1"):
        for kind in ("llama", "qwen2"):
            target = quantize_blocks(loading.load_target(tiny_models[kind], torch.device("cpu"), torch.float32), fmt)
            exact_prefill(target)
            out[fmt, kind] = target
    return out


@pytest.mark.parametrize("fmt", ("q4_0", "q8_0", "q4_1"))
@torch.inference_mode()
def test_tree_rows_equal_decode_steps_along_their_paths(targets, fmt):
    rng = random.Random(fmt)
    for kind in ("llama", "qwen2"):
        target = targets[fmt, kind]
        for t in (2, 3, 6, 11, 16):
            assert target.verifies_trees(t)
            parents = random_tree(rng, t)
            tokens = [rng.randrange(255) for _ in range(t)]
            prompt = [rng.randrange(255) for _ in range(rng.randint(1, 30))]
            check_tree(target, prompt, parents, tokens, (0, 1), 64)


@pytest.mark.parametrize("threads", [1, 2])
@torch.inference_mode()
def test_tree_rows_after_long_contexts(tmp_path, threads):
    """After 600 keys (a float16 cache's decode attention splits by keys there), one and two threads."""
    target = long_context_target(tmp_path, 3, "q4_0")
    assert target.cache_dtype == torch.float16
    rng = random.Random(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for context in (5, 600):
            parents = random_tree(rng, 9)
            check_tree(target, [rng.randrange(255) for _ in range(context)], parents,
                       [rng.randrange(255) for _ in range(9)], (2,), context + 16)
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def test_a_model_without_the_native_stack_says_it_cannot(tiny_models):
    qwen3 = quantize_blocks(loading.load_target(tiny_models["qwen3"], torch.device("cpu"), torch.float32), "q4_0")
    exact_prefill(qwen3)  # q/k norms: the scripted flat path, not the native stack
    assert not qwen3.verifies_trees(4)
    with pytest.raises(ValueError, match="cannot verify a tree"):
        qwen3(torch.tensor([[1, 2, 3]]), qwen3.new_cache(8), parents=[-1, 0, 0])
    with pytest.raises(ValueError, match="does not come before"):
        tree_depths([-1, 2, 0])


def test_tree_shape_is_a_tree_of_the_likeliest_paths():
    freq = [[0.4, 0.15, 0.06, 0.03], [0.2, 0.1, 0.07, 0.04], [0.13, 0.08, 0.07, 0.05]]
    for nodes in range(1, 16):
        shape = trees.best_shape(freq, nodes)
        assert len(shape.paths) == nodes and len(set(shape.paths)) == nodes
        assert shape.paths[0] == (0,)
        for i, p in enumerate(shape.paths):  # every prefix earlier in the list, ranks within the table
            assert len(p) == 1 or shape.paths.index(p[:-1]) < i
            assert all(r < 4 for r in p) and len(p) <= 3
        # no left-out path one step outside the shape more likely than a chosen one
        chosen = min(trees.probability(freq, p) for p in shape.paths)
        inside = set(shape.paths)
        frontier = [q for q in [(r,) for r in range(4)] + [p + (r,) for p in shape.paths for r in range(4)]
                    if q not in inside]
        for p in frontier:
            assert trees.probability(freq, p) <= chosen + 1e-12


@pytest.mark.parametrize("fmt", ("q4_0", "q8_0"))
def test_tree_drafts_equal_target_only_output(tiny_models, tmp_path, fmt):
    """Generation with tree drafts (random drafters: mostly side branches kept or nothing) equals target-only
    greedy output, with lookup and without, at widths 2..16; the trees were really drafted and kept from."""
    rng = random.Random(fmt)
    checked = tree_cycles = side_kept = 0
    for kind in ("llama", "qwen2"):
        target = quantize_blocks(loading.load_target(tiny_models[kind], torch.device("cpu"), torch.float32), fmt)
        exact_prefill(target)
        drafter = quantize_blocks(load_drafter(make_drafter(tiny_models[kind], tmp_path / kind, block_size=16)), fmt)
        for i in range(12):
            base = [rng.randrange(255) for _ in range(rng.randint(1, 8))]
            prompt = base * rng.randint(1, 3)
            n = rng.randint(8, 28)
            want = list(generate_tokens(target, prompt, max_new_tokens=n))
            for bs in (2, 4, 8, 16):
                stats = Stats()
                got = list(generate_tokens(target, prompt, max_new_tokens=n, drafter=drafter, block_size=bs,
                                           stats=stats, lookup=i % 2 == 1))
                assert got == want, (fmt, kind, i, bs)
                checked += 1
                tree_cycles += stats.tree_cycles
                side_kept += stats.tree_side_kept
    assert checked == 2 * 12 * 4
    assert tree_cycles > checked and side_kept > 0


def test_trees_can_be_switched_off(tiny_models, tmp_path, monkeypatch):
    target = quantize_blocks(loading.load_target(tiny_models["llama"], torch.device("cpu"), torch.float32), "q4_0")
    exact_prefill(target)
    drafter = load_drafter(make_drafter(tiny_models["llama"], tmp_path / "d", block_size=8))
    prompt = [5, 6, 7, 8]
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(proposers, "TREES", on)
        stats = Stats()
        runs[on] = (list(generate_tokens(target, prompt, max_new_tokens=20, drafter=drafter, stats=stats)), stats)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].tree_cycles > 0 and runs[False][1].tree_cycles == 0


def test_rank_stats_keep_expected_tokens_only_until_the_counts_move():
    """expected_tokens is kept per width between observations: after every observation it equals the sum over
    the current shape's paths of their probabilities under the current counts, computed afresh."""
    rng = random.Random(0)
    ranks = trees.RankStats(7)

    def fresh(width):
        freq = ranks.freq()
        return 1.0 + sum(trees.probability(freq, p) for p in ranks.shape(width - 1).paths)

    moved = 0
    for _ in range(40):
        before = [ranks.expected_tokens(width) for width in range(2, 9)]
        assert before == [fresh(width) for width in range(2, 9)]
        top = [[rng.randrange(50) for _ in range(4)] for _ in range(7)]  # candidates per position
        new = [row[rng.randrange(4)] if rng.random() < 0.6 else 99 for row in top][: rng.randrange(1, 8)]  # 99: no rank
        ranks.observe(top, new)
        moved += [ranks.expected_tokens(width) for width in range(2, 9)] != before
    assert moved > 30  # the counts moved the estimates: stale values would have failed above


def test_adaptive_width_prices_trees_by_their_shapes(tiny_models, tmp_path):
    """With the adaptive width (and the fallback around it), a tree-drafting generation hands the controller
    the trees' expected tokens per width, and still emits target-only output."""
    from dflash_torch.decoding.adaptive import AdaptiveBlockSize, WithFallback
    from dflash_torch.decoding.fallback import FallbackController

    target = quantize_blocks(loading.load_target(tiny_models["llama"], torch.device("cpu"), torch.float32), "q4_0")
    exact_prefill(target)
    drafter = load_drafter(make_drafter(tiny_models["llama"], tmp_path / "d", block_size=8))
    costs = {b: 1e-3 * (1 + 0.05 * b) for b in range(1, 9)}  # cheap wide passes: the controller drafts
    prompt = [9, 8, 7, 6, 5]
    want = list(generate_tokens(target, prompt, max_new_tokens=24))
    adaptive = AdaptiveBlockSize(costs, 8)
    stats = Stats()
    got = list(generate_tokens(target, prompt, max_new_tokens=24, drafter=drafter, stats=stats,
                               controller=WithFallback(FallbackController(), adaptive)))
    assert got == want
    ranks = drafter.tree_ranks
    assert adaptive.estimate == ranks.expected_tokens and stats.tree_cycles > 0
    e = [ranks.expected_tokens(b) for b in range(1, 9)]
    assert e[0] == 1.0 and all(a <= b for a, b in zip(e, e[1:]))


@torch.inference_mode()
def test_tree_cycles_leave_the_prefix_cache_a_cold_prefills_bits(tiny_models, tmp_path):
    """Turns of a conversation through a prefix cache with tree drafts: each equals a cold target-only run, and
    the kept keys/values and tap features (moved into place after each tree pass) are those of one cold
    prefill over the same tokens, bit for bit."""
    from dflash_torch.decoding.prefix_cache import PrefixCache

    target = quantize_blocks(loading.load_target(tiny_models["llama"], torch.device("cpu"), torch.float32), "q4_0")
    exact_prefill(target)
    drafter = load_drafter(make_drafter(tiny_models["llama"], tmp_path / "d", block_size=8))
    taps = drafter.target_layer_ids
    rng = random.Random(7)
    prefix = PrefixCache()
    prompt = [rng.randrange(255) for _ in range(30)]
    trees_run = 0
    for turn in range(4):
        cold = list(generate_tokens(target, prompt, max_new_tokens=20))
        stats = Stats()
        warm = list(generate_tokens(target, prompt, max_new_tokens=20, drafter=drafter, stats=stats, prefix=prefix))
        assert warm == cold, turn
        trees_run += stats.tree_cycles
        e = prefix.entries[0]
        n = len(e.ids)
        fresh = target.new_cache(n)
        out = target(torch.tensor([e.ids]), fresh, logits=None, taps=taps)
        assert torch.equal(fresh.k[..., :n, :], e.cache.k[..., :n, :]), turn
        assert torch.equal(fresh.v[..., :n, :], e.cache.v[..., :n, :]), turn
        hidden = e.hidden if isinstance(e.hidden, torch.Tensor) else torch.cat(list(e.hidden), dim=1)
        assert hidden.shape[1] >= n - 1 and torch.equal(out.hidden[:, : hidden.shape[1]], hidden), turn
        prompt = prompt + warm + [rng.randrange(255) for _ in range(12)]
    assert trees_run > 0


def test_tree_cycles_report_target_only_logprobs(tiny_models, tmp_path):
    """Each token's log-probability and top alternatives come from the kept path's rows: target-only's, bit for
    bit."""
    from dflash_torch.decoding.sampling import TokenLogprobs

    target = quantize_blocks(loading.load_target(tiny_models["qwen2"], torch.device("cpu"), torch.float32), "q8_0")
    exact_prefill(target)
    drafter = load_drafter(make_drafter(tiny_models["qwen2"], tmp_path / "d", block_size=8))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    runs = []
    for d in (None, drafter):
        lp, stats = TokenLogprobs(3), Stats()
        out = list(generate_tokens(target, prompt, max_new_tokens=30, drafter=d, stats=stats, logprobs=lp))
        runs.append((out, lp.entries, stats))
    assert runs[0][:2] == runs[1][:2]
    assert runs[1][2].tree_cycles > 0


def test_walk_keeps_the_longest_path_of_the_targets_choices():
    """On random trees and choices: the kept rows form a path from the root, each row's token is the target's
    choice at its parent, the next token is the choice at the last kept row, and no child of that row holds it."""
    rng = random.Random(11)
    for _ in range(300):
        t = rng.randint(1, 16)
        parents = random_tree(rng, t)
        tokens = [rng.randrange(4) for _ in range(t)]
        choice = [rng.randrange(4) for _ in range(t)]
        rows, bonus = trees.walk(parents, tokens, choice)
        assert rows[0] == 0 and bonus == choice[rows[-1]]
        for a, b in zip(rows, rows[1:]):
            assert parents[b] == a and tokens[b] == choice[a]
        assert not any(parents[r] == rows[-1] and tokens[r] == bonus for r in range(1, t))


def test_tree_shape_under_a_selector_takes_the_likeliest_conditional_paths():
    """With transition chances (a candidate selector: a position's candidates priced given its parent's), the
    shape holds the `nodes` likeliest paths under them, each after its prefix, its first rows the chain of each
    node's likeliest child; with every transition row equal to the independent table it is that table's shape."""
    rng = random.Random(3)
    for _ in range(50):
        depth, k = rng.randint(1, 5), rng.randint(1, 4)
        freq = [sorted((rng.random() / k for _ in range(k)), reverse=True) for _ in range(depth)]
        trans = [[[rng.random() / k for _ in range(k)] for _ in range(k)] for _ in range(depth - 1)]

        def prob(path, freq=freq, trans=trans):
            p = freq[0][path[0]]
            for d in range(1, len(path)):
                p *= trans[d - 1][path[d - 1]][path[d]]
            return p

        for nodes in (1, 3, 7, 15):
            shape = trees.best_shape(freq, nodes, trans)
            n = min(nodes, sum(k ** d for d in range(1, depth + 1)))
            assert len(set(shape.paths)) == len(shape.paths) == n
            for i, p in enumerate(shape.paths):
                assert len(p) == 1 or shape.paths.index(p[:-1]) < i
            inside = set(shape.paths)
            frontier = [q for q in [(r,) for r in range(k)] + [p + (r,) for p in shape.paths if len(p) < depth
                                                                for r in range(k)] if q not in inside]
            assert all(prob(q) <= min(map(prob, shape.paths)) + 1e-12 for q in frontier)
            spine = [p for p in shape.paths if len(p) == shape.paths.index(p) + 1 and
                     all(shape.paths[j] == p[: j + 1] for j in range(len(p)))]
            for p in spine:  # each spine row is its parent's likeliest child in the shape
                siblings = [q for q in shape.paths if len(q) == len(p) and q[:-1] == p[:-1]]
                assert prob(p) == max(map(prob, siblings))
        same = [[list(freq[d + 1]) for _ in range(k)] for d in range(depth - 1)]
        for nodes in (1, 4, 9):
            assert trees.best_shape(freq, nodes, same).paths == trees.best_shape(freq, nodes).paths


def _selector_drafter(tiny_model, path, scale: float):
    """A random drafter for `tiny_model` exported as DFlash2 with a selector whose interaction term is random
    (scale > 0) or zero (a fresh selector, scale 0): `train_selector.export_dflash2`, as `dflash train --selector`."""
    from dflash_torch.train_selector import Selector, export_dflash2

    base = make_drafter(tiny_model, path / "base", block_size=16)
    c = json.loads((tiny_model / "config.json").read_text())
    embed = torch.randn(c["vocab_size"], c["hidden_size"], generator=torch.Generator().manual_seed(0))
    sel = Selector(c["hidden_size"], embed / c["hidden_size"] ** 0.5, 4)  # codebook rows of about unit norm
    sel.reset(0)
    with torch.no_grad():
        sel.successor_projection.weight.normal_(0, scale)
    return load_drafter(export_dflash2(base, sel, path / "dflash2", top_k=6, dtype="float32"))


def test_selector_ensemble_exports_as_one_selector(tiny_models, tmp_path):
    """`dflash train --selector --selector-ensemble N`: N selectors' averaged interactions, exported as one selector
    of rank N r in the published layout, score every candidate as the ensemble does, so the loaded drafter picks
    the ensemble's tokens."""
    from dflash_torch.train_selector import Selector, SelectorEnsemble, export_dflash2

    base = make_drafter(tiny_models["llama"], tmp_path / "base", block_size=16)
    c = json.loads((tiny_models["llama"] / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(c["vocab_size"], c["hidden_size"], generator=g) / c["hidden_size"] ** 0.5
    members = []
    for seed in range(3):
        sel = Selector(c["hidden_size"], embed, 4)
        sel.reset(seed)
        with torch.no_grad():
            sel.successor_projection.weight.normal_(0, 1.0, generator=g)
        members.append(sel)
    ens = SelectorEnsemble(members)
    d = load_drafter(export_dflash2(base, ens, tmp_path / "dflash2", top_k=6, dtype="float32"))
    assert d.candidate_selector.predecessor_codebook.shape == (c["vocab_size"], 12)
    K, V = 15, c["vocab_size"]
    logits, hidden, anchor = torch.randn(K, V, generator=g) * 3, torch.randn(K, c["hidden_size"], generator=g), 7
    with torch.no_grad():
        picked = d.candidate_selector(logits, hidden, anchor)
        pred = torch.tensor(anchor)
        for j in range(K):  # along the loaded selector's own choices, the ensemble's scores are its scores
            unary = logits[j].topk(6).values
            want = ens.scores(hidden[j], pred, picked.candidates[j], unary)
            torch.testing.assert_close(picked.scores[j], want, rtol=1e-5, atol=1e-5)
            top2 = want.topk(2).values
            if top2[0] - top2[1] > 1e-4:  # its pick is the ensemble's, unless the two are tied at float32's reach
                assert picked.tokens[j] == picked.candidates[j, want.argmax()]
            pred = picked.tokens[j]


def test_identity_convolutions_are_checked_only_when_a_tensor_changes(tiny_models, tmp_path, monkeypatch):
    """A DFlash2 drafter with identity convolutions (the export of `dflash train --selector`) takes the flat draft
    path; whether they are the identity is checked again only when a stored tensor changes, since reading a
    quantized projection's `.weight` dequantizes it."""
    from dflash_torch.decoding import dflash2

    d = quantize_blocks(_selector_drafter(tiny_models["llama"], tmp_path, 1.0), "q8_0")
    d.fuse_context_kv()  # as `generate.load` does
    calls, real = [], dflash2._is_identity
    monkeypatch.setattr(dflash2, "_is_identity", lambda conv: calls.append(conv) or real(conv))
    assert d._flat_plan() is not None and d._flat_plan() is not None
    assert len(calls) == 2 * len(d.layers)  # each convolution once, on the first call only
    conv = d.layers[0].attention_conv
    kernel = conv.base_kernel.detach().clone()
    kernel[0, 1, 0] = 0.5  # the position before now counts: no longer the identity
    conv.base_kernel = torch.nn.Parameter(kernel, requires_grad=False)
    assert d._flat_plan() is None


@torch.inference_mode()
def test_a_fresh_selectors_transitions_are_the_drafters_own_chances(tiny_models, tmp_path):
    d = _selector_drafter(tiny_models["llama"], tmp_path, 0.0)
    probs = torch.softmax(torch.randn(5, 256), -1).topk(6, dim=-1)
    first, trans = d.candidate_selector.transitions(probs.values, probs.indices, torch.randn(5, 64), 7)
    assert torch.allclose(first, probs.values[0], rtol=1e-5, atol=0)
    assert torch.allclose(trans, probs.values[1:, None].expand(4, 6, 6), rtol=1e-5, atol=0)


@pytest.mark.parametrize("fmt", ("q4_0", "q8_0"))
def test_tree_drafts_with_a_selector_equal_target_only_output(tiny_models, tmp_path, fmt):
    """A DFlash2 drafter's selector prices each tree node given its parent: generation equals target-only
    greedy output at widths 2..16, trees were drafted, and their shapes are not those without the selector."""
    target = quantize_blocks(loading.load_target(tiny_models["llama"], torch.device("cpu"), torch.float32), fmt)
    exact_prefill(target)
    drafter = quantize_blocks(_selector_drafter(tiny_models["llama"], tmp_path, 3.0), fmt)
    shapes = []
    best_shape = trees.best_shape

    def spy(freq, nodes, trans=None):
        shape = best_shape(freq, nodes, trans)
        if trans is not None:  # freq[1:]: the drafter's own chances, as a drafter without a selector prices them
            shapes.append(shape.paths != best_shape(freq, nodes).paths)
        return shape

    rng = random.Random(fmt)
    tree_cycles = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trees, "best_shape", spy)
        for i in range(6):
            prompt = [rng.randrange(255) for _ in range(rng.randint(1, 8))] * 2
            want = list(generate_tokens(target, prompt, max_new_tokens=20))
            for bs in (2, 4, 8, 16):
                stats = Stats()
                got = list(generate_tokens(target, prompt, max_new_tokens=20, drafter=drafter, block_size=bs,
                                           stats=stats, lookup=i % 2 == 1))
                assert got == want, (fmt, i, bs)
                tree_cycles += stats.tree_cycles
    assert tree_cycles > 0 and any(shapes)
