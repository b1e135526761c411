"""Target-only greedy replies of 400 tokens (no stop token), again and again for SECONDS, for a sampling profiler
to attach to (decode_threads.txt): the default model, `--quantize auto`, 2 threads. Prints tokens per second,
each reply's prefill included.

    python docs/bench/cpu-epyc-zen4-headroom/gen_loop.py SECONDS
"""

from __future__ import annotations

import sys
import time

import torch

from dflash_torch.decoding.speculative import generate_tokens
from dflash_torch.generate import load

torch.set_grad_enabled(False)
pipe = load(draft=None, quantize="auto", quiet=True)
ids = pipe.tokenizer.encode("Write a long story about a dragon and a knight who become friends.")
end, n, t0 = time.time() + float(sys.argv[1]), 0, time.perf_counter()
while time.time() < end:
    for _ in generate_tokens(pipe.target, ids, max_new_tokens=400, stop_token_ids=[]):
        n += 1
print(f"{n / (time.perf_counter() - t0):.1f} tok/s")
