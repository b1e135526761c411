"""Block weights in transparent huge pages (Linux): the same bytes, fewer page walks.

A decode step reads every packed weight once (92 MiB for the default model), stream after stream of 4 KB pages:
about 23,500 of them, far more than the TLB holds (expected to cost page walks). Copied once after loading into one
anonymous mapping that is 2 MB aligned and marked MADV_HUGEPAGE, they lie in about 46 pages. Where the kernel
gives no huge pages (transparent huge pages "never", another OS) nothing is copied. Either way the bytes, and so
every result, are the same (docs/performance.md, "Block weights in huge pages").
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
TRIM_BYTES = 16 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether an madvised anonymous mapping can get transparent huge pages here."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def move_blocks(*models: nn.Module | None) -> int:
    """Copy every block layer's packed weights (`quantize.BlockLinear.packed`, CPU) of `models` into one
    huge-page mapping and drop the plans that held the old tensors; a tensor that several layers or models
    share stays shared. Returns the bytes moved: 0 where huge pages are not available."""
    from ..loading import release_freed_memory
    from .quantize import BlockLinear, forget_plans

    models = tuple(m for m in models if m is not None)
    layers = [m for model in models for m in model.modules()
              if isinstance(m, BlockLinear) and m.packed.device.type == "cpu" and m.packed.is_contiguous()]
    if not layers or not available():
        return 0
    sharing: dict[tuple, list[BlockLinear]] = {}  # (address, bytes) -> the layers whose packed weights lie there
    for m in layers:
        sharing.setdefault(_key(m.packed), []).append(m)
    total = sum(_round(n) for _, n in sharing)
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first write: the pages are faulted in huge
    except OSError:  # a kernel built without them
        mapping.close()
        return 0
    for model in models:  # the plans hold the old tensors, each of which should go once it is copied
        forget_plans(model)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    offset = -whole.data_ptr() % HUGE_PAGE  # the first byte on a huge page's boundary
    pending = 0  # bytes freed since the heap last handed its free pages back
    for (_, n), group in sharing.items():  # one tensor at a time, each old one freed once copied
        old = group[0].packed
        new = whole[offset : offset + n].view(old.dtype).view(old.shape)
        new.copy_(old)
        for m in group:
            m.packed = new
        del old
        offset, pending = offset + _round(n), pending + n
        if pending >= TRIM_BYTES:  # so that the load's peak grows by about that much, not by all of it
            release_freed_memory()
            pending = 0
    return total


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.numel() * t.element_size()


def _round(n: int) -> int:  # each tensor on a 64-byte (cache line) boundary, as an allocator would put it
    return (n + 63) // 64 * 64
