"""The flat paths (decode steps, verify passes and draft passes without the layer modules, in Python or
compiled by TorchScript; the native draft pass) are bit for bit the module path's; the rotary table's rows
are the positions computed alone."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_torch.decoding.drafter import FlatDraft, NativeDraft, load_drafter
from dflash_torch.models import flat
from dflash_torch.models.layers import RMSNorm
from dflash_torch.models.quantize import quantize_blocks, quantize_int4, quantize_int8

from . import fast_support
from .fast_support import _load

pair = fast_support.pair  # the shared module-scoped fixture: this module gets its own


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
def test_native_draft_loops_equal_its_operators(pair, tmp_path, monkeypatch):
    """draft_stack normalizes, rotates and writes the keys and values in plain loops where the cache and the rotary
    tables are float32 rows of D (as NativeDraft gives them), else through the operators: both give the same
    hidden states and cache, bit for bit (rotary tables as strided views take the operators)."""
    from dflash_torch.decoding import drafter_blocks

    path, dpath = pair
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    target = quantize_blocks(_load(path), "q4_0")
    drafter = drafter_blocks.load_in_blocks(dpath, "q4_0", torch.device("cpu"), torch.float32).fuse_context_kv()
    with torch.inference_mode():
        c = target.new_cache(64)
        feats = target(torch.tensor([list(range(3, 26))]), c, taps=drafter.target_layer_ids).hidden  # [1, 23, F]
        plan = drafter._flat_plan()
        assert isinstance(plan, NativeDraft)
        x = target.embed_tokens(torch.tensor([5, drafter.mask_token_id, drafter.mask_token_id]))
        q_cos, q_sin, q_signed = drafter.rotary.rows(23, 26, torch.float32)
        c_cos, c_sin, c_signed = drafter.rotary.rows(0, 23, torch.float32)

        def strided(t):  # the same values, rows 2 D apart
            return torch.zeros(*t.shape[:-1], 2 * t.shape[-1]).narrow(-1, 0, t.shape[-1]).copy_(t)

        outs = []
        for tables in ((q_cos, q_sin, c_cos, c_sin, q_signed, c_signed),
                       tuple(strided(t) for t in (q_cos, q_sin, c_cos, c_sin, q_signed, c_signed))):
            dc = drafter.new_cache(64)
            qc, qs, cc, cs, qg, cg = tables
            hidden = plan(x, feats[0], qc, qs, cc, cs, 0, dc.k, dc.v, qg, cg)
            outs.append((hidden, dc.k[..., :26, :].clone(), dc.v[..., :26, :].clone()))  # context, then the block
        assert all(torch.equal(a, b) for a, b in zip(*outs))


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
