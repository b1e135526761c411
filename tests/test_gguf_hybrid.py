"""GGUF files of Gemma 4 (`gemma4`, dense and mixture-of-experts) and the Qwen3.5 hybrid (`qwen35`,
`qwen35moe`) in every storage type the other families are checked in (Q4_K: `test_gguf_hybrid_q4_k`).

Each file is written here from a tiny random transformers model the way llama.cpp's converter
(convert_hf_to_gguf.py: Gemma4Model, Qwen3_5TextModel, Qwen3_5MoeTextModel) writes one:

* Gemma 4: norms as they are, the layer pattern as a per-layer boolean `sliding_window_pattern`, global and
  sliding head sizes as key_length / key_length_swa, per-layer KV head counts (global layers have their own
  with values from the key projection), per-layer feed-forward lengths (the KV-shared layers' double-wide
  MLP), the global layers' partial rotary as the `rope_freqs` tensor, `layer_scalar` as
  `layer_output_scale.weight`. Gemma 4 MoE (26B-A4B-style): expert_count / expert_used_count /
  expert_feed_forward_length, the fused gate/up expert stack as HF holds it, `router.scale` as
  `ffn_gate_inp.scale`, `router.per_expert_scale` as `ffn_down_exps.scale`, the router in F32.
* Qwen3.5: RMSNorms but the Gated DeltaNet output norm as 1 + w, A_log as -exp(A_log), dt_bias as
  `ssm_dt.bias`, the conv1d weight squeezed to [C, K], value heads of the linear-attention tensors reordered
  from grouped by key head to tiled (fewer key than value heads here), the Gated DeltaNet sizes as ssm.*
  keys and the layer pattern as full_attention_interval; MoE experts as gate / up / down stacks.

transformers reads dense Gemma 4 GGUF files (compared against as tests/test_gguf.py does), but not Qwen3.5
ones, and it cannot pair Gemma 4 MoE's expert and router-scale tensors: a Qwen3.5 or Gemma 4 MoE file is
compared against the HF directory of the very model it was written from (transformers' model and the
engine's), whose weights are first rounded to the file's storage type, so both hold the same values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_torch.decoding.speculative import generate_tokens

from .test_gguf import (
    BASE,
    IDS,
    K_SIZES,
    TYPES,
    _quantized_activations,
    _tokenizer,
    assert_experts_in_blocks,
    block_quantize,
    check_q4_k,
    k_quant_type,
    split_gate_up,
)

GEMMA4 = dict(num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=4, final_logit_softcapping=30.0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True, num_global_key_value_heads=1,
              hidden_size_per_layer_input=32, vocab_size_per_layer_input=BASE["vocab_size"], tie_word_embeddings=True)
# 4 key / 8 value heads... scaled down: 2 key heads, 4 value heads (reordered), value heads of 32 (whole blocks)
QWEN35 = dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=32, linear_conv_kernel_dim=4, tie_word_embeddings=False)
QWEN35_MOE = dict(QWEN35, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32)
# 26B-A4B-style: a router and experts beside every layer's dense MLP, global layers with their own KV heads
# and values from keys; no per-layer inputs, KV sharing or double-wide MLP (26B-A4B has none)
GEMMA4_MOE = dict(GEMMA4, hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
                  enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
# (test name: (transformers config class, its settings)); Gemma 4 MoE files are GGUF architecture gemma4
FAMILIES = {"gemma4": ("Gemma4TextConfig", GEMMA4), "qwen35": ("Qwen3_5TextConfig", QWEN35),
            "qwen35moe": ("Qwen3_5MoeTextConfig", QWEN35_MOE), "gemma4moe": ("Gemma4TextConfig", GEMMA4_MOE)}
GGUF_ARCH = {"gemma4moe": "gemma4"}


def _model(arch: str, seed: int = 0, qtype: str = "F32"):
    """The tiny random model of `arch` (a FAMILIES name), as wide as a `qtype` file needs (`K_SIZES` for
    Q4_K); its settings, with BASE's, in `model.settings`."""
    import transformers

    cls, settings = FAMILIES[arch]
    settings = {**BASE, **(K_SIZES if qtype == "Q4_K" else {}), **settings}
    config = getattr(transformers, cls)(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms, biases, scalars away from their init values, so a mix-up shows
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.ndim == 1 and p.is_floating_point() and "rotary" not in name:
                p.add_(torch.randn_like(p) * 0.2)
        model.lm_head.weight.mul_(4)  # logits far apart: greedy text is not one repeated token
    model.settings = settings
    return model


def _tiled(w: np.ndarray, dim: int, k_heads: int, per_k: int, unit: int) -> np.ndarray:
    # llama.cpp's _reorder_v_heads: HF's value heads grouped by key head -> tiled
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], k_heads, per_k, unit, *shape[dim + 1:])
    return np.ascontiguousarray(np.swapaxes(w, dim, dim + 1)).reshape(shape)


