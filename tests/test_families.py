"""Qwen3.5 (hybrid Gated DeltaNet) and Gemma 4 / Gemma 3 targets: they match transformers, speculative
greedy decoding over them is exactly transformers' greedy decoding, and the Qwen3.5 cache rolls back
exactly (bit for bit)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_torch import loading
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.models import gemma4, layers, qwen3_5
from dflash_torch.models.cache import KVCache

from .conftest import make_drafter

CPU = torch.device("cpu")
S, G = "sliding_attention", "full_attention"

# Tiny Qwen3.5: 6 Gated DeltaNet + 2 attention layers. 32 value heads (of 4 dims) and every per-token
# width a multiple of 32, so that CPU vector kernels, which finish a tensor's ragged tail with a scalar
# loop (different last bits for exp, sigmoid, softplus...), treat every token alike whatever the pass
# length: needed for the bit-exact rollback test, harmless elsewhere.
QWEN = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=8, linear_num_value_heads=32, linear_key_head_dim=8,
    linear_value_head_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
# Tiny Gemma 4 with every text-model feature: sliding window 8 (prompts are longer), global layers with their
# own head dim, one KV head and values from the key projection, per-layer inputs, the last 3 layers sharing
# keys/values (double-wide MLP there), final logit soft-capping.
# Tiny Qwen3.5 MoE: the same stack with 8 experts (2 per token) of 32 and a shared expert of 48.
QWEN_MOE = {k: v for k, v in QWEN.items() if k != "intermediate_size"} | dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# Tiny Qwen3 MoE: 8 experts (2 per token, renormalised), layer 2 dense.
QWEN3_MOE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[2])
GEMMA4 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, layer_types=[S, G, S, S, G, S, S, G],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
    attention_k_eq_v=True, sliding_window=8, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
    num_kv_shared_layers=3, use_double_wide_mlp=True, max_position_embeddings=512, final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)
GEMMA4_MOE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=[S, G, S, G],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
    hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    max_position_embeddings=512, final_logit_softcapping=30.0, tie_word_embeddings=False,
)
GEMMA3 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=8, sliding_window_pattern=3, max_position_embeddings=512,
    query_pre_attn_scalar=24, rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_word_embeddings=True,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread is faster than two, and far faster on a machine whose cores are busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Norm weights, scalars and router scales away from their init values (a (1 + w) vs w mix-up would
    go unseen with zeros or ones), and a larger LM head so that logits are far apart (greedy text is not
    one repeated token, and near-ties that float rounding could flip are rare)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "per_expert_scale", "dt_bias")):
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))
            if name.endswith((".mlp.gate.weight", "shared_expert_gate.weight")):  # routers start at zero
                p.normal_(0, 0.5, generator=g)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5, generator=g)
        model.lm_head.weight.mul_(8.0)


def _save(kind: str, cfg: dict, path: Path, seed: int):
    import transformers

    cls = {
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**cfg)).eval()
    _randomise(model, seed)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    """{name: (directory, transformers model, our model)} for each tiny family."""
    base = tmp_path_factory.mktemp("families")
    out = {}
    for i, (name, kind, cfg) in enumerate([
        ("qwen3_5", "qwen3_5", QWEN), ("gemma4", "gemma4", GEMMA4),
        ("gemma4_moe", "gemma4", GEMMA4_MOE), ("gemma3", "gemma3", GEMMA3), ("qwen3_5_moe", "qwen3_5_moe", QWEN_MOE),
        ("qwen3_moe", "qwen3_moe", QWEN3_MOE),
    ]):
        hf = _save(kind, cfg, base / name, seed=i)
        out[name] = (base / name, hf, loading.load_target(base / name, CPU, torch.float32))
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "qwen3_moe", "gemma4", "gemma4_moe", "gemma3"])
@pytest.mark.parametrize("prompt_len", [20, 100])  # Qwen3.5: recurrent and chunked (> 64 tokens) prefill
@torch.inference_mode()
def test_matches_transformers(families, name, prompt_len):
    """Prefill logits and tap hidden states, decode steps, a verify pass, and the passes after rolling it
    back, against transformers' logits over the whole sequence (float32, rtol/atol 1e-4)."""
    _, hf, ours = families[name]
    torch.manual_seed(prompt_len)
    seq = torch.randint(0, 255, (1, prompt_len + 20))
    ref = hf(seq, output_hidden_states=True)
    n_layers = ours.num_layers
    # transformers' last hidden state is the final-normed one; DFlash never taps the last layer
    taps = [0, n_layers // 2, n_layers - 2]
    cache = ours.new_cache(prompt_len + 32)
    out = ours(seq[:, :prompt_len], cache, logits="all", taps=taps)
    _close(out.logits, ref.logits[:, :prompt_len])
    want = torch.cat([ref.hidden_states[i + 1][:, :prompt_len] for i in taps], dim=-1)
    _close(out.hidden, want)
    n = prompt_len
    for j in range(3):  # decode
        out = ours(seq[:, n + j : n + j + 1], cache, logits="last")
        _close(out.logits[0, -1], ref.logits[0, n + j])
    n += 3
    out = ours(seq[:, n : n + 8], cache, logits="all")  # verify a block ...
    _close(out.logits[0], ref.logits[0, n : n + 8])
    cache.crop(n + 3)  # ... keep 3 of it, and go on from there
    out = ours(seq[:, n + 3 : n + 10], cache, logits="all")
    _close(out.logits[0], ref.logits[0, n + 3 : n + 10])
    assert cache.length == n + 10


def _hf_greedy(hf, prompt: list[int], n: int, eos) -> list[int]:
    ids = torch.tensor([prompt])  # an explicit mask: generate would otherwise mask prompt tokens equal to the pad id
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                      pad_token_id=0)
    return out[0, len(prompt) :].tolist()


