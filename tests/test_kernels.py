"""The block kernels (dflash_torch/kernels): every compiled path equals the PyTorch reference bit for bit,
each row's result is independent of the other rows, and the blocks are GGUF's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dflash_torch import kernels
from dflash_torch.kernels import pack, reference
from dflash_torch.models.quantize import BlockLinear, fuse_projections

pytestmark = pytest.mark.fastpath
ROOT = Path(__file__).resolve().parents[1]
kernels.ensure()  # torch.ops.dflash.* exist from here on (built on first use)


def _isas() -> list[int]:
    """The compiled paths this CPU can run: scalar, then AVX2 and VNNI where it has them."""
    best = kernels.best_isa()
    return [] if best == "reference" else list(range(kernels.ISAS.index(best) + 1))


# (3 and 4 rows x 293 outputs: the threads' chunks hold pairs of column groups, whose next pair the 256-bit rows
# prefetch into L1 or, past 16 KB for the two, into L2)
SHAPES = [(1, 8, 32), (3, 13, 64), (16, 40, 96), (2, 1, 32), (33, 21, 160), (70, 24, 128), (5, 72, 608),
          (3, 293, 512), (4, 293, 1056)]


@pytest.mark.parametrize("fmt", pack.FORMATS)
def test_compiled_paths_equal_reference(fmt):
    """Scalar, AVX2 and VNNI paths (as this CPU has them) against the reference, bit for bit, on odd
    shapes (N not a multiple of the 8-column group, M across the 64-row tile), with zero blocks, ties
    at half a quantization step and values of very different magnitudes."""
    assert _isas(), "the C++ extension did not build"
    gen = torch.Generator().manual_seed(1)
    code = pack.FORMATS.index(fmt)
    for m, n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
        x[0, :32] = 0.0  # a zero block: scale 0
        if k >= 64:
            x[-1, 32:64] = torch.arange(32) - 15.5  # exact ties x * (1/d) = k + 0.5 appear here
        p = pack.pack(pack.quantize(w, fmt), fmt)
        want = reference.block_mm(x, p, code, n)
        for isa in [*_isas(), -1]:  # -1: the path the dispatch picks for these rows
            got = kernels.block_mm(x, p, code, n, isa)
            assert torch.equal(got, want), (fmt, m, n, k, isa, (got - want).abs().max())


def test_q8_0_extreme_quants():
    """Q8_0 quants of -128 and 127 (a GGUF file may hold -128 though llama.cpp's quantizer never writes it):
    the 512-bit VNNI path feeds the activations as x + 128 and takes 128 * sum(w) off again, exact for every
    int8 weight; every path against the reference."""
    gen = torch.Generator().manual_seed(5)
    n, k = 24, 96
    raw = pack.quantize(torch.randn(n, k, generator=gen), "q8_0").view(n, k // 32, 34).clone()
    raw[:, :, 2:] = torch.randint(0, 256, (n, k // 32, 32), generator=gen, dtype=torch.uint8)
    raw[0, :, 2:] = 0x80  # every quant -128
    raw[1, :, 2:] = 0x7F  # every quant 127
    p = pack.pack(raw.view(n, -1), "q8_0")
    x = torch.randn(9, k, generator=gen) * 4
    want = reference.block_mm(x, p, 2, n)
    assert torch.isfinite(want).all()
    for isa in _isas():
        assert torch.equal(kernels.block_mm(x, p, 2, n, isa), want), kernels.ISAS[isa]


@pytest.mark.parametrize("fmt", pack.FORMATS)
def test_rows_are_independent_of_other_rows(fmt):
    """Row i computed alone, among 2..70 rows, and in any order of rows: the same bits (what makes a
    verify pass reproduce decode steps)."""
    gen = torch.Generator().manual_seed(2)
    code = pack.FORMATS.index(fmt)
    n, k = 40, 192
    p = pack.pack(pack.quantize(torch.randn(n, k, generator=gen), fmt), fmt)
    x = torch.randn(70, k, generator=gen)
    alone = torch.cat([kernels.block_mm(x[i : i + 1], p, code, n) for i in range(70)])
    for m in (2, 4, 16, 33, 64, 70):
        assert torch.equal(kernels.block_mm(x[:m], p, code, n), alone[:m]), m
    perm = torch.randperm(70, generator=gen)
    assert torch.equal(kernels.block_mm(x[perm], p, code, n), alone[perm])


@pytest.mark.parametrize("nb", [1, 8, 19])  # the vector path takes blocks 8 at a time: whole groups and a rest
def test_activation_quantization_equals_reference(nb):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 32 * nb, generator=gen) * 10
    x[1] = 0.0
    x[2, :32] = torch.arange(32) * 0.5  # halves: exact ties
    x[3, :32] = 1e-30  # a subnormal-sized block
    x[4, -32:] = 0.0  # a zero block last (a group's last lane where nb is 8)
    x[5, (nb // 2) * 32:(nb // 2 + 1) * 32] *= 1e6  # one block far larger than the others of its group
    want = reference.quantize_act(x)
    for isa in _isas():
        got = torch.ops.dflash.quantize_act(x, isa)
        for g, w in zip(got, want):
            assert torch.equal(g, w), kernels.ISAS[isa]
    q, d, s = want
    assert q.abs().max() <= 127 and torch.equal(s, q.reshape(9, nb, 32).int().sum(-1))


@pytest.mark.parametrize("fmt", pack.FORMATS)
def test_accuracy_within_the_activation_rounding_bound(fmt):
    """Against float32 x @ W_dequantized^T, each output may differ by at most what rounding the
    activations to 8 bits can cause: each value moves by at most half a step (d/2, d = block max / 127),
    so |error| <= sum over blocks of d_b / 2 * sum |w| (plus float32 summation rounding)."""
    gen = torch.Generator().manual_seed(4)
    n, k = 48, 320
    raw = pack.quantize(torch.randn(n, k, generator=gen), fmt)
    wd = pack.dequantize(raw, fmt).double()
    x = torch.randn(6, k, generator=gen)
    y = kernels.block_mm(x, pack.pack(raw, fmt), pack.FORMATS.index(fmt), n).double()
    exact = x.double() @ wd.t()
    half_step = x.reshape(6, -1, 32).abs().amax(-1).double() / 127 / 2  # [M, nb]
    bound = torch.einsum("mb,nb->mn", half_step, wd.abs().reshape(n, -1, 32).sum(-1))
    float_sum = 1e-6 * (x.double().abs() @ wd.abs().t())
    assert ((y - exact).abs() <= bound + float_sum).all()
    assert (y - exact).abs().max() > 0  # the activations are really quantized


@pytest.mark.parametrize("fmt", pack.FORMATS)
def test_blocks_are_gguf_blocks(fmt):
    """pack/unpack keep GGUF's bytes; dequantize reads them as the gguf package does."""
    from gguf import quants

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(21, 96, generator=gen)
    raw = pack.quantize(w, fmt)
    want = quants.quantize(w.numpy(), pack.gguf_type(fmt))
    assert np.array_equal(raw.numpy(), want)
    assert torch.equal(pack.unpack(pack.pack(raw, fmt), fmt, 21, 96), raw)
    assert torch.equal(pack.dequantize(raw, fmt), torch.from_numpy(quants.dequantize(want, pack.gguf_type(fmt))))


def test_default_gguf_blocks_survive_requantization():
    """The default model's GGUF file: quantizing its dequantized Q4_1 / Q8_0 matrices again gives back the
    stored bytes, so the engine's blocks are the file's (checked on a sample of tensors of each type)."""
    import gguf

    from dflash_torch import loading
    from dflash_torch.gguf_reader import open_gguf

    reader = open_gguf(loading.default_gguf())
    seen: dict[str, int] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        if name not in ("Q4_0", "Q4_1", "Q8_0") or seen.get(name, 0) >= 6:
            continue
        raw = np.asarray(t.data)
        w = gguf.quants.dequantize(raw, t.tensor_type)
        assert np.array_equal(gguf.quants.quantize(w, t.tensor_type).reshape(raw.shape), raw), t.name
        seen[name] = seen.get(name, 0) + 1
    assert seen.get("Q4_1", 0) >= 6 and seen.get("Q8_0", 0) >= 1


@pytest.mark.parametrize("fmt", pack.FORMATS)
def test_block_linear_layer(fmt):
    """BlockLinear: 3-D inputs, bias, row selection without requantization, fused q/k/v == apart."""
    gen = torch.Generator().manual_seed(6)
    parts = [nn.Linear(64, n, bias=True) for n in (24, 8, 8)]
    for lin in parts:
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
    x = torch.randn(2, 5, 64, generator=gen)
    layers = [BlockLinear(lin, fmt) for lin in parts]
    ys = [layer(x) for layer in layers]
    for lin, layer, y in zip(parts, layers, ys):
        want = reference.block_mm(x.reshape(-1, 64), layer.packed, layer.code, lin.out_features) + lin.bias
        assert torch.equal(y, want.reshape(2, 5, -1))
    rows = torch.tensor([3, 0, 17])
    assert torch.equal(layers[0].rows(rows)(x), ys[0][..., rows])

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = parts
            self.qkv_proj = None

    a = fuse_projections(Attn())
    fused = BlockLinear(a.qkv_proj, fmt)
    assert torch.equal(fused(x), torch.cat(ys, dim=-1))


def test_without_the_extension_the_reference_serves(tmp_path):
    """DFLASH_NO_EXTENSION=1 (as where no compiler is found): one clear warning, and the same results
    through the same op names."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(12, 64, generator=gen)
    p = pack.pack(pack.quantize(w, "q4_1"), "q4_1")
    nw = torch.randn(64, generator=gen)
    torch.save({"x": x, "p": p, "w": nw}, tmp_path / "in.pt")
    code = (
        "import sys, warnings, torch\n"
        "from dflash_torch import kernels\n"
        "d = torch.load(sys.argv[1])\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    backend = kernels.ensure(); kernels.ensure()\n"
        "y = torch.ops.dflash.block_mm(d['x'], d['p'], 1, 12, -1)\n"
        "z = torch.ops.dflash.block_mm_norm(d['x'], d['w'], 1e-6, d['p'], 1, 12, -1)\n"
        "kv = d['w'].view(1, 4, 16)\n"
        "a = torch.ops.dflash.full_attention(d['x'].view(3, 4, 16), kv, kv, 3, 0.25)\n"
        "t = torch.ops.dflash.top_probs(d['x'], 5)\n"
        "cb = d['w'].view(16, 4)\n"
        "s = torch.ops.dflash.selector_chances(t[0], torch.arange(15).view(3, 5), d['x'][:, :4], cb, cb, 2)\n"
        "w = [str(w.message) for w in caught]\n"
        "torch.save({'backend': backend, 'y': y, 'z': z, 'a': a, 't': t, 's': s, 'warnings': w}, sys.argv[2])\n"
    )
    env = dict(os.environ, DFLASH_NO_EXTENSION="1")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                   cwd=ROOT, check=True, timeout=300)
    out = torch.load(tmp_path / "out.pt")
    assert out["backend"] == "reference"
    assert len(out["warnings"]) == 1 and "C++ block kernels are not available" in out["warnings"][0]
    assert torch.equal(out["y"], kernels.block_mm(x, p, 1, 12))
    assert torch.equal(out["z"], reference.block_mm(reference.rms_norm(x, nw, 1e-6), p, 1, 12))
    kv = nw.view(1, 4, 16)
    assert torch.equal(out["a"], reference.full_attention(x.view(3, 4, 16), kv, kv, 3, 0.25))
    assert all(torch.equal(a, b) for a, b in zip(out["t"], reference.top_probs(x, 5)))
    cb = nw.view(16, 4)
    want = reference.selector_chances(out["t"][0], torch.arange(15).view(3, 5), x[:, :4], cb, cb, 2)
    assert torch.equal(out["s"], want)


def test_a_build_cut_short_does_not_hold_up_the_next(tmp_path, monkeypatch, capsys):
    """A build interrupted by Ctrl-C or a kill leaves torch.utils.cpp_extension's lock file behind, and every
    later process used to wait for it forever (`dflash serve` answering "loading" for good). The next build
    takes the kernels' own flock, which the system released with the dead process, removes that file and
    builds, saying so on stderr; once built from these sources, later processes load it without building."""
    from torch.utils import cpp_extension

    build = tmp_path / "kernels"
    build.mkdir()
    (build / "lock").touch()  # what the interrupted build left
    seen = []

    def fake_load(**kw):  # what cpp_extension.load leaves: the library (here empty), its lock released
        seen.append(("built", (build / "lock").exists()))
        (build / "dflash_blocks.so").write_bytes(b"")

    monkeypatch.setattr(kernels, "_build_dir", lambda: build)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: seen.append(("loaded", path)))
    kernels._compile()
    assert seen == [("built", False)]
    assert (build / "sources.sha256").read_text().strip() == kernels.fingerprint()
    assert "building the C++ kernels" in capsys.readouterr().err
    kernels._compile()
    assert seen == [("built", False), ("loaded", str(build / "dflash_blocks.so"))]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("min_rows,vnni256", [("0", "1"), ("9", "1"), ("9", "0"), ("17", "1")])
def test_the_row_count_dispatch_keeps_the_bits(tmp_path, min_rows, vnni256):
    """DFLASH_VNNI_MIN_ROWS moves the row count below which a VNNI CPU runs the AVX2 path's layout on 256-bit
    dpbusd (AMD Zen 4 by default), DFLASH_VNNI256=0 runs those rows on AVX2's maddubs instead: 0 keeps the
    512-bit path everywhere, 9 (Zen 4's default) sends 1-8 rows to the narrow path, 17 1-16 rows, past its 8 rows
    in registers, its activations block-major from 5 rows (tiles of 8, shared out to the threads by tiles, or by
    blocks within one tile). Every row count, on 1-3 threads, with the norm inside the call or not, gives the
    reference's bits (on CPUs without VNNI the variables change nothing)."""
    gen = torch.Generator().manual_seed(8)
    x, nw = torch.randn(17, 96, generator=gen), torch.randn(96, generator=gen)
    # 293 outputs: 37 column groups, the last part-filled, in chunks of several groups (pairs of groups for 3-4
    # rows of Q4, and a group left over)
    ws = {fmt: pack.pack(pack.quantize(torch.randn(293, 96, generator=gen), fmt), fmt) for fmt in pack.FORMATS}
    torch.save({"x": x, "nw": nw, "ws": ws}, tmp_path / "in.pt")
    code = (
        "import sys, torch\n"
        "from dflash_torch import kernels\n"
        "from dflash_torch.kernels import pack\n"
        "kernels.ensure()\n"
        "d, out = torch.load(sys.argv[1]), {}\n"
        "for t in (1, 2, 3):\n"
        "    torch.set_num_threads(t)\n"
        "    for f, w in d['ws'].items():\n"
        "        for m in range(1, 18):\n"
        "            c = pack.FORMATS.index(f)\n"
        "            out[f, m, t, False] = torch.ops.dflash.block_mm(d['x'][:m], w, c, 293, -1)\n"
        "            out[f, m, t, True] = torch.ops.dflash.block_mm_norm(d['x'][:m], d['nw'], 1e-6, w, c, 293, -1)\n"
        "torch.save(out, sys.argv[2])\n"
    )
    env = dict(os.environ, DFLASH_VNNI_MIN_ROWS=min_rows, DFLASH_VNNI256=vnni256)
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                   cwd=ROOT, check=True, timeout=300)
    out = torch.load(tmp_path / "out.pt")
    normed = torch.ops.dflash.rms_norm(x, nw, 1e-6, -1)
    for (fmt, m, threads, norm), y in out.items():
        want = reference.block_mm((normed if norm else x)[:m], ws[fmt], pack.FORMATS.index(fmt), 293)
        assert torch.equal(y, want), (fmt, m, threads, norm, min_rows, vnni256)


def test_auto_picks_the_files_own_blocks():
    from dflash_torch import loading

    cpu = torch.device("cpu")
    cfg = {"gguf_weight_types": {"Q4_1": 210, "head": "Q8_0"}}
    assert loading.auto_quantize(cfg, cpu) == ("q4_1", "q8_0")
    assert loading.auto_quantize({"gguf_weight_types": {"Q4_0": 7, "head": "Q6_K"}}, cpu) == ("q4_0", "q8_0")
    assert loading.auto_quantize({"gguf_weight_types": {"Q4_K": 7, "head": "Q6_K"}}, cpu) == ("int4", "int8")
    assert loading.auto_quantize(json.loads(json.dumps(cfg)), torch.device("meta")) == (None, None)


# (T, H, Hkv, D, start); the AVX2 path's tiles (up to 32 query heads of a kv head x positions) then cover:
# one query, several tiles of positions (70 rows: 7 tiles of 10 x 3 heads), a group of more than 32 heads;
# the AVX-512 path's tiles of fewer than 4 queries on a float16 cache after 512 keys or more (two keys per
# vector: the float16 test below holds them to the float32 cache's AVX2 tile) every head size they take,
# with key counts across and inside their blocks of 64
ATTENTION_SHAPES = [(1, 9, 3, 64, 100), (16, 9, 3, 64, 37), (5, 4, 4, 16, 0), (3, 8, 2, 128, 1000), (7, 4, 2, 24, 5),
                    (70, 6, 2, 64, 130), (3, 40, 1, 16, 20), (16, 8, 2, 256, 70), (9, 6, 3, 96, 130), (4, 9, 3, 64, 50),
                    (1, 9, 3, 64, 600), (2, 2, 1, 128, 520), (1, 3, 1, 32, 575), (1, 6, 3, 96, 516), (1, 4, 4, 16, 513),
                    # verify passes split by keys (2-8 positions after 512+ keys; queries in batches of 12)
                    (3, 9, 3, 64, 530), (4, 9, 3, 64, 700), (8, 9, 3, 64, 513), (5, 8, 2, 128, 600),
                    (6, 6, 3, 96, 520), (7, 12, 3, 32, 509), (8, 4, 4, 16, 600), (16, 9, 3, 64, 512)]


def _attention_isas() -> list[int]:
    """The attention paths this CPU runs: 0 scalar, 1 AVX2, 2 AVX-512 (a path it lacks is refused)."""
    q, kv = torch.zeros(1, 1, 16), torch.zeros(1, 1, 16)
    isas = [0]
    for isa in (1, 2):
        try:
            torch.ops.dflash.causal_attention(q, kv, kv, 0, 1.0, isa)
        except RuntimeError:
            break
        isas.append(isa)
    return isas


def test_attention_paths_agree_and_queries_are_independent():
    """The AVX2 path == the scalar twin bit for bit; query i's result is the same alone (at start + i) as
    among T queries (what makes prefill, verify and decode agree) and on 1, 2 or 3 threads; against
    PyTorch's attention, within float32 rounding of sums over the keys and head dimensions."""
    gen = torch.Generator().manual_seed(8)
    for t, h, hkv, d, start in ATTENTION_SHAPES:
        s = start + t + 3
        q, k, v = (torch.randn(*shape, generator=gen) for shape in ((t, h, d), (hkv, s, d), (hkv, s, d)))
        scale = d**-0.5
        outs = [torch.ops.dflash.causal_attention(q, k, v, start, scale, isa) for isa in _attention_isas()]
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), (t, h, d, start)
        alone = torch.cat([torch.ops.dflash.causal_attention(q[i : i + 1], k, v, start + i, scale, -1)
                           for i in range(t)])
        assert torch.equal(alone, outs[-1])
        for threads in (2, 3):  # the tiles' positions follow the thread count: the loop order, not the bits
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                assert torch.equal(torch.ops.dflash.causal_attention(q, k, v, start, scale, -1), outs[-1])
            finally:
                torch.set_num_threads(before)
        want = reference.causal_attention(q, k, v, start, scale)
        tol = 4 * (start + t + d) * 2.0**-24 * v.abs().max()
        assert (outs[-1] - want).abs().max() <= tol, (t, h, d, start)


