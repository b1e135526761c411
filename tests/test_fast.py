"""Performance switches never change results: int8 / int4 weights, bfloat16, adaptive block sizes."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.adaptive import AdaptiveBlockSize, calibrate
from dflash_torch.decoding.drafter import FlatDraft, NativeDraft, load_drafter
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import Pipeline
from dflash_torch.models import flat, layers
from dflash_torch.models.layers import RMSNorm
from dflash_torch.models.quantize import Int4Linear, Int8Linear, quantize_blocks, quantize_int4, quantize_int8
from dflash_torch.profile import profile_pipeline

from .conftest import BF16_STEP, F32_STEP, assert_within_steps, make_drafter, within_steps
from .test_lossless import OracleDrafter, clear_margins


def _gen(target, prompt, n, drafter=None, controller=None, bs=None):
    stats = Stats()
    out = list(generate_tokens(target, prompt, max_new_tokens=n, drafter=drafter, stats=stats, controller=controller,
                               block_size=bs))
    return out, stats


@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):
    path = tiny_models["qwen3"]
    d = make_drafter(path, tmp_path_factory.mktemp("fd") / "d", block_size=8)
    return path, d


@pytest.mark.fastpath
def test_int8_linear_matches_dequantized_weights():
    lin = torch.nn.Linear(64, 96, bias=True)
    q = Int8Linear(lin)
    x = torch.randn(5, 64)
    ref = torch.nn.functional.linear(x, q.weight, q.bias)
    # `_weight_int8pack_mm` against float32 F.linear on the dequantized weight: the kernel rounds the input,
    # the scales and its output to bfloat16 (3 roundings, each at most a step of |x| @ |W|^T)
    assert_within_steps(q(x), ref, x.abs() @ q.weight.abs().T, 3)
    assert (q.weight - lin.weight).abs().max() <= lin.weight.abs().max() / 127  # rounding error bound


@pytest.mark.fastpath
def test_int4_linear_matches_dequantized_weights():
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 48, bias=True)
    q = Int4Linear(lin, group_size=32)
    x = torch.randn(5, 128)
    w = q.weight.float()  # [48, 128], read back through the kernel
    xb = x.bfloat16().float()
    ref = torch.nn.functional.linear(xb, w, q.bias)
    # `_weight_int4pack_mm_for_cpu` against float32 F.linear on the same bf16 input and the weight read back
    # through the kernel: the read-back rounds the weight to bfloat16, the kernel rounds its output (2 roundings)
    assert_within_steps(q(x), ref, xb.abs() @ w.abs().T, 2)
    groups = lin.weight.detach().reshape(48, 4, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # [48, 4] quantization step per group
    err = (w - lin.weight).abs().reshape(48, 4, 32).amax(-1)
    assert (err <= step / 2 + lin.weight.abs().max() / 128).all()  # half a step, plus bf16 rounding


@pytest.mark.fastpath
def test_int8_keeps_layers_the_kernel_cannot_take():
    """The CPU int8 kernel reads past the input for in_features not a multiple of 16 (a crash at 8)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 64))
    quantize_int8(model)
    assert [type(m).__name__ for m in model] == ["Int8Linear", "Linear"]
    x = torch.randn(3, 64)
    for _ in range(200):  # the kernel read past the end of an 8-wide input and crashed the process
        y = model(x)
    assert y.shape == (3, 64) and torch.isfinite(y).all()
    direct = Int8Linear(torch.nn.Linear(8, 16))  # built by hand: the plain path, never the kernel
    assert torch.isfinite(direct(torch.randn(2, 8))).all()


@pytest.mark.fastpath
def test_int4_keeps_layers_the_kernel_cannot_take():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 40), torch.nn.Linear(40, 64))
    quantize_int4(model)
    # N must be a multiple of 16 and K of the group size (32)
    assert [type(m).__name__ for m in model] == ["Int4Linear", "Linear", "Linear"]
    for quantize in (quantize_int4, quantize_int8):  # an LM head format the quantizers do not have
        with pytest.raises(ValueError, match="unknown LM head format"):
            quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)), head="int2")


