"""Performance switches never change results: int8 / int4 weights and bfloat16, in the target and the
drafter; fused projections; quantized verify passes, bit for bit the decode steps'."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.models import layers
from dflash_torch.models.quantize import Int4Linear, Int8Linear, quantize_int4, quantize_int8

from . import fast_support
from .conftest import assert_within_steps
from .fast_support import _gen
from .test_lossless import OracleDrafter, clear_margins

pair = fast_support.pair  # the shared module-scoped fixture: this module gets its own


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
