"""Rotary position embeddings: inverse frequencies for the rope types the supported checkpoints use."""

from __future__ import annotations

import math

import torch


def rope_parameters(config: dict) -> dict:
    """The rope settings of an HF config, whether written as `rope_parameters` (transformers 5)
    or as `rope_theta` + `rope_scaling` (older files)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params


def inv_freq(params: dict, rotary_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] and the attention scaling factor for cos/sin."""
    base = float(params["rope_theta"])
    # on the CPU, whatever the default device: under a meta skeleton (layers.skeleton) these few values are
    # real already, and arithmetic on meta tensors would import torch._dynamo and sympy (70 MB resident)
    cpu = torch.device("cpu")
    kind = params.get("rope_type", "default")
    freqs = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=cpu) / rotary_dim))
    scale = 1.0
    if kind in ("default", None):
        pass
    elif kind == "linear":
        freqs = freqs / float(params["factor"])
    elif kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freqs = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        factor = float(params["factor"])
        old_ctx = float(params.get("original_max_position_embeddings") or max_position_embeddings)
        beta_fast, beta_slow = float(params.get("beta_fast", 32)), float(params.get("beta_slow", 1))
        mscale = params.get("attention_factor")
        scale = float(mscale) if mscale is not None else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def correction_dim(rotations: float) -> float:
            return (rotary_dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64, device=cpu) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        freqs = (freqs / factor) * (1 - extrapolation) + freqs * extrapolation
    else:
        raise ValueError(f"unsupported rope_type {kind!r}")
    return freqs.float(), scale


class Rotary(torch.nn.Module):
    """cos/sin tables indexed by absolute position (computed once for the whole context)."""

    def __init__(self, params: dict, rotary_dim: int, max_positions: int) -> None:
        super().__init__()
        freqs, scale = inv_freq(params, rotary_dim, max_positions)
        self.rotary_dim = rotary_dim
        self.scale = scale
        self.register_buffer("inv_freq", freqs, persistent=False)

        # (dtype, device) -> (cos, sin) [N, D] for positions 0 .. N - 1 (`span`), then cos, sin and the signed
        # sine as [N, 1, D] (`rows`)
        self._tables: dict = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed in float32 from the positions each call; cheap next to the matmuls.
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat([angles, angles], dim=-1)  # [T, D]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def span(self, start: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(torch.arange(start, end), dtype)` as rows of a table kept from earlier calls: the same
        values (every step is elementwise, so a position's row does not depend on the others computed with
        it; tests/test_fast_flat.py), without the eight small operators a decode step or draft pass paid for them."""
        table = self._table(end, dtype)
        return table[0][start:end], table[1][start:end]

    def rows(self, start: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`span`'s rows as [T, 1, D] (one head axis, as the flat paths take them), and the signed sine
        [-sin1, sin2] that `flat.rotate` and the kernels take (`flat.signed` of the same rows: a negation, so the
        same bits). Three slices of kept tables instead of the eight small operators these took, which right after
        a pass's matmuls, with the caches cold, cost several times what they cost warm (docs/performance.md,
        "What a pass costs around its kernels")."""
        table = self._table(end, dtype)
        return table[2][start:end], table[3][start:end], table[4][start:end]

    def _table(self, end: int, dtype: torch.dtype) -> tuple:
        device = self.inv_freq.device
        table = self._tables.get((dtype, device))
        if table is None or table[0].shape[0] < end:
            n = max(end, 2 * table[0].shape[0] if table is not None else 256)  # grows by doubling
            cos, sin = self(torch.arange(n, device=device), dtype)
            half = sin.shape[-1] // 2
            signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # flat.signed, on the whole table
            table = self._tables[(dtype, device)] = (cos, sin, cos[:, None], sin[:, None], signed[:, None])
        return table


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [T, Dr] with Dr <= D (partial rotary leaves the tail untouched)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)