@pytest.mark.fastpath
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", [None, "int8", "int4", "int4+int8 head", "int4+full head"])
def test_switches_keep_speculative_equal_to_target_only(pair, dtype, quant):
    """Under each switch, DFlash greedy == target-only greedy with the same switch (the mixed LM heads are
    what --quantize auto picks for GGUF files storing it in 8 bits or in full precision)."""
    path, dpath = pair
    target = loading.load_target(path, torch.device("cpu"), dtype)
    if quant == "int8":
        quantize_int8(target)
        assert isinstance(target.lm_head, Int8Linear)
    if quant == "int4":
        quantize_int4(target)
        assert isinstance(target.lm_head, Int4Linear)
        assert all(not isinstance(m, torch.nn.Linear) for m in target.modules())  # every layer fits the kernel
    if quant in ("int4+int8 head", "int4+full head"):
        quantize_int4(target, head="int8" if quant == "int4+int8 head" else None)
        assert type(target.lm_head) is (Int8Linear if quant == "int4+int8 head" else layers.Linear)
        assert isinstance(target.model.layers[0].mlp.down_proj, Int4Linear)
    drafter = load_drafter(dpath, dtype=dtype)
    rng = random.Random(5)
    margin = 1e-3 if dtype == torch.float32 else 1e-2  # bfloat16 logits are coarse: near-ties are common
    checked = 0
    for _ in range(60):
        prompt = [rng.randrange(255) for _ in range(rng.randint(2, 10))]
        ref, _ = _gen(target, prompt, 20)
        truth, _ = _gen(target, prompt, 40)
        if not clear_margins(target, prompt, ref, margin):
            continue
        checked += 1
        assert _gen(target, prompt, 20, drafter)[0] == ref
        assert _gen(target, prompt, 20, OracleDrafter(truth, len(prompt), 256, 0.2, 8))[0] == ref
        if checked == 6:
            break
    assert checked == 6


@pytest.mark.fastpath
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantize_covers_the_drafter_and_keeps_output(pair, quant):
    """`load(quantize=...)` quantizes the drafter's layers too (fewer bytes per draft pass); its
    proposals change a little, the tokens do not: DFlash greedy == target-only greedy, exactly."""
    from dflash_torch.generate import load

    path, dpath = pair
    pipe = load(str(path), str(dpath), "cpu", "float32", quantize=quant, quiet=True)
    kind = Int8Linear if quant == "int8" else Int4Linear
    d = pipe.drafter
    assert isinstance(d.fc, kind) and isinstance(d.layers[0].self_attn.q_proj, kind)
    assert d.dtype == torch.float32 and d.new_cache(8).k.dtype == torch.float32
    k0 = d.layers[0].self_attn.k_proj
    assert torch.equal(d.ctx_kv_weight[: k0.out_features], k0.weight.float())  # context k/v: the same weights
    plain = load_drafter(dpath)
    rng = random.Random(4)
    with torch.inference_mode():
        ids = torch.tensor([[rng.randrange(255) for _ in range(12)]])
        c = pipe.target.new_cache(40)
        hidden = pipe.target(ids, c, taps=d.target_layer_ids).hidden
        block = torch.full((1, 8), d.mask_token_id)
        block[0, 0] = 7
        quantized = d.propose(pipe.target, block, hidden, d.new_cache(40))
        full = plain.propose(pipe.target, block, hidden, plain.new_cache(40))
    assert not torch.equal(quantized, full)  # the drafter did change
    for _ in range(6):
        prompt = [rng.randrange(255) for _ in range(rng.randint(2, 12))]
        ref, _ = _gen(pipe.target, prompt, 24)
        assert _gen(pipe.target, prompt, 24, d)[0] == ref


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


@pytest.mark.fastpath
@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fused_projections_change_nothing(tiny_models, kind, quant):
    """Quantizing fuses q/k/v and gate/up into one layer each; the logits of a prefill, decode steps and
    a verify pass are bit-identical to the same quantized weights kept as separate layers."""
    quantizer = quantize_int8 if quant == "int8" else quantize_int4
    models = []
    for fuse in (False, True):
        target = loading.load_target(tiny_models[kind], torch.device("cpu"), torch.float32)
        models.append(quantizer(target, fuse=fuse))
    fused_layer = models[1].model.layers[0]
    assert fused_layer.self_attn.qkv_proj is not None and fused_layer.mlp.gate_up_proj is not None
    assert not hasattr(fused_layer.self_attn, "q_proj") and not hasattr(fused_layer.mlp, "up_proj")
    assert models[0].model.layers[0].self_attn.qkv_proj is None
    rng = random.Random(11)
    prompt = [rng.randrange(255) for _ in range(20)]
    with torch.inference_mode():
        logits, caches = [], []
        for m in models:
            c = m.new_cache(64)
            out = [m(torch.tensor([prompt]), c, logits="all").logits]
            out += [m(torch.tensor([[t]]), c, logits="all").logits for t in prompt[:5]]
            out.append(m(torch.tensor([prompt[5:17]]), c, logits="all").logits)
            logits.append(torch.cat(out, dim=1))
            caches.append(c)
        assert torch.equal(logits[0], logits[1])
        n = caches[0].length  # the slots the passes wrote (a CPU cache's other slots are left unwritten)
        assert caches[1].length == n and torch.equal(caches[0].k[..., :n, :], caches[1].k[..., :n, :])
        assert torch.equal(caches[0].v[..., :n, :], caches[1].v[..., :n, :])


