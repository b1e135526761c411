"""Shared test helpers: tiny random models of each family, saved as HF directories, and drafters."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Tiny models: one thread is fastest (no OpenMP barriers per small op) and keeps results stable.
torch.set_num_threads(1)

# The C++ kernels from the user cache (built by `make install`), loaded before any test points DFLASH_HOME
# elsewhere: a test that does must not rebuild them there.
from dflash_torch import kernels  # noqa: E402

kernels.ensure()

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DFLASH_SHARED", ROOT.parent / "shared"))
ZLAB = SHARED / "fixtures" / "zlab-tiny"

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def make_hf_model(kind: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random transformers model of `kind` (llama, qwen2, qwen3) to `path`.

    The LM head is scaled up so logits are far apart: greedy text is not one repeated token, and
    near-ties (where float rounding between a 1-token and a 16-token pass could flip the argmax) are rare."""
    import transformers

    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    cfg = dict(TINY, **overrides)
    if kind == "qwen3":
        cfg.setdefault("head_dim", 16)
    torch.manual_seed(seed)
    model = cls[1](cls[0](**cfg)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    return path


def make_drafter(target_path: Path, path: Path, *, layers: int = 2, block_size: int = 8, seed: int = 0) -> Path:
    """A random drafter in the published format for the target at `target_path`."""
    from dflash_torch.decoding.drafter import DFlashDrafter

    t = json.loads((target_path / "config.json").read_text())
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": t["hidden_size"], "intermediate_size": 128, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": t["vocab_size"], "num_target_layers": t["num_hidden_layers"],
        "max_position_embeddings": 512, "rope_theta": 10000.0,
        "dflash_config": {"block_size": block_size, "mask_token_id": t["vocab_size"] - 1},
    }
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    d.save(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """{kind: directory} for tiny random llama, qwen2 and qwen3 targets."""
    base = tmp_path_factory.mktemp("tiny")
    return {k: make_hf_model(k, base / k, seed=i) for i, k in enumerate(("llama", "qwen2", "qwen3"))}


@pytest.fixture(scope="session")
def zlab() -> Path:
    if not ZLAB.is_dir():
        pytest.fail(f"fixture directory {ZLAB} is missing (set DFLASH_SHARED to the shared/ folder)")
    return ZLAB


SMALL_VOCAB = 5


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory):
    """(target, drafter) over a 5-token vocabulary, for exact distribution tests. One layer each: the
    property tested (the accept / residual arithmetic of rejection sampling) does not depend on depth,
    and these tests run thousands of generations, whose cost is per layer."""
    from dflash_torch import loading
    from dflash_torch.decoding.drafter import load_drafter

    base = tmp_path_factory.mktemp("sv")
    path = make_hf_model("llama", base / "t", seed=7, vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    target = loading.load_target(path, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # back to moderate logits, so sampling is spread over the vocab
        target.lm_head.weight.mul_(0.1)
    drafter = load_drafter(make_drafter(path, base / "d", layers=1, block_size=4, seed=3))
    return target, drafter


# One rounding to a floating-point format moves a value by at most half a step, a step being 2^-(mantissa bits)
# of the value's magnitude: bfloat16 keeps 8 significant bits, float32 24. Tolerances below are counted in
# these steps (of a stated magnitude) times the roundings that can differ, never tuned to one machine.
BF16_STEP = 2.0**-8
F32_STEP = 2.0**-24


def within_steps(got: torch.Tensor, want: torch.Tensor, scale, roundings: float, step: float = BF16_STEP) -> bool:
    """Whether |got - want| <= roundings * step * scale everywhere (scale broadcasts against want)."""
    return bool(((got.float() - want.float()).abs() <= roundings * step * scale).all())


def assert_within_steps(got, want, scale, roundings: float, step: float = BF16_STEP) -> None:
    diff = ((got.float() - want.float()).abs() / (step * scale)).max().item()
    assert within_steps(got, want, scale, roundings, step), f"off by {diff:.2f} steps, {roundings} allowed"
