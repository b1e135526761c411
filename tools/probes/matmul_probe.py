"""The matmul part of one forward pass of the default model, per kernel and number of rows (docs/performance.md).

Times the linear layers of SmolLM2-135M-Instruct's shapes (per layer: fused q/k/v 576->960, o 576->576,
fused gate/up 576->3072, down 1536->576; 30 layers; plus the 576->49152 LM head) on random weights, for
1..16 rows (a decode step is 1 row, a verify pass of width B is B rows), with:

  int4   the engine's `Int4Linear` (group-wise int4 weights, bfloat16 activations)
  int8   the engine's `Int8Linear` (weight-only int8, bfloat16 activations)
  w8a8   int8 weights and int8 activations scaled per row, `torch._int_mm` (int32 accumulation)
  bf16   bfloat16 weights and activations, `F.linear`
  fp32   float32, `F.linear`

and checks which ones give a row the same bits whatever the other rows are (what lets a verify pass
reproduce decode steps exactly).

    python tools/probes/matmul_probe.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from dflash_torch.models.quantize import Int4Linear, Int8Linear

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) per decoder layer
HEAD = (576, 49152)
LAYERS = 30


def w8a8(weight: torch.Tensor):
    """x [M, K] float32 -> [M, N]: per-output-channel int8 weights, per-row int8 activations."""
    scale = (weight.abs().amax(1) / 127).clamp_min(1e-12)  # [N]
    wq = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8).t().contiguous()  # [K, N]

    def run(x: torch.Tensor) -> torch.Tensor:
        xs = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127  # [M, 1]
        xq = torch.round(x / xs).to(torch.int8)
        return torch._int_mm(xq, wq).float() * xs * scale  # integer sums are exact in any order

    return run


def kernels(k: int, n: int) -> dict:
    lin = nn.Linear(k, n, bias=False)
    w = lin.weight.detach()
    wb = w.bfloat16()
    return {"int4": Int4Linear(lin), "int8": Int8Linear(lin), "w8a8": w8a8(w),
            "bf16": lambda x: F.linear(x.bfloat16(), wb), "fp32": lambda x: F.linear(x, w)}


def timed(f, x: torch.Tensor, n: int) -> float:
    for _ in range(max(10, n // 5)):  # warm up (first calls page in weights, pick kernels)
        f(x)
    t = time.perf_counter()
    for _ in range(n):
        f(x)
    return (time.perf_counter() - t) / n


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [(s, LAYERS) for s in LAYER_SHAPES] + [(HEAD, 1)]
    built = [(kernels(k, n), k, count) for (k, n), count in shapes]
    names = list(built[0][0])
    print("ms per forward pass (30 layers + LM head), matmuls only")
    print(" rows  " + "".join(f"{name:>8}" for name in names))
    for m in [int(r) for r in args.rows.split(",")]:
        total = dict.fromkeys(names, 0.0)
        for ks, k, count in built:
            x = torch.randn(m, k)
            for name, f in ks.items():
                total[name] += timed(f, x, args.iters) * count * 1e3
        print(f"{m:5d}  " + "".join(f"{total[name]:8.2f}" for name in names))
    ks, k, _ = built[2]
    x = torch.randn(16, k)
    same = {name: all(torch.equal(f(x[:r])[:3], f(x)[:3]) for r in (3, 4, 8)) for name, f in ks.items()}
    print("first 3 rows bit-identical when computed with 0/1/5/13 other rows:",
          ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in same.items()))


if __name__ == "__main__":
    main()
