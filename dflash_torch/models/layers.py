"""Building blocks shared by the model files: RMSNorm, the gated MLP, masked attention."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
          "xavier_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def skeleton():
    """Build modules on the meta device without running their initializers: their weights are about to
    be replaced by a checkpoint's. (On meta tensors `nn.init.normal_` goes through torch._refs, whose
    first use imports torch._dynamo and sympy: 70 MB of resident memory for nothing.)"""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class RMSNorm(nn.Module):
    """Llama/Qwen RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = False  # set by quantize.quantize_blocks: kernels/norm.cpp, one pass per row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and x.dtype == torch.float32:
            return torch.ops.dflash.rms_norm(x, self.weight, self.eps, -1)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call instead of eight; computes exactly the plain path below (tests/test_core.py).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# Float32 matmuls of a few rows on a CPU: torch's x @ W^T (F.linear) runs MKL's kernel for that layout,
# which for 1-4 rows reads the weights up to 5x slower than computing (W @ x^T)^T, whose kernel streams
# the weight's rows; from 6 rows on, runs of `python tools/probes/skinny_probe.py` disagreed on which is faster.
# One row goes in twice: the single-column kernel is as slow as F.linear's. `set_skinny_rows(model, 0)`: F.linear
# everywhere, the reference; layers built later take this value.
SKINNY_ROWS = 4


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, skinny: int) -> torch.Tensor:
    """F.linear(x, w, b), as (w @ x^T)^T for float32 CPU inputs of at most `skinny` rows."""
    k = x.shape[-1]
    rows = x.numel() // k if k > 0 else 0
    if 0 < rows <= skinny and x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu":
        x2 = x.reshape(rows, k)
        if rows == 1:
            x2 = torch.cat([x2, x2])
        y = torch.mm(w, x2.t()).t()  # [rows (2 for one), N], transposed
        if rows == 1:
            y = y[:1]
        y = y.contiguous()
        if b is not None:
            y = y + b
        shape = list(x.shape[:-1])
        shape.append(w.shape[0])
        return y.view(shape)
    return F.linear(x, w, b)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint keys) through `linear`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.skinny = SKINNY_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.skinny)


def set_skinny_rows(model: nn.Module, rows: int) -> nn.Module:
    """Set the skinny-rows limit of every `Linear` of `model` (and a drafter's context k/v matmul); 0: the
    plain F.linear path everywhere, the reference the fast one is tested against."""
    for m in model.modules():
        if isinstance(m, Linear) or hasattr(m, "ctx_kv_weight"):
            m.skinny = rows
        if hasattr(m, "_plan"):  # flat plans (and a drafter's draft-vocabulary head) copy it when built
            m._plan = None
        if hasattr(m, "_head"):
            m._head = None
    return model


class MLP(nn.Module):
    """SwiGLU feed-forward: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = None  # [gate; up] as one layer, set by quantize.fuse_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu(x: torch.Tensor) -> torch.Tensor:
    # on a CPU, torch's exact (erf) gelu gives other bits for a strided input (the gate half of a fused
    # gate/up output, 2+ rows) than for a contiguous one (1 row, or a copy); every path takes a contiguous
    # input, whose results do not depend on how its rows or columns are split (the C++ stack's threads)
    return F.gelu(x.contiguous())


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh, "gelu": _gelu}


def attention_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool = True, window: int | None = None
) -> torch.Tensor:
    """Boolean visibility [Tq, Tk] (True = may attend) from absolute query and key positions."""
    q = q_pos[:, None]
    k = k_pos[None, :]
    visible = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q_pos.device)
    if causal:
        visible &= k <= q
    if window is not None:
        visible &= q - k < window
        if not causal:
            visible &= k - q < window
    return visible


def attend_each_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of queries at positions start.. start + Tq - 1, one query at a time over
    exactly the keys a decode step at that position sees (shapes as `attend`, no mask).

    Bit-identical to Tq decode steps, where one fused Tq-query call rounds differently (~1e-7). With
    quantized weights, whose kernels give each row the same result whatever the number of rows, this
    makes a verify pass reproduce decode steps exactly; that matters there because the activations are
    rounded to bfloat16, which turns 1e-7 differences into flipped near-tie tokens."""
    outs = [attend(q[:, :, i : i + 1], k[:, :, : start + i + 1], v[:, :, : start + i + 1], None, scale)
            for i in range(q.shape[2])]
    return torch.cat(outs, dim=1)  # [B, Tq, H * Dv]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, H, Tq, D], k/v [B, Hkv, Tk, D], mask [Tq, Tk] bool or None -> [B, Tq, H * Dv]."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    if softcap is None:
        # The fused kernel; at decode/verify shapes on one CPU thread it measured ~1.6x faster than
        # the plain path below (20 vs 35 us for 1 query, 93 vs 152 us for 16; see docs/performance.md).
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hkv != h)
        return out.transpose(1, 2).reshape(b, t, -1)
    # Soft-capped scores (Gemma 2 style) cannot go through SDPA: plain matmuls. The query heads that
    # share a kv head are stacked as extra rows, so keys/values are never copied per head.
    g = h // hkv
    qg = q.reshape(b, hkv, g * t, d)  # row j * Tq + i = query head kv * g + j, position i
    scores = (qg @ k.transpose(-1, -2)).float() * scale  # [B, Hkv, G * Tq, Tk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat(g, 1), float("-inf"))
    out = scores.softmax(-1).to(v.dtype) @ v  # [B, Hkv, G * Tq, Dv]
    return out.reshape(b, h, t, -1).transpose(1, 2).reshape(b, t, -1)