def _qwen35_tensor(key: str, a: np.ndarray, c) -> np.ndarray:
    """One Qwen3.5 tensor as llama.cpp's converter writes it (Qwen3NextModel, _LinearAttentionVReorderBase);
    Gemma 4's are written as they are."""
    if c.model_type.startswith("gemma4"):
        return a
    k, per_k = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    if key.endswith(".A_log"):
        a = -np.exp(a)
    elif "conv1d" in key:
        a = a.squeeze(1)
    elif key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
        a = a + 1
    if "linear_attn." in key and per_k > 1:
        if ".in_proj_qkv." in key or ".conv1d" in key:
            a = np.concatenate([a[: 2 * k * dk], _tiled(a[2 * k * dk:], 0, k, per_k, dv)])
        elif ".in_proj_z." in key:
            a = _tiled(a, 0, k, per_k, dv)
        elif ".in_proj_a." in key or ".in_proj_b." in key or key.endswith((".A_log", ".dt_bias")):
            a = _tiled(a, 0, k, per_k, 1)
        elif ".out_proj." in key:
            a = _tiled(a, 1, k, per_k, dv)
    return a


def _gguf_name(arch: str, key: str, name_map) -> str:
    parts = key.split(".")
    if key.endswith("router.scale"):  # Gemma4Model.modify_tensors names these in code
        return f"blk.{parts[2]}.ffn_gate_inp.scale"
    if key.endswith("router.per_expert_scale"):
        return f"blk.{parts[2]}.ffn_down_exps.scale"
    if key.endswith("linear_attn.dt_bias"):
        return f"blk.{parts[2]}.ssm_dt.bias"
    if key.endswith("linear_attn.A_log"):
        return f"blk.{parts[2]}.ssm_a"  # (llama.cpp's map finds no suffix to keep)
    base, _, suffix = key.rpartition(".")
    if suffix not in ("weight", "bias"):  # layer_scalar: Gemma4Model.filter_tensors adds ".weight"
        base, suffix = key, "weight"
    return f"{name_map.get_name(base)}.{suffix}"


def _stored(name: str, a: np.ndarray, qtype: str, tied: bool = False) -> str:
    """The type llama.cpp stores a tensor in for a file of `qtype`: 1-D tensors, the conv kernel (rows of 4)
    and the MoE router in F32, the rest in `qtype` (Q4_K files: `k_quant_type`; `tied`: no output matrix)."""
    if a.ndim == 1 or qtype == "F32" or "ssm_conv1d" in name or name.endswith("ffn_gate_inp.weight"):
        return "F32"
    return k_quant_type(name, a, tied) if qtype == "Q4_K" else qtype


