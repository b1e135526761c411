"""Whether a greedy step could skip most of the Q8_0 LM head and still pick its exact argmax: screen every token with
a Q4_0 copy of the head, bound each screened logit's distance from the exact one, and compute exactly only the tokens
whose bound reaches the best lower bound. The bound must hold for every input: with the activation quantized as the
kernel quantizes it (Q8_0 blocks), |exact - screened| <= sum over blocks of d_x * sum|q_x| * max|w8 - w4| in that
block. Over the final hidden states of greedy decoding on held-out prompts: the bound against the real error, and how
many tokens would stay candidates (the head has 49,152).

    python tools/probes/head_screen_probe.py [--steps 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash_torch import data  # noqa: E402
from dflash_torch.generate import load  # noqa: E402
from dflash_torch.kernels import pack, reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64, help="decode steps per prompt (2 held-out prompts per kind)")
    a = ap.parse_args()
    torch.set_num_threads(2)
    p = load(draft=None, quantize="auto", quiet=True)
    t = p.target
    head, norm = t.lm_head, t.model.norm
    v, h = head.out_features, head.in_features
    w8 = head.weight.float()  # [V, H]: the stored Q8_0 blocks, dequantized
    w4 = pack.dequantize(pack.quantize(w8, "q4_0"), "q4_0").reshape(v, h)
    err_w = (w8 - w4).abs().reshape(v, h // pack.QK, pack.QK).amax(-1)  # [V, nb]
    finals = []
    with torch.inference_mode():
        for prompts in data.heldout_prompts(2, 2, 2).values():
            for prompt in prompts:
                ids = data.encode_chat(p.tokenizer, prompt)
                cache = t.new_cache(len(ids) + a.steps + 1)
                token = int(t(torch.tensor([ids]), cache, logits="last").logits[0, -1].argmax())
                for _ in range(a.steps):
                    out = t(torch.tensor([[token]]), cache, logits="rows" if t.defers_head(2) else None,
                            taps=[t.num_layers - 1])
                    finals.append(out.hidden[0])  # the last layer's output [1, H]
                    token = int(t.head(out.hidden[0]).argmax())
        x = norm(torch.cat(finals))  # [N, H], as the head normalizes it
        q, dx, _ = reference.quantize_act(x)
        n = x.shape[0]
        xq = (q.float().reshape(n, -1, pack.QK) * dx[..., None]).reshape(n, h)
        screened, exact = xq @ w4.T, xq @ w8.T
        bound = (q.float().abs().reshape(n, -1, pack.QK).sum(-1) * dx) @ err_w.T  # [N, V]
        real = (exact - screened).abs()
        kept = (screened + bound >= (screened - bound).max(-1, keepdim=True).values).sum(-1).float()
        top2 = exact.topk(2).values
    print(f"{n} decode steps; the bound over the real error: median {(bound / real.clamp_min(1e-9)).median():.1f}x "
          f"(never below: {bool((real <= bound).all())}); bound median {bound.median():.2f}, top-1 minus top-2 "
          f"logit median {(top2[:, 0] - top2[:, 1]).median():.2f}; candidates per step of {v}: median "
          f"{kept.median():.0f}, 10th percentile {kept.quantile(0.1):.0f}, max {kept.max():.0f}")


if __name__ == "__main__":
    main()
