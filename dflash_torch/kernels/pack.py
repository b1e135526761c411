"""GGUF's Q4_0 / Q4_1 / Q8_0 blocks, and the column-group layout the block kernels read.

A GGUF tensor of one of these types is, per output row, K/32 blocks: an fp16 scale d (Q4_1: then an
fp16 minimum m) and the 32 values' quants (Q4: 16 bytes, value j in the low nibble of byte j and value
j + 16 in its high nibble, w = d * (q - 8) for Q4_0 and d * q + m for Q4_1; Q8_0: 32 signed bytes,
w = d * q). `pack` reorders those bytes, unchanged, into records of 8 output columns per block
(blocks.cpp explains the record; llama.cpp repacks its Q4_0 for its CPU kernels alike); `unpack` is
its inverse. Floats are quantized into blocks by the `gguf` package's own quantizer, which reproduces
llama.cpp's reference quantization.
"""

from __future__ import annotations

import numpy as np
import torch

FORMATS = ("q4_0", "q4_1", "q8_0")  # the kernel's format codes are their indices
QK, GROUP = 32, 8
HEADER = {"q4_0": 2, "q4_1": 4, "q8_0": 2}  # bytes before a block's quants: d (and m)
QUANTS = {"q4_0": 16, "q4_1": 16, "q8_0": 32}  # bytes of a block's quants


def block_bytes(fmt: str) -> int:
    return HEADER[fmt] + QUANTS[fmt]


def gguf_type(fmt: str):
    from gguf import GGMLQuantizationType as T

    return {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0}[fmt]


def quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """GGUF blocks [N, K/32 * block_bytes] (uint8) of a float weight [N, K] (K a multiple of 32)."""
    from gguf import quants

    n, k = w.shape
    if k % QK:
        raise ValueError(f"{fmt} needs in_features divisible by {QK}, got {k}")
    w = w.detach().cpu()
    raw = np.empty((n, k // QK * block_bytes(fmt)), dtype=np.uint8)  # [N, nb * bs]
    for r in range(0, n, 128):  # each block is its row's own: a few rows at a time bound the temporaries
        rows = w[r:r + 128].float().numpy()
        raw[r:r + 128] = quants.quantize(rows, gguf_type(fmt)).reshape(-1, raw.shape[1])
    return torch.from_numpy(raw)


def pack(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """GGUF blocks [N, nb * bs] -> the kernel's layout, flat uint8 [ceil(N/8) * nb * record]: per group of 8
    columns and block, the 8 scales, (Q4_1) the 8 minimums, then the 8 columns' quant bytes in chunks of
    4 (chunk j of column c at byte 32 j + 4 c), so that one 32-byte load holds 4 values of each column.
    Only bytes move: no value changes. Rows past N are zero blocks (scale 0), so padded columns compute
    0 and are never returned."""
    step = 64 * GROUP  # groups are packed apart: a few at a time bound the temporaries (a head: 30 MB each)
    if raw.shape[0] <= step:
        return _pack(raw, fmt)
    out = torch.empty(-(-raw.shape[0] // GROUP) * GROUP * raw.shape[1], dtype=torch.uint8)  # a record: 8 blocks
    for r in range(0, raw.shape[0], step):
        part = _pack(raw[r:r + step], fmt)
        out[r * raw.shape[1]:r * raw.shape[1] + part.numel()] = part
    return out


def _pack(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    bs, hb = block_bytes(fmt), HEADER[fmt]
    n = raw.shape[0]
    nb = raw.shape[1] // bs
    groups = -(-n // GROUP)
    if groups * GROUP != n:
        raw = torch.cat([raw, raw.new_zeros(groups * GROUP - n, raw.shape[1])])
    blk = raw.reshape(groups, GROUP, nb, bs).permute(0, 2, 1, 3)  # [G, nb, 8, bs]
    parts = [blk[..., 0:2].reshape(groups, nb, 2 * GROUP)]
    if fmt == "q4_1":
        parts.append(blk[..., 2:4].reshape(groups, nb, 2 * GROUP))
    q = QUANTS[fmt]  # the quants in chunks of 4 bytes, chunk-major: chunk j of column c at 32 j + 4 c
    chunks = blk[..., hb:].reshape(groups, nb, GROUP, q // 4, 4).transpose(2, 3)  # [G, nb, q / 4, 8, 4]
    parts.append(chunks.reshape(groups, nb, GROUP * q))
    return torch.cat(parts, dim=-1).reshape(-1).contiguous()


def unpack(packed: torch.Tensor, fmt: str, n: int, k: int) -> torch.Tensor:
    """The GGUF blocks [N, nb * bs] that `pack` reordered (exactly)."""
    nb, groups, q = k // QK, -(-n // GROUP), QUANTS[fmt]
    rec = packed.reshape(groups, nb, -1)
    d = rec[..., : 2 * GROUP].reshape(groups, nb, GROUP, 2)
    parts = [d]
    if fmt == "q4_1":
        parts.append(rec[..., 2 * GROUP : 4 * GROUP].reshape(groups, nb, GROUP, 2))
    chunks = rec[..., -GROUP * q :].reshape(groups, nb, q // 4, GROUP, 4).transpose(2, 3)  # [G, nb, 8, q / 4, 4]
    parts.append(chunks.reshape(groups, nb, GROUP, q))
    blk = torch.cat(parts, dim=-1).permute(0, 2, 1, 3)  # [G, 8, nb, bs]
    return blk.reshape(groups * GROUP, nb * block_bytes(fmt))[:n].contiguous()


def unpack_rows(packed: torch.Tensor, fmt: str, n: int, k: int, rows: torch.Tensor) -> torch.Tensor:
    """The GGUF blocks [R, nb * bs] of output rows `rows` [R] only: exactly `unpack(packed, fmt, n, k)[rows]`,
    without unpacking the others (a token embedding that shares a tied LM head's blocks)."""
    nb, q, r = k // QK, QUANTS[fmt], rows.numel()
    rec = packed.reshape(-(-n // GROUP), nb, -1)[rows // GROUP]  # [R, nb, record]: each row's group
    c, at = rows % GROUP, torch.arange(r)
    parts = [rec[..., : 2 * GROUP].reshape(r, nb, GROUP, 2)[at, :, c]]  # [R, nb, 2]: its scale
    if fmt == "q4_1":
        parts.append(rec[..., 2 * GROUP : 4 * GROUP].reshape(r, nb, GROUP, 2)[at, :, c])
    chunks = rec[..., -GROUP * q :].reshape(r, nb, q // 4, GROUP, 4)[at, :, :, c]  # [R, nb, q / 4, 4]
    parts.append(chunks.reshape(r, nb, q))
    return torch.cat(parts, dim=-1).reshape(r, nb * block_bytes(fmt))


def fields(raw: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF blocks [N, nb * bs] -> (quants [N, nb, 32] int32: Q4 nibbles 0..15 or Q8 values, scales d
    [N, nb] float32, minimums m [N, nb] float32 or None), each exactly as stored."""
    n = raw.shape[0]
    blk = raw.reshape(n, -1, block_bytes(fmt))
    d = blk[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = blk[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float() if fmt == "q4_1" else None
    qs = blk[..., HEADER[fmt]:]
    if fmt == "q8_0":
        q = qs.contiguous().view(torch.int8).int()
    else:
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).int()  # values 0..15, then 16..31
    return q, d, m


def dequantize(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 weight [N, K] that GGUF blocks stand for (each value d * q (- 8 d) (+ m), rounded once)."""
    q, d, m = fields(raw, fmt)
    if fmt == "q4_0":
        w = (q - 8).float() * d[..., None]
    elif fmt == "q4_1":
        w = q.float() * d[..., None] + m[..., None]
    else:
        w = q.float() * d[..., None]
    return w.reshape(raw.shape[0], -1)
