"""What the distribution tests' statistic catches (tests/test_sampling.py): p-values for two broken verifies on
the tests' own 5-token model, with the joint of all four tokens alone (the statistic before) and with every one-
and two-position marginal added (`_chi2_pvalue`, Bonferroni over 11 views).

    python tools/probes/chi2_power_probe.py     # from the repository root; ~16,000 generations
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from dflash_torch import loading  # noqa: E402
from dflash_torch.decoding.drafter import load_drafter  # noqa: E402
from dflash_torch.decoding.sampling import Sampler  # noqa: E402
from tests import test_sampling as T  # noqa: E402
from tests.conftest import SMALL_VOCAB, make_drafter, make_hf_model  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    base = pathlib.Path(tempfile.mkdtemp())
    path = make_hf_model("llama", base / "t", seed=7, vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # (as conftest.small_vocab)
    target = loading.load_target(path, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.1)
    drafter = load_drafter(make_drafter(path, base / "d", layers=1, block_size=4, seed=3))
    prompt, settings = [1, 3, 0, 2], {"temperature": 1.0}
    exact = T._exact_joint(target, prompt, Sampler(**settings))
    real = Sampler.verify
    try:
        for broken, runs in ((T._accept_all, [(1000, 0), (2000, 0)]),
                             (T._no_residual, [(4000, 0), (3000, 0), (3000, 10**6), (3000, 2 * 10**6)])):
            Sampler.verify = broken
            for n, seed0 in runs:
                counts, _ = T._sample_counts(target, drafter, prompt, settings, n, seed0)
                pair = {}
                for cell, c in counts.items():
                    pair[cell[1:3]] = pair.get(cell[1:3], 0) + c
                want = {}
                for cell, p in exact.items():
                    want[cell[1:3]] = want.get(cell[1:3], 0.0) + p
                print(f"{broken.__name__} n={n} seeds from {seed0}: joint alone p={T._pearson(counts, exact, n):.2g}, "
                      f"positions 2-3 p={T._pearson(pair, want, n):.2g}, "
                      f"_chi2_pvalue={T._chi2_pvalue(counts, exact, n):.2g}", flush=True)
    finally:
        Sampler.verify = real


if __name__ == "__main__":
    main()