@pytest.mark.fastpath
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_verify_reproduces_decode_bit_for_bit(tiny_models, pair, quant):
    """With quantized weights a T-token verify gives exactly the logits of T decode steps, so
    speculative output equals target-only output with no near-tie exception (no margin filter here)."""
    target = loading.load_target(tiny_models["llama"], torch.device("cpu"), torch.float32)
    (quantize_int8 if quant == "int8" else quantize_int4)(target)
    rng = random.Random(3)
    with torch.inference_mode():
        for _ in range(5):
            prompt = [rng.randrange(255) for _ in range(rng.randint(2, 30))]
            block = [rng.randrange(255) for _ in range(16)]
            c1 = target.new_cache(64)
            target(torch.tensor([prompt]), c1, logits="last")
            steps = torch.cat([target(torch.tensor([[t]]), c1, logits="all").logits[0] for t in block])
            c2 = target.new_cache(64)
            target(torch.tensor([prompt]), c2, logits="last")
            verify = target(torch.tensor([block]), c2, logits="all").logits[0]
            assert torch.equal(steps, verify)
            assert torch.equal(c1.k[:, :, :, : c1.length], c2.k[:, :, :, : c2.length])
    path, dpath = pair
    target = loading.load_target(path, torch.device("cpu"), torch.float32)
    (quantize_int8 if quant == "int8" else quantize_int4)(target)
    drafter = load_drafter(dpath)
    for _ in range(8):
        unit = [rng.randrange(255) for _ in range(rng.randint(1, 5))]
        prompt = (unit * 10)[: rng.randint(2, 24)]
        ref, _ = _gen(target, prompt, 48)
        assert _gen(target, prompt, 48, drafter)[0] == ref
        out, stats = [], Stats()
        out = list(generate_tokens(target, prompt, max_new_tokens=48, drafter=drafter, stats=stats, lookup=True))
        assert out == ref


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


def _load(path, quant=None, dtype=torch.float32):
    target = loading.load_target(path, torch.device("cpu"), dtype)
    return {"int8": quantize_int8, "int4": quantize_int4}.get(quant, lambda m: m)(target)


def _decode_run(target, prompt: list[int], steps: int, taps=(2, 0, 1)):
    """Logits and taps of `steps` greedy one-token passes after a prefill, and the cache."""
    c = target.new_cache(len(prompt) + steps + 1)
    tok = target(torch.tensor([prompt]), c).logits[0, -1].argmax()
    out = []
    for _ in range(steps):
        r = target(tok.view(1, 1), c, logits="last", taps=taps)
        out += [r.logits, r.hidden]
        tok = r.logits[0, -1].argmax()
    return out, c


