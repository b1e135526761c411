"""A windowed drafter (attention sinks and the recent positions) proposes what the whole-context drafter
proposes with the left-out positions masked, takes its context in parts, and takes its window from the
drafter's config."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.models.quantize import quantize_int4

from . import fast_support
from .conftest import BF16_STEP, F32_STEP, assert_within_steps, within_steps
from .fast_support import _gen, _load

pair = fast_support.pair  # the shared module-scoped fixture: this module gets its own


@pytest.mark.fastpath
@pytest.mark.parametrize("quant", [None, "int4"])
def test_draft_window_attends_sinks_and_recent_positions(pair, quant, monkeypatch):
    """A windowed drafter (set_window) proposes what the whole-context drafter proposes when the positions
    its cache left out are masked, flat path or modules, over cycles that trim new context and compact the
    cache; its cache stays within the window; speculative output still equals target-only output."""
    from dflash_torch.decoding import drafter as drafter_module

    monkeypatch.setattr(drafter_module, "WINDOW_SLACK", 4)
    path, dpath = pair
    target = _load(path, quant)
    drafter = load_drafter(dpath)
    if quant:
        quantize_int4(drafter)
    drafter.fuse_context_kv()
    rng = random.Random(5)
    prompt = [rng.randrange(255) for _ in range(64)]
    sinks, size = 3, 10
    with torch.inference_mode():
        feats = target(torch.tensor([prompt]), target.new_cache(80), taps=drafter.target_layer_ids).hidden
        for fast in (False, True):
            drafter.flat = fast
            drafter.set_window(size, sinks)
            dc = drafter.new_cache(80)
            assert dc.max_len <= sinks + size + 4 + drafter.block_size
            used, dropped = 0, []
            for n_ctx, width in ((20, 8), (1, 2), (3, 5), (2, 8), (6, 4), (1, 8), (9, 3), (2, 8)):
                block = torch.tensor([[prompt[used + n_ctx - 1]] + [drafter.mask_token_id] * (width - 1)])
                got = drafter.propose(target, block, feats[:, used : used + n_ctx], dc)
                used += n_ctx
                assert dc.length + dc.dropped == used and dc.length <= sinks + size + 4
                dropped.append(dc.dropped)
                # the reference: the whole context, the left-out positions masked
                seen = torch.zeros(used + width, dtype=torch.bool)
                seen[: min(sinks, used)] = seen[sinks + dc.dropped :] = True
                drafter.set_window(None)
                emb = target.embed_tokens(block)
                hidden = drafter(emb, feats[:, :used], torch.arange(used, used + width), torch.arange(used),
                                 extra_mask=seen.expand(width, -1))
                want = drafter.logits(hidden[:, 1:], target.lm_head)
                seen[sinks + dc.dropped - 1] = True  # a mask off by one: attends a position the window left out
                hidden = drafter(emb, feats[:, :used], torch.arange(used, used + width), torch.arange(used),
                                 extra_mask=seen.expand(width, -1))
                wrong = drafter.logits(hidden[:, 1:], target.lm_head)
                drafter.set_window(size, sinks)
                # Both sides run the same kernels (int4: `_weight_int4pack_mm_for_cpu` with bf16 activations;
                # float32: F.linear and SDPA); they differ in the float32 attention's summation order only (keys
                # of a compacted cache, or of the whole context with a mask). In float32 that is a few float32
                # steps per term of the 64-long reductions; with int4 weights each linear rounds its input and
                # output to bfloat16, where such a difference crossing a rounding boundary is one bf16 step: a
                # few (4) of those steps of the row's largest logit. The off-by-one mask is outside the bound.
                roundings, step = (4, BF16_STEP) if quant else (64, F32_STEP)
                scale = want.abs().amax(-1, keepdim=True)
                assert_within_steps(got, want, scale, roundings, step)
                assert not within_steps(wrong, want, scale, roundings, step)
            assert dropped[0] == 20 - sinks - size and dropped[-1] > dropped[0]  # trimmed, then compacted
        drafter.set_window(4, 2)
        for bs in (3, 8):
            want, _ = _gen(target, prompt[:9], 40)
            got, stats = _gen(target, prompt[:9], 40, drafter=drafter, bs=bs)
            assert got == want and stats.cycles > 0
    with pytest.raises(ValueError, match="size >= 1"):
        drafter.set_window(0)


def test_draft_window_from_the_drafter_config(pair, tmp_path):
    """A drafter whose config names a window (dflash_config.draft_window, draft_sinks) attends through it by
    default; load(draft_window=0) turns it off, draft_window=N replaces it."""
    import json

    from dflash_torch.generate import load

    path, dpath = pair
    d = tmp_path / "d"
    d.mkdir()
    for f in dpath.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "config.json").read_text())
    config["dflash_config"] |= {"draft_window": 32, "draft_sinks": 4}
    (d / "config.json").write_text(json.dumps(config))
    assert load_drafter(d).window == (4, 32) and load_drafter(dpath).window is None
    assert load(str(path), str(d), device="cpu", dtype="float32", quiet=True).drafter.window == (4, 32)
    assert load(str(path), str(d), device="cpu", dtype="float32", quiet=True, draft_window=0).drafter.window is None
    pipe = load(str(path), str(d), device="cpu", dtype="float32", quiet=True, draft_window=16, draft_sinks=2)
    assert pipe.drafter.window == (2, 16)


def test_windowed_drafter_takes_its_context_in_parts(pair):
    """A windowed drafter given its new context as parts (a long prompt's features, then a few plain
    steps') copies only the rows it keeps: the same drafts, bit for bit, and the same cache as the joined
    context gives, whether the kept rows lie in one part or across several."""
    path, dpath = pair
    target = _load(path, False)
    drafter = load_drafter(dpath)
    rng = random.Random(7)
    prompt = [rng.randrange(255) for _ in range(70)]
    with torch.inference_mode():
        feats = target(torch.tensor([prompt]), target.new_cache(80), taps=drafter.target_layer_ids).hidden
        drafter.set_window(10, 3)
        whole, parts = drafter.new_cache(80), drafter.new_cache(80)
        used = 0
        for cuts in ((2, 20, 41), (1, 2), (5,), (3, 4, 9)):  # the parts' ends, relative to `used`
            end = used + cuts[-1]
            pieces = [feats[:, used + a : used + b] for a, b in zip((0, *cuts[:-1]), cuts)]
            block = torch.tensor([[prompt[end - 1]] + [drafter.mask_token_id] * 5])
            want = drafter.propose(target, block, feats[:, used:end], whole)
            got = drafter.propose(target, block, pieces, parts)
            assert torch.equal(got, want)
            assert (parts.length, parts.dropped) == (whole.length, whole.dropped)
            assert torch.equal(parts.k[..., : parts.length, :], whole.k[..., : whole.length, :])
            used = end
