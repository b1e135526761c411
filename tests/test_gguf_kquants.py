"""gguf_kquants.py's Q4_K / Q6_K encoders against the `gguf` package's own decoder: every value within the
rounding the block's decoded scales allow."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_torch.gguf_kquants import QK_K, encode_q4_k, encode_q6_k


def _weights(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[0, :32] = 0.0  # a constant sub-block
    w[1] = np.abs(w[1])  # a row without negatives: the minimum clamps to 0
    w[2, :QK_K] *= 40  # an outlier block
    return w


@pytest.mark.parametrize("rows,cols", [(4, 256), (7, 768)])
def test_q4_k_decodes_within_its_steps(rows, cols):
    import gguf
    from gguf.quants import Q4_K

    w = _weights(rows, cols, 0)
    blocks = encode_q4_k(w)
    assert blocks.shape == (rows, cols // QK_K * 144) and blocks.dtype == np.uint8
    back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(w.shape)
    b = blocks.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())  # [blocks, 8] each
    step = d * sc.astype(np.float32)  # [blocks, 8]: each sub-block's level spacing
    # Rounding to the nearest level: half a step. The levels' span falls short of the sub-block's range by
    # at most the rounding of its 6-bit scale (half of d, over 15 steps) and minimum (half of dmin), and
    # d / dmin themselves are fp16 (2^-11 relative of what they scale: 63 steps, 63 minimums).
    bound = 0.5 * step + 7.5 * d + 0.5 * dmin + (15 * 63 * d + 63 * dmin) * 2**-11 + 1e-7
    err = np.abs(back - w).reshape(-1, 8, 32).max(-1)
    assert (err <= bound).all()
    assert np.abs(back - w).max() < 0.1 * np.abs(w).max()  # and not scrambled: a layout error is of range size


@pytest.mark.parametrize("rows,cols", [(4, 256), (7, 768)])
def test_q6_k_decodes_within_its_steps(rows, cols):
    import gguf

    w = _weights(rows, cols, 1)
    blocks = encode_q6_k(w)
    assert blocks.shape == (rows, cols // QK_K * 210) and blocks.dtype == np.uint8
    back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K).reshape(w.shape)
    b = blocks.reshape(-1, 210)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # [blocks, 16]: 16 values each
    step = d * np.abs(sc)
    # half a step; the top level 31 * step falls short of the sub-block's largest magnitude by at most the
    # 8-bit scale's rounding (half of d, 31 times) and d's fp16 rounding (2^-11 of 127 steps, 31 times)
    bound = 0.5 * step + 15.5 * d + 31 * 127 * d * 2**-11 + 1e-7
    err = np.abs(back - w).reshape(-1, 16, 16).max(-1)
    assert (err <= bound).all()
    assert np.abs(back - w).max() < 0.05 * np.abs(w).max()
