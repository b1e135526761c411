"""Context keys/values of all draft layers in one matmul, or two per layer? (docs/performance.md)

Loads the default model and its drafter as `dflash generate` does (context k/v fused by
`DFlashDrafter.fuse_context_kv`), makes an unfused copy, and times `propose` for a 16-wide block after
200 cached context tokens, with 1, 4 and 16 new context rows, median of 40; prints the largest
difference between the two drafters' logits.

    python tools/probes/ctx_kv_probe.py
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from dflash_torch.generate import load


def main() -> None:
    torch.set_num_threads(2)
    pipe = load(None, "auto", "cpu", "float32", quiet=True)
    target, fused = pipe.target, pipe.drafter
    plain = copy.deepcopy(fused)
    plain.ctx_kv_weight = plain.ctx_kv_bias = None
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 4, 16):
            ctx = torch.randn(1, 200, len(fused.target_layer_ids) * target.config.hidden_size, generator=g)
            new = torch.randn(1, rows, ctx.shape[-1], generator=g)
            block = torch.full((1, 16), fused.mask_token_id)
            block[0, 0] = 42
            res = {}
            for name, m in (("per layer", plain), ("fused", fused)):
                cache = m.new_cache(512)
                m.propose(target, block, ctx, cache)
                times = []
                for _ in range(40):
                    cache.length = 200
                    t0 = time.perf_counter()
                    out = m.propose(target, block, new, cache)
                    times.append(time.perf_counter() - t0)
                res[name] = (statistics.median(times) * 1e3, out)
            diff = (res["fused"][1] - res["per layer"][1]).abs().max().item()
            print(f"context rows {rows:2d}: per layer {res['per layer'][0]:.2f} ms, fused {res['fused'][0]:.2f} ms, "
                  f"max logit difference {diff:.2e}")


if __name__ == "__main__":
    main()