class OracleDrafter:
    """Proposes the true greedy continuation with each position corrupted with probability p, so blocks
    are accepted in part, at every length; it keeps its cache length the way the real drafter does."""

    def __init__(self, truth: list[int], vocab: int, block_size: int, taps: list[int], p: float, seed: int):
        self.truth, self.vocab, self.p = truth, vocab, p
        self.block_size, self.mask_token_id, self.target_layer_ids = block_size, vocab - 1, taps
        self.rng = random.Random(seed)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(1, 1, 1, max_len)

    def propose(self, target, block, ctx, cache):
        cache.length += ctx.shape[1]
        pos = cache.length  # position of block[0]
        logits = torch.zeros(1, block.shape[1] - 1, self.vocab)
        for j in range(1, block.shape[1]):
            tok = self.truth[pos + j] if pos + j < len(self.truth) else 0
            if self.rng.random() < self.p:
                tok = (tok + self.rng.randrange(1, self.vocab)) % self.vocab
            logits[0, j - 1, tok] = 10.0
        return logits


@pytest.mark.parametrize(("name", "prompts"), [("qwen3_5", 6), ("qwen3_5_moe", 3), ("qwen3_moe", 3), ("gemma4", 5),
                                                ("gemma4_moe", 3)])
@torch.inference_mode()
def test_lossless_generation(families, name, prompts, tmp_path):
    """Speculative greedy output == transformers' greedy output, with a random drafter (almost everything
    rejected) and an oracle drafter (partial acceptance at every length), many prompts x block sizes."""
    path, hf, ours = families[name]
    eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
    stops = [eos] if isinstance(eos, int) else (eos or [])
    drafter = load_drafter(make_drafter(path, tmp_path / "draft", block_size=16))
    rng = random.Random(1)
    lengths = set()
    for i in range(prompts):
        prompt = [rng.randrange(255) for _ in range(rng.randint(1, 30))]
        n = rng.randint(10, 36)
        want = _hf_greedy(hf, prompt, n, eos)
        assert list(generate_tokens(ours, prompt, max_new_tokens=n, stop_token_ids=stops)) == want, (i, "target")
        truth = prompt + want
        for bs in (2, 4, 8, 16):
            got = list(generate_tokens(ours, prompt, max_new_tokens=n, drafter=drafter, block_size=bs,
                                       stop_token_ids=stops))
            assert got == want, (i, bs, "random drafter")
            oracle = OracleDrafter(truth, 256, bs, drafter.target_layer_ids, p=0.2, seed=i * 100 + bs)
            stats = Stats()
            got = list(generate_tokens(ours, prompt, max_new_tokens=n, drafter=oracle, stop_token_ids=stops,
                                       stats=stats))
            assert got == want, (i, bs, "oracle drafter")
            lengths.update(stats.acceptance_lengths)
    assert len(lengths) >= 8  # partial acceptance of many lengths happened (committed 1 .. 16 per cycle)


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4"])
@torch.inference_mode()
def test_penalties_and_logprobs_with_rollback(families, name, tmp_path):
    """Penalised greedy decoding with log-probabilities through a recurrent-state target (Qwen3.5) and a
    sliding-window one (Gemma 4): speculation, with rollback after rejections, gives target-only's tokens
    and log-probabilities."""
    from dflash_torch.decoding.sampling import Sampler, TokenLogprobs

    path, _, ours = families[name]
    drafter = load_drafter(make_drafter(path, tmp_path / "draft", block_size=8))
    settings = dict(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.4, logit_bias={7: 2.0})
    rng = random.Random(3)
    for _ in range(3):
        prompt = [rng.randrange(255) for _ in range(rng.randint(2, 20))]
        ref = TokenLogprobs(2)
        want = list(generate_tokens(ours, prompt, max_new_tokens=24, sampler=Sampler(**settings), logprobs=ref))
        truth = prompt + list(generate_tokens(ours, prompt, max_new_tokens=40, sampler=Sampler(**settings)))
        for d in (drafter, OracleDrafter(truth, 256, 8, drafter.target_layer_ids, p=0.25, seed=5)):
            got = TokenLogprobs(2)
            assert list(generate_tokens(ours, prompt, max_new_tokens=24, drafter=d, sampler=Sampler(**settings),
                                        logprobs=got, lookup=True)) == want
            assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(got.entries, ref.entries))