def test_attention_reads_strided_caches():
    """Keys and values as the cache holds them ([Hkv, S, D] views of [L, B, Hkv, S, D]): same as copies."""
    gen = torch.Generator().manual_seed(9)
    cache_k, cache_v = torch.randn(2, 1, 3, 50, 32, generator=gen), torch.randn(2, 1, 3, 50, 32, generator=gen)
    q = torch.randn(4, 6, 32, generator=gen)
    k, v = cache_k[1, 0, :, :20], cache_v[1, 0, :, :20]
    got = torch.ops.dflash.causal_attention(q, k, v, 16, 0.2, -1)
    assert torch.equal(got, torch.ops.dflash.causal_attention(q, k.contiguous(), v.contiguous(), 16, 0.2, -1))


def test_full_attention_every_query_sees_the_same_keys():
    """full_attention (a draft block's: every query attends to keys 0 .. n - 1): the paths agree bit for bit, a
    query's result is the same alone as among T and on 2 or 3 threads, a float16 cache reads as its widened
    values, and against PyTorch's attention (the reference) it is within float32 rounding; n < T works, n
    outside 1 .. S is refused."""
    gen = torch.Generator().manual_seed(21)
    for t, h, hkv, d, n in [(3, 9, 3, 64, 303), (16, 9, 3, 64, 336), (5, 4, 4, 16, 3), (1, 8, 2, 128, 700),
                            (7, 4, 2, 24, 60), (4, 6, 3, 96, 130), (2, 8, 2, 32, 1)]:
        q = torch.randn(t, h, d, generator=gen)
        k, v = torch.randn(hkv, n + 5, d, generator=gen), torch.randn(hkv, n + 5, d, generator=gen)
        scale = d**-0.5
        outs = [torch.ops.dflash.full_attention(q, k, v, n, scale, isa) for isa in _attention_isas()]
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), (t, h, d, n)
        alone = torch.cat([torch.ops.dflash.full_attention(q[i : i + 1], k, v, n, scale, -1) for i in range(t)])
        assert torch.equal(alone, outs[-1])
        before = torch.get_num_threads()
        try:
            for threads in (2, 3):
                torch.set_num_threads(threads)
                assert torch.equal(torch.ops.dflash.full_attention(q, k, v, n, scale, -1), outs[-1]), threads
        finally:
            torch.set_num_threads(before)
        kh, vh = k.half(), v.half()
        assert torch.equal(torch.ops.dflash.full_attention(q, kh, vh, n, scale, -1),
                           torch.ops.dflash.full_attention(q, kh.float(), vh.float(), n, scale, -1))
        want = reference.full_attention(q, k, v, n, scale)
        tol = 4 * (n + d) * 2.0**-24 * v.abs().max()
        assert (outs[-1] - want).abs().max() <= tol, (t, h, d, n)
    for bad in (0, 12):
        with pytest.raises(RuntimeError, match="1 <= n"):
            torch.ops.dflash.full_attention(torch.zeros(1, 2, 16), torch.zeros(1, 11, 16), torch.zeros(1, 11, 16), bad,
                                            1.0, -1)


