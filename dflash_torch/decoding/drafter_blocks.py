"""A drafter in block formats (q4_0 / q4_1 / q8_0), its blocks kept in the user cache.

Drafters are published in bfloat16 or float32. Quantizing one into blocks at every start reads all its
float weights into memory, runs the quantizer over them and drops them again: for the default drafter
that is the largest transient of a start (the drafter's load peaks 42 MB above where it starts, 13 MB
from cached blocks: tools/probes/memory_savings_probe.py) and a share of its time. The blocks depend
only on the weights and the format, so the first load writes them to the cache, and later loads build
the block layers from them without reading those float weights at all (they stay on the meta device
until the block layers replace them). The blocks are the ones
`quantize_blocks` makes, byte for byte (tests/test_drafter_blocks.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from ..models.layers import RMSNorm, skeleton
from ..models.quantize import BlockLinear, block_fits, fuse_projections, quantize_blocks
from .drafter import DFlashDrafter, DraftAttention, load_drafter

VERSION = 1  # of the cache's contents: bump when the blocks a format gets would change


def _cache_file(path: Path, fmt: str) -> Path:
    from ..loading import cache_home

    files = sorted(path.glob("*.safetensors"))
    stamp = [VERSION, str(path.resolve()), fmt] + [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    digest = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]
    return cache_home() / "drafters" / f"{path.name}-{fmt}-{digest}" / "blocks.safetensors"


def load_in_blocks(path: Path, fmt: str, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
    """The drafter at `path` with every linear layer the block kernels take in `fmt` (as
    `quantize_blocks(drafter, fmt)` makes it), the rest in `dtype`; from the cache when it holds them."""
    from ..loading import ModelError, iter_tensors

    file = _cache_file(Path(path), fmt)
    if file.is_file():
        try:
            stored, skip = {}, None
            for name, raw, metadata in iter_tensors(file):
                stored[name], skip = raw, json.loads(metadata["skip"])
            if skip is not None:
                return _from_blocks(path, fmt, stored, set(skip), device, dtype)
        except (OSError, ValueError, KeyError, ModelError):  # a damaged or foreign file: quantize again
            pass
    drafter = load_drafter(path, device=device, dtype=None)
    linears = {n: m for n, m in drafter.named_modules() if isinstance(m, nn.Linear)}
    skip = sorted(f"{n}.weight" for n, m in linears.items() if block_fits(m))
    cacheable = all(linears[n.removesuffix(".weight")].bias is None for n in skip)
    quantize_blocks(drafter, fmt)
    _norms_in_one_pass(drafter)
    if cacheable:
        _write(file, {n: m.raw() for n, m in drafter.named_modules() if isinstance(m, BlockLinear)}, skip)
    return drafter.to(dtype=dtype)


def _from_blocks(path: Path, fmt: str, stored: dict, skip: set, device, dtype) -> DFlashDrafter:
    drafter = load_drafter(path, device=device, dtype=None, skip=skip)
    with skeleton():  # the fused layers of float weights never read (meta): shapes only
        fuse_projections(drafter, fits=block_fits)
    modules = dict(drafter.named_modules())
    if set(stored) != {n for n, m in modules.items() if isinstance(m, nn.Linear) and block_fits(m)}:
        raise ValueError("the cached blocks do not match the drafter's layers")
    quantize_blocks(drafter, fmt, stored={modules[n]: (fmt, raw) for n, raw in stored.items()})
    _norms_in_one_pass(drafter)
    return drafter.to(dtype=dtype)


def _norms_in_one_pass(drafter: DFlashDrafter) -> None:
    # A draft pass of a few rows runs a dozen norms; PyTorch's float32 rms_norm is a chain of operators,
    # kernels/norm.cpp one pass (tools/probes/draft_norm_probe.py times the difference); its attention goes to
    # kernels/attention.cpp's tiles likewise. Every norm and attention, the modules' and the flat plan's alike,
    # so the paths keep the same bits. Drafts only propose: the output is the target's either way.
    for m in drafter.modules():
        if isinstance(m, (RMSNorm, DraftAttention)):
            m.kernel = True


def _write(file: Path, blocks: dict, skip: list) -> None:
    from safetensors.torch import save_file

    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        save_file({n: t.contiguous() for n, t in blocks.items()}, str(tmp), metadata={"skip": json.dumps(skip)})
        tmp.replace(file)
    except OSError:  # a read-only cache: quantized again next time
        pass
