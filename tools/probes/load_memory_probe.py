"""Where a loaded default model's resident memory goes, step by step (docs/performance.md, "Memory").

    .venv/bin/python tools/probes/load_memory_probe.py

Prints VmRSS and its peak (VmHWM) from /proc/self/status (Linux) after each step of what `generate.load`
does for `--quantize auto`: import torch, the kernels, the target built from the GGUF's blocks, the rest
of the block quantization, the tokenizer, the drafter, one prefill and one decode step.
"""

from __future__ import annotations

import importlib


def rss(step: str) -> None:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                fields[line.split(":")[0]] = int(line.split()[1]) // 1024
    print(f"{step:28s} rss {fields['VmRSS']:5d} MB   peak {fields['VmHWM']:5d} MB")


def main() -> None:
    rss("start")
    import torch

    rss("import torch")
    from dflash_torch import kernels, loading

    kernels.ensure()
    rss("kernels")
    path = loading.resolve_model(None)
    target = loading.load_target(path, torch.device("cpu"), torch.float32, blocks=("q4_1", "q8_0"))
    rss("target from its blocks")
    from dflash_torch.models.quantize import quantize_blocks

    quantize_blocks(target, "q4_1", head="q8_0", stored=loading.stored_blocks(target, path))
    rss("block quantization (fused)")
    loading.load_tokenizer(path)
    rss("tokenizer")
    generate = importlib.import_module("dflash_torch.generate")
    pipe = generate.load(None, quiet=True, quantize="auto")  # a second target beside the first, and the drafter
    rss("generate.load (+ drafter)")
    with torch.inference_mode():
        cache = pipe.target.new_cache(64)
        pipe.target(torch.tensor([[1, 2, 3]]), cache, logits="last")
        rss("prefill")
        pipe.target(torch.tensor([[4]]), cache, logits="last")
        rss("decode step")


if __name__ == "__main__":
    main()
