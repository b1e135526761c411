"""A quantized drafter: draft pass time and acceptance against the same drafter in float32.

Loads the embedded default model with int4 weights and its drafter, times draft passes per block
size after a 128-token context (`profile.profile_pipeline`, steady state), and runs four short
greedy generations (no prompt lookup, no fallback) for their acceptance length; then quantizes the
drafter's layers as `load(quantize=...)` does and repeats both (docs/performance.md).

    python tools/probes/draft_quant_probe.py --quantize int4
"""

from __future__ import annotations

import argparse

import torch

from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load
from dflash_torch.models.quantize import quantize_int4, quantize_int8
from dflash_torch.profile import profile_pipeline

PROMPTS = ["Explain recursion in two sentences.", "Write a Python function that reverses a list.",
           "What is the capital of France? Answer briefly.", "List five animals that live in the ocean."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", default="int4", choices=["int8", "int4"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load(None, "auto", "cpu", "float32", quiet=True)
    (quantize_int4 if args.quantize == "int4" else quantize_int8)(pipe.target)  # the drafter still float32
    prompts = [pipe.encode(text) for text in PROMPTS]
    for name in ("float32 drafter", f"{args.quantize} drafter"):
        if name != "float32 drafter":
            (quantize_int4 if args.quantize == "int4" else quantize_int8)(pipe.drafter)
            pipe.drafter.fuse_context_kv()  # the stacked context k/v, read back from the quantized layers
        draft = profile_pipeline(pipe, [2, 4, 16], 128, 9)["draft_s"]
        lengths = []
        for ids in prompts:
            stats = Stats()
            list(generate_tokens(pipe.target, ids, max_new_tokens=96, drafter=pipe.drafter,
                                 stop_token_ids=pipe.stop_token_ids, stats=stats))
            lengths.append(stats.acceptance_length_mean)
        times = ", ".join(f"B={b}: {t * 1e3:.2f} ms" for b, t in draft.items())
        print(f"{name}: draft pass {times}; acceptance length {' '.join(f'{x:.3f}' for x in lengths)}")


if __name__ == "__main__":
    main()
