"""Block weights moved into one huge-page mapping (models/hugepages.py): the same bytes, so the same tokens, and
nothing left holding the old copies."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from dflash_torch import loading
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.speculative import generate_tokens
from dflash_torch.models import hugepages
from dflash_torch.models.quantize import BlockLinear, exact_prefill, quantize_blocks

from .conftest import make_drafter


def _blocks(*models) -> list[BlockLinear]:
    return [m for model in models for m in model.modules() if isinstance(m, BlockLinear)]


@pytest.mark.parametrize("fmt", ("q4_0", "q8_0"))
@torch.inference_mode()
def test_moved_weights_give_the_same_tokens_and_free_the_old(tiny_models, tmp_path, fmt, monkeypatch):
    monkeypatch.setattr(hugepages, "available", lambda: True)  # the copy runs whatever this machine's setting
    path = tiny_models["llama"]
    target = quantize_blocks(loading.load_target(path, torch.device("cpu"), torch.float32), fmt)
    exact_prefill(target)
    drafter = quantize_blocks(load_drafter(make_drafter(path, tmp_path / "d", block_size=8)), fmt)
    prompt = [5, 17, 42, 5, 17, 9]
    want = list(generate_tokens(target, prompt, max_new_tokens=24))  # builds the flat plans on the old tensors
    spec = list(generate_tokens(target, prompt, max_new_tokens=24, drafter=drafter, block_size=4))
    layers = _blocks(target, drafter)
    values = {m: m.packed.clone() for m in layers}
    old = [weakref.ref(m.packed) for m in layers]
    moved = hugepages.move_blocks(target, drafter)
    if moved:  # (0: a kernel without transparent huge pages refused the madvise; nothing moved)
        ptrs = [m.packed.data_ptr() for m in layers]
        assert min(ptrs) % hugepages.HUGE_PAGE == 0 and max(ptrs) < min(ptrs) + moved  # one aligned mapping
        gc.collect()
        assert not any(r() is not None for r in old)  # no plan or layer holds the old tensors
    assert all(torch.equal(m.packed, values[m]) for m in layers)
    assert list(generate_tokens(target, prompt, max_new_tokens=24)) == want
    assert list(generate_tokens(target, prompt, max_new_tokens=24, drafter=drafter, block_size=4)) == spec


def test_shared_weights_stay_shared_and_nothing_moves_without_huge_pages(monkeypatch):
    a, b = BlockLinear(nn.Linear(64, 32), "q4_0"), BlockLinear(nn.Linear(64, 16), "q8_0")
    twin = BlockLinear(nn.Linear(64, 32), "q4_0")
    twin.packed = a.packed  # as a tied embedding and LM head, or a drafter reading the target's head
    layers = nn.ModuleList([a, b, twin])
    before = [m.packed for m in layers]
    monkeypatch.setattr(hugepages, "available", lambda: False)
    assert hugepages.move_blocks(layers) == 0
    assert all(m.packed is t for m, t in zip(layers, before))
    monkeypatch.setattr(hugepages, "available", lambda: True)
    if hugepages.move_blocks(layers, None):
        assert twin.packed is a.packed and a.packed is not before[0]
        assert b.packed.data_ptr() != a.packed.data_ptr()
    assert all(torch.equal(m.packed, t) for m, t in zip(layers, before))
