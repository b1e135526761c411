"""K-quant encoders (GGUF's Q4_K and Q6_K blocks of 256 values) in numpy: the plain scheme (each
sub-block's minimum / maximum, scales rounded to 6 or 8 bits), not llama.cpp's search for the best
scales. The `gguf` package decodes K-quants but cannot encode them; these make valid blocks of real
weights, for tests and for measuring what converting K-quant files costs (tools/kquant_nll.py). Checked
against gguf's own decoder in tests/test_gguf_kquants.py."""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K % 256 == 0) -> Q4_K blocks [N, K / 256 * 144] uint8."""
    n, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-blocks, values]
    lo = np.minimum(x.min(-1), 0.0)  # value = d * sc * q - dmin * m, q in 0..15, m >= 0
    scale, mins = (x.max(-1) - lo) / 15, -lo
    d, dmin = _f16(scale.max(-1) / 63), _f16(mins.max(-1) / 63)  # [blocks]
    fd, fdmin = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, fd, out=np.zeros_like(scale), where=fd > 0)), 0, 63).astype(np.uint8)
    mq = np.clip(np.rint(np.divide(mins, fdmin, out=np.zeros_like(mins), where=fdmin > 0)), 0, 63).astype(np.uint8)
    step, offset = (fd * sc)[..., None], (fdmin * mq)[..., None]
    q = np.clip(np.rint(np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0)), 0, 15).astype(np.uint8)
    scales = np.empty((x.shape[0], 12), np.uint8)  # 6-bit scales and minimums, packed as ggml packs them
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mq[:, :4] | ((mq[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mq[:, 4:] & 15) << 4)
    q = q.reshape(-1, 4, 2, 32)  # chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(n, k // QK_K * 144)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K % 256 == 0) -> Q6_K blocks [N, K / 256 * 210] uint8."""
    n, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)  # [blocks, sub-blocks of 16, values]
    amax = np.abs(x).max(-1)
    scale = amax / 31  # q in -32..31
    d = _f16(np.abs(scale).max(-1) / 127)  # [blocks]
    fd = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, fd, out=np.zeros_like(scale), where=fd > 0)), -128, 127).astype(np.int8)
    step = (fd * sc)[..., None]
    q = np.clip(np.rint(np.divide(x, step, out=np.zeros_like(x), where=step > 0)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # [blocks, 2, 64]
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [blocks, 2, 32]
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d[:, None].view(np.uint8)],
                            axis=1)
    return blocks.reshape(n, k // QK_K * 210)


ENCODERS = {"Q4_K": encode_q4_k, "Q6_K": encode_q6_k}
