"""Weight-only int8 quantization of a target's linear layers.

Per output channel symmetric int8 (scale = max |w| / 127). On CPU the matmul runs in
`aten._weight_int8pack_mm` (int8 weights, float/bf16 activations, no dequantized copy); elsewhere
the weights are dequantized on the fly. Reads a quarter of the float32 bytes per decode step, which
is what decode on a CPU is bound by. The embedding stays in full precision: the drafter reads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    """A frozen linear layer with int8 weights [N, K] and per-row scales [N]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [N]
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (for code that reads .weight: dtype/device, or the plain path)."""
        return self.weight_int8.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.device.type == "cpu" and x2.dtype in (torch.float32, torch.bfloat16):
            # The CPU kernel is fast with bfloat16 activations and several times slower with float32
            # (measured with `dflash profile`), so float32 inputs go through it in bfloat16.
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.weight_int8,
                                                   self.scale.to(torch.bfloat16)).to(x2.dtype)
        else:
            y = F.linear(x2, self.weight_int8.to(x2.dtype)) * self.scale.to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of `model` (the LM head included, untied from the embedding) in place."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model