def _round_to_file(model, arch: str, qtype: str) -> None:
    """Round the model's weights, in place, to what a file of `qtype` stores (F16, or a block format's
    dequantized values): each such row is quantized alike in HF's layout and the file's (llama.cpp's
    transformations move whole rows, or for ssm_out whole 32-column blocks), so the HF directory of the
    rounded model holds the file's values."""
    import gguf

    if qtype == "F32":
        return
    arch = GGUF_ARCH.get(arch, arch)
    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), 99)
    with torch.no_grad():
        for key, t in model.state_dict().items():
            a = t.float().numpy()
            if key.endswith("gate_up_proj"):
                name = "x.ffn_gate_exps.weight"
            else:
                name = _gguf_name(arch, key, name_map)
            kind = _stored(name, _qwen35_tensor(key, a, model.config), qtype, model.config.tie_word_embeddings)
            if kind == "F32":
                continue
            if kind == "F16":
                t.copy_(t.half().float())
            else:
                raw = block_quantize(a, kind)
                t.copy_(torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])).reshape(t.shape))


def write_gguf(arch: str, qtype: str, path, model) -> None:
    """`model` (a tiny Gemma 4, Gemma 4 MoE or Qwen3.5 transformers model; `arch` its FAMILIES name) written to
    `path` as llama.cpp would, its tensors in `qtype` (`_stored`)."""
    import gguf

    c = model.config
    arch = GGUF_ARCH.get(arch, arch)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    # newer llama.cpp appends Qwen3.5's multi-token-prediction layer as one more block (written for the dense
    # model here: the engine does not use it and must not count it)
    mtp = arch == "qwen35"
    w.add_block_count(c.num_hidden_layers + mtp)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "gemma4":
        g = model.settings  # (per-layer sizes: Gemma 4's config does not give them globally)
        swa = [t == "sliding_attention" for t in c.layer_types]
        first_shared = c.num_hidden_layers - c.num_kv_shared_layers
        if g["use_double_wide_mlp"]:  # (llama.cpp writes the per-layer array only then)
            w.add_feed_forward_length([g["intermediate_size"] * (1 if i < first_shared else 2)
                                       for i in range(c.num_hidden_layers)])
        else:
            w.add_feed_forward_length(g["intermediate_size"])
        if g.get("enable_moe_block"):
            w.add_expert_count(g["num_experts"])
            w.add_expert_used_count(g["top_k_experts"])
            w.add_expert_feed_forward_length(g["moe_intermediate_size"])
        w.add_head_count_kv([g["num_key_value_heads"] if s else g["num_global_key_value_heads"] for s in swa])
        full, sliding = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(sliding["rope_theta"])
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
        w.add_shared_kv_layers(c.num_kv_shared_layers)
        w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input)
        w.add_sliding_window_pattern(swa)
        global_head_dim = g["global_head_dim"]
        w.add_key_length(global_head_dim)
        w.add_value_length(global_head_dim)
        w.add_key_length_swa(g["head_dim"])
        w.add_value_length_swa(g["head_dim"])
        w.add_rope_dimension_count(global_head_dim)
        w.add_rope_dimension_count_swa(g["head_dim"])
        rotated = int(global_head_dim * full["partial_rotary_factor"] / 2)
        w.add_tensor("rope_freqs.weight",
                     np.array([1.0] * rotated + [1e30] * (global_head_dim // 2 - rotated), np.float32))
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        if arch == "qwen35":
            w.add_feed_forward_length(c.intermediate_size)
        else:
            w.add_expert_count(c.num_experts)
            w.add_expert_used_count(c.num_experts_per_tok)
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
        w.add_ssm_state_size(c.linear_key_head_dim)
        w.add_ssm_group_count(c.linear_num_key_heads)
        w.add_ssm_time_step_rank(c.linear_num_value_heads)
        w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
        w.add_full_attention_interval(4)
        w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
        w.add_rope_dimension_sections([11, 11, 10, 0])  # llama.cpp's default (multimodal positions only)
    _tokenizer(w)
    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                        c.num_hidden_layers)
    tensors = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = _qwen35_tensor(key, t.float().numpy(), c)
        if split_gate_up(tensors, key, a):  # (Gemma 4's `experts.gate_up_proj`, not under `mlp.`, stays fused)
            continue
        tensors[_gguf_name(arch, key, name_map)] = a
    if mtp:
        rng = np.random.default_rng(0)
        tensors[f"blk.{c.num_hidden_layers}.nextn.eh_proj.weight"] = rng.standard_normal(
            (c.hidden_size, 2 * c.hidden_size)).astype(np.float32)
        tensors[f"blk.{c.num_hidden_layers}.attn_norm.weight"] = np.ones(c.hidden_size, np.float32)
    for name, a in tensors.items():
        kind = _stored(name, a, qtype, c.tie_word_embeddings)
        if kind == "F32":
            w.add_tensor(name, a.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, block_quantize(a, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_gemma4_gguf(path):
    """transformers' own GGUF loading of a Gemma 4 file (`load_gguf_checkpoint`, as `from_pretrained(gguf_file=)`
    does), given what its reader leaves at Gemma4TextConfig's defaults though the file says otherwise: it maps
    only the sizes, the window and the epsilon, so the sliding head size (key_length_swa), the layer pattern,
    the per-layer KV heads, KV sharing, the per-layer input width and table size, the double-wide MLP, the
    rotary bases and global partial rotary (`rope_freqs`) and the soft-capping are read from the file here.
    Its name map also gives `layer_scalar` no ".weight", which llama.cpp's file has: that tensor is paired here."""
    import gguf
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reader = gguf.GGUFReader(str(path))

    def field(key):
        return reader.fields[f"gemma4.{key}"].contents()

    settings = dict(load_gguf_checkpoint(str(path))["config"])
    types = ["sliding_attention" if s else "full_attention" for s in field("attention.sliding_window_pattern")]
    kv = field("attention.head_count_kv")
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    per_layer = next(t for t in reader.tensors if t.name == "per_layer_token_embd.weight")
    settings.update(
        head_dim=field("attention.key_length_swa"), layer_types=types,
        num_key_value_heads=kv[types.index("sliding_attention")],
        num_global_key_value_heads=kv[types.index("full_attention")], attention_k_eq_v=True,
        num_kv_shared_layers=field("attention.shared_kv_layers"),
        hidden_size_per_layer_input=field("embedding_length_per_layer_input"),
        vocab_size_per_layer_input=int(per_layer.shape[-1]),
        intermediate_size=field("feed_forward_length")[0], use_double_wide_mlp=True,
        final_logit_softcapping=field("final_logit_softcapping"),
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": field("rope.freq_base_swa")},
                         "full_attention": {"rope_type": "proportional", "rope_theta": field("rope.freq_base"),
                                            "partial_rotary_factor": 2 * int((freqs < 1e29).sum())
                                            / field("attention.key_length")}})
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    for t in reader.tensors:
        if t.name.endswith("layer_output_scale.weight"):
            tensors[f"model.layers.{t.name.split('.')[1]}.layer_scalar"] = torch.from_numpy(
                gguf.quants.dequantize(t.data, t.tensor_type).copy())
    missing, _ = model.load_state_dict(tensors, strict=False)
    assert not [k for k in missing if k != "lm_head.weight"], missing
    model.tie_weights()
    return model.float().eval()


def _check(pipe, path, reference, quantize: str) -> None:
    """The engine's logits of the file against `reference` (transformers on the file's values), to float32
    rounding with --quantize none and on the block kernels to float32 rounding plus flipped activation
    roundings (tests/test_gguf.py explains the bound); greedy speculative output equal to target-only."""
    from dflash_torch.generate import load

    ids = torch.tensor([IDS])
    with torch.inference_mode():
        theirs = reference(ids).logits
        none = pipe.target if quantize == "none" else load(str(path), None, "cpu", quiet=True, quantize="none").target
        floats = none(ids, none.new_cache(64), logits="all").logits
    scale = theirs.abs().max().item()
    # float32 weights on both sides (F16 widened exactly): a few ulps per op through a few layers
    torch.testing.assert_close(floats, theirs, rtol=0, atol=1e-4 * scale)
    if quantize != "none":
        from dflash_torch.models.quantize import BlockLinear

        # every linear layer on the block kernels (all in_features here are whole blocks), the file's stored
        # ones from their own bytes: none left in float
        assert pipe.quantize == quantize and any(isinstance(m, BlockLinear) for m in pipe.target.modules())
        assert not [n for n, m in pipe.target.named_modules() if isinstance(m, torch.nn.Linear)]
        # and no embedding table in float: each kept in its stored blocks, rows dequantized as looked up
        # (Gemma 4's per-layer table too: 262,144 x 8,960 values in E2B)
        from dflash_torch.models.quantize import BlockEmbedding

        tables = [m for m in pipe.target.modules() if isinstance(m, (torch.nn.Embedding, BlockEmbedding))]
        assert tables and all(isinstance(m, BlockEmbedding) for m in tables)
        # and no expert stack in float: each expert's matrices in the file's blocks, on the block kernels
        if "moe" in path.name:
            assert assert_experts_in_blocks(pipe.target) > 0
        with torch.inference_mode():
            ours = pipe.target(ids, pipe.target.new_cache(64), logits="all").logits
            quantized = _quantized_activations(reference, quantize)(ids).logits
        bound = (quantized - theirs).abs().max().item() + 1e-4 * scale
        torch.testing.assert_close(ours, quantized, rtol=0, atol=bound)
    a = list(generate_tokens(pipe.target, IDS, max_new_tokens=24))
    b = list(generate_tokens(pipe.target, IDS, max_new_tokens=24, lookup=True))
    assert a == b and len(a) == 24


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_gemma4_matches_transformers(qtype, tmp_path, monkeypatch):
    """A Gemma 4 file (per-layer inputs, KV sharing, double-wide MLP, global layers with their own head size,
    KV heads, values from keys and partial rotary, sliding layers masking): the engine's logits equal
    transformers' GGUF loading of it, and greedy speculative output equals target-only output."""
    from dflash_torch.generate import load

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    path = tmp_path / f"tiny-gemma4.{qtype}.gguf"
    write_gguf("gemma4", qtype, path, _model("gemma4"))
    quantize = qtype.lower() if qtype.startswith("Q") else "none"
    pipe = load(str(path), None, "cpu", quiet=True, quantize=quantize)
    _check(pipe, path, _hf_gemma4_gguf(path), quantize)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_gguf_qwen35_matches_hf_directory(arch, qtype, tmp_path, monkeypatch):
    """A Qwen3.5 (dense or MoE) file: the engine's logits equal transformers' and the engine's own on the HF
    directory of the model it was written from (weights rounded to the file's type), and greedy speculative
    output equals target-only output."""
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    _check_against_hf_directory(arch, qtype, tmp_path)


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_gemma4_moe_matches_hf_directory(qtype, tmp_path, monkeypatch):
    """A Gemma 4 mixture-of-experts file (26B-A4B-style: router and experts beside every dense MLP, the router's
    per-dim and per-expert scales under llama.cpp's names, the fused gate/up expert stack; global layers with
    their own KV heads and values from keys): the engine's logits equal transformers' and the engine's own on
    the HF directory it was written from (transformers' GGUF loader cannot pair these tensors), and greedy
    speculative output equals target-only output."""
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    _check_against_hf_directory("gemma4moe", qtype, tmp_path)


def _check_against_hf_directory(arch: str, qtype: str, tmp_path) -> None:
    """The tiny model of `arch` (a FAMILIES name), its weights rounded to `qtype`, saved as an HF directory and
    written as llama.cpp would: the file holds the rounded values (transformed as llama.cpp transforms them),
    and the engine on the file matches the engine and transformers on the directory (`_check`)."""
    import transformers

    from dflash_torch.generate import load

    model = _model(arch)
    _round_to_file(model, arch, qtype)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(str(hf_dir))
    path = tmp_path / f"tiny-{arch}.{qtype}.gguf"
    write_gguf(arch, qtype, path, model)
    _assert_file_holds(model, arch, path)
    quantize = qtype.lower() if qtype.startswith("Q") else "none"
    pipe = load(str(path), None, "cpu", quiet=True, quantize=quantize)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    engine_hf = load(str(hf_dir), None, "cpu", quiet=True, quantize="none").target
    with torch.inference_mode():
        ids = torch.tensor([IDS])
        ours = load(str(path), None, "cpu", quiet=True, quantize="none").target
        theirs = engine_hf(ids, engine_hf.new_cache(64), logits="all").logits
        # the file's values are the directory's up to the rounding of 1 + w - 1 and log(exp(A_log)): float32
        torch.testing.assert_close(ours(ids, ours.new_cache(64), logits="all").logits, theirs, rtol=0,
                                   atol=1e-4 * theirs.abs().max().item())
    _check(pipe, path, reference, quantize)


def test_gguf_gemma4_moe_split_experts_say_so(tmp_path, monkeypatch):
    """A Gemma 4 MoE file whose experts' gate and up stacks are apart (not what llama.cpp writes for Gemma 4,
    which transformers' model cannot pair either) gets a ModelError saying so before anything is written to
    the cache."""
    import gguf

    from dflash_torch import loading

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    model = _model("gemma4moe")
    good, path = tmp_path / "moe.gguf", tmp_path / "split.gguf"
    write_gguf("gemma4moe", "F32", good, model)
    reader = gguf.GGUFReader(str(good))
    w = gguf.GGUFWriter(str(path), "gemma4")
    for field in reader.fields.values():  # the same metadata
        if not field.name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        a = np.array(t.data)
        if t.name.endswith("ffn_gate_up_exps.weight"):
            layer = t.name.split(".")[1]
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(a[:, : a.shape[1] // 2]))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(a[:, a.shape[1] // 2:]))
        else:
            w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(loading.ModelError, match=r"gemma4 mixture-of-experts file whose layer 0 has its experts' "
                                                 r"gate and up stacks apart"):
        loading.resolve_model(str(path))
    assert not list((tmp_path / "home").glob("models/*"))


def _assert_file_holds(model, arch: str, path) -> None:
    """The rounding is the file's: each stored tensor dequantizes to the (rounded) model's values, transformed
    as llama.cpp transforms them."""
    import gguf

    writer_view = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        writer_view[t.name] = gguf.quants.dequantize(t.data, t.tensor_type)
    enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == GGUF_ARCH.get(arch, arch))
    name_map = gguf.get_tensor_name_map(enum, 4)
    for key, t in model.state_dict().items():
        # (Qwen's gate/up expert stack is written as two tensors; the tied head is not written)
        if not key.endswith("mlp.experts.gate_up_proj") and not (key == "lm_head.weight"
                                                                  and model.config.tie_word_embeddings):
            expected = _qwen35_tensor(key, t.numpy(), model.config)
            np.testing.assert_array_equal(writer_view[_gguf_name(arch, key, name_map)].reshape(expected.shape),
                                          expected.astype(np.float32), err_msg=key)


@pytest.mark.parametrize("arch", ["gemma4", "qwen35", "qwen35moe", "gemma4moe"])
def test_gguf_hybrid_q4_k(arch, tmp_path, monkeypatch, capsys):
    """A Q4_K_M-style file (tests/test_gguf.py's `k_quant_type`) of Gemma 4 (dense: against transformers' GGUF
    loading of it) and of Qwen3.5 / 3.5-MoE / Gemma 4 MoE (against the HF directory of the model, its weights
    rounded to the file's dequantized values): `check_q4_k`."""
    import transformers

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    model = _model(arch, qtype="Q4_K")
    path = tmp_path / f"tiny-{arch}.Q4_K.gguf"
    # written first, then rounded: a Q4_K encoding of already-rounded values need not give the same values
    # again (its scales come from each sub-block's range), and llama.cpp's moves of whole rows commute with
    # the rounding of each row, so the file holds exactly the rounded model's values (checked)
    write_gguf(arch, "Q4_K", path, model)
    if arch == "gemma4":
        check_q4_k(path, lambda: _hf_gemma4_gguf(path), capsys)
        return
    _round_to_file(model, arch, "Q4_K")
    _assert_file_holds(model, arch, path)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(str(hf_dir))
    check_q4_k(path, lambda: transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
               .eval(), capsys)
