"""GGUF layouts of Gemma 4 (`gemma4`) and the Qwen3.5 hybrid (`qwen35`, `qwen35moe`): their HF configs from
the file's metadata, and the inverse of what llama.cpp's converter (convert_hf_to_gguf.py, its Gemma4Model
and Qwen3_5TextModel / Qwen3_5MoeTextModel) does to their tensors.

Gemma 4: norms as they are (no 1 + w), a per-layer boolean sliding-window pattern, head sizes for global
(key_length) and sliding layers (key_length_swa), KV head counts per layer when global layers have their
own, a feed-forward length per layer for the double-wide MLP of KV-shared layers, and the partial rotary
of global layers as a `rope_freqs` tensor (1 for each rotated frequency pair, 1e30 for the others). MoE
files (26B-A4B): expert_count / expert_used_count / expert_feed_forward_length, the experts' fused gate/up
and down stacks as HF holds them, the router's projection as `ffn_gate_inp`, its per-dim scale as
`ffn_gate_inp.scale` and its per-expert scale as `ffn_down_exps.scale`.

Qwen3.5: every RMSNorm but the Gated DeltaNet output norm stored as 1 + w; A_log stored as -exp(A_log);
dt_bias as `ssm_dt.bias`; the conv1d weight [C, 1, K] squeezed to [C, K]; where there are fewer key than
value heads, the value heads of every linear-attention tensor reordered from grouped by key head
([k0v0, k0v1, .., k1v0, ..]) to tiled ([k0v0, k1v0, .., k0v1, ..]); the layer pattern as
full_attention_interval; the Gated DeltaNet sizes as ssm.* keys; multi-token-prediction layers (not used
here) appended after the model's own blocks (nextn_predict_layers).
"""

from __future__ import annotations

import torch

from .loading import ModelError

# HF key (after "model.layers.N.") -> GGUF name (after "blk.N."): names llama.cpp's converter gives that
# gguf's name map does not (it renames them in code), or gives without the ".weight" the map would add.
SPECIAL_NAMES = {
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    # Gemma 4 MoE (Gemma4Model.modify_tensors): the router's per-dim input scale beside its projection, and
    # its per-expert output scale beside the down stack (where llama.cpp's graph applies it)
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
}
QWEN35 = ("qwen35", "qwen35moe")
# Tensors whose value heads llama.cpp tiles (`_LinearAttentionVReorderBase`)
_V_HEAD_TENSORS = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt", "ssm_conv1d", "ssm_out")


def gemma4_config(field, reader, config: dict) -> dict:
    """The Gemma 4 settings of `config` (the generic ones, already read) from the file's metadata."""
    import gguf

    layers = config["num_hidden_layers"]
    pattern = field("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ModelError(f"gemma4 file without a sliding-window pattern of its {layers} layers")
    types = ["sliding_attention" if s else "full_attention" for s in pattern]
    head_dim, global_head_dim = field("attention.key_length_swa"), field("attention.key_length")
    names = {t.name for t in reader.tensors}
    shared = field("attention.shared_kv_layers", 0) or 0
    # llama.cpp writes no flag for it: global layers that take values from the key projection have no attn_v
    k_eq_v = any(k == "full_attention" and f"blk.{i}.attn_v.weight" not in names
                 for i, k in enumerate(types[: layers - shared]))
    kv = field("attention.head_count_kv")
    kv_swa = kv_full = kv
    if isinstance(kv, list):
        kv_swa = next(n for n, k in zip(kv, types) if k == "sliding_attention")
        kv_full = next(n for n, k in zip(kv, types) if k == "full_attention")
        if kv_full != kv_swa and not k_eq_v:  # transformers' config has the override only with k_eq_v
            raise ModelError("gemma4 file with global KV heads of their own but values from a v projection: "
                             "a layout transformers' Gemma 4 config cannot express")
    ff = field("feed_forward_length")
    double = False
    if isinstance(ff, list):
        double = ff != [ff[0]] * layers
        if double and ff != [ff[0] if i < layers - shared else 2 * ff[0] for i in range(layers)]:
            raise ModelError(f"gemma4 file with per-layer feed-forward lengths {ff}: only the double-wide MLP "
                             "of the KV-shared layers is a Gemma 4 layout")
        ff = ff[0]
    if field("rope.dimension_count_swa", head_dim) != head_dim:
        raise ModelError("gemma4 file with partial rotary on its sliding layers: not a Gemma 4 layout")
    # global layers: "proportional" rotary, its partial_rotary_factor as the count of rotated pairs
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    rotated = global_head_dim // 2
    if freqs is not None:
        rotated = int((gguf.quants.dequantize(freqs.data, freqs.tensor_type) < 1e29).sum())
    per_layer = next((t for t in reader.tensors if t.name == "per_layer_token_embd.weight"), None)
    config.update({
        "intermediate_size": ff,
        "use_double_wide_mlp": double,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_key_value_heads": kv_swa,
        "attention_k_eq_v": k_eq_v,
        "layer_types": types,
        "sliding_window": field("attention.sliding_window"),
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": field("embedding_length_per_layer_input", 0) or 0,
        "vocab_size_per_layer_input": int(per_layer.shape[-1]) if per_layer is not None else config["vocab_size"],
        "final_logit_softcapping": field("final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": field("rope.freq_base_swa", 10000.0)},
            "full_attention": {"rope_type": "proportional", "rope_theta": config.pop("rope_theta"),
                               "partial_rotary_factor": 2 * rotated / global_head_dim},
        },
    })
    if k_eq_v:
        config["num_global_key_value_heads"] = kv_full
    if field("expert_count"):
        config.update(_gemma4_moe(field, reader, layers))
    return config


