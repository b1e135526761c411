"""On the block formats (q4_0, q4_1, q8_0) the whole forward is batch-invariant: a verify pass computes
each row exactly as a decode step does, so speculative greedy output equals target-only greedy output bit
for bit, with no near-tie to skip."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.models.quantize import exact_prefill, quantize_blocks

from .conftest import make_drafter
from .test_lossless import OracleDrafter

pytestmark = pytest.mark.fastpath
FORMATS = ("q4_0", "q8_0", "q4_1")


@pytest.fixture(scope="module")
def quantized(tiny_models, tmp_path_factory):
    """{fmt: [(kind, target, drafter)]}: the tiny targets and random drafters with block weights."""
    base = tmp_path_factory.mktemp("exact")
    out = {}
    for fmt in FORMATS:
        out[fmt] = []
        for kind, path in tiny_models.items():
            target = quantize_blocks(loading.load_target(path, torch.device("cpu"), torch.float32), fmt)
            exact_prefill(target)  # as generate.load does for quantized targets: prefills attend as decode too
            drafter = quantize_blocks(load_drafter(make_drafter(path, base / f"{fmt}-{kind}", block_size=16)), fmt)
            out[fmt].append((kind, target, drafter))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@torch.inference_mode()
def test_verify_rows_equal_decode_steps(quantized, fmt):
    """Logits and tap features of a T-token pass at any position == T one-token passes, bit for bit
    (T = 33: a prefill's size, past the verify blocks)."""
    rng = random.Random(1)
    for kind, target, drafter in quantized[fmt]:
        taps = drafter.target_layer_ids
        for t in (2, 5, 16, 33):
            prompt = [rng.randrange(255) for _ in range(rng.randint(1, 30))]
            block = [rng.randrange(255) for _ in range(t)]
            wide_cache, step_cache = target.new_cache(80), target.new_cache(80)
            target(torch.tensor([prompt]), wide_cache, logits=None)
            target(torch.tensor([prompt]), step_cache, logits=None)
            wide = target(torch.tensor([block]), wide_cache, logits="all", taps=taps)
            steps = [target(torch.tensor([[b]]), step_cache, logits="all", taps=taps) for b in block]
            assert torch.equal(wide.logits, torch.cat([s.logits for s in steps], dim=1)), (kind, t)
            assert torch.equal(wide.hidden, torch.cat([s.hidden for s in steps], dim=1)), (kind, t)


@pytest.mark.parametrize("fmt", ("q4_0", "q8_0"))
def test_speculative_equals_target_only_bit_for_bit(quantized, fmt):
    """36 random prompts per family x 3 families (108) x block sizes {2, 4, 8, 16}, every case checked:
    the random drafter (mostly rejected: the bonus token comes from a verify row), an oracle drafter
    (long accepted runs), and prompt lookup on repetitive prompts."""
    rng = random.Random(fmt)
    checked = accepted = 0
    for kind, target, drafter in quantized[fmt]:
        for i in range(36):
            base = [rng.randrange(255) for _ in range(rng.randint(1, 8))]
            prompt = base * rng.randint(1, 3)  # repeats give prompt lookup something to find
            n = rng.randint(8, 28)
            want = list(generate_tokens(target, prompt, max_new_tokens=n))
            for bs in (2, 4, 8, 16):
                if i % 3 == 0:
                    d = drafter
                else:
                    d = OracleDrafter(want, len(prompt), 256, 0.2, bs, seed=i * 16 + bs)
                    d.target_layer_ids = drafter.target_layer_ids
                stats = Stats()
                got = list(generate_tokens(target, prompt, max_new_tokens=n, drafter=d, block_size=bs,
                                           stats=stats, lookup=i % 2 == 1))
                assert got == want, (fmt, kind, i, bs)
                checked += 1
                accepted += stats.accepted_tokens
    assert checked == 3 * 36 * 4
    assert accepted > checked  # the drafts were really kept, often


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", FORMATS)
@torch.inference_mode()
def test_flat_path_equals_layer_modules(quantized, fmt, threads):
    """The one-call C++ decoder stack (kernels/layers.cpp), the flat (scripted) decode path and the layer
    modules compute the same bits on block weights (logits, tap features, the cache), for decode steps,
    verify blocks and prefills; the stack serves the Llama and Qwen2 targets (biases included), Qwen3's
    q/k norms take the scripted path. With two threads the stack's kernels split rows (quantization, the
    rotation, the activation) and columns between them: the same bits as the module path on one thread."""
    from dflash_torch import kernels
    from dflash_torch.models.llama import NativeLayers

    rng = random.Random(2)
    before = torch.get_num_threads()
    for kind, target, _ in quantized[fmt]:
        for t in (1, 7, 40):
            prompt = [rng.randrange(255) for _ in range(t)]
            outs = []
            for flat, native, n_threads in ((True, True, threads), (True, False, threads), (False, False, 1)):
                target.flat, target.native = flat, native
                torch.set_num_threads(n_threads)
                cache = target.new_cache(64)
                target(torch.tensor([[3, 4]]), cache, logits=None)
                out = target(torch.tensor([prompt]), cache, logits="all", taps=(2, 0, 2))
                n = cache.length
                outs.append((out.logits, out.hidden, cache.k[:, :, :, :n], cache.v[:, :, :, :n]))
            target.flat, target.native = True, True
            torch.set_num_threads(before)
            for other in outs[1:]:
                assert all(torch.equal(a, b) for a, b in zip(outs[0], other)), (kind, t, threads)
        if kernels.ensure() == "compiled":
            assert isinstance(target._plan[(True, True)], NativeLayers) == (kind != "qwen3"), kind


@pytest.mark.parametrize("fmt", FORMATS)
@torch.inference_mode()
def test_deferred_head_gives_the_whole_heads_rows_and_choices(quantized, fmt):
    """A verify pass that leaves its LM head for later (`logits="rows"`) and runs it on any split of its rows
    gives the logits of `logits="all"` bit for bit, and the loop's acceptance from it (the head on the first
    rows, the rest only if their drafts are all kept) keeps the same drafts and the same next token."""
    from dflash_torch.decoding import speculative
    from dflash_torch.decoding.proposers import Draft
    from dflash_torch.decoding.sampling import Sampler

    rng = random.Random(4)
    rules = speculative.Rules(Sampler(), None, None)
    for kind, target, _ in quantized[fmt]:
        assert target.defers_head(16) and not target.defers_head(1), kind
        for _ in range(4):
            prompt = [rng.randrange(255) for _ in range(rng.randint(1, 20))]
            block = [rng.randrange(255) for _ in range(rng.choice((5, 8, 16)))]
            c1, c2 = target.new_cache(64), target.new_cache(64)
            target(torch.tensor([prompt]), c1, logits=None)
            target(torch.tensor([prompt]), c2, logits=None)
            whole = target(torch.tensor([block]), c1, logits="all", taps=(0, 1))
            rows = target(torch.tensor([block]), c2, logits="rows", taps=(0, 1))
            assert rows.logits is None and torch.equal(rows.hidden, whole.hidden)
            cut = rng.randint(1, len(block) - 1)
            split = torch.cat([target.head(rows.final[:cut]), target.head(rows.final[cut:])])
            assert torch.equal(split, whole.logits[0]), (kind, cut)
            choice = whole.logits[0].argmax(-1).tolist()
            for keep in (0, 2, speculative.HEAD_FIRST_ROWS - 1, speculative.HEAD_FIRST_ROWS, len(block) - 1):
                keep = min(keep, len(block) - 1)  # drafts equal to the target's choices up to `keep`, then not
                drafts = [choice[i] if i < keep else (choice[i] + 1) % 255 for i in range(len(block) - 1)]
                draft = Draft(None, torch.tensor([[block[0], *drafts]]))  # its token list read from the block
                want = speculative._accept(target, whole, draft, rules)
                got = speculative._accept(target, rows, Draft(None, draft.block, tokens=[block[0], *drafts]), rules)
                assert got[:2] == want[:2] == (list(range(keep + 1)), choice[keep]), (kind, keep)
                assert torch.equal(got[2], want[2][: got[2].shape[0]]) and got[2].shape[0] > keep


def long_context_target(tmp_path, seed: int, fmt: str, act: str = "silu"):
    """A small Llama with room for 1,024 positions (3 kv heads of 6 query heads) on block weights, prefills
    attending as decode does (a float16 cache)."""
    from .conftest import make_hf_model

    path = make_hf_model("llama", tmp_path / "t", seed=seed, max_position_embeddings=1024, num_attention_heads=6,
                         num_key_value_heads=3, hidden_size=96, intermediate_size=192, hidden_act=act)
    target = quantize_blocks(loading.load_target(path, torch.device("cpu"), torch.float32), fmt)
    exact_prefill(target)
    return target


@pytest.mark.parametrize("fmt, act", [("q4_0", "silu"), ("q8_0", "gelu_pytorch_tanh"), ("q4_0", "gelu")])
@pytest.mark.parametrize("threads", [1, 2, 4])
@torch.inference_mode()
def test_decode_region_equals_layer_modules_after_long_contexts(tmp_path, fmt, act, threads):
    """A decode step of the C++ stack runs in one parallel region (kernels/layers.cpp, decode_region: every
    thread quantizes each matmul's row itself and takes chunks of its columns at once while thread 0 deals the
    next matmul's, each thread runs the activation on the whole row, the attention's tasks are split between
    the threads, barriers between the steps; with 4 threads on 2 cores some threads run far behind others).
    Its logits, taps and cache are the layer modules' bit for bit after short and long contexts (from 128
    keys the region splits a step's attention by keys, the layer modules' per-call attention from 512: the
    same bits), with the tapped layers listed out of order and twice, for each activation (the 3-row prefill
    gives the threads 2 rows and 1: torch's exact gelu, which takes another kernel for a strided input than
    for a contiguous one, gets a contiguous input on every path, models/layers.py)."""
    from dflash_torch.models.llama import NativeLayers

    target = long_context_target(tmp_path, 3, fmt, act)
    rng = random.Random(fmt)
    before = torch.get_num_threads()
    try:
        for context in (3, 300, 700):
            prompt = [rng.randrange(255) for _ in range(context)]
            runs = []
            for native, n_threads in ((True, threads), (False, 1)):
                target.flat, target.native = native, native
                torch.set_num_threads(n_threads)
                cache = target.new_cache(context + 8)
                target(torch.tensor([prompt]), cache, logits=None)
                out = []
                for tok in (5, 17, 250, 3):
                    r = target(torch.tensor([[tok]]), cache, logits="last", taps=(4, 1, 4))
                    out += [r.logits, r.hidden]
                n = cache.length
                runs.append((out, cache.k[..., :n, :].clone(), cache.v[..., :n, :].clone()))
            (a, ka, va), (b, kb, vb) = runs
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (context, threads)
            assert torch.equal(ka, kb) and torch.equal(va, vb), context
        assert target.cache_dtype == torch.float16 and isinstance(target._plan[(True, True)], NativeLayers)
    finally:
        target.flat, target.native = True, True
        torch.set_num_threads(before)


@pytest.mark.parametrize("by_rows", ["0", "2"])
@pytest.mark.parametrize("threads", [1, 2, 4])
@torch.inference_mode()
def test_verify_region_equals_layer_modules_after_long_contexts(tmp_path, threads, by_rows, monkeypatch):
    """A verify pass of the C++ stack runs in one parallel region (kernels/layers.cpp, rows_region: rows and
    columns and attention tiles shared by the threads). Its logits, taps and cache are the layer modules' bit
    for bit for passes of 2, 5, 12 and 40 rows after short and long contexts (a float16 cache; passes of up to 16
    rows from 128 keys take the attention's split by keys inside the region, the modules its tiles below 512).
    With 4 threads a 2-row pass has fewer rows than threads (thread 0 quantizes them all), and every thread
    takes chunks of the columns as they go (ColumnShare), on 2 cores some threads much later than others.
    DFLASH_ROWS_BY_THREAD=2 runs every pass whose rows the threads can share by rows (each thread its own rows
    through every layer; 5 rows on 4 threads cannot be, and stay by columns), 0 none."""
    monkeypatch.setenv("DFLASH_ROWS_BY_THREAD", by_rows)
    target = long_context_target(tmp_path, 5, "q4_0")
    rng = random.Random(threads)
    before = torch.get_num_threads()
    try:
        for context in (3, 300, 700):
            prompt = [rng.randrange(255) for _ in range(context)]
            blocks = [[rng.randrange(255) for _ in range(t)] for t in (2, 5, 12, 40)]
            runs = []
            for native, n_threads in ((True, threads), (False, 1)):
                target.flat, target.native = native, native
                torch.set_num_threads(n_threads)
                out = []
                for block in blocks:
                    cache = target.new_cache(context + 48)
                    target(torch.tensor([prompt]), cache, logits=None)
                    r = target(torch.tensor([block]), cache, logits="all", taps=(4, 1, 4))
                    n = cache.length
                    out += [r.logits, r.hidden, cache.k[..., :n, :].clone(), cache.v[..., :n, :].clone()]
                runs.append(out)
            assert all(torch.equal(x, y) for x, y in zip(*runs)), (context, threads)
    finally:
        target.flat, target.native = True, True
        torch.set_num_threads(before)
