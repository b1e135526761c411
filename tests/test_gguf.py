"""GGUF files of every supported family and storage type: the engine's logits equal transformers' own
GGUF loading of the same file, greedy speculative output equals target-only output, and files it cannot
run get a clear error.

Each file is written here from a tiny random transformers model, the way llama.cpp's converter writes
one: tensor names through gguf's name map, Llama q/k rows permuted for llama.cpp's rotary layout, Gemma
norms stored as 1 + w, MoE experts as gate / up / down stacks, the router kept in F32, 1-D tensors in F32.
Q4_K files (`test_gguf_family_q4_k`) are as llama.cpp's Q4_K_M stores them (`k_quant_type`), encoded by
dflash_torch/gguf_kquants.py, and checked by `check_q4_k` (also used by tests/test_gguf_hybrid.py).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.speculative import Stats, generate_tokens

VOCAB = 512
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {  # GGUF architecture: (transformers config class, its settings)
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32, rope_theta=1e6)),  # head_dim != H / heads
    "qwen3moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=64, norm_topk_prob=True)),
    # 6 layers: llama.cpp's fixed pattern (5 sliding, 1 global) holds a global layer; a window shorter than
    # the prompt, so the sliding layers mask
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, sliding_window=4, query_pre_attn_scalar=16,
                                        tie_word_embeddings=True)),
}
TYPES = ("F32", "F16", "Q8_0", "Q4_0")
# Q4_K files: K-quant rows are whole 256-value blocks, so the Q4_K models are this wide (the families' own
# settings, e.g. Qwen3's head_dim, still win: their narrower matrices are then written in Q8_0)
K_SIZES = dict(hidden_size=256, intermediate_size=256, head_dim=64)


def k_quant_type(name: str, a: np.ndarray, tied: bool) -> str:
    """The type a Q4_K_M-style file stores a matrix in: the LM head (output, or the token embedding when it
    is tied) in Q6_K, as llama.cpp's Q4_K_M does; matrices whose rows are whole 256-value blocks in Q4_K, the
    others in Q8_0 (llama.cpp itself falls back to Q5_0 for those; Q8_0 keeps every matrix of the tiny
    models in a block format the engine keeps)."""
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        return "Q6_K"
    return "Q4_K" if a.shape[-1] % 256 == 0 else "Q8_0"


def block_quantize(a: np.ndarray, kind: str) -> np.ndarray:
    """`a` (any leading dims) as GGUF blocks of `kind`: gguf's quantizer, or gguf_kquants' encoders for the
    K-quants gguf cannot encode."""
    import gguf

    from dflash_torch.gguf_kquants import ENCODERS

    if kind not in ENCODERS:
        return gguf.quants.quantize(a, gguf.GGMLQuantizationType[kind])
    return ENCODERS[kind](np.ascontiguousarray(a.reshape(-1, a.shape[-1]), np.float32)).reshape(*a.shape[:-1], -1)


@functools.cache
def _tokenizer_fields() -> tuple:
    """A small byte-level BPE tokenizer: the first VOCAB tokens of the default model's, the merges among them,
    its chat template (read once: the default file's 49,152 tokens take a while)."""
    from dflash_torch.gguf_reader import open_gguf

    reader = open_gguf(loading.default_gguf())

    def field(name):
        return reader.fields[name].contents()

    tokens = field("tokenizer.ggml.tokens")[:VOCAB]
    have = set(tokens)
    merges = [m for m in field("tokenizer.ggml.merges")
              if len(parts := m.split(" ")) == 2 and {parts[0], parts[1], "".join(parts)} <= have]
    return tokens, field("tokenizer.ggml.token_type")[:VOCAB], merges, field("tokenizer.chat_template")


def _tokenizer(writer) -> None:
    """The tokenizer's metadata as llama.cpp writes it."""
    tokens, types, merges, template = _tokenizer_fields()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(template)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's LlamaModel.permute: HF's rotary halves -> interleaved pairs
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def split_gate_up(tensors: dict, key: str, a: np.ndarray) -> bool:
    """Qwen's [E, 2I, H] expert stack `key` as llama.cpp stores it, gate and up apart, into `tensors`;
    False (nothing added) for any other tensor."""
    if not key.endswith("mlp.experts.gate_up_proj"):
        return False
    layer = key.split(".")[2]
    tensors[f"blk.{layer}.ffn_gate_exps.weight"], tensors[f"blk.{layer}.ffn_up_exps.weight"] = (
        np.ascontiguousarray(a[:, : a.shape[1] // 2]), np.ascontiguousarray(a[:, a.shape[1] // 2:]))
    return True


def write_gguf(arch: str, qtype: str, path, seed: int = 0):
    """A tiny random model of `arch` written to `path` (tensors in `qtype`); returns transformers' model."""
    import gguf
    import transformers

    cls, settings = FAMILIES[arch]
    config = getattr(transformers, cls)(**{**BASE, **(K_SIZES if qtype == "Q4_K" else {}), **settings})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms and biases away from their init values (1 or 0), so a mix-up shows
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
        model.lm_head.weight.mul_(4)  # logits far apart: greedy text is not one repeated token
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if arch != "gemma3"
                         else c.rope_parameters["full_attention"]["rope_theta"])
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    _tokenizer(w)
    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                        c.num_hidden_layers)
    tensors = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.float().numpy()
        if split_gate_up(tensors, key, a):
            continue
        base, _, suffix = key.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = key, "weight"
        name = f"{name_map.get_name(base)}.{suffix}"
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            a = _permute(a, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1
        tensors[name] = a
    for name, a in tensors.items():
        if a.ndim == 1 or "ffn_gate_inp" in name or qtype == "F32":
            w.add_tensor(name, a.astype(np.float32))
        elif qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            kind = k_quant_type(name, a, c.tie_word_embeddings) if qtype == "Q4_K" else qtype
            w.add_tensor(name, block_quantize(a, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def _hf_gguf(path):
    """transformers' own GGUF loading of the file: its config and its tensors (every one dequantized to
    float32, names paired by its name map) through `load_gguf_checkpoint`, as `from_pretrained(gguf_file=)`
    does (which also needs `accelerate`, not installed here)."""
    import gguf
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    settings = dict(load_gguf_checkpoint(str(path))["config"])
    # What transformers' GGUF reader leaves at its config defaults though the file (or llama.cpp's code) says
    # otherwise, given here as the engine reads it: Qwen3's head_dim (it reads no key_length for qwen3, so
    # it assumes hidden / heads), Qwen3-MoE's expert width (expert_feed_forward_length), Gemma 3's
    # query_pre_attn_scalar (llama.cpp scales by 1/sqrt(key_length); transformers' default is 256)
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    key_length = key_length.contents() if key_length is not None else None
    if arch == "qwen3":
        settings["head_dim"] = key_length
    if arch == "qwen3moe":
        settings["moe_intermediate_size"] = reader.fields[f"{arch}.expert_feed_forward_length"].contents()
    if arch == "gemma3":
        settings["query_pre_attn_scalar"] = key_length
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, _ = model.load_state_dict(tensors, strict=False)
    assert not [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)], missing
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


def _float32_cache(model, n: int):
    """model.new_cache(n) with float32 keys and values, whatever the model keeps them in."""
    kept = getattr(model, "cache_dtype", None)
    if kept is not None:
        model.cache_dtype = None
    try:
        return model.new_cache(n)
    finally:
        if kept is not None:
            model.cache_dtype = kept


def _quantized_activations(model, fmt: str):
    """Round every linear layer's input as the block kernels do (per row, blocks of 32, d = max|x| / 127,
    q = round(x / d): `kernels.reference.quantize_act`), so that transformers computes what the engine's
    block formats compute (integer block dot products are exact; the rest is float32 rounding). A MoE
    router (Qwen's, Gemma 4's projection), stored in F32 but run by the engine in the layers' format `fmt`,
    gets its weight quantized too. The experts' two matmuls (3-D stacks, not nn.Linear: the engine runs them
    on the block kernels too) get their inputs rounded alike; their weights are the model's own (set them to
    the blocks' dequantized values where those differ from the file's)."""
    import types

    import torch.nn.functional as F

    from dflash_torch.kernels import pack, reference

    def act(x):
        flat = x.reshape(-1, x.shape[-1])
        q, d, _ = reference.quantize_act(flat)
        return (q.float().reshape(flat.shape[0], -1, 32) * d[..., None]).reshape(x.shape)

    def hook(_module, args):
        return (act(args[0]),)

    def experts(self, hidden_states, top_k_index, top_k_weights):  # transformers' loop, inputs rounded
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(act(hidden_states[token]), self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(act(self.act_fn(gate) * up), self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    for m in model.modules():
        if type(m).__name__.endswith("Experts") and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor):
            m.forward = types.MethodType(experts, m)
        if type(m).__name__.endswith("TopKRouter"):  # not an nn.Linear, but one to the engine
            with torch.no_grad():
                m.weight.copy_(pack.dequantize(pack.quantize(m.weight, fmt), fmt))
        if type(m).__name__ == "Gemma4TextRouter":  # its projection (an nn.Linear: hooked below) stored in F32
            with torch.no_grad():
                m.proj.weight.copy_(pack.dequantize(pack.quantize(m.proj.weight, fmt), fmt))
        if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("TopKRouter"):
            m.register_forward_pre_hook(hook)
    return model


def assert_experts_in_blocks(model) -> int:
    """Every expert stack of the engine's `model` is held in GGUF blocks (`quantize.BlockStack`: one packed
    matrix per expert, run on the block kernels), none in float; returns how many stacks there are."""
    from dflash_torch.models.moe import Experts
    from dflash_torch.models.quantize import BlockStack

    stacks = [(n, getattr(m, s)) for n, m in model.named_modules() if isinstance(m, Experts)
              for s in ("gate_up_proj", "down_proj")]
    assert all(isinstance(w, BlockStack) for _, w in stacks), [n for n, w in stacks if not isinstance(w, BlockStack)]
    return len(stacks)


IDS = [1, 17, 250, 3, 99, 17, 250, 3, 99, 400, 12, 7]  # longer than Gemma's window (4); a repeat for lookup


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_gguf_family_matches_transformers(arch, qtype, tmp_path, monkeypatch):
    """The engine's logits of a GGUF file equal transformers' GGUF loading of it, and greedy speculative
    decoding (prompt lookup) gives target-only output."""
    from dflash_torch.generate import load

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    path = tmp_path / f"tiny-{arch}.{qtype}.gguf"
    write_gguf(arch, qtype, path)
    quantize = qtype.lower() if qtype.startswith("Q") else "none"
    pipe = load(str(path), None, "cpu", quiet=True, quantize=quantize)
    ids = torch.tensor([IDS])
    hf = _hf_gguf(path)
    # Against transformers, a float32 cache like its own (block formats keep theirs in float16, whose reads
    # tests/test_kernels.py checks: the float32 kernel's results on the widened values, bit for bit).
    t = pipe.target
    with torch.inference_mode():
        ours = t(ids, _float32_cache(t, 64), logits="all").logits
        theirs = hf(ids).logits
    # F32 / F16 files: both read the same float32 weights (F16 widened exactly) and differ only in the order
    # of float32 operations: a few ulps per op through a few layers, far under 1e-4 of logits of size ~1-10.
    scale = theirs.abs().max().item()
    if quantize == "none":
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * scale)
    else:
        # The block formats: the file's floats themselves first (--quantize none dequantizes the kept
        # blocks, rows in HF's order), to the same float32 tolerance
        none = load(str(path), None, "cpu", quiet=True, quantize="none").target
        with torch.inference_mode():
            floats = none(ids, none.new_cache(64), logits="all").logits
            quantized = _quantized_activations(hf, quantize)(ids).logits
        torch.testing.assert_close(floats, theirs, rtol=0, atol=1e-4 * scale)
        # then the kernels, whose activations are quantized to 8 bits: transformers on the same weights with
        # its linear layers' inputs quantized the same way computes the same integer block sums, so the two
        # differ by float32 rounding, except where an input sits within rounding of a quantization step's
        # midpoint and the two round it apart: one step of one element. Such flips are bounded by the whole
        # activation quantization's own effect (every element moved by up to half a step), measured as
        # |transformers quantized - transformers float|.
        bound = (quantized - theirs).abs().max().item() + 1e-4 * scale
        torch.testing.assert_close(ours, quantized, rtol=0, atol=bound)
        if arch == "qwen3moe":  # the experts in the file's blocks, on the block kernels, never in float
            assert assert_experts_in_blocks(pipe.target) == 2 * BASE["num_hidden_layers"]
    prompt = IDS
    plain, fast = Stats(), Stats()
    a = list(generate_tokens(pipe.target, prompt, max_new_tokens=24, stats=plain))
    b = list(generate_tokens(pipe.target, prompt, max_new_tokens=24, stats=fast, lookup=True))
    assert a == b and len(a) == 24
    cfg = (pipe.model_path / "config.json").read_text()
    assert '"gguf_group_types"' in cfg


def _minimal(path, arch: str, qtype: str = "F32") -> None:
    """A GGUF file of `arch` with Llama-style metadata and one tensor stored as `qtype` (raw bytes)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for add, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("head_count", 4), ("head_count_kv", 4), ("context_length", 64)):
        getattr(w, f"add_{add}")(value)
    _tokenizer(w)
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 64 // block * size), np.uint8), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_unsupported_family_and_type_say_so(tmp_path, monkeypatch):
    """A file of an architecture the engine does not convert, or with a tensor type gguf cannot dequantize,
    gets a ModelError naming it and what is supported, before anything is written to the cache."""
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    _minimal(tmp_path / "phi.gguf", "phi3")  # transformers and gguf know it; the engine has no Phi family
    with pytest.raises(loading.ModelError, match=r"GGUF architecture 'phi3' is not supported \(supported: llama, "
                                                 r"qwen2, qwen3, qwen3moe, gemma3, gemma4, qwen35, qwen35moe\)"):
        loading.resolve_model(str(tmp_path / "phi.gguf"))
    _minimal(tmp_path / "q81.gguf", "llama", "Q8_1")  # a type llama.cpp uses only for activations
    with pytest.raises(loading.ModelError, match=r"GGUF tensor type\(s\) Q8_1 not supported \(supported: F32, F16, "
                                                 r"Q4_0.*Q8_0"):
        loading.resolve_model(str(tmp_path / "q81.gguf"))
    assert not list((tmp_path / "home").glob("models/*"))


# Byte layouts of one 256-value K-quant block (ggml): where its fp16 scale(s) sit; the other bytes (6-bit
# sub-block scales and minimums, quants) may hold any value. Q6_K's sub-block scales are int8.
_K_BLOCKS = {"Q4_K": (144, {0: 2e-4, 2: 2e-4}), "Q5_K": (176, {0: 1e-4, 2: 1e-4}), "Q6_K": (210, {208: 5e-5})}


def _kquant(rows: int, cols: int, qtype: str, rng) -> np.ndarray:
    """A [rows, cols] matrix of K-quant blocks: random quants and sub-block scales under fixed fp16 scales
    (every such block is a valid one; the `gguf` package can decode K-quants but not encode them)."""
    size, scales = _K_BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for offset, d in scales.items():
        raw[..., offset:offset + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def _write_kquant_llama(path, qtype: str) -> None:
    """A 2-layer Llama file (hidden 256: K-quant rows are 256-value blocks) with its matrices and embedding
    in `qtype` and its LM head in Q6_K, as llama.cpp's Q4_K_M and Q5_K_M files store theirs."""
    import gguf

    h, ffn, heads, kv, head_dim = 256, 256, 4, 2, 64
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in (("block_count", 2), ("embedding_length", h), ("feed_forward_length", ffn),
                       ("head_count", heads), ("head_count_kv", kv), ("context_length", 256),
                       ("rope_dimension_count", head_dim)):
        getattr(w, f"add_{add}")(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    _tokenizer(w)
    t = gguf.GGMLQuantizationType[qtype]
    w.add_tensor("token_embd.weight", _kquant(VOCAB, h, qtype, rng), raw_dtype=t)
    w.add_tensor("output.weight", _kquant(VOCAB, h, "Q6_K", rng), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    shapes = {"attn_q": (heads * head_dim, h), "attn_k": (kv * head_dim, h), "attn_v": (kv * head_dim, h),
              "attn_output": (h, heads * head_dim), "ffn_gate": (ffn, h), "ffn_up": (ffn, h), "ffn_down": (h, ffn)}
    for i in range(2):
        for name, (n, k) in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", _kquant(n, k, qtype, rng), raw_dtype=t)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype,fmt", [("Q4_K", "q4_1"), ("Q5_K", "q8_0")])
def test_gguf_kquants_convert_to_block_formats(qtype, fmt, tmp_path, monkeypatch, capsys):
    """K-quant matrices are converted once into the nearest block format (Q4_K -> q4_1, Q5_K and Q6_K ->
    q8_0), within that format's rounding of the file's values; --quantize auto runs them on the block
    kernels, the banner says so, and the logits are transformers' on the converted weights."""
    from dflash_torch.generate import load
    from dflash_torch.kernels import pack

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    path = tmp_path / f"tiny-llama.{qtype}.gguf"
    _write_kquant_llama(path, qtype)
    pipe = load(str(path), None, "cpu", quantize="auto")
    err = capsys.readouterr().err
    assert (pipe.quantize, pipe.lm_head) == (fmt, "q8_0")
    assert f"MLP gate/up: {qtype} -> {fmt} (converted) -> {fmt} (block kernels)" in err
    assert "LM head: Q6_K -> q8_0 (converted) -> q8_0 (block kernels)" in err
    model_dir = pipe.model_path
    assert_converted_within_rounding(model_dir, _hf_gguf(path).state_dict())
    # the kernels on the converted blocks against transformers on the same (dequantized) blocks with its
    # linear layers' inputs quantized as the kernels do: float32 rounding, and as above, flipped roundings of
    # activations bounded by the activation quantization's whole effect
    # --quantize none (and transformers' model of the directory) read the file's own values, exactly
    ids = torch.tensor([IDS])
    hf = loading.hf_model(model_dir, torch.float32)
    none = load(str(path), None, "cpu", quiet=True, quantize="none").target
    with torch.inference_mode():
        floats = _hf_gguf(path)(ids).logits
        scale = floats.abs().max().item()
        torch.testing.assert_close(none(ids, none.new_cache(64), logits="all").logits, floats, rtol=0,
                                   atol=1e-4 * scale)
        torch.testing.assert_close(hf(ids).logits, floats, rtol=0, atol=1e-4 * scale)
    hf.load_state_dict({name: pack.dequantize(raw, kind) for name, kind, raw in loading.iter_blocks(model_dir)},
                       strict=False)  # now on the converted weights, as the block kernels run them
    with torch.inference_mode():
        ours = pipe.target(ids, pipe.target.new_cache(64), logits="all").logits
        floats = hf(ids).logits
        quantized = _quantized_activations(hf, fmt)(ids).logits
    # The two sides round the same activations to 8 bits, but float32 differences upstream (a Gated DeltaNet's
    # recurrence against transformers' chunked form, other vector widths under AVX2) flip some of those
    # roundings to the neighbouring level: a whole step, where rounding moves a value by at most half of
    # one. Allowance: twice the rounding's whole effect on the logits, plus float32 rounding.
    effect = (quantized - floats).abs().max().item()
    torch.testing.assert_close(ours, quantized, rtol=0, atol=2 * effect + 1e-4 * scale)
    a = list(generate_tokens(pipe.target, IDS, max_new_tokens=24))
    assert a == list(generate_tokens(pipe.target, IDS, max_new_tokens=24, lookup=True)) and len(a) == 24


def assert_converted_within_rounding(model_dir, theirs: dict) -> None:
    """Each block-kept matrix of a converted directory against the file's own values (`theirs`: HF name ->
    float32, e.g. transformers' own dequantization of the file): gguf's quantizer (llama.cpp's reference)
    rounds each value to the nearest of its block's levels, so the error is at most half a step d (q8_0:
    max|w| / 127; q4_1: (max - min) / 15), plus the fp16 rounding of the block's scale times its largest
    quant (127, 15) and, q4_1, of its minimum m: half an fp16 ulp, 2^-11 relative, or 2^-25 where the value
    is subnormal in fp16 (below 2^-14). (Matrices the file stores in a block format are its bytes: exact.)"""
    from dflash_torch.kernels import pack

    def fp16(x):
        return torch.maximum(x.abs() * 2**-11, torch.tensor(2.0**-25))

    for name, kind, raw in loading.iter_blocks(model_dir):
        ours = pack.dequantize(raw, kind)
        ref = theirs[name].reshape(ours.shape[0], -1, 32)
        if kind == "q8_0":
            d = ref.abs().amax(-1, keepdim=True) / 127
            bound = 0.5 * d + 127 * fp16(d)
        else:
            lo, hi = ref.amin(-1, keepdim=True), ref.amax(-1, keepdim=True)
            d = (hi - lo) / 15
            bound = 0.5 * d + 15 * fp16(d) + fp16(lo)
        assert ((ours.reshape(ref.shape) - ref).abs() <= bound + 1e-7).all(), name


def check_q4_k(path, reference, capsys) -> None:
    """A Q4_K file (`k_quant_type`) against `reference` (a function giving a fresh transformers model on the
    file's own values): with --quantize none the engine's logits equal it to float32 rounding; with
    --quantize auto every Q4_K matrix runs as converted q4_1 blocks (the banner says so) and every other kept
    matrix in its own format, each converted matrix within its format's rounding of the file's values, the
    logits those of transformers on the converted weights with its linear layers' inputs quantized as the
    kernels do (float32 rounding plus flipped activation roundings: see the allowance below), and greedy
    speculative output equals target-only output."""
    import json

    import gguf

    from dflash_torch import gguf_convert
    from dflash_torch.generate import load
    from dflash_torch.models.quantize import BlockLinear

    ids = torch.tensor([IDS])
    none = load(str(path), None, "cpu", quiet=True, quantize="none").target
    with torch.inference_mode():
        theirs = reference()(ids).logits
        scale = theirs.abs().max().item()
        torch.testing.assert_close(none(ids, none.new_cache(64), logits="all").logits, theirs, rtol=0,
                                   atol=1e-4 * scale)
    capsys.readouterr()
    pipe = load(str(path), None, "cpu", quantize="auto")
    err = capsys.readouterr().err
    assert pipe.quantize == "q4_1" and "Q4_K -> q4_1 (converted) -> q4_1 (block kernels)" in err, err
    model_dir = pipe.model_path
    # every 2-D Q4_K matrix of the file is kept as q4_1 blocks, and only those
    reader = gguf.GGUFReader(str(path))
    names = gguf_convert.hf_names(reader, json.loads((model_dir / "config.json").read_text()))
    q4_k = {names[t.name] for t in reader.tensors  # (of the tensors the engine reads: not Qwen3.5's MTP block)
            if t.tensor_type.name == "Q4_K" and len(t.shape) in (2, 3) and t.name in names}  # (3-D: experts)
    kept = {name: kind for name, kind, _ in loading.iter_blocks(model_dir)}
    assert q4_k and {n for n, k in kept.items() if k == "q4_1"} == q4_k
    assert not [n for n, m in pipe.target.named_modules() if isinstance(m, torch.nn.Linear)]
    if any(len(t.shape) == 3 for t in reader.tensors):  # a MoE file: its expert stacks in blocks too
        assert assert_experts_in_blocks(pipe.target) > 0
    assert_converted_within_rounding(model_dir, reference().state_dict())

    # --quantize auto runs every kept matrix in its own format: a Q8_0 matrix of the Q4_K file as q8_0 beside
    # the q4_1 ones, not requantized into the model's majority format
    layer_kinds = {kind for name, kind in kept.items() if "embed_tokens" not in name}
    assert layer_kinds <= {m.fmt for m in pipe.target.modules() if isinstance(m, BlockLinear)}, layer_kinds
    hf = reference()
    hf.load_state_dict({name: loading.dequantize_blocks(raw, kind) for name, kind, raw in loading.iter_blocks(
        model_dir)}, strict=False)  # on the converted weights (expert stacks too), as the block kernels run them
    if getattr(hf.config, "tie_word_embeddings", False):
        hf.tie_weights()
    with torch.inference_mode():
        ours = pipe.target(ids, pipe.target.new_cache(64), logits="all").logits
        floats = hf(ids).logits
        quantized = _quantized_activations(hf, pipe.quantize)(ids).logits
    # The two sides round the same activations to 8 bits, but float32 differences upstream (a Gated DeltaNet's
    # recurrence against transformers' chunked form, other vector widths under AVX2) flip some of those
    # roundings to the neighbouring level: a whole step, where rounding moves a value by at most half of
    # one. Allowance: twice the rounding's whole effect on the logits, plus float32 rounding.
    effect = (quantized - floats).abs().max().item()
    torch.testing.assert_close(ours, quantized, rtol=0, atol=2 * effect + 1e-4 * scale)
    a = list(generate_tokens(pipe.target, IDS, max_new_tokens=24))
    assert a == list(generate_tokens(pipe.target, IDS, max_new_tokens=24, lookup=True)) and len(a) == 24


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_gguf_family_q4_k(arch, tmp_path, monkeypatch, capsys):
    """A Q4_K_M-style file of each family (Q4_K matrices, Q8_0 where rows are not whole 256-value blocks, the
    LM head in Q6_K): against transformers' own GGUF loading of it (`check_q4_k`)."""
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    path = tmp_path / f"tiny-{arch}.Q4_K.gguf"
    write_gguf(arch, "Q4_K", path)
    check_q4_k(path, lambda: _hf_gguf(path), capsys)


def test_open_gguf_reads_what_gguf_reads():
    """`open_gguf` (gguf's reader on a plain view of the mapping) gives gguf's own reader's fields and tensors:
    every value, every tensor's name, type, shape and bytes; a reader it cannot speed up is used as it is."""
    import gguf

    from dflash_torch.gguf_reader import _fast_reader, open_gguf

    path = loading.default_gguf()
    stock, fast = gguf.GGUFReader(str(path)), open_gguf(path)
    assert type(fast) is not gguf.GGUFReader  # (else this compares the reader with itself)
    assert list(fast.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        assert fast.fields[name].contents() == field.contents(), name
        assert fast.fields[name].types == field.types and fast.fields[name].offset == field.offset, name
    assert len(fast.tensors) == len(stock.tensors) > 0
    for a, b in zip(fast.tensors, stock.tensors):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset) == (b.name, b.tensor_type, list(b.shape),
                                                                          b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)

    class Other(gguf.GGUFReader):  # a reader whose reads take other arguments
        def _get(self, offset, dtype, count=1, override_order=None, extra=None):
            return super()._get(offset, dtype, count, override_order)

    assert _fast_reader(Other) is Other