@pytest.mark.parametrize("fmt", pack.FORMATS)
def test_residual_add_inside_the_kernel_equals_adding_after(fmt):
    """block_mm_add(x, W, r) == r + block_mm(x, W), bit for bit, on every path (the flat decode step adds
    the residual inside the kernel; the layer modules add it after)."""
    gen = torch.Generator().manual_seed(10)
    code = pack.FORMATS.index(fmt)
    for m, n, k in ((1, 24, 64), (7, 13, 96), (66, 40, 32)):
        p = pack.pack(pack.quantize(torch.randn(n, k, generator=gen), fmt), fmt)
        x, r = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
        for isa in _isas():
            want = r + kernels.block_mm(x, p, code, n, isa)
            assert torch.equal(torch.ops.dflash.block_mm_add(x, p, code, n, r, isa), want), (m, n, k, isa)


@pytest.mark.parametrize("threads", [1, 2])
def test_norm_inside_the_kernel_equals_norm_then_kernel(threads):
    """block_mm_norm(x, w, eps, W) == block_mm(rms_norm(x, w, eps), W), bit for bit, on every path and with
    rows split over threads (the decoder stack normalizes each row on the way to its quantization)."""
    gen = torch.Generator().manual_seed(12)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fmt in pack.FORMATS:
            code = pack.FORMATS.index(fmt)
            for m, n, k in ((1, 24, 64), (4, 13, 96), (16, 40, 160), (33, 8, 32)):
                p = pack.pack(pack.quantize(torch.randn(n, k, generator=gen), fmt), fmt)
                x, w = torch.randn(m, k, generator=gen) * 3, torch.randn(k, generator=gen)
                for isa in [*_isas(), -1]:
                    want = kernels.block_mm(torch.ops.dflash.rms_norm(x, w, 1e-6, -1), p, code, n, isa)
                    got = torch.ops.dflash.block_mm_norm(x, w, 1e-6, p, code, n, isa)
                    assert torch.equal(got, want), (fmt, m, n, k, isa)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_split_rows_and_columns_exactly(threads):
    """With several threads each quantizes its share of the rows, then computes its share of the columns, in
    one parallel region: the same bits as the reference on every path, including where there are fewer
    column tiles or rows than threads (the tests otherwise run on one thread)."""
    gen = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fmt in pack.FORMATS:
            code = pack.FORMATS.index(fmt)
            for m, n, k in ((1, 8, 32), (2, 40, 64), (16, 72, 96), (17, 200, 160), (33, 24, 64)):
                p = pack.pack(pack.quantize(torch.randn(n, k, generator=gen), fmt), fmt)
                x, r = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
                want = reference.block_mm(x, p, code, n)
                for isa in [*_isas(), -1]:  # -1: the dispatch's own choice for these rows
                    assert torch.equal(kernels.block_mm(x, p, code, n, isa), want), (fmt, m, n, k, isa)
                    assert torch.equal(torch.ops.dflash.block_mm_add(x, p, code, n, r, isa), r + want), (fmt, m, n)
    finally:
        torch.set_num_threads(before)