def _gemma4_moe(field, reader, layers: int) -> dict:
    """The MoE settings of a Gemma 4 file (26B-A4B: a router and experts beside every layer's dense MLP).
    llama.cpp writes the experts as HF holds them, one fused gate/up stack (`ffn_gate_up_exps`), and the
    router's two learned scales under names of its own (`SPECIAL_NAMES`); a file with gate and up apart, or
    experts in some layers only, is not a layout transformers' Gemma 4 can express."""
    names = {t.name for t in reader.tensors}
    for i in range(layers):
        have = {k for k in ("ffn_gate_inp.weight", "ffn_gate_up_exps.weight", "ffn_down_exps.weight")
                if f"blk.{i}.{k}" in names}
        if len(have) < 3:
            apart = f"blk.{i}.ffn_gate_exps.weight" in names
            raise ModelError(f"gemma4 mixture-of-experts file whose layer {i} has "
                             + ("its experts' gate and up stacks apart (not the fused ffn_gate_up_exps llama.cpp "
                                "writes for Gemma 4)" if apart else "no router or experts")
                             + ": only every layer with a router and fused experts is a Gemma 4 layout")
    return {"enable_moe_block": True, "num_experts": field("expert_count"),
            "top_k_experts": field("expert_used_count"), "moe_intermediate_size": field("expert_feed_forward_length")}


def qwen35_config(field, config: dict, arch: str) -> dict:
    """The Qwen3.5 settings of `config` (the generic ones, already read) from the file's metadata."""
    layers = config["num_hidden_layers"] - (field("nextn_predict_layers", 0) or 0)  # MTP blocks come last
    interval = field("full_attention_interval", 4)
    value_heads = field("ssm.time_step_rank")
    head_dim = config["head_dim"]
    rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta"),
            "partial_rotary_factor": field("rope.dimension_count", head_dim // 4) / head_dim}
    if field("rope.dimension_sections") is not None:  # multimodal positions only: the same for text
        rope.update(mrope_section=list(field("rope.dimension_sections"))[:3], mrope_interleaved=True)
    config.update({
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        "full_attention_interval": interval,
        "linear_conv_kernel_dim": field("ssm.conv_kernel"),
        "linear_key_head_dim": field("ssm.state_size"),
        "linear_num_key_heads": field("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": field("ssm.inner_size") // value_heads,
        "rope_parameters": rope,
        "hidden_act": "silu",
    })
    if arch == "qwen35moe":
        config.pop("intermediate_size", None)
        config.update({"num_experts": field("expert_count"),
                       "num_experts_per_tok": field("expert_used_count"),
                       "moe_intermediate_size": field("expert_feed_forward_length"),
                       "shared_expert_intermediate_size": field("expert_shared_feed_forward_length", 0) or 0})
    return config


def _grouped(w: torch.Tensor, dim: int, k_heads: int, per_k: int, unit: int) -> torch.Tensor:
    # llama.cpp's tiled order [per_k, k_heads, unit] along `dim` back to HF's grouped [k_heads, per_k, unit]
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], per_k, k_heads, unit, *shape[dim + 1:])
    return w.transpose(dim, dim + 1).reshape(shape)


def _v_head_unit(config: dict) -> tuple[int, int, int, int] | None:
    k, v = config.get("linear_num_key_heads") or 0, config.get("linear_num_value_heads") or 0
    if not k or k == v:
        return None  # llama.cpp reorders only where key heads are fewer
    return k, v // k, config["linear_key_head_dim"], config["linear_value_head_dim"]


def keeps_blocks(arch: str, gguf_name: str, config: dict) -> bool:
    """Whether a block-stored matrix can stay in blocks in HF's layout: not a Gated DeltaNet output
    projection whose value heads are reordered in column units that are not whole blocks of 32."""
    heads = _v_head_unit(config) if arch in QWEN35 else None
    return not (heads and "ssm_out" in gguf_name and heads[3] % 32)


def to_hf(arch: str, gguf_name: str, w: torch.Tensor, config: dict, block_bytes: int = 0) -> torch.Tensor:
    """A tensor of `arch` as the file stores it -> HF's layout and values. `block_bytes`: for the raw blocks
    of a block-stored matrix (uint8 [N, K / 32 * block_bytes]), where only row and whole-block moves apply."""
    if arch not in QWEN35:
        return w
    if not block_bytes:
        if gguf_name.endswith("norm.weight") and not gguf_name.endswith("ssm_norm.weight"):
            w = w - 1
        elif gguf_name.endswith("ssm_conv1d.weight"):
            w = w.reshape(w.shape[0], 1, -1)  # [C, K] -> [C, 1, K]
        elif gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(1, -1)  # (some files store it 1-D)
    heads = _v_head_unit(config)
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if heads is not None and kind in _V_HEAD_TENSORS:
        k, per_k, dk, dv = heads
        if kind in ("attn_qkv", "ssm_conv1d"):  # only the value rows, after q and k
            qk = 2 * k * dk
            w = torch.cat([w[:qk], _grouped(w[qk:], 0, k, per_k, dv)])
        elif kind == "attn_gate":
            w = _grouped(w, 0, k, per_k, dv)
        elif kind == "ssm_out":  # columns: whole blocks of dv / 32 when stored in blocks
            w = _grouped(w, 1, k, per_k, dv // 32 * block_bytes if block_bytes else dv)
        else:  # one row (or value) per value head
            w = _grouped(w, 0, k, per_k, 1)
    if gguf_name.endswith("ssm_a"):
        w = torch.log(-w)  # stored as -exp(A_log)
    return w.contiguous()
