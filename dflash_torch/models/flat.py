"""The flat path's pieces: layers as plain tensors, the kernels they call, and TorchScript.

A decode step of a small model is mostly small operators around its matmuls, and calling them through
nn.Module layers costs more than some of them compute. The flat layers (`llama.FlatLayers`,
`drafter.FlatDraft`) hold plain tensors looked up once and call exactly the kernels the layer modules
call, in the same order, so their results are the modules' bit for bit; `script` then runs them from
TorchScript's graph interpreter instead of Python bytecode (docs/performance.md, "A flat decode step"
and "A scripted decode step"). The functions here are written so that TorchScript compiles them: no
globals, plain ints for kinds.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Linear, RMSNorm
from .layers import linear as dense

# A linear layer as the flat layers read it: (kind, weight, scales, bias, group size).
LinearSpec = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None, int]
LINEAR, INT8, INT8_DEQUANT, INT4, BLOCK = 0, 1, 2, 3, 4
# BLOCK's group slot holds 8 * out_features + the block format's code (TorchScript reads no attributes)


def linear_spec(m: nn.Module) -> tuple:
    """(kind, weight, scales, bias, group) computing exactly what calling m on a 2-D input computes."""
    from .quantize import BlockLinear, Int4Linear, Int8Linear, int8_fits

    none = torch.empty(0)
    if type(m) is nn.Linear:  # the group slot of a float layer: its skinny-rows limit (layers.linear)
        return (LINEAR, m.weight, none, m.bias, 0)
    if type(m) is Linear:
        return (LINEAR, m.weight, none, m.bias, m.skinny)
    if isinstance(m, BlockLinear):
        return (BLOCK, m.packed, none, m.bias, 8 * m.out_features + m.code)
    if isinstance(m, Int4Linear):
        return (INT4, m.weight_int4, m.scales_and_zeros, m.bias, m.group_size)
    if isinstance(m, Int8Linear):
        if m.weight_int8.device.type == "cpu" and int8_fits(m):  # Int8Linear.forward's kernel branch
            return (INT8, m.weight_int8, m.scale.to(torch.bfloat16), m.bias, 0)
        return (INT8_DEQUANT, m.weight_int8, m.scale, m.bias, 0)
    raise TypeError(f"no flat path for {type(m).__name__}")


def norm_weight(m: RMSNorm) -> torch.Tensor:
    if type(m) is not RMSNorm:
        raise TypeError(f"no flat path for {type(m).__name__}")
    return m.weight


def linear(x: torch.Tensor, spec: LinearSpec) -> torch.Tensor:
    kind, w, sz, b, group = spec
    if kind == 0:  # LINEAR (TorchScript reads no globals)
        return dense(x, w, b, group)
    if kind == 4:  # BLOCK (quantize.BlockLinear): float32 out
        y = torch.ops.dflash.block_mm(x, w, group % 8, group // 8, -1)
        if b is not None:
            y = y + b
        return y.to(x.dtype)
    if kind == 3:  # INT4: the kernel takes bfloat16 activations (quantize.Int4Linear)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w, group, sz).to(x.dtype)
    elif kind == 1:  # INT8
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), w, sz).to(x.dtype)
    else:
        y = F.linear(x, w.to(x.dtype)) * sz.to(x.dtype)
    if b is not None:
        y = y + b
    return y


def add_linear(r: torch.Tensor, x: torch.Tensor, spec: LinearSpec
                ) -> torch.Tensor:
    """r + _linear(x, spec), bit for bit, with a quantized kernel's bfloat16 output added as it is: adding
    promotes it to r's dtype exactly as the cast back would (one operator fewer)."""
    kind, w, sz, b, group = spec
    if b is None and kind == 4 and r.dtype == torch.float32:  # the add inside the kernel's output loop
        return torch.ops.dflash.block_mm_add(x, w, group % 8, group // 8, r, -1)
    if b is None and kind == 3:
        return r + torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w, group, sz)
    if b is None and kind == 1:
        return r + torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), w, sz)
    return r + linear(x, spec)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and w.dtype == torch.float32:  # RMSNorm.forward's fast path, else its reference
        return F.rms_norm(x, [w.shape[0]], w, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dtype)


def norm(x: torch.Tensor, w: torch.Tensor, eps: float, kernel: bool) -> torch.Tensor:
    """RMSNorm as layers.RMSNorm computes it with `kernel` set (kernels/norm.cpp) or not."""
    if kernel and x.dtype == torch.float32:
        return torch.ops.dflash.rms_norm(x, w, eps, -1)
    return rms_norm(x, w, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # rope.apply_rotary for x [T, N, D], cos/sin [T, 1, Dr] (Dr < D: partial rotary). In full, rotate_half(x)
    # * sin = [-x2, x1] * sin = roll(x) * [-sin1, sin2] (a product's sign is exact): 4 operators, not 6.
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + x.roll(rd // 2, -1) * signed_sin
    rot = x[..., :rd]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat([rot * cos + torch.cat([-x2, x1], dim=-1) * sin, x[..., rd:]], dim=-1)


def add_mlp(r: torch.Tensor, y: torch.Tensor, ins: list[LinearSpec], down: LinearSpec, act: int) -> torch.Tensor:
    """r + down(act(gate(y)) * up(y)) as layers.MLP computes it; ins: [gate_up] fused, or [gate, up].
    act: 0 silu, 1 gelu (tanh), 2 gelu."""
    if len(ins) == 1:
        gu = linear(y, ins[0]).chunk(2, dim=-1)
        gate, up = gu[0], gu[1]
    else:
        gate, up = linear(y, ins[0]), linear(y, ins[1])
    if act == 0:
        gate = F.silu(gate)
    elif act == 1:
        gate = F.gelu(gate, approximate="tanh")
    else:
        gate = F.gelu(gate.contiguous())  # contiguous, as layers._gelu says why
    return add_linear(r, gate * up, down)


ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")  # add_mlp's act codes


def signed(sin: torch.Tensor) -> torch.Tensor:
    """[-sin1, sin2] for `rotate` (sin [T, 1, Dr])."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def script(layers: nn.Module) -> nn.Module:
    """`layers` compiled by TorchScript: the same operators run from its graph interpreter instead of
    Python bytecode. TorchScript fuses nothing on CPU, so the bits are the same (tests/test_fast_flat.py);
    the time is not (docs/performance.md, "A scripted decode step"). `layers` itself where TorchScript
    cannot compile it."""
    from .. import kernels

    kernels.ensure()  # the graph names torch.ops.dflash.* (the block kernels' branches): they must exist
    # The graph executor's optimizing passes (profiling, specialization, unrolling) buy no time here:
    # the graphs are a few hundred calls of our kernels and aten ops, run as written (same bits, and the
    # same speed measured in alternation: tools/probes/graph_optimize_probe.py), while their specialized
    # copies kept ~19 MB resident for the target's and the drafter's plans (memory_savings_probe.py). Read
    # when a graph first runs; this process has no other graphs.
    torch._C._set_graph_executor_optimize(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script is deprecated in favour of torch.compile
            return torch.jit.script(layers)
    except Exception as e:  # no TorchScript in this torch, or no source to compile
        warnings.warn(f"TorchScript unavailable ({type(e).__name__}): decode steps run in Python", stacklevel=2)
        return layers