def test_float16_cache_reads_as_its_widened_values():
    """A float16 cache (block-format targets keep theirs so) gives exactly what the float32 kernel gives on
    the same values widened, on every path and on 1, 2 or 3 threads, for every shape the float32 test takes."""
    gen = torch.Generator().manual_seed(12)
    for t, h, hkv, d, start in ATTENTION_SHAPES:
        s = start + t + 3
        q = torch.randn(t, h, d, generator=gen)
        k, v = (torch.randn(hkv, s, d, generator=gen).half() for _ in range(2))
        want = torch.ops.dflash.causal_attention(q, k.float(), v.float(), start, d**-0.5, 0)  # the scalar twin
        for isa in _attention_isas():
            got = torch.ops.dflash.causal_attention(q, k, v, start, d**-0.5, isa)
            assert torch.equal(got, torch.ops.dflash.causal_attention(q, k.float(), v.float(), start, d**-0.5, isa))
            assert torch.equal(got, want), (t, h, d, start, isa)
        before = torch.get_num_threads()
        try:
            for threads in (2, 3):  # a decode step's work split over threads by keys and by dimensions
                torch.set_num_threads(threads)
                assert torch.equal(torch.ops.dflash.causal_attention(q, k, v, start, d**-0.5, -1), want), threads
        finally:
            torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_attention_equals_its_operators(dtype):
    """rope_attention (rotation, cache writes and attention in one call) == flat.rotate, the cache copies and
    causal_attention as separate operators, bit for bit; the reference writes the same cache. A float16
    cache gets the rotated keys and the values rounded as Tensor.copy_ rounds them."""
    from dflash_torch.models import flat

    gen = torch.Generator().manual_seed(11)
    t, h, hkv, d, start = 5, 4, 2, 16, 9
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen)
    angles = torch.randn(t, 1, d, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    signed = flat.signed(sin)
    k_init, v_init = (torch.randn(hkv, 20, d, generator=gen).to(dtype) for _ in range(2))
    caches = [(k_init.clone(), v_init.clone()) for _ in range(2)]
    k0, v0 = k_init.clone(), v_init.clone()
    got = torch.ops.dflash.rope_attention(qkv, cos, signed, caches[0][0], caches[0][1], start, h, hkv, 0.25)
    qk = flat.rotate(qkv[:, : (h + hkv) * d].view(t, h + hkv, d), cos, sin, signed)
    k0[:, start : start + t] = qk[:, h:].transpose(0, 1)
    v0[:, start : start + t] = qkv[:, (h + hkv) * d :].view(t, hkv, d).transpose(0, 1)
    assert torch.equal(caches[0][0], k0) and torch.equal(caches[0][1], v0)
    assert torch.equal(got, torch.ops.dflash.causal_attention(qk[:, :h], k0, v0, start, 0.25, -1))
    ref = reference.rope_attention(qkv, cos, signed, caches[1][0], caches[1][1], start, h, hkv, 0.25)
    assert torch.equal(caches[1][0], k0) and torch.equal(caches[1][1], v0)
    assert (ref - got).abs().max() <= 4 * (start + t + d) * 2.0**-24 * v0.float().abs().max()


def test_rope_attention_rounds_into_a_float16_cache_as_copy_does():
    """The float16 cache writes (8 at a time by the CPU's converter where it has one, a scalar tail) round
    every float as Tensor.copy_ does: ties to even, float16 subnormals, overflow to infinity, signed zeros,
    head sizes with a tail that is not a multiple of 8."""
    from dflash_torch.models import flat

    gen = torch.Generator().manual_seed(13)
    tiny = 2.0**-24  # the smallest float16 subnormal
    special = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11), tiny / 2, 3 * tiny / 2, tiny / 3,
                            2.0**-15 + tiny / 2, 65504.0, 65519.0, 65520.0, -65520.0, 1e30, float("inf"), -0.0,
                            0.0, 2.0**-14 - tiny / 2])  # ties, subnormals, the largest half, overflow
    for d in (12, 16, 22):
        t, h, hkv, start = 3, 2, 2, 4
        qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen)
        values = qkv[:, (h + hkv) * d :]
        picks = torch.randint(0, len(special), values.shape, generator=gen)
        values.copy_(torch.where(torch.rand(values.shape, generator=gen) < 0.7, special[picks], values))
        angles = torch.randn(t, 1, d, generator=gen)
        cos, sin = angles.cos(), angles.sin()
        k, v = (torch.zeros(hkv, 10, d, dtype=torch.float16) for _ in range(2))
        torch.ops.dflash.rope_attention(qkv, cos, flat.signed(sin), k, v, start, h, hkv, 0.25)
        want_v = torch.zeros_like(v)
        want_v[:, start : start + t] = values.view(t, hkv, d).transpose(0, 1)
        assert torch.equal(v.view(torch.int16), want_v.view(torch.int16)), d  # bit for bit: -0.0 and inf too
        qk = flat.rotate(qkv[:, : (h + hkv) * d].view(t, h + hkv, d), cos, sin, flat.signed(sin))
        want_k = torch.zeros_like(k)
        want_k[:, start : start + t] = qk[:, h:].transpose(0, 1)
        assert torch.equal(k.view(torch.int16), want_k.view(torch.int16)), d


