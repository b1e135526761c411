"""A draft pass without the layer modules: `FlatDraft` runs a DFlash drafter's block through exactly the kernels of
its modules, in the same order, from plain tensors (models/flat.py; in Python or compiled by TorchScript), and
`NativeDraft` runs its block-format layers in one call of kernels/draft.cpp. Both give the modules' bits
(tests/test_fast_flat.py); `DFlashDrafter._flat_plan` picks the one that applies."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..models import flat

if TYPE_CHECKING:
    from .drafter import DFlashDrafter


class FlatDraft(nn.Module):
    """A draft pass of one block (batch 1, full-attention layers, stacked context k/v) through exactly the
    kernels of the drafter's modules, in the same order, from plain tensors (flat.py): the block's hidden
    states after the final norm, bit for bit what `DFlashDrafter.forward` returns, and the same cache."""

    def __init__(self, d: DFlashDrafter) -> None:
        super().__init__()
        a0, m0 = d.layers[0].self_attn, d.layers[0].mlp
        self.h, self.hkv, self.dh, self.scale = a0.n_heads, a0.n_kv, a0.head_dim, float(a0.scale)
        self.eps = float(d.norm.eps)
        self.kernel = bool(d.norm.kernel)  # kernels/norm.cpp for every norm (drafter_blocks sets them together)
        self.fc = flat.linear_spec(d.fc)
        self.hidden_norm, self.final_norm = flat.norm_weight(d.hidden_norm), flat.norm_weight(d.norm)
        # the context k/v matmul as DFlashDrafter.context_kv runs it
        self.ctx_kv = (flat.linear_spec(d.ctx_kv_blocks) if d.ctx_kv_blocks is not None
                       else (flat.LINEAR, d.ctx_kv_weight, torch.empty(0), d.ctx_kv_bias, d.skinny))
        self.fused_mlp = m0.gate_up_proj is not None
        norms, qk_norms, lins = [], [], []
        for layer in d.layers:
            a, mlp = layer.self_attn, layer.mlp
            if (mlp.gate_up_proj is not None) != self.fused_mlp:
                raise TypeError("no flat path for layers fused differently")
            norms += [flat.norm_weight(layer.input_layernorm), flat.norm_weight(layer.post_attention_layernorm)]
            qk_norms += [flat.norm_weight(a.q_norm), flat.norm_weight(a.k_norm)]
            mlp_in = [mlp.gate_up_proj] if self.fused_mlp else [mlp.gate_proj, mlp.up_proj]
            lins += [flat.linear_spec(m) for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, *mlp_in, mlp.down_proj)]
        if len({float(n.eps) for layer in d.layers for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                                              layer.self_attn.q_norm, layer.self_attn.k_norm)}
               | {self.eps, float(d.hidden_norm.eps)}) != 1:
            raise TypeError("no flat path for norms with different eps")
        self.norms, self.qk_norms, self.lins = norms, qk_norms, lins
        self.per_layer = len(lins) // len(d.layers)
        self.act = flat.ACTIVATIONS.index(d.config.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, q_cos: torch.Tensor, q_sin: torch.Tensor,
                c_cos: torch.Tensor, c_sin: torch.Tensor, start: int, keys: torch.Tensor,
                values: torch.Tensor, q_signed: torch.Tensor | None = None,
                c_signed: torch.Tensor | None = None) -> torch.Tensor:
        # x [T, H] the embedded block; ctx [Tc, F] new tap features at positions start..; cos/sin [T or Tc,
        # 1, D]; keys/values: the drafter's cache [L, 1, Hkv, S, D] (context, then the block as scratch);
        # q_signed / c_signed: flat.signed of the sines where the caller has them (Rotary.rows)
        t, tc, h, hkv, dh, eps, n = x.shape[0], ctx.shape[0], self.h, self.hkv, self.dh, self.eps, self.per_layer
        kn = self.kernel
        c = flat.norm(flat.linear(ctx, self.fc), self.hidden_norm, eps, kn)  # [Tc, H]
        kv = flat.linear(c, self.ctx_kv).chunk(2 * keys.shape[0], dim=-1)  # k, v per layer
        if q_signed is None:
            q_signed = flat.signed(q_sin)
        if c_signed is None:
            c_signed = flat.signed(c_sin)
        end = start + tc + t
        for i in range(keys.shape[0]):
            ls = self.lins[i * n : (i + 1) * n]
            k_norm = self.qk_norms[2 * i + 1]
            y = flat.norm(x, self.norms[2 * i], eps, kn)
            q = flat.rotate(flat.norm(flat.linear(y, ls[0]).view(t, h, dh), self.qk_norms[2 * i], eps, kn),
                            q_cos, q_sin, q_signed)  # [T, H, D]
            k_blk = flat.rotate(flat.norm(flat.linear(y, ls[1]).view(t, hkv, dh), k_norm, eps, kn),
                                q_cos, q_sin, q_signed)
            k_ctx = flat.rotate(flat.norm(kv[2 * i].view(tc, hkv, dh), k_norm, eps, kn), c_cos, c_sin, c_signed)
            layer_k, layer_v = keys[i], values[i]  # [1, Hkv, S, D]
            layer_k.narrow(2, start, tc).copy_(k_ctx.transpose(0, 1))
            layer_v.narrow(2, start, tc).copy_(kv[2 * i + 1].view(tc, hkv, dh).transpose(0, 1))
            layer_k.narrow(2, start + tc, t).copy_(k_blk.transpose(0, 1))
            layer_v.narrow(2, start + tc, t).copy_(flat.linear(y, ls[2]).view(t, hkv, dh).transpose(0, 1))
            if kn and x.dtype == torch.float32:  # kernels/attention.cpp, as DraftAttention runs it
                a = torch.ops.dflash.full_attention(q, layer_k[0], layer_v[0], end, self.scale, -1)  # [T, H * D]
            else:
                a = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), layer_k.narrow(2, 0, end),
                                                   layer_v.narrow(2, 0, end), scale=self.scale,
                                                   enable_gqa=hkv != h)[0].transpose(0, 1).reshape(t, h * dh)
            x = flat.add_linear(x, a, ls[3])
            y = flat.norm(x, self.norms[2 * i + 1], eps, kn)
            x = flat.add_mlp(x, y, ls[4:5] if self.fused_mlp else ls[4:6], ls[-1], self.act)
        return flat.norm(x, self.final_norm, eps, kn)


class NativeDraft:
    """FlatDraft's pass for block-format layers (fused gate/up, norms on kernels/norm.cpp, full rotary,
    float32) with its layers in one call of kernels/draft.cpp (`draft_stack`): the same operators in the
    same order (same bits, tests/test_fast_flat.py), without TorchScript's per-operator interpretation."""

    def __init__(self, d: FlatDraft) -> None:
        self.d = d
        n = d.per_layer
        self.norms = [w for i in range(len(d.lins) // n) for w in (d.norms[2 * i], d.norms[2 * i + 1],
                                                                   d.qk_norms[2 * i], d.qk_norms[2 * i + 1])]
        # q/k/v as one matmul in every layer where they all can be (same bits, two calls fewer per layer)
        fused = [self._fused_qkv(d.lins[i : i + 3]) for i in range(0, len(d.lins), n)]
        specs = d.lins if any(len(f) != 1 for f in fused) else [
            spec for i, f in zip(range(0, len(d.lins), n), fused) for spec in f + d.lins[i + 3 : i + n]]
        self.packed = [spec[1] for spec in specs]
        self.codes = [spec[4] for spec in specs]  # 8 * out_features + format
        self.biases = [spec[3] for spec in specs]

    @staticmethod
    def _fused_qkv(qkv: list) -> list:
        # [q, k, v] as one BLOCK spec, where all are in one format with no bias and whole column groups: the
        # packed layout is group after group (kernels/pack.py), so the stack is their buffers end to end; the
        # kernel computes each output column alike, so the bits are the three calls'. Else as given.
        from ..kernels import pack

        sizes = [spec[4] // 8 for spec in qkv]
        if (any(spec[3] is not None for spec in qkv) or len({spec[4] % 8 for spec in qkv}) != 1
                or any(size % pack.GROUP for size in sizes)):
            return qkv
        return [(flat.BLOCK, torch.cat([spec[1] for spec in qkv]), torch.empty(0), None,
                 8 * sum(sizes) + qkv[0][4] % 8)]

    @staticmethod
    def applies(d: FlatDraft) -> bool:
        from .. import kernels

        return (d.kernel and d.fused_mlp and d.per_layer == 6 and all(spec[0] == flat.BLOCK for spec in d.lins)
                and d.fc[0] == flat.BLOCK and kernels.ensure() == "compiled")

    def __call__(self, x: torch.Tensor, ctx: torch.Tensor, q_cos: torch.Tensor, q_sin: torch.Tensor,
                 c_cos: torch.Tensor, c_sin: torch.Tensor, start: int, keys: torch.Tensor,
                 values: torch.Tensor, q_signed: torch.Tensor | None = None,
                 c_signed: torch.Tensor | None = None) -> torch.Tensor:
        d = self.d
        if x.dtype != torch.float32 or q_cos.shape[-1] != d.dh:  # (partial rotary: FlatDraft's own path)
            return d(x, ctx, q_cos, q_sin, c_cos, c_sin, start, keys, values, q_signed, c_signed)
        c = flat.norm(flat.linear(ctx, d.fc), d.hidden_norm, d.eps, True)  # [Tc, H]
        kv = flat.linear(c, d.ctx_kv)  # [Tc, 2 L Hkv D]
        return torch.ops.dflash.draft_stack(x, kv, q_cos, flat.signed(q_sin) if q_signed is None else q_signed, c_cos,
                                            flat.signed(c_sin) if c_signed is None else c_signed, start, keys, values,
                                            self.norms, self.packed, self.codes, self.biases, d.final_norm, d.eps, d.h,
                                            d.hkv, d.dh, d.scale, d.act)


# For TorchScript (this file's annotations are strings; lists and Optionals need their types).
FlatDraft.__annotations__ = {"lins": list[flat.LinearSpec], "norms": list[torch.Tensor],
                             "qk_norms": list[torch.Tensor], "ctx_kv": flat.LinearSpec}
