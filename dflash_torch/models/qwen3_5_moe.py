"""Qwen3.5 / Qwen3.6 mixture-of-experts text targets (transformers `qwen3_5_moe_text`, and the language
model of the multimodal `qwen3_5_moe`: Qwen3.5-35B-A3B, Qwen3.6-35B-A3B).

The stack is the dense Qwen3.5 one (`qwen3_5.py`: Gated DeltaNet and gated attention layers, the same
`HybridCache` and its exact rollback) with every MLP a sparse mixture of experts (`moe.QwenMoeBlock`): a
softmax router picks `num_experts_per_tok` of `num_experts` experts per token, their weights
renormalised to sum 1, plus a shared expert scaled by sigmoid(shared_expert_gate). Checkpoint keys:
`mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj` (stacked into 3-D tensors on load),
`mlp.shared_expert.*`, `mlp.shared_expert_gate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import qwen3_5
from .moe import QwenMoeBlock, stack_experts
from .qwen3_5 import Qwen35Config

MODEL_TYPES = qwen3_5.MOE_TYPES


@dataclass
class Qwen35MoeConfig(Qwen35Config):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> Qwen35MoeConfig:
        text = d.get("text_config") or d
        # the dense stack's MLP size sizes the placeholders the experts replace
        base = vars(Qwen35Config.from_dict(d)) | {"intermediate_size": text["moe_intermediate_size"]}
        return cls(**base, num_experts=text.get("num_experts") or text["num_local_experts"],
                   num_experts_per_tok=text["num_experts_per_tok"],
                   moe_intermediate_size=text["moe_intermediate_size"],
                   shared_expert_intermediate_size=text.get("shared_expert_intermediate_size") or 0)


class Model(qwen3_5.Model):
    """A Qwen3.5 / Qwen3.6 MoE causal LM over a `qwen3_5.HybridCache`."""

    def __init__(self, config: Qwen35MoeConfig) -> None:
        super().__init__(config)
        c = config
        for layer in self.model.layers:  # built on the meta device by the loader: the dense MLPs cost nothing
            layer.mlp = QwenMoeBlock(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                                     c.shared_expert_intermediate_size, norm_topk=True, act=c.hidden_act)


def from_config(config: dict) -> Model:
    return Model(Qwen35MoeConfig.from_dict(config))


def map_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys -> ours: the dense model's mapping, and each layer's experts stacked."""
    return stack_experts(qwen3_5.map_state(state))
