"""Shared helpers of the performance-switch tests (tests/test_fast_*.py): a greedy generation with its stats,
a tiny target with a switch applied, and the `pair` fixture (a tiny Qwen3 target and a drafter for it;
module-scoped: each test module that imports it gets its own)."""

from __future__ import annotations

import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.models.quantize import quantize_int4, quantize_int8

from .conftest import make_drafter


def _gen(target, prompt, n, drafter=None, controller=None, bs=None):
    stats = Stats()
    out = list(generate_tokens(target, prompt, max_new_tokens=n, drafter=drafter, stats=stats, controller=controller,
                               block_size=bs))
    return out, stats


@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):
    path = tiny_models["qwen3"]
    d = make_drafter(path, tmp_path_factory.mktemp("fd") / "d", block_size=8)
    return path, d


def _load(path, quant=None, dtype=torch.float32):
    target = loading.load_target(path, torch.device("cpu"), dtype)
    return {"int8": quantize_int8, "int4": quantize_int4}.get(quant, lambda m: m)(target)
