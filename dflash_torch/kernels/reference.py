"""The block kernels' arithmetic in plain PyTorch: the same integers and the same float steps as
blocks.cpp, so its results equal the compiled kernels' bit for bit (tests/test_kernels.py). Slow; it is
the definition the fast paths are held to, and the fallback where no C++ compiler is at hand.
"""

from __future__ import annotations

import torch

from .pack import FORMATS, QK, fields, unpack


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (quants [M, K] int8, scales [M, K/32] float32, quant sums [M, K/32] int32):
    per block of 32, d = max|x| / 127 and q = round(x / d) (half to even), computed as x * (1 / d)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    amax = xb.abs().amax(-1)  # [M, nb]
    d = amax / torch.full_like(amax, 127.0)  # a tensor divisor: a true division, as the C++ one
    inv = torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(m, k), d, q.sum(-1).to(torch.int32)


def block_mm(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, isa: int = -1) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for W packed by `pack.pack` in format FORMATS[fmt] (`isa` is ignored)."""
    name = FORMATS[fmt]
    m, k = x.shape
    nb = k // QK
    wq, dw, mw = fields(unpack(packed, name, n, k), name)  # [N, nb, 32], [N, nb], [N, nb]
    q, dx, sx = quantize_act(x)
    # exact integer block sums, in int64 and bounded by 32 * 127 * 127
    isum = torch.einsum("mbi,nbi->mnb", q.reshape(m, nb, QK).long(), wq.long())  # [M, N, nb]
    if name == "q4_0":
        isum = isum - 8 * sx.long()[:, None, :]
    isum = isum.float()  # exact: |isum| < 2**24
    acc = torch.zeros(m, n)
    for b in range(nb):  # in block order, each step rounded as the C++ loop rounds it
        acc = acc + isum[:, :, b] * (dx[:, b, None] * dw[None, :, b])
        if name == "q4_1":
            acc = acc + mw[None, :, b] * (dx[:, b] * sx[:, b].float())[:, None]
    return acc


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                     isa: int = -1) -> torch.Tensor:
    """q [T, H, D], k/v [Hkv, S, D] -> [T, H * D]: query i attends to keys 0 .. start + i, each query on its
    own (so its result does not depend on T), through PyTorch's attention. Not the compiled kernel's bits
    (attention.cpp has its own exp), but the same for a query whatever the call it is in, which is what
    the fallback needs: decode steps and verify passes then agree with each other."""
    import torch.nn.functional as F

    t, h, d = q.shape
    hkv = k.shape[0]
    k, v = k[:, : start + t].float(), v[:, : start + t].float()  # a float16 cache widens exactly
    outs = [F.scaled_dot_product_attention(q[i].float()[None, :, None], k[None, :, : start + i + 1],
                                           v[None, :, : start + i + 1], scale=scale, enable_gqa=hkv != h)
            for i in range(t)]  # T x [1, H, 1, D]
    return torch.cat(outs, dim=2)[0].transpose(0, 1).reshape(t, h * d)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float,
                   isa: int = -1) -> torch.Tensor:
    """q [T, H, D], k/v [Hkv, S, D] -> [T, H * D]: every query attends to keys 0 .. n - 1, each query on its own
    (its result does not depend on T), through PyTorch's attention (not the compiled kernel's bits)."""
    import torch.nn.functional as F

    t, h, d = q.shape
    if not 1 <= n <= k.shape[1]:
        raise ValueError(f"full_attention needs 1 <= n <= the cache's {k.shape[1]} positions, got {n}")
    k, v = k[None, :, :n].float(), v[None, :, :n].float()  # a float16 cache widens exactly
    outs = [F.scaled_dot_product_attention(q[i].float()[None, :, None], k, v, scale=scale, enable_gqa=k.shape[1] != h)
            for i in range(t)]  # T x [1, H, 1, D]
    return torch.cat(outs, dim=2)[0].transpose(0, 1).reshape(t, h * d)


def top_probs(x: torch.Tensor, k: int, isa: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, V] -> (the softmax of each row at its k largest values [T, k], their indices [T, k]), in descending
    order (argmax.cpp's; ties there go to the lower index, here to topk's order)."""
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"top_probs needs 1 <= k <= V = {x.shape[-1]}, got k = {k}")
    top = x.topk(k, dim=-1)
    return (top.values - x.logsumexp(-1, keepdim=True)).exp(), top.indices


def selector_chances(probs: torch.Tensor, cand: torch.Tensor, proj: torch.Tensor, pred: torch.Tensor,
                     succ: torch.Tensor, anchor: int) -> torch.Tensor:
    """A DFlash2 selector's chances for a tree draft: probs [K, k] the drafter's softmax at its candidates cand [K, k]
    (token ids), proj [K, r] the selector's projection of the drafter's hidden states, pred / succ its codebooks
    [V, r] -> [K, k (prev), k]: for position j and candidate q of position j - 1 (the anchor for j = 0: row 0's k
    rows are all alike), softmax over m of log p[j, m] + sum over r of pred[prev, r] * succ[cand[j, m], r] *
    proj[j, r], times sum over m of p[j, m]. selector.cpp computes the same in plain loops."""
    s = succ[cand].float() * proj.float()[:, None]  # [K, k, r]
    prev = torch.cat([cand.new_full((1, cand.shape[1]), int(anchor)), cand[:-1]])  # [K, k]: each row's predecessor
    pairs = pred[prev].float() @ s.transpose(1, 2)  # [K, k (prev), k]
    score = probs.float().clamp_min(1e-30).log()  # [K, k]: the logits up to a per-position constant
    return (score[:, None, :] + pairs).softmax(-1) * probs.float().sum(-1)[:, None, None]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, isa: int = -1) -> torch.Tensor:
    """w * (x * (1 / sqrt(mean(x^2) + eps))) per row (norm.cpp's formula; its sums in another order)."""
    return w * (x * (1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)))


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   start: int, h: int, hkv: int, scale: float) -> torch.Tensor:
    """attention.cpp's rope_attention: rotate q/k of qkv [T, (H + 2 Hkv) * D] (x * cos + roll(x, D/2) *
    signed_sin), write k/v into the cache k/v [Hkv, S, D] at start.., attend (`causal_attention`)."""
    t, d = qkv.shape[0], k.shape[2]
    cos, signed_sin = cos.reshape(t, 1, d), signed_sin.reshape(t, 1, d)
    qk = qkv[:, : (h + hkv) * d].reshape(t, h + hkv, d)
    qk = qk * cos + qk.roll(d // 2, -1) * signed_sin
    k[:, start : start + t] = qk[:, h:].transpose(0, 1)
    v[:, start : start + t] = qkv[:, (h + hkv) * d :].reshape(t, hkv, d).transpose(0, 1)
    return causal_attention(qk[:, :h], k, v, start, scale)
