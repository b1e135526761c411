"""Static, preallocated key/value cache.

Position is the index: the keys and values of the token at position p live in slot p. A forward
pass over T tokens writes slots [length, length + T) and advances `length`. Rolling back after a
rejected draft is setting `length` again: the stale slots past it are overwritten by the next pass
and never read, because attention only looks at slots below the current end.

A windowed drafter's cache (`DFlashDrafter.set_window`) keeps only its first positions (the sinks) and the
most recent ones: there, slots past the sinks hold position slot + `dropped`.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for `num_layers` attention layers, `max_len` positions each."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        v_shape = shape[:-1] + (v_head_dim or head_dim,)
        # On a CPU the slots are left unwritten: every pass reads only slots it or an earlier pass wrote, and
        # zeroing a conversation's cache (94 MB at 4,096 positions of a 135M model) cost 17 ms before its first
        # token. The one reader of whole buffers, the static-shape path (`write_at`), zeroes the rest once.
        # Elsewhere zeros: a CUDA graph captures its passes, and must not capture a first-time fill.
        self.unwritten = torch.device(device).type == "cpu"  # slots past `length` hold whatever memory held
        alloc = torch.empty if self.unwritten else torch.zeros
        self.k = alloc(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, D]
        self.v = alloc(v_shape, dtype=dtype, device=device)
        # One view per layer, made once: a write then slices one dim instead of indexing four.
        self.k_layers = [self.k[i] for i in range(num_layers)]  # L x [B, Hkv, S, D]
        self.v_layers = [self.v[i] for i in range(num_layers)]
        self.max_len = max_len
        self.length = 0
        self.dropped = 0  # positions left out between the sinks and the rest (a windowed drafter's cache)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] at positions [start, start + T); return keys/values [0, start + T)."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: position {end} > capacity {self.max_len}")
        keys, values = self.k_layers[layer], self.v_layers[layer]
        keys[:, :, start:end].copy_(k)
        values[:, :, start:end].copy_(v)
        return keys[:, :, :end], values[:, :, :end]

    def write_at(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] at `positions` [T] (a device tensor: no host sync, so a CUDA graph can
        hold it); return the whole buffers [B, Hkv, S, D] (the caller masks what is not written yet)."""
        if self.unwritten:  # masked slots are multiplied by 0: they must be finite, so zero them once
            self.k[:, :, :, self.length :].zero_()
            self.v[:, :, :, self.length :].zero_()
            self.unwritten = False
        keys, values = self.k_layers[layer], self.v_layers[layer]
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
        return keys, values

    def keep_rows(self, start: int, rows: list[int]) -> None:
        """After a tree pass from `start` (`Model.forward(parents=...)`, row i in slot start + i): put the
        keys/values of `rows` (a path, root first: rows[i] >= i) in slots start, start + 1, ..; then `crop`.
        Each was rotated for position start + its depth, which is where it lands, so the move is exact."""
        moves = [(start + i, start + r) for i, r in enumerate(rows) if r != i]
        if not moves:
            return
        dst = torch.tensor([m[0] for m in moves], device=self.k.device)
        src = torch.tensor([m[1] for m in moves], device=self.k.device)
        # (every source is read before any slot is written: the gather copies them out first)
        self.k.index_copy_(3, dst, self.k.index_select(3, src))
        self.v.index_copy_(3, dst, self.v.index_select(3, src))

    def crop(self, length: int) -> None:
        """Forget every slot at or after `length` (rollback; 0: start over)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cannot crop cache of capacity {self.max_len} to {length}")
        self.length = length
        if length == 0:
            self.dropped = 0
