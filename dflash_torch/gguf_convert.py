"""GGUF files -> HF-style model directories in the cache (converted once, reused after).

A converted directory holds config.json (an HF config of the file's family, built from its metadata),
the tokenizer and chat template (transformers reads them out of the file), `loading.BLOCKS_FILE` (the
matrices the file stores as Q4_0 / Q4_1 / Q8_0, their bytes as stored, rows in HF's order) and
model.safetensors (every other tensor, dequantized to float32).

Tensor names come from gguf's own name maps (`gguf.get_tensor_name_map`) applied to the keys of
transformers' model of the family, which is how transformers' GGUF loader pairs them, so the engine
and that loader read the same tensor into the same weight. Gemma 4's and Qwen3.5's layouts (their
metadata, the tensors llama.cpp's converter renames or transforms) are in `gguf_families`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import gguf_families, loading
from .gguf_reader import open_gguf
from .loading import ModelError

# GGUF architecture -> (HF model_type, HF class): the engine's families (models/) whose GGUF layout both
# the gguf package and transformers' GGUF loader know. Mistral files are architecture "llama".
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "gemma4": ("gemma4_text", "Gemma4ForCausalLM"),
    # (transformers' GGUF loader has no Qwen3.5; its model classes name the tensors all the same)
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
}
# llama.cpp's converter interleaves q/k rows for its rotary layout only for these (its LlamaModel);
# Qwen and Gemma files keep HF's order (llama.cpp runs them with NeoX-style rotary).
_PERMUTED = ("llama",)
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight as is); HF keeps w.
_NORM_PLUS_ONE = ("gemma3",)


def _field(reader, name: str, default=None):
    f = reader.fields.get(name)
    return default if f is None else f.contents()


def _arch(reader, path: Path | None = None) -> str:
    """The file's architecture, or a ModelError naming it and the supported ones."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        name = path.name if path is not None else "GGUF file"
        raise ModelError(f"{name}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    return arch



def _check_types(reader, path: Path) -> None:
    """Every tensor in a type gguf can dequantize; else a ModelError naming the type and the supported ones."""
    import gguf
    import numpy as np

    supported, bad = [], set()
    for t in gguf.GGMLQuantizationType:
        block, size = gguf.GGML_QUANT_SIZES.get(t, (0, 0))
        try:
            gguf.quants.dequantize(np.zeros((1, size * max(1, 256 // max(block, 1))), np.uint8), t)
            supported.append(t.name)
        except Exception:  # noqa: BLE001 -- gguf raises NotImplementedError (or worse) for types it lacks
            pass
    for t in reader.tensors:
        if t.tensor_type.name not in supported:
            bad.add(t.tensor_type.name)
    if bad:
        raise ModelError(f"{path.name}: GGUF tensor type(s) {', '.join(sorted(bad))} not supported "
                         f"(supported: {', '.join(supported)})")


def _config(reader, path: Path) -> dict:
    """The HF config.json of the file's family, from its metadata (what transformers' GGUF loader reads,
    plus what llama.cpp fixes in code rather than in the file, e.g. Gemma 3's attention pattern)."""
    arch = _arch(reader, path)
    model_type, cls = ARCHITECTURES[arch]

    def field(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    heads, kv_heads = field("attention.head_count"), field("attention.head_count_kv")
    hidden, layers = field("embedding_length"), field("block_count")
    head_dim = field("attention.key_length") or hidden // heads
    config = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": field("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads or heads,
        "head_dim": head_dim,
        "rms_norm_eps": field("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": field("context_length", 4096),
        "rope_theta": field("rope.freq_base", 10000.0),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    }
    if arch == "qwen3moe":
        moe = field("expert_feed_forward_length")
        config.update({"intermediate_size": config["intermediate_size"] or moe, "moe_intermediate_size": moe,
                       "num_experts": field("expert_count"), "num_experts_per_tok": field("expert_used_count"),
                       # transformers' GGUF default; llama.cpp's qwen3moe graph normalizes the top-k weights
                       "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []})
    if arch == "gemma4":
        config = gguf_families.gemma4_config(field, reader, config)
    if arch in gguf_families.QWEN35:
        config = gguf_families.qwen35_config(field, config, arch)
    if arch == "gemma3":
        # llama.cpp fixes these in code, not in the file: 5 sliding layers then a global one, local rotary
        # base 10,000 (unless the file names one), attention scale 1/sqrt(head_dim) (the 27B model, 62
        # layers, 1/sqrt(hidden / heads): its query_pre_attn_scalar)
        theta = config.pop("rope_theta")
        full = {"rope_type": "default", "rope_theta": theta}
        if field("rope.scaling.type") not in (None, "none") and field("rope.scaling.factor"):
            full.update(rope_type=field("rope.scaling.type"), factor=field("rope.scaling.factor"))
        config.update({
            "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
            "sliding_window": field("attention.sliding_window"),
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": field("rope.freq_base_swa", 10000.0)}},
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": field("final_logit_softcapping"),
            "attn_logit_softcapping": field("attn_logit_softcapping"),
        })
    config.update({
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "converted_from": path.name,
        "gguf_path": str(path.resolve()),  # transformers' GGUF loader reads it there (`hf_model`)
    })
    return config


def hf_names(reader, config: dict) -> dict[str, str]:
    """{GGUF tensor name: HF checkpoint key} for the tensors the engine reads: each key of transformers'
    model of the family (built on the meta device, no weights) through gguf's name map, as transformers'
    GGUF loader pairs them, but for the names llama.cpp's converter gives in code (`gguf_families.SPECIAL_NAMES`).
    A MoE layer's fused `mlp.experts.gate_up_proj` takes two tensors (gate, up)."""
    import gguf
    import transformers

    arch = _arch(reader)
    enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    name_map = gguf.get_tensor_name_map(enum, config["num_hidden_layers"])
    keep = {"converted_from", "gguf_path", "gguf_weight_types", "gguf_group_types", "architectures", "model_type"}
    hf_config = transformers.CONFIG_MAPPING[config["model_type"]](**{k: v for k, v in config.items()
                                                                     if k not in keep})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    names = {}
    for key in model.state_dict():
        parts = key.split(".")
        special = gguf_families.SPECIAL_NAMES.get(".".join(parts[3:])) if key.startswith("model.layers.") else None
        if special is not None:
            names[f"blk.{parts[2]}.{special}"] = key
            continue
        if key.endswith("mlp.experts.gate_up_proj"):
            # llama.cpp writes gate and up apart (qwen35moe's name map also names a fused stack, which its
            # converter writes only when told to: not read here)
            names[f"blk.{parts[2]}.ffn_gate_exps.weight"] = names[f"blk.{parts[2]}.ffn_up_exps.weight"] = key
            continue
        base, dot, suffix = key.rpartition(".")
        if suffix not in ("weight", "bias"):  # 3-D expert tensors are parameters without a suffix
            base, suffix = key, "weight"
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = key
    return names


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp stores q/k rows interleaved for its rotary layout; undo that to get HF's halves layout.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rows_as_hf(w: torch.Tensor, hf: str, heads: int, kv_heads: int, arch: str = "llama", gguf_name: str = "",
                config: dict | None = None, block_bytes: int = 0) -> torch.Tensor:
    """A GGUF tensor in HF's layout: q and k rows are interleaved for llama.cpp's rotary layout in the
    architectures it permutes (`_PERMUTED`); Gemma 4's and Qwen3.5's own transformations are undone by
    `gguf_families.to_hf`. Works on float rows and on rows of blocks (`block_bytes`: their block size) alike
    (a block never spans two rows)."""
    if arch in gguf_families.QWEN35 or arch == "gemma4":
        return gguf_families.to_hf(arch, gguf_name, w, config or {}, block_bytes)
    if arch not in _PERMUTED:
        return w
    if hf.endswith("self_attn.q_proj.weight"):
        return _unpermute(w, heads)
    if hf.endswith("self_attn.k_proj.weight"):
        return _unpermute(w, kv_heads)
    return w


# K-quants the block kernels cannot read, converted once into the nearest format they can: Q4_K's 4-bit
# scale-and-minimum sub-blocks of 32 into Q4_1's (the same shape of code, fp16 scale and minimum per 32);
# 5 and 6 bits into Q8_0 (Q4_1 would drop 1-2 bits per weight).
CONVERTED = {"Q4_K": "q4_1", "Q5_K": "q8_0", "Q6_K": "q8_0"}


# A MoE layer's expert stacks [E, N, K] (llama.cpp's names): kept in blocks one expert at a time, gate and up
# (written apart for Qwen, fused for Gemma 4) concatenated into HF's gate_up_proj where both share a format.
EXPERT_STACKS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_up_exps.weight", "ffn_down_exps.weight")
_GATE_UP_APART = {"ffn_gate_exps.weight": "ffn_up_exps.weight", "ffn_up_exps.weight": "ffn_gate_exps.weight"}


def _block_format(t, hf: str | None, arch: str = "", config: dict | None = None, reader=None) -> str | None:
    """The block format a matrix is kept in (its own, or `CONVERTED`'s), None for tensors kept in float: 1-D
    ones, other types, and those `gguf_families.keeps_blocks` leaves out. 3-D expert stacks (`EXPERT_STACKS`)
    are kept alike, each expert's matrix as its blocks; a gate stack and an up stack written apart only where
    both become one format (`reader`: the file, to look up the other; without it they are kept in float)."""
    if hf is None or not gguf_families.keeps_blocks(arch, t.name, config or {}):
        return None
    if len(t.shape) == 3 and t.name.endswith(EXPERT_STACKS):
        suffix = next(s for s in _GATE_UP_APART if t.name.endswith(s)) if t.name.endswith(
            tuple(_GATE_UP_APART)) else None
        if suffix is not None:
            other = t.name.removesuffix(suffix) + _GATE_UP_APART[suffix]
            partner = next((u for u in reader.tensors if u.name == other), None) if reader is not None else None
            if partner is None or _type_format(partner) != _type_format(t):
                return None
    elif len(t.shape) != 2:
        return None
    return _type_format(t)


def _type_format(t) -> str | None:
    """The block format a tensor's type is kept in: its own, or `CONVERTED`'s (None: not a block format)."""
    from .kernels import pack

    name = t.tensor_type.name
    return name.lower() if name.lower() in pack.FORMATS else CONVERTED.get(name)


def converted_types(reader, names: dict[str, str], config: dict | None = None) -> dict[str, str]:
    """{GGUF type: the block format `_save_blocks` converts it to} for the file's converted matrices."""
    arch = _arch(reader)
    return {t.tensor_type.name: CONVERTED[t.tensor_type.name] for t in reader.tensors
            if t.tensor_type.name in CONVERTED and _block_format(t, names.get(t.name), arch, config, reader)}


def original_matrices(path: Path):
    """For a converted directory (`path`) of a file with K-quants: a function giving a converted matrix's
    exact float32 values (HF name -> [N, K], rows in HF's order), dequantized from the GGUF file itself, so
    that what does not run in its converted blocks (`--quantize none`, another format, transformers'
    model) has the file's values rather than the conversion's rounding of them. It gives None for other
    names, and always where the file is no longer at its recorded path (the blocks then stand in)."""
    config = json.loads((path / "config.json").read_text())
    gguf_file = Path(config.get("gguf_path") or "")
    if not config.get("gguf_converted") or not gguf_file.is_file():
        return lambda name: None
    import gguf

    reader = open_gguf(gguf_file)
    names = hf_names(reader, config)
    tensors: dict[str, list] = {}  # (an expert gate/up stack: two tensors, gate first)
    for t in reader.tensors:
        if t.name in names and t.tensor_type.name in CONVERTED:
            tensors.setdefault(names[t.name], []).append(t)
    for parts in tensors.values():
        parts.sort(key=lambda t: "ffn_up_exps" in t.name)
    arch, heads = _arch(reader), config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads

    def get(name: str) -> torch.Tensor | None:
        parts = tensors.get(name)
        if parts is None or (len(parts) < 2 and parts[0].name.endswith(tuple(_GATE_UP_APART))):
            return None  # (gate and up apart, only one of them a K-quant: the blocks stand in)
        ws = [_rows_as_hf(torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float(),
                          name, heads, kv_heads, arch, t.name, config) for t in parts]
        return torch.cat(ws, dim=-2).contiguous()  # (gate and up experts: rows [E, 2I, H])

    return get


def gguf_group_types(reader, names: dict[str, str], config: dict | None = None) -> dict[str, str]:
    """{group of matrices: the GGUF type(s) the file stores it in ("Q4_1", or "Q4_K/Q6_K" when mixed)};
    a tied LM head is stored as the token embedding. `names`: `hf_names` of the file."""
    arch = _arch(reader)
    found: dict[str, set[str]] = {}
    for t in reader.tensors:
        hf = names.get(t.name)
        group = loading._group(hf) if hf else None
        if group is not None:
            kind = t.tensor_type.name
            if kind in CONVERTED and _block_format(t, hf, arch, config, reader):
                kind = f"{kind} -> {CONVERTED[kind]} (converted)"
            found.setdefault(group, set()).add(kind)
    if "LM head" not in found and "token embedding" in found:
        found["LM head"] = found["token embedding"]
    return {label: "/".join(sorted(found[label])) for label, _ in loading._GROUPS if label in found}


def gguf_weight_types(reader) -> dict[str, int]:
    """How many of a GGUF file's layer matrices each storage type holds, e.g. {"Q4_1": 210}, and under
    "head" the LM head's type (the output matrix, else the tied token embedding)."""
    counts: dict[str, int] = {}
    head = None
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            name = t.tensor_type.name
            counts[name] = counts.get(name, 0) + 1
        elif t.name == "output.weight" or (t.name == "token_embd.weight" and head is None):
            head = t.tensor_type.name
    return {**counts, "head": head}


def _float_state(reader, config: dict, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """In float32 what is not kept in the block formats (`_block_format`), under HF names, in HF's layout."""
    import gguf
    from tqdm import tqdm

    arch = _arch(reader)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    state, experts = {}, {}
    for t in tqdm(reader.tensors, desc="reading", unit="tensor", file=sys.stderr):
        hf = names.get(t.name)
        if hf is None or _block_format(t, hf, arch, config, reader):
            continue
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        if arch in _NORM_PLUS_ONE and t.name.endswith("norm.weight"):
            w = w - 1
        if t.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):  # [E, I, H] gate, up -> [E, 2I, H]
            experts.setdefault(hf, {})["up" if "ffn_up_exps" in t.name else "gate"] = w
            continue
        state[hf] = _rows_as_hf(w, hf, heads, kv_heads, arch, t.name, config).contiguous()
    for hf, parts in experts.items():
        state[hf] = torch.cat([parts["gate"], parts["up"]], dim=1).contiguous()
    return state


def _save_blocks(reader, config: dict, out: Path, names: dict[str, str]) -> None:
    """The file's matrices in the block kernels' formats, as uint8 blocks [N, K/32 * bytes] under their HF
    names, rows in HF's order (expert stacks [E, N, K/32 * bytes]); the format of each in the metadata. Those
    the file stores in one are its bytes as they are; K-quants (`CONVERTED`) are dequantized and quantized
    into theirs by gguf's quantizer (llama.cpp's reference), once, one matrix (one expert) at a time."""
    arch = _arch(reader)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    blocks, formats, apart = {}, {}, {}
    for t in reader.tensors:
        hf = names.get(t.name)
        fmt = _block_format(t, hf, arch, config, reader)
        if fmt is None:
            continue
        if len(t.shape) == 3:  # an expert stack: each expert's matrix as blocks [E, N, K/32 * bytes]
            raw = torch.stack([_matrix_blocks(t, t.data[e], fmt, hf, heads, kv_heads, arch, config)
                               for e in range(t.data.shape[0])])
            if t.name.endswith(tuple(_GATE_UP_APART)):  # gate and up [E, I, ...] -> HF's gate_up [E, 2I, ...]
                apart.setdefault(hf, {})["up" if "ffn_up_exps" in t.name else "gate"] = raw
                if len(apart[hf]) < 2:
                    continue
                parts = apart.pop(hf)
                raw = torch.cat([parts["gate"], parts["up"]], dim=1)
            blocks[hf], formats[hf] = raw.contiguous(), fmt
            continue
        blocks[hf], formats[hf] = _matrix_blocks(t, t.data, fmt, hf, heads, kv_heads, arch, config).contiguous(), fmt
    save_file(blocks, str(out), metadata={"formats": json.dumps(formats)})


def _matrix_blocks(t, data, fmt: str, hf: str, heads: int, kv_heads: int, arch: str, config: dict) -> torch.Tensor:
    """One matrix `data` (GGUF rows of tensor `t`'s type) as blocks of `fmt` [N, K/32 * bytes] in HF's layout:
    its bytes, or (a K-quant) dequantized and quantized into `fmt`, this matrix only."""
    import gguf
    import numpy as np

    from .kernels import pack

    if t.tensor_type.name in CONVERTED:
        w = torch.from_numpy(gguf.quants.dequantize(data, t.tensor_type).copy()).float()
        return pack.quantize(_rows_as_hf(w, hf, heads, kv_heads, arch, t.name, config), fmt)
    raw = torch.from_numpy(np.array(data, dtype=np.uint8))  # out of the memmap
    return _rows_as_hf(raw, hf, heads, kv_heads, arch, t.name, config, pack.block_bytes(fmt))


def convert_gguf(path: Path) -> Path:
    """Convert a GGUF file of a supported architecture (`ARCHITECTURES`) into an HF-style directory in the
    cache (once; later calls return it, upgrading a cache an earlier version wrote)."""
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:10]
    out = loading.cache_home() / "models" / f"{path.stem}-{key}"
    blocks_file = loading.BLOCKS_FILE
    if (out / "config.json").is_file():
        config = json.loads((out / "config.json").read_text())
        if config.get("gguf_path") != str(path.resolve()):
            config["gguf_path"] = str(path.resolve())
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if ("head" not in config.get("gguf_weight_types", {}) or "gguf_group_types" not in config
                or not (out / blocks_file).is_file()):
            # converted by an earlier version: add what --quantize auto, stored_blocks and weight_report read
            reader = open_gguf(path)
            names = hf_names(reader, config)
            config["gguf_weight_types"] = gguf_weight_types(reader)
            config["gguf_group_types"] = gguf_group_types(reader, names, config)
            if converted_types(reader, names, config):
                config["gguf_converted"] = converted_types(reader, names, config)
            _save_blocks(reader, config, out / blocks_file, names)
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _drop_float_copies(out)
        return out

    try:
        reader = open_gguf(path)
    except Exception as e:  # not a GGUF file, truncated, a newer version of the format
        raise ModelError(f"{path.name}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    config = _config(reader, path)  # (raises for an unsupported architecture before anything is written)
    _check_types(reader, path)
    print(f"dflash: converting {path.name} to {out} (once; later runs reuse it)", file=sys.stderr)
    names = hf_names(reader, config)
    config["gguf_weight_types"] = gguf_weight_types(reader)
    config["gguf_group_types"] = gguf_group_types(reader, names, config)
    if converted_types(reader, names, config):  # (only then: a file of block formats keeps its config as before)
        config["gguf_converted"] = converted_types(reader, names, config)
    state = _float_state(reader, config, names)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _save_blocks(reader, config, tmp / blocks_file, names)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": config["eos_token_id"], "bos_token_id": config["bos_token_id"]}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    _tokenizer(path, config["model_type"]).save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _tokenizer(path: Path, model_type: str):
    """transformers' tokenizer of the file. AutoTokenizer(gguf_file=) first builds the model's config with
    transformers' GGUF config reader, which knows no Qwen3.5 and fails on Gemma 4's per-layer arrays; for
    those the tokenizer class it would pick for the model type is built from the file directly, as
    AutoTokenizer then does."""
    import transformers

    if model_type not in ("gemma4_text", "qwen3_5_text", "qwen3_5_moe_text"):
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    cls = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    return cls.from_pretrained(str(path.parent), gguf_file=path.name)


def _drop_float_copies(out: Path) -> None:
    """An earlier version's cache also held the block-stored matrices in float32 (538 MB for the default
    model's 75 MB file): rewrite its model.safetensors without them, once."""
    from safetensors import safe_open

    floats, blocks = out / "model.safetensors", out / loading.BLOCKS_FILE
    if not floats.is_file() or not blocks.is_file():
        return
    with safe_open(str(blocks), framework="pt") as f:
        stored = set(f.keys())
    with safe_open(str(floats), framework="pt") as f:
        names = list(f.keys())
        if not stored & set(names):
            return
        keep = {n: f.get_tensor(n) for n in names if n not in stored}
    tmp = floats.with_suffix(f".{os.getpid()}.tmp")  # two processes upgrading at once write apart
    save_file(keep, str(tmp), metadata={"format": "pt"})
    tmp.replace(floats)
