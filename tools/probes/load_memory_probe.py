"""Where a loaded default model's resident memory goes, step by step (docs/performance.md, "Memory").

    .venv/bin/python tools/probes/load_memory_probe.py

Prints VmRSS and the peak since the previous step (VmHWM, reset after each step through
/proc/self/clear_refs) after each stage of `generate.load(quantize="auto")` (Linux): the target built from
the GGUF's blocks, the rest of its block quantization, the tokenizer, the drafter, each followed by
`release_freed_memory`; then the drafter's head, one 31-token prompt generating 8 tokens.
"""

from __future__ import annotations

import importlib


def rss(step: str) -> None:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                fields[line.split(":")[0]] = int(line.split()[1]) // 1024
    print(f"{step:28s} rss {fields['VmRSS']:5d} MB   peak since the last step {fields['VmHWM']:5d} MB")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from here


def main() -> None:
    rss("start")
    import torch

    rss("import torch")
    from dflash_torch import kernels, loading
    from dflash_torch.decoding import drafter_blocks
    from dflash_torch.models import quantize

    kernels.ensure()
    rss("kernels")
    generate = importlib.import_module("dflash_torch.generate")

    def step(module, name, label):
        fn = getattr(module, name)

        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            rss(label)
            return out

        setattr(module, name, wrapped)

    step(loading, "load_target", "target from its blocks")
    step(quantize, "quantize_blocks", "block quantization (fused)")
    step(loading, "load_tokenizer", "tokenizer")
    step(drafter_blocks, "load_in_blocks", "drafter (cached blocks)")
    step(loading, "release_freed_memory", "  freed pages returned")
    pipe = generate.load(None, quiet=True, quantize="auto")
    rss("loaded")
    generate.generate(pipe, pipe.encode("hi"), max_tokens=8)
    rss("prompt + 8 tokens")
    del torch


if __name__ == "__main__":
    main()
