"""How far `--quantize auto`'s int4 weights are from the GGUF file's own 4-bit weights.

Loads the embedded default model (its Q4_1 weights dequantized to float32, exactly as stored), builds
the int4 layers `--quantize int4` uses (group 32, bfloat16 scale and zero point), reads their weights
back through the kernel and compares them with the stored ones, over every quantized layer:

    python docs/gguf_int4_probe.py
"""

from __future__ import annotations

from torch import nn

from dflash_torch.generate import load
from dflash_torch.quantize import Int4Linear, int4_fits


def main() -> None:
    target = load(None, None, "cpu", "float32", quiet=True).target
    diff2 = norm2 = 0.0
    worst, n = 0.0, 0
    for m in target.modules():
        if type(m) is nn.Linear and int4_fits(m):
            w = m.weight.detach()
            back = Int4Linear(m).weight.float()
            diff2 += (back - w).pow(2).sum().item()
            norm2 += w.pow(2).sum().item()
            worst = max(worst, ((back - w).norm() / w.norm()).item())
            n += 1
    print(f"{n} layers: int4 weights differ from the stored Q4_1 weights by {(diff2 / norm2) ** 0.5:.2%} "
          f"(relative, all layers), {worst:.2%} in the worst layer")


if __name__ == "__main__":
    main()