def _rowwise_linear(self, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([F.linear(x[..., i : i + 1, :], self.weight, self.bias) for i in range(x.shape[-2])], dim=-2)


def _rowwise_attend(q, k, v, mask, scale, softcap=None):
    """Causal attention one query at a time over exactly the keys it sees (no masked tail)."""
    start, groups = k.shape[2] - q.shape[2], q.shape[1] // k.shape[1]
    rows = []
    for i in range(q.shape[2]):
        kk = k[:, :, : start + i + 1].repeat_interleave(groups, 1)
        vv = v[:, :, : start + i + 1].repeat_interleave(groups, 1)
        rows.append(((q[:, :, i : i + 1] @ kk.transpose(-1, -2)) * scale).softmax(-1) @ vv)
    out = torch.cat(rows, dim=2)
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


def _assert_same_state(a: qwen3_5.HybridCache, b: qwen3_5.HybridCache) -> None:
    assert a.length == b.length
    for x, y in zip(a.recurrent, b.recurrent):
        assert torch.equal(x, y)
    for x, y in zip(a.conv, b.conv):
        assert torch.equal(x, y)
    n = a.length
    assert torch.equal(a.kv.k[:, :, :, :n], b.kv.k[:, :, :, :n])
    assert torch.equal(a.kv.v[:, :, :, :n], b.kv.v[:, :, :, :n])


@torch.inference_mode()
def test_rollback_is_bit_exact(families, monkeypatch):
    """After a 16-token verify pass cropped to `a` accepted tokens, the recurrent states, conv states and
    keys/values below the length are bit for bit those of a fresh run over only the accepted tokens, for
    every a and both rollback modes.

    A matrix product over T rows does not give each row the same bits as one over fewer rows (CPU GEMM
    blocking depends on the row count), so this test runs linear layers and attention one row at a time:
    then every token's arithmetic is the same whatever the pass length, and equality must be exact."""
    _, _, ours = families["qwen3_5"]
    monkeypatch.setattr(torch.nn.Linear, "forward", _rowwise_linear)
    monkeypatch.setattr(layers.Linear, "forward", _rowwise_linear)
    monkeypatch.setattr(qwen3_5, "attend", _rowwise_attend)
    torch.manual_seed(5)
    prompt, block = torch.randint(0, 255, (1, 11)), torch.randint(0, 255, (1, 16))
    for mode in ("keep", "replay"):
        for a in range(17):
            rolled = ours.new_cache(64, rollback=mode)
            ours(prompt, rolled)
            ours(block, rolled, logits="all")
            rolled.crop(11 + a)
            fresh = ours.new_cache(48, rollback=mode)  # another size: rotary tables must not depend on it
            ours(prompt, fresh)
            if a:
                ours(block[:, :a], fresh, logits="all")
            _assert_same_state(rolled, fresh)


@torch.inference_mode()
def test_rollback_modes_agree_and_limits(families):
    """"keep" and "replay" restore the same bits (without any test harness); rollback is refused outside
    the last pass and inside a chunked (long) pass, and a chunked pass can still be cropped to its ends."""
    _, _, ours = families["qwen3_5"]
    torch.manual_seed(6)
    prompt, block = torch.randint(0, 255, (1, 30)), torch.randint(0, 255, (1, 16))
    for a in (0, 1, 7, 15, 16):
        caches = []
        for mode in ("keep", "replay"):
            c = ours.new_cache(64, rollback=mode)
            ours(prompt, c)
            ours(block, c, logits="all")
            c.crop(30 + a)
            caches.append(c)
        _assert_same_state(*caches)
    c = caches[0]
    with pytest.raises(ValueError, match="within its last forward pass"):
        c.crop(29)
    long = torch.randint(0, 255, (1, qwen3_5.RECURRENT_MAX_TOKENS + 6))
    c = ours.new_cache(128)
    ours(long, c)
    with pytest.raises(ValueError, match="cannot roll back into a pass"):
        c.crop(10)
    c.crop(0)
    assert c.length == 0 and all(not s.any() for s in c.recurrent)


def test_chunked_form_matches_recurrent():
    """The chunked delta rule (prefill) against the plain recurrent reference: several chunks, a ragged
    last one, grouped value heads and a non-zero initial state."""
    torch.manual_seed(7)
    b, t, hk, hv, dk, dv = 1, 150, 2, 4, 8, 6
    q, k = torch.randn(b, t, hk, dk), torch.randn(b, t, hk, dk)
    v = torch.randn(b, t, hv, dv)
    g = -F.softplus(torch.randn(b, t, hv))
    beta = torch.rand(b, t, hv)
    state = torch.randn(b, hv, dk, dv)
    inputs = qwen3_5.prepare_delta_inputs(q, k, v, g, beta)
    out_r, state_r, _ = qwen3_5.delta_rule_recurrent(*inputs, state)
    out_c, state_c = qwen3_5.delta_rule_chunked(*inputs, state)
    torch.testing.assert_close(out_c, out_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state_c, state_r, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or qwen3_5._fla_chunk() is None, reason="needs CUDA and fla")
def test_fla_matches_torch_path():
    """flash-linear-attention's chunk kernel (used for long prefills on CUDA) against the torch reference."""
    torch.manual_seed(8)
    b, t, hk, hv, dk, dv = 1, 200, 2, 4, 64, 64
    dev = torch.device("cuda")
    q, k = torch.randn(b, t, hk, dk, device=dev), torch.randn(b, t, hk, dk, device=dev)
    v = torch.randn(b, t, hv, dv, device=dev)
    g = -F.softplus(torch.randn(b, t, hv, device=dev))
    beta = torch.rand(b, t, hv, device=dev)
    state = torch.randn(b, hv, dk, dv, device=dev)
    out_r, state_r, _ = qwen3_5.delta_rule_recurrent(*qwen3_5.prepare_delta_inputs(q, k, v, g, beta), state)
    rep = hv // hk
    out_f, state_f = qwen3_5._fla_chunk()(
        q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g=g, beta=beta, initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out_f.float(), out_r, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(state_f.float(), state_r, rtol=1e-3, atol=1e-3)


@torch.inference_mode()
def test_multimodal_checkpoints_load(tmp_path):
    """Multimodal Qwen3.5 and Gemma 4 checkpoints (language model under `model.language_model.`, a vision
    tower beside it) load as text targets and give transformers' logits for text input."""
    import transformers

    torch.manual_seed(9)
    text = {k: v for k, v in QWEN.items() if k != "tie_word_embeddings"}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    qwen = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    ).eval()
    g4text = {k: v for k, v in GEMMA4.items() if k != "tie_word_embeddings"}
    gemma = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=g4text, vision_config=None, audio_config=None)
    ).eval()
    for name, hf in (("qwen3_5", qwen), ("gemma4", gemma)):
        _randomise(hf, 9)
        hf.save_pretrained(tmp_path / name)
        keys = loading.read_state(tmp_path / name)
        assert any(k.startswith("model.language_model.") for k in keys)
        ours = loading.load_target(tmp_path / name, CPU, torch.float32)
        ids = torch.randint(0, 255, (1, 24))
        want = hf(input_ids=ids).logits
        _close(ours(ids, ours.new_cache(32), logits="all").logits, want)


