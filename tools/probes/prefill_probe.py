"""How long a cold prefill of T tokens takes, and where the time goes: the default model's target (no
drafter) through one forward pass of T random token ids (fixed seed), timed, with torch.profiler's
heaviest operators; with --llamacpp, llama.cpp (llama-cpp-python) evaluating the same ids on the same GGUF
file with batch 512.

    python tools/probes/prefill_probe.py [--tokens 2048,6000] [--quantize auto] [--threads 2] [--llamacpp]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def ours(tokens: list[int], quantize: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from dflash_torch.generate import load

    target = load(None, None, quantize=quantize).target
    for n in tokens:
        ids = torch.randint(0, target.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            cache = target.new_cache(n + 8)
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                target(ids, cache, logits="last")
            dt = time.perf_counter() - t0
        print(f"dflash-torch --quantize {quantize}: {n} tokens in {dt:.2f} s, {n / dt:.0f} tok/s")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=5))


def llamacpp(tokens: list[int], threads: int) -> None:
    from llama_cpp import Llama

    from dflash_torch import loading

    llm = Llama(model_path=str(loading.default_gguf()), n_ctx=max(tokens) + 8, n_batch=512, n_ubatch=512,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    for n in tokens:
        ids = torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(0)).tolist()
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        dt = time.perf_counter() - t0
        print(f"llama.cpp: {n} tokens in {dt:.2f} s, {n / dt:.0f} tok/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048,6000")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp", action="store_true", help="also time llama.cpp on the same ids")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    ours(tokens, args.quantize)
    if args.llamacpp:
        llamacpp(tokens, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
