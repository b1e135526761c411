"""The static-shape target that CUDA graphs replay computes the dynamic passes and keeps speculative output
equal to target-only output; on a GPU, graph replays equal the same passes run eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.drafter import load_drafter

from . import fast_support
from .fast_support import _gen
from .test_lossless import OracleDrafter, clear_margins

pair = fast_support.pair  # the shared module-scoped fixture: this module gets its own


def _passes(target, prompt: list[int], block: list[int]):
    """Logits of a prefill, 5 decode steps and a verify pass, and the cache after them."""
    c = target.new_cache(len(prompt) + 5 + len(block) + 1)
    out = [target(torch.tensor([prompt]), c, logits="all").logits]
    out += [target(torch.tensor([[t]]), c, logits="last").logits for t in block[:5]]
    out.append(target(torch.tensor([block]), c, logits="all", taps=(0, 1)).logits)
    return torch.cat(out, dim=1), c


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_static_shape_passes_match_dynamic(tiny_models, kind):
    """The static-shape forward that CUDA graphs capture (positions as a tensor, masked attention over the
    whole cache) computes the same passes as the dynamic one, and writes the same cache."""
    from dflash_torch.models.cudagraph import GraphedTarget

    target = loading.load_target(tiny_models[kind], torch.device("cpu"), torch.float32)
    static = GraphedTarget(target, use_graphs=False)
    rng = random.Random(2)
    with torch.inference_mode():
        for _ in range(3):
            prompt = [rng.randrange(255) for _ in range(rng.randint(1, 40))]
            block = [rng.randrange(255) for _ in range(rng.randint(2, 16))]
            want, c1 = _passes(target, prompt, block)
            got, c2 = _passes(static, prompt, block)
            assert c2.max_len >= 256 and c2.length == c1.length  # capacity rounded up; length kept the same way
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(c2.k[:, :, :, : c1.length], c1.k[:, :, :, : c1.length], rtol=1e-5, atol=1e-6)


def test_static_shapes_keep_speculative_equal_to_target_only(pair, tiny_models):
    """Through the static-shape target (what --cuda-graphs replays), DFlash greedy == target-only greedy,
    a drafter that is the truth is fully accepted, and bad uses are clear errors."""
    from dflash_torch.models.cudagraph import GraphedTarget

    path, dpath = pair
    plain = loading.load_target(path, torch.device("cpu"), torch.float32)
    target = GraphedTarget(plain, use_graphs=False)
    drafter = load_drafter(dpath)
    rng = random.Random(8)
    checked = 0
    for _ in range(60):
        prompt = [rng.randrange(255) for _ in range(rng.randint(2, 10))]
        ref, _ = _gen(target, prompt, 20)
        truth, _ = _gen(target, prompt, 40)
        if not clear_margins(target, prompt, ref):
            continue
        checked += 1
        assert _gen(plain, prompt, 20)[0] == ref  # the switch itself changes no greedy token
        assert _gen(target, prompt, 20, drafter)[0] == ref
        out, stats = _gen(target, prompt, 20, OracleDrafter(truth, len(prompt), 256, 0.0, 8))
        assert out == ref and stats.acceptance_rate == 1.0
        if checked == 4:
            break
    assert checked == 4
    with pytest.raises(ValueError, match="own new_cache"):
        target(torch.tensor([[1]]), target.target.new_cache(8))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        GraphedTarget(target.target)
    with pytest.raises(ValueError, match="overflow"):
        target(torch.tensor([[1] * 300]), target.new_cache(10))
    from dflash_torch.decoding import speculative

    plain.flat_serves = lambda: True  # even where the wrapped model's flat path would serve every pass,
    assert speculative._runner(target) != plain._flat  # the loops call the wrapper (its graphs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager(pair):
    """On a GPU: graph replays give bit-identical logits and cache to the same static passes run eagerly,
    and DFlash greedy through graphs == target-only greedy through graphs."""
    from dflash_torch.models.cudagraph import GraphedTarget

    path, dpath = pair
    dev = torch.device("cuda")
    graphed = GraphedTarget(loading.load_target(path, dev, torch.float32))
    eager = GraphedTarget(loading.load_target(path, dev, torch.float32), use_graphs=False)
    rng = random.Random(4)
    with torch.inference_mode():
        for _ in range(3):
            prompt = [rng.randrange(255) for _ in range(rng.randint(2, 40))]
            block = [rng.randrange(255) for _ in range(16)]
            outs = []
            for m in (graphed, eager):
                c = m.new_cache(80)
                logits = [m(torch.tensor([prompt], device=dev), c, logits="last").logits]
                logits += [m(torch.tensor([[t]], device=dev), c, logits="last").logits for t in block[:6]]
                logits.append(m(torch.tensor([block], device=dev), c, logits="all", taps=(0,)).logits)
                outs.append((torch.cat(logits, dim=1), c.k[:, :, :, : c.length].clone()))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert graphed.replays > 0
    drafter = load_drafter(dpath, device=dev)
    checked = 0
    for _ in range(40):
        prompt = [rng.randrange(255) for _ in range(rng.randint(2, 10))]
        ref, _ = _gen(graphed, prompt, 24)
        if not clear_margins(graphed, prompt, ref):  # widths 1 and 8 may round a near-tie apart on a GPU
            continue
        checked += 1
        assert _gen(graphed, prompt, 24, drafter)[0] == ref
        if checked == 4:
            break
    assert checked == 4
