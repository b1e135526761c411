"""torch's exact (erf) gelu on a strided gate (the first half of a fused gate/up output, 64 rows of 1,536) against the
same values contiguous, and both against row-by-row and split calls: how many values differ.

    python docs/bench/cpu-epyc-zen4-headroom/gelu_layouts.py
"""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
n = 1536
gate = (torch.randn(64, 2 * n) * 4)[:, :n]  # strided, as the fused projection leaves it
for name, f in (("silu", F.silu), ("gelu tanh", lambda x: F.gelu(x, approximate="tanh")), ("gelu exact", F.gelu)):
    strided, contiguous = f(gate), f(gate.contiguous())
    rows = torch.cat([f(gate[i : i + 1]) for i in range(gate.shape[0])])
    split = torch.cat([f(gate.contiguous()[:5]), f(gate.contiguous()[5:])])
    print(f"{name:10s}: strided vs contiguous {(strided != contiguous).sum().item()} of {gate.numel()} differ; "
          f"rows one by one vs contiguous {(rows != contiguous).sum().item()}; "
          f"contiguous split 5 + 59 rows vs whole {(split != contiguous).sum().item()}")
