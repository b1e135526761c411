"""How far the quantized weights are from the ones the GGUF file stores.

Loads the embedded default model (its weights dequantized to float32, exactly as stored: Q4_1 layer
matrices, a Q8_0 LM head tied to the embedding), builds the int4 layers `--quantize int4` uses (group
32, bfloat16 scale and zero point) and the int8 LM head `--quantize auto` uses, reads their weights back
and compares them with the stored ones, and times the two heads. Then greedy replies to six prompts
with float32 weights (the stored values), with `--quantize int4` and with `--quantize auto`: for how
many tokens each quantized reply stays equal to the float32 one.

    python tools/probes/quantize_auto_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from dflash_torch.decoding.speculative import generate_tokens
from dflash_torch.generate import load
from dflash_torch.models.quantize import Int4Linear, Int8Linear, int4_fits


def main() -> None:
    torch.set_num_threads(2)
    target = load(None, None, "cpu", "float32", quiet=True).target
    diff2 = norm2 = 0.0
    worst, n = 0.0, 0
    for m in target.model.modules():  # the layers; the LM head below
        if type(m) is nn.Linear and int4_fits(m):
            w = m.weight.detach()
            back = Int4Linear(m).weight.float()
            diff2 += (back - w).pow(2).sum().item()
            norm2 += w.pow(2).sum().item()
            worst = max(worst, ((back - w).norm() / w.norm()).item())
            n += 1
    print(f"{n} layer matrices: int4 weights differ from the stored Q4_1 weights by {(diff2 / norm2) ** 0.5:.2%} "
          f"(relative, all together), {worst:.2%} in the worst")
    w = target.lm_head.weight.detach()
    heads = {"int4": Int4Linear(target.lm_head), "int8": Int8Linear(target.lm_head)}
    for name, q in heads.items():
        print(f"LM head: {name} weights differ from the stored Q8_0 weights by "
              f"{((q.weight.float() - w).norm() / w.norm()).item():.2%}")
    x, times = torch.randn(1, w.shape[1]), {name: [] for name in heads}
    with torch.inference_mode():
        for i in range(2 * 105):  # the two in turn, so both see the same machine load
            name = list(heads)[i % 2]
            t0 = time.perf_counter()
            heads[name](x)
            times[name].append(time.perf_counter() - t0)
    print("LM head, one row: " + ", ".join(f"{k} {statistics.median(v[5:]) * 1e3:.2f} ms" for k, v in times.items()))

    prompts = ["Explain recursion in two sentences.", "Write a Python function that reverses a list.",
               "What is the capital of France? Answer briefly.", "List five animals that live in the ocean.",
               "Describe how a bicycle works.", "Give three tips for better sleep."]
    pipes = {q: load(None, None, "cpu", "float32", quiet=True, quantize=q) for q in ("none", "int4", "auto")}
    ref = pipes["none"]
    for text in prompts:
        ids = ref.encode(text)
        replies = {q: list(generate_tokens(p.target, ids, max_new_tokens=96, stop_token_ids=p.stop_token_ids))
                   for q, p in pipes.items()}
        same = {q: next((i for i, (a, b) in enumerate(zip(replies["none"], r)) if a != b), len(r))
                for q, r in replies.items() if q != "none"}
        print(f"{text!r}: float32 reply {len(replies['none'])} tokens; equal to it for "
              + ", ".join(f"{n} tokens with {q}" for q, n in same.items()))


if __name__ == "__main__":
    main()
