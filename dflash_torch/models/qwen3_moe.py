"""Qwen3 mixture-of-experts targets (transformers `qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B,
Qwen3-Coder-30B-A3B).

Qwen3's attention layers (`llama.py`, with q/k RMSNorm) and a sparse MLP (`moe.QwenMoeBlock`: a softmax
router over `num_experts`, the top `num_experts_per_tok` renormalised when `norm_topk_prob`, no shared
expert) on the layers `decoder_sparse_step` and `mlp_only_layers` make sparse (every layer in the released
models); the others keep a dense MLP of `intermediate_size`. Checkpoint keys: `mlp.gate`,
`mlp.experts.{e}.{gate,up,down}_proj` (stacked into 3-D tensors on load).

Decode steps run through the layer modules: the flat decode step (`llama.FlatLayers`) knows dense MLPs
only. CUDA graphs are refused (expert routing picks tensors by value, which a graph cannot replay).
"""

from __future__ import annotations

import dataclasses

import torch

from . import llama
from .llama import LlamaConfig
from .moe import QwenMoeBlock, stack_experts

MODEL_TYPES = ("qwen3_moe",)


class Model(llama.Model):
    """A Qwen3 MoE causal LM over a static KV cache."""

    graphable = False

    def __init__(self, config: LlamaConfig, moe: dict) -> None:
        super().__init__(config)
        self.flat = False  # the flat step has no expert layers
        sparse_step, dense = moe.get("decoder_sparse_step") or 1, set(moe.get("mlp_only_layers") or ())
        experts = moe.get("num_experts") or moe.get("num_local_experts") or 0  # the hub's name, transformers 5's
        for i, layer in enumerate(self.model.layers):
            if i not in dense and experts > 0 and (i + 1) % sparse_step == 0:
                layer.mlp = QwenMoeBlock(config.hidden_size, experts, moe["num_experts_per_tok"],
                                         moe["moe_intermediate_size"], norm_topk=bool(moe.get("norm_topk_prob")),
                                         act=config.hidden_act)


def from_config(config: dict) -> Model:
    # Qwen3's attention (q/k norm, no bias); a dense MLP where a layer has no experts
    dense = config | {"intermediate_size": config.get("intermediate_size") or config["moe_intermediate_size"]}
    c = dataclasses.replace(LlamaConfig.from_dict(dense), qk_norm=True, attention_bias=False)
    return Model(c, config)


def map_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys -> ours: the Llama family's, with each layer's experts stacked."""
    return stack_experts(llama.map_state(state))
