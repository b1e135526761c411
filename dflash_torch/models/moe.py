"""Mixture-of-experts MLPs: the expert weights as 3-D tensors (as transformers holds them), and the Qwen
MoE block (Qwen3-MoE, Qwen3.5/3.6-MoE): a softmax router picks k experts per token, and Qwen3.5's adds a
shared expert scaled by a sigmoid gate.

Checkpoints on the hub store each expert as its own gate/up/down projections; `stack_experts` turns those
keys into the 3-D tensors."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ACTIVATIONS, MLP, Linear


class Experts(nn.Module):
    """Expert MLPs stored as 3-D tensors: gate_up_proj [E, 2I, H], down_proj [E, H, I]; or either stack in GGUF
    blocks (`quantize.BlockStack`: one packed matrix per expert, on the block kernels), as a GGUF file's
    block-stored experts load (`loading.load_target`) and `quantize.quantize_blocks` quantizes float ones.
    Each token's output is computed alike whatever the other tokens routed with it (the block kernels'
    rows are independent, and a token's experts are summed in ascending order), so verify passes reproduce
    decode steps bit for bit on blocks."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x [N, H]; each token goes through its k experts (index [N, k]), outputs summed with the router
        weights [N, k]."""
        out = torch.zeros_like(x)
        for e in index.unique().tolist():
            token, slot = torch.where(index == e)
            gate, up = _mm(x[token], self.gate_up_proj, e).chunk(2, dim=-1)
            y = _mm(self.act(gate) * up, self.down_proj, e) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _mm(x: torch.Tensor, stack, e: int) -> torch.Tensor:
    """x [M, K] @ expert e's matrix^T, of a float stack [E, N, K] or of blocks (a module: `quantize.BlockStack`)."""
    return stack(x, e) if isinstance(stack, nn.Module) else F.linear(x, stack[e])


class QwenMoeBlock(nn.Module):
    """Router `gate` (softmax over experts in float32, top k, renormalised to sum 1 when `norm_topk`),
    the experts, and optionally a shared expert whose output is scaled by sigmoid(shared_expert_gate)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int = 0,
                 norm_topk: bool = True, act: str = "silu") -> None:
        super().__init__()
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate, act)
        self.top_k, self.norm_topk = top_k, norm_topk
        self.shared = shared_intermediate > 0
        if self.shared:
            self.shared_expert = MLP(hidden, shared_intermediate, act=act)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        logits = self.gate(flat)  # [N, E]
        weights, index = logits.float().softmax(-1).topk(self.top_k, dim=-1)  # [N, k]
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = self.experts(flat, weights.to(logits.dtype), index)
        if self.shared:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(x.shape)


_EXPERT_KEY = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint keys (`...experts.{e}.gate_proj.weight`, up_proj, down_proj) -> the 3-D
    `...experts.gate_up_proj` [E, 2I, H] and `...experts.down_proj` [E, H, I]; other keys pass through.
    The per-expert tensors are dropped from `state` as each layer is stacked (peak memory: one layer)."""
    groups: dict[str, dict[int, dict[str, str]]] = {}
    for key in state:
        m = _EXPERT_KEY.match(key)
        if m:
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = key
    out = {k: v for k, v in state.items() if not _EXPERT_KEY.match(k)}
    for prefix, experts in groups.items():
        if sorted(experts) != list(range(len(experts))) or any(len(p) != 3 for p in experts.values()):
            raise ValueError(f"{prefix}: the checkpoint's experts are incomplete")
        gate_up, down = [], []
        for e in range(len(experts)):
            keys = experts[e]
            gate_up.append(torch.cat([state.pop(keys["gate_proj"]), state.pop(keys["up_proj"])], dim=0))
            down.append(state.pop(keys["down_proj"]))
        out[prefix + ".gate_up_proj"] = torch.stack(gate_up)
        out[prefix + ".down_proj"] = torch.stack(down)
    return out