def test_top_probs_are_the_softmax_at_the_top_k():
    """top_probs (a tree draft's candidates): the scalar and AVX2 paths give the same bits; on rows without ties
    the indices are torch.topk's and the probabilities the softmax's at them (within float32 rounding of a sum
    over the row); ties go to the lower index; a NaN counts as -inf; k outside 1 .. V is refused."""
    gen = torch.Generator().manual_seed(13)
    isas = [0, 1] if kernels.best_isa() in ("avx2", "vnni", "amx") else [0]
    for width, k in ((1, 1), (7, 3), (8, 8), (9, 8), (31, 5), (1000, 8), (8192, 8), (49152, 16)):
        x = torch.randn(6, width, generator=gen) * 4
        outs = [torch.ops.dflash.top_probs(x, k, isa) for isa in isas]
        for p, i in outs[1:]:
            assert torch.equal(p, outs[0][0]) and torch.equal(i, outs[0][1]), (width, k)
        probs, idx = outs[-1]
        top = x.topk(k, dim=-1)
        assert torch.equal(idx, top.indices), (width, k)
        want = (top.values - x.logsumexp(-1, keepdim=True)).exp()
        assert ((probs - want).abs() <= 8 * width * 2.0**-24 * want + 1e-30).all(), (width, k)
        assert torch.equal(kernels.top_probs(x, k)[1], idx)
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, float("nan"), 3.0, 0.5, 2.0, 3.0, 1.0]])
    for isa in isas:
        p, i = torch.ops.dflash.top_probs(x, 5, isa)
        assert i.tolist() == [[1, 3, 5, 8, 2]]  # the four 3s in index order, then the first 2; the NaN never
        assert torch.equal(p[0, :4], p[0, :1].expand(4)) and p[0, 4] < p[0, 0]
        for bad in (0, 11):
            with pytest.raises(RuntimeError, match="1 <= k"):
                torch.ops.dflash.top_probs(x, bad, isa)