def test_moe_and_bidirectional_configs_are_refused():
    with pytest.raises(ValueError, match="mixture-of-experts"):
        qwen3_5.from_config({"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": 2}})
    with pytest.raises(ValueError, match="non-causal"):
        gemma4.from_config(dict(GEMMA4, model_type="gemma4_text", use_bidirectional_attention="all"))


@pytest.mark.fastpath
@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("name", ["qwen3_5", "gemma4", "gemma3"])
def test_fused_mlp_changes_nothing(families, name, quant):
    """Quantizing fuses each MLP's gate/up into one layer: bit-identical logits to separate layers."""
    from dflash_torch.models.quantize import quantize_int4, quantize_int8

    quantizer = quantize_int8 if quant == "int8" else quantize_int4
    path = families[name][0]
    models = [quantizer(loading.load_target(path, CPU, torch.float32), fuse=f) for f in (False, True)]
    assert models[1].model.layers[0].mlp.gate_up_proj is not None
    prompt = [random.Random(4).randrange(256) for _ in range(12)]
    with torch.inference_mode():
        logits = []
        for m in models:
            c = m.new_cache(32)
            out = [m(torch.tensor([prompt]), c, logits="all").logits]
            out += [m(torch.tensor([[t]]), c, logits="all").logits for t in prompt[:4]]
            logits.append(torch.cat(out, dim=1))
    assert torch.equal(logits[0], logits[1])


