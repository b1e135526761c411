"""A drafter's blocks kept in the cache (drafter_blocks.py) and the stored calibration (adaptive.calibrated):
what a later start reads back must be what a fresh one computes."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from dflash_torch.decoding import adaptive, drafter_blocks
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.models.quantize import quantize_blocks

from .conftest import make_drafter, make_hf_model

CPU = torch.device("cpu")


@pytest.fixture()
def drafter_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    target = make_hf_model("llama", tmp_path / "t", seed=1)
    return make_drafter(target, tmp_path / "d", layers=2, block_size=4, seed=2)


def _fresh(path, fmt):
    d = load_drafter(path, device=CPU, dtype=None)
    quantize_blocks(d, fmt)
    drafter_blocks._norms_in_one_pass(d)
    return d.to(dtype=torch.float32)


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert not sa[k].is_meta and sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_cached_blocks_are_the_quantizers(drafter_dir, fmt):
    want = _fresh(drafter_dir, fmt)
    first = drafter_blocks.load_in_blocks(drafter_dir, fmt, CPU, torch.float32)  # quantizes, writes the cache
    file = drafter_blocks._cache_file(drafter_dir, fmt)
    assert file.is_file()
    again = drafter_blocks.load_in_blocks(drafter_dir, fmt, CPU, torch.float32)  # from the cache
    _same(first, want)
    _same(again, want)
    ctx = torch.randn(1, 5, want.fc.in_features)
    block = torch.tensor([[3, want.mask_token_id, want.mask_token_id, want.mask_token_id]])
    head = torch.nn.Linear(want.config["hidden_size"], want.config["vocab_size"], bias=False)
    target = SimpleNamespace(embed_tokens=torch.nn.Embedding(want.config["vocab_size"], want.config["hidden_size"]),
                             lm_head=head)
    outs = [d.propose(target, block, ctx, d.new_cache(16)) for d in (want, again)]
    assert torch.equal(outs[0], outs[1])


def test_changed_weights_or_a_damaged_cache_quantize_again(drafter_dir):
    drafter_blocks.load_in_blocks(drafter_dir, "q4_0", CPU, torch.float32)
    file = drafter_blocks._cache_file(drafter_dir, "q4_0")
    file.write_bytes(b"not a safetensors file")
    _same(drafter_blocks.load_in_blocks(drafter_dir, "q4_0", CPU, torch.float32), _fresh(drafter_dir, "q4_0"))
    weights = drafter_dir / "model.safetensors"
    make_drafter(drafter_dir.parent / "t", drafter_dir, layers=2, block_size=4, seed=9)  # new weights, same path
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert drafter_blocks._cache_file(drafter_dir, "q4_0") != file
    _same(drafter_blocks.load_in_blocks(drafter_dir, "q4_0", CPU, torch.float32), _fresh(drafter_dir, "q4_0"))


def test_calibration_is_measured_once_per_setup(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    runs = []

    def measure(target, drafter):
        runs.append(1)
        return {1: 0.01, 2: 0.012, 4: 0.015 + len(runs)}

    monkeypatch.setattr(adaptive, "calibrate", measure)
    drafter = SimpleNamespace(window=None, draft_vocab=None, block_size=4)
    pipe = SimpleNamespace(model_path=tmp_path / "m", draft_path=tmp_path / "d", quantize="q4_0", lm_head="q8_0",
                           dtype=torch.float32, device=CPU, drafter=drafter, target=None)
    first = adaptive.calibrated(pipe)
    assert adaptive.calibrated(pipe) == first == {1: 0.01, 2: 0.012, 4: 1.015} and len(runs) == 1
    pipe.quantize = "q8_0"  # another setup: its own measurement
    assert adaptive.calibrated(pipe)[4] == 2.015 and len(runs) == 2
    pipe.quantize = "q4_0"
    (file,) = [f for f in (tmp_path / "calibration").iterdir() if json.loads(f.read_text())["costs"]["4"] == 1.015]
    saved = json.loads(file.read_text())
    file.write_text(json.dumps(saved | {"time": saved["time"] - (adaptive.CALIBRATION_DAYS + 1) * 86400}))
    assert adaptive.calibrated(pipe)[4] == 3.015 and len(runs) == 3  # too old: measured again