@pytest.mark.fastpath
@pytest.mark.parametrize("quant", [None, "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_flat_decode_step_equals_module_path(tiny_models, kind, quant):
    """One-token passes go through llama.Model._flat (the layer modules' kernels, flattened): logits, tap
    features and cache are bit for bit the module path's, over a run of greedy steps."""
    dtype = torch.bfloat16 if quant == "bfloat16" else torch.float32
    target = _load(tiny_models[kind], None if quant == "bfloat16" else quant, dtype)
    rng = random.Random(5)
    for _ in range(3):
        prompt = [rng.randrange(255) for _ in range(rng.randint(1, 20))]
        runs = []
        with torch.inference_mode():
            for fast, scripted in ((False, False), (True, False), (True, True)):
                target.flat, target.script, target._plan = fast, scripted, None
                runs.append(_decode_run(target, prompt, 12))
        assert isinstance(target._plan[(True, True)], torch.jit.ScriptModule)  # the scripted flat path ran
        (want, c1), *others = runs
        for got, c2 in others:  # the flat layers in Python, then compiled by TorchScript
            assert all(torch.equal(a, b) for a, b in zip(want, got))
            n = c1.length  # the written slots
            assert c2.length == n and torch.equal(c1.k[..., :n, :], c2.k[..., :n, :])
            assert torch.equal(c1.v[..., :n, :], c2.v[..., :n, :])


@pytest.mark.fastpath
def test_flat_decode_follows_replaced_layers_and_windows(tiny_models):
    """The flat path looks its layers up once; quantizing or converting afterwards rebuilds that (same
    results as a model quantized before its first step), and a sliding window past its reach takes the
    module path (masked decode)."""
    path = tiny_models["llama"]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.inference_mode():
        for quant, fuse in (("int8", True), ("int4", True), ("int4", False)):
            late = _load(path)
            _decode_run(late, prompt, 2)  # builds the plan from float32 layers
            (quantize_int8 if quant == "int8" else quantize_int4)(late, fuse=fuse)
            want, _ = _decode_run(_load(path, quant), prompt, 6)
            got, _ = _decode_run(late, prompt, 6)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
        late = _load(path)
        _decode_run(late, prompt, 2)
        overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)  # new tensors, as a device move makes
        try:
            late.to(torch.bfloat16)
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        got, _ = _decode_run(late, prompt, 6)
        late.flat = False
        want, _ = _decode_run(late, prompt, 6)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        windowed = _load(path)
        windowed.config.sliding_window = 12  # steps at positions 8..11 flat, from 12 on masked
        runs = []
        for fast in (False, True):
            windowed.flat = fast
            runs.append(_decode_run(windowed, prompt, 10)[0])
        assert all(torch.equal(a, b) for a, b in zip(*runs))
        plain = _load(path)
        plain.config.sliding_window = 12
        plain.flat = False
        free = _decode_run(_load(path), prompt, 10)[0]  # no window: differs once the window cuts keys off
        assert not all(torch.equal(a, b) for a, b in zip(runs[0], free))


@pytest.mark.fastpath
@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_flat_verify_and_exact_prefill_equal_module_path(tiny_models, kind, quant, monkeypatch):
    """Quantized targets attend one query at a time in verify passes (and in prefills with
    quantize.exact_prefill); those passes take the flat path too, bit for bit the module path's."""
    from dflash_torch.models import llama
    from dflash_torch.models.quantize import exact_prefill

    target = _load(tiny_models[kind], quant)
    widths = []
    flat = llama.Model._flat
    monkeypatch.setattr(llama.Model, "_flat", lambda self, ids, *a: widths.append(ids.shape[1]) or flat(self, ids, *a))
    rng = random.Random(8)
    for prefill_exact in (False, True):
        if prefill_exact:
            exact_prefill(target)
        prompt = [rng.randrange(255) for _ in range(40)]
        blocks = [[rng.randrange(255) for _ in range(w)] for w in (7, 1, 16, 3)]
        runs = []
        with torch.inference_mode():
            for on, scripted in ((False, False), (True, False), (True, True)):
                target.flat, target.script = on, scripted
                c = target.new_cache(len(prompt) + 30)
                out = [target(torch.tensor([prompt]), c, logits="all", taps=(1,)).logits]
                for b in blocks:
                    r = target(torch.tensor([b]), c, logits="all", taps=(0, 2))
                    out += [r.logits, r.hidden]
                    c.crop(c.length - len(b) + 1)  # keep one token of each block, as a rejected draft would
                runs.append((out, c))
        (want, c1), *others = runs
        for got, c2 in others:
            assert all(torch.equal(a, b) for a, b in zip(want, got))
            assert torch.equal(c1.k[:, :, :, : c1.length], c2.k[:, :, :, : c2.length]) and c1.length == c2.length
    assert 7 in widths and 16 in widths and 40 in widths  # verify passes, and the exact prefill, went flat


@pytest.mark.fastpath
def test_flat_path_falls_back_without_torchscript_or_for_unknown_layers(tiny_models, monkeypatch):
    """Where TorchScript cannot compile the flat layers they run in Python, and a layer type the flat path
    does not know sends decode steps through the layer modules: a warning each, the same tokens."""
    path, prompt = tiny_models["llama"], [3, 1, 4, 1, 5]
    with torch.inference_mode():
        want, _ = _decode_run(_load(path, "int4"), prompt, 6)

        def no_script(m):
            raise RuntimeError("no TorchScript here")

        monkeypatch.setattr(torch.jit, "script", no_script)
        target = _load(path, "int4")
        with pytest.warns(UserWarning, match="TorchScript unavailable"):
            got, _ = _decode_run(target, prompt, 6)
        assert not isinstance(target._plan[(True, True)], torch.jit.ScriptModule)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        monkeypatch.undo()

        class Other(torch.nn.Linear):  # e.g. an adapter around a linear layer
            pass

        target = _load(path, "int4")
        other = Other(1, 1)
        other.forward = target.model.layers[0].self_attn.o_proj.forward
        target.model.layers[0].self_attn.o_proj = other
        with pytest.warns(UserWarning, match="no flat path for Other"):
            got, _ = _decode_run(target, prompt, 6)
        assert not target.flat
        assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.fastpath
@pytest.mark.parametrize("quant", [None, "bfloat16", "int8", "int4", "q4_0", "q8_0"])
def test_flat_draft_pass_equals_module_path(pair, quant, tmp_path, monkeypatch):
    """Draft passes go through drafter.FlatDraft (in Python and compiled by TorchScript): logits and the
    drafter's cache are bit for bit the modules', over cycles with new context of several lengths (block
    formats: the drafter as generate loads it, its norms on kernels/norm.cpp)."""
    path, dpath = pair
    dtype = torch.bfloat16 if quant == "bfloat16" else torch.float32
    if quant in ("q4_0", "q8_0"):
        from dflash_torch.decoding import drafter_blocks

        monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
        target = quantize_blocks(_load(path), quant)
        drafter = drafter_blocks.load_in_blocks(dpath, quant, torch.device("cpu"), dtype)
        assert all(m.kernel for m in drafter.modules() if isinstance(m, RMSNorm))
    else:
        target = _load(path, None if quant == "bfloat16" else quant, dtype)
        drafter = load_drafter(dpath, dtype=dtype)
    if quant in ("int8", "int4"):
        (quantize_int8 if quant == "int8" else quantize_int4)(drafter)
    drafter.fuse_context_kv()
    rng = random.Random(3)
    prompt = [rng.randrange(255) for _ in range(23)]
    with torch.inference_mode():
        c = target.new_cache(64)
        feats = target(torch.tensor([prompt]), c, taps=drafter.target_layer_ids).hidden  # [1, 23, F]
        runs = []
        combos = [(False, False, False), (True, False, False), (True, True, False)]
        if quant in ("q4_0", "q8_0"):
            combos.append((True, True, True))  # NativeDraft: the layers in one C++ call
        for fast, scripted, native in combos:
            drafter.flat, drafter.script, drafter.native = fast, scripted, native
            dc = drafter.new_cache(64)
            out, used = [], 0
            for n_ctx, width in ((17, 8), (1, 2), (3, 5), (2, 8)):  # new context tokens, block width
                block = torch.tensor([[prompt[used + n_ctx - 1]] + [drafter.mask_token_id] * (width - 1)])
                out.append(drafter.propose(target, block, feats[:, used : used + n_ctx], dc))
                used += n_ctx
            runs.append((out, dc))
        assert isinstance(drafter._plan[True, False], torch.jit.ScriptModule)  # the scripted draft pass ran
        assert isinstance(drafter._plan[False, False], FlatDraft)  # and the flat one in Python
        if quant in ("q4_0", "q8_0"):
            native = drafter._plan[True, True]
            assert isinstance(native, NativeDraft)
            assert len(native.packed) == 4 * len(drafter.layers)  # q/k/v as one matmul per layer
            assert drafter.ctx_kv_blocks is not None  # the context k/v on the block kernels, in every path
        (want, c1), *others = runs
        for got, c2 in others:
            assert all(torch.equal(a, b) for a, b in zip(want, got))
            assert c1.length == c2.length == 23
            assert torch.equal(c1.k[:, :, :, :23], c2.k[:, :, :, :23])
            assert torch.equal(c1.v[:, :, :, :23], c2.v[:, :, :, :23])


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


@pytest.mark.parametrize("params", [{"rope_theta": 10000.0}, {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0},
                                    {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                    {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 128}])
def test_rotary_table_rows_equal_the_positions_computed_alone(params):
    """Rotary.span's rows (a table computed once, grown by doubling) are exactly what forward computes for
    those positions alone, whichever order the spans are asked for in and for each dtype; Rotary.rows gives
    the same rows as [T, 1, D] with flat.signed's signed sine."""
    from dflash_torch.models.rope import Rotary

    rot = Rotary({"rope_type": "default", **params}, 64, 8192)
    rng = random.Random(5)
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(60):
            start = rng.randrange(0, 3000)
            end = start + rng.choice([1, 2, 3, 16, 17, 200])
            want = rot(torch.arange(start, end), dtype)
            got = rot.span(start, end, dtype)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (start, end, dtype)
            assert got[0].dtype == dtype
            cos, sin, signed = rot.rows(start, end, dtype)
            assert cos.shape == (end - start, 1, 64) and torch.equal(cos[:, 0], want[0])
            assert torch.equal(sin[:, 0], want[1]) and torch.equal(signed, flat.signed(want[1][:, None]))