def test_cuda_graphs_refuse_other_families(families):
    """--cuda-graphs covers Llama-family targets; the others say so instead of failing mid-generation."""
    from dflash_torch.models.cudagraph import GraphedTarget

    for name in ("qwen3_5", "qwen3_5_moe", "qwen3_moe", "gemma4", "gemma3"):
        with pytest.raises(ValueError, match="Llama-family"):
            GraphedTarget(families[name][2], use_graphs=False)


@pytest.mark.fastpath
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_moe_quantized_speculation_is_exact(families, name, tmp_path):
    """int4 weights on an MoE target (the shared expert and attention quantized, the experts as loaded):
    speculation with a drafter and prompt lookup gives target-only decoding's tokens bit for bit."""
    from dflash_torch.models.quantize import quantize_int4

    path = families[name][0]
    ours = quantize_int4(loading.load_target(path, CPU, torch.float32))
    drafter = load_drafter(make_drafter(path, tmp_path / "draft", block_size=8))
    rng = random.Random(6)
    with torch.inference_mode():
        for _ in range(3):
            prompt = [rng.randrange(255) for _ in range(rng.randint(2, 20))]
            want = list(generate_tokens(ours, prompt, max_new_tokens=24))
            truth = prompt + list(generate_tokens(ours, prompt, max_new_tokens=40))
            for d in (drafter, OracleDrafter(truth, 256, 8, drafter.target_layer_ids, p=0.2, seed=2)):
                assert list(generate_tokens(ours, prompt, max_new_tokens=24, drafter=d, lookup=True)) == want