def test_selector_chances_are_the_references():
    """selector.cpp (a DFlash2 selector's chances for a tree draft) against the same formula in torch operators:
    within float32 rounding of sums of r products and a softmax over k; position 1's rows are all the anchor's, each
    row sums to the drafter's mass at its position; a token outside the codebooks is refused."""
    gen = torch.Generator().manual_seed(14)
    for n, k, r, v in ((1, 8, 16, 300), (2, 8, 16, 49152), (5, 6, 4, 100), (16, 8, 16, 1000)):
        probs = torch.softmax(torch.randn(n, 50, generator=gen) * 3, -1).topk(k, dim=-1).values  # [n, k]
        cand = torch.randint(0, v, (n, k), generator=gen)
        proj = torch.randn(n, r, generator=gen)
        pred, succ = torch.randn(v, r, generator=gen) * 0.5, torch.randn(v, r, generator=gen) * 0.5
        got = torch.ops.dflash.selector_chances(probs, cand, proj, pred, succ, 7)
        want = reference.selector_chances(probs, cand, proj, pred, succ, 7)
        assert got.shape == (n, k, k)
        # a score's error: r products and sums (|terms| bounded by the score's own size), then exp and a sum of k
        scale = (pred[7].abs().max() * succ.abs().max() * proj.abs().max() * r + 70).item()
        assert torch.allclose(got, want, rtol=4 * (r + k) * scale * 2.0**-24, atol=1e-12), (n, k, r)
        assert torch.equal(got[0], got[0, :1].expand(k, k))
        assert torch.allclose(got.sum(-1), probs.sum(-1)[:, None].expand(n, k), rtol=1e-5)
    with pytest.raises(RuntimeError, match="outside the codebooks"):
        torch.ops.dflash.selector_chances(probs, cand + v, proj, pred, succ, 7)


