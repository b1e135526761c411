"""What each of a start's memory savings is worth (docs/performance.md, "Memory"), each measured in fresh
processes, with and without it (Linux: VmRSS / VmHWM from /proc/self/status, after malloc_trim):

    .venv/bin/python tools/probes/memory_savings_probe.py

- tokenizer: resident after loading the default model's tokenizer, the `tokenizers` library's own
  (tokenizer.py) against transformers' PreTrainedTokenizerFast (its import included);
- skeleton: resident after building the default model's modules on meta, with `layers.skeleton()`
  against a plain `torch.device("meta")` (whose initializers import torch._dynamo and sympy);
- drafter: the peak while the drafter is loaded into blocks, from the cache against quantized afresh;
- torchscript: resident after a generation of 8 tokens with the graph executor's optimizing passes off
  (as `flat.script` sets them) against on;
- cpp_extension: resident after importing torch.utils.cpp_extension.
"""

from __future__ import annotations

import subprocess
import sys

PRELUDE = """
import ctypes, json, torch
def rss(field="VmRSS"):
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
def reset_peak():
    open("/proc/self/clear_refs", "w").write("5")
from dflash_torch import kernels, loading
kernels.ensure()
path = loading.resolve_model(None)
"""

CASES = {
    "tokenizer": ("""
base = rss()
from dflash_torch import tokenizer
tok = tokenizer.load(path)
print(rss() - base)""", """
base = rss()
from transformers import PreTrainedTokenizerFast
tok = PreTrainedTokenizerFast.from_pretrained(str(path))
print(rss() - base)"""),
    "skeleton": ("""
from dflash_torch.models import llama
from dflash_torch.models.layers import skeleton
config = json.loads((path / "config.json").read_text())
base = rss()
with skeleton():
    m = llama.from_config(config)
print(rss() - base)""", """
from dflash_torch.models import llama
config = json.loads((path / "config.json").read_text())
base = rss()
with torch.device("meta"):
    m = llama.from_config(config)
print(rss() - base)"""),
    "drafter": ("""
from dflash_torch.decoding import drafter_blocks
from pathlib import Path
import dflash_torch
d = Path(dflash_torch.__file__).parent / "drafters" / "smollm2-135m-instruct"
drafter_blocks.load_in_blocks(d, "q4_1", torch.device("cpu"), torch.float32)  # the cache filled
base = rss(); reset_peak()
drafter_blocks.load_in_blocks(d, "q4_1", torch.device("cpu"), torch.float32)
print(rss("VmHWM") - base)""", """
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.models.quantize import quantize_blocks
from pathlib import Path
import dflash_torch
d = Path(dflash_torch.__file__).parent / "drafters" / "smollm2-135m-instruct"
base = rss(); reset_peak()
x = load_drafter(d, device=torch.device("cpu"), dtype=None)
quantize_blocks(x, "q4_1")
x.to(dtype=torch.float32)
print(rss("VmHWM") - base)"""),
    "torchscript": ("""
import importlib
gen = importlib.import_module("dflash_torch.generate")
pipe = gen.load(None, quiet=True, quantize="auto")
base = rss()
gen.generate(pipe, pipe.encode("hi"), max_tokens=8)
print(rss() - base)""", """
import importlib
torch._C._set_graph_executor_optimize(True)
torch._C._set_graph_executor_optimize = lambda flag: None  # flat.script's setting undone
gen = importlib.import_module("dflash_torch.generate")
pipe = gen.load(None, quiet=True, quantize="auto")
base = rss()
gen.generate(pipe, pipe.encode("hi"), max_tokens=8)
print(rss() - base)"""),
    "cpp_extension": (None, """
base = rss()
from torch.utils import cpp_extension
print(rss() - base)"""),
}


def run(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    print(f"{'saving':14s} {'with it MB':>11s} {'without MB':>11s} {'difference':>11s}")
    for name, (with_it, without) in CASES.items():
        a = run(with_it) if with_it else 0.0
        b = run(without)
        print(f"{name:14s} {a:11.1f} {b:11.1f} {b - a:11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