def test_argmax_rows_is_torch_argmax():
    """argmax.cpp's paths (scalar, AVX2) give torch.argmax(x, -1)'s index on every row: ties to the first
    index, a NaN's index where a row has one, all -inf rows, signed zeros, widths that are not a multiple
    of 8 (the vector tail)."""
    gen = torch.Generator().manual_seed(11)
    isas = [0, 1] if kernels.best_isa() in ("avx2", "vnni", "amx") else [0]
    for width in (1, 7, 8, 9, 31, 1000, 49152):
        x = torch.randn(12, width, generator=gen)
        x[1] = x[1].round()  # many ties
        x[2] = float("-inf")
        x[3, width // 2] = float("nan")
        x[4] = 0.0
        x[4, width - 1] = -0.0
        x[5, width - 1] = float("inf")
        x[6] = (x[6] * 4).round() / 4
        x[7, 0] = -0.0
        x[7, 1:] = -1.0
        x[8, -1] = float("nan")
        x[8, 0] = float("nan")
        want = x.argmax(-1)
        for isa in isas:
            assert torch.equal(torch.ops.dflash.argmax_rows(x, isa), want), (width, isa)
        assert torch.equal(kernels.argmax(x), want)
        assert torch.equal(kernels.argmax(x[:, : max(1, width // 2)]), x[:, : max(1, width // 2)].argmax(-1))


@pytest.mark.parametrize("threads", [2, 3])
def test_argmax_of_one_wide_row_split_over_threads(threads):
    """One vocabulary-wide row is split over the threads by columns: the same index as torch.argmax, with
    the maximum tied across the shares, a NaN in a later share only, NaNs in several, all -inf, signed
    zeros, and widths the threads do not divide."""
    gen = torch.Generator().manual_seed(12)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for width in (32768, 40001, 49152):
            rows = []
            x = torch.randn(width, generator=gen)
            rows.append(x.clone())
            y = x.clone()
            y[width - 3] = y[5] = 9.0  # the maximum in the first and in the last share
            rows.append(y)
            y = x.clone()
            y[width - 2] = float("nan")  # in the last share only
            rows.append(y)
            y = x.clone()
            y[width - 2], y[width // 2 + 1], y[7] = float("nan"), float("nan"), 50.0
            rows.append(y)
            rows.append(torch.full((width,), float("-inf")))
            y = torch.zeros(width)
            y[: width // 2] = -0.0
            rows.append(y)
            y = (x * 2).round()
            rows.append(y)
            for row in rows:
                for isa in ([0, 1] if kernels.best_isa() in ("avx2", "vnni", "amx") else [0]):
                    got = torch.ops.dflash.argmax_rows(row[None], isa)
                    assert torch.equal(got, row[None].argmax(-1)), (width, isa, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(kernels.ensure() != "compiled", reason="the decoder stack's activation is in the C++ extension")
def test_activation_is_torchs_silu_times_up():
    """The decoder stack's silu(gate) * up (activation.cpp: on an AVX2 CPU its own loop through the exp PyTorch's silu
    kernel calls) against `F.silu(gate) * up` bit for bit: gate and up the halves of one fused projection's rows as
    the stack passes them, and a contiguous single row; row lengths across PyTorch's vector steps and tails; values
    from tiny to past exp's overflow, zeros, infinities; 1 to 6 rows (from 4 the threads share them)."""
    gen = torch.Generator().manual_seed(15)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, -1e-40, 88.0, -88.0, 104.0, -104.0,
                            200.0, -200.0, 1e-7, -1e-7])
    for n in (1, 7, 8, 15, 16, 17, 31, 32, 33, 100, 1536, 1543):
        for t in range(1, 7):
            scale = torch.logspace(-3, 2, 2 * n)[torch.randperm(2 * n, generator=gen)]
            gu = torch.randn(t, 2 * n, generator=gen) * scale
            flat = gu.view(-1)
            flat[torch.randint(0, flat.numel(), (min(len(special), flat.numel()),), generator=gen)] = \
                special[: min(len(special), flat.numel())]
            gate, up = gu[:, :n], gu[:, n:]
            for g, u in ((gate, up), (gate[:1].contiguous(), up[:1].contiguous())):
                got = torch.ops.dflash.act_mul(g, u, 0)
                want = torch.nn.functional.silu(g) * u
                same = got.view(torch.int32) == want.view(torch.int32)
                assert bool((same | (got.isnan() & want.isnan())).all()), (n, t, g.is_contiguous())
