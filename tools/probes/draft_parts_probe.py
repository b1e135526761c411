"""Where a drafter cycle's draft time goes in the real loop: the greedy loop at a fixed width (the drafter alone, the
default model and drafter, a held-out chat prompt), with timers around `DrafterProposer._draft_tree` (the whole draft:
block, context, pass, top-k, tree), `propose` (the pass and its head), `draft_hidden` (the layers and the context
projections), `logits` (the draft head), and the calls of `NativeDraft` (fc + hidden norm, the context k/v matmul,
`draft_stack`). Medians per draft, in ms.

    python tools/probes/draft_parts_probe.py [--widths 2,4,16] [--tokens 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_torch import data
from dflash_torch.decoding import drafter as drafter_module
from dflash_torch.decoding import proposers, speculative
from dflash_torch.generate import load
from dflash_torch.models import flat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="2,4,16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load(quantize="auto", quiet=True)
    d = pipe.drafter
    ids = data.encode_chat(pipe.tokenizer, data.heldout_prompts(1, 0, 0)["chat"][0])
    times: dict[str, list[float]] = {}

    def timed(name, f):
        def call(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            times.setdefault(name, []).append(time.perf_counter() - t)
            return out
        return call

    def native(self, x, ctx, q_cos, q_sin, c_cos, c_sin, start, keys, values, q_signed=None, c_signed=None):
        dd, t0 = self.d, time.perf_counter()  # NativeDraft.__call__, timed
        c = flat.norm(flat.linear(ctx, dd.fc), dd.hidden_norm, dd.eps, True)
        t1 = time.perf_counter()
        kv = flat.linear(c, dd.ctx_kv)
        t2 = time.perf_counter()
        q_signed = flat.signed(q_sin) if q_signed is None else q_signed
        c_signed = flat.signed(c_sin) if c_signed is None else c_signed
        out = torch.ops.dflash.draft_stack(x, kv, q_cos, q_signed, c_cos, c_signed, start, keys, values,
                                           self.norms, self.packed, self.codes, self.biases, dd.final_norm,
                                           dd.eps, dd.h, dd.hkv, dd.dh, dd.scale, dd.act)
        t3 = time.perf_counter()
        for name, dt in (("fc", t1 - t0), ("context k/v", t2 - t1), ("draft_stack", t3 - t2)):
            times.setdefault(name, []).append(dt)
        return out

    proposers.DrafterProposer._draft_tree = timed("draft", proposers.DrafterProposer._draft_tree)
    cls = type(d)
    cls.propose, cls.draft_hidden, cls.logits = (timed("propose", cls.propose), timed("layers", cls.draft_hidden),
                                                 timed("head", cls.logits))
    drafter_module.NativeDraft.__call__ = native
    for width in map(int, args.widths.split(",")):
        for _ in range(2):  # the first run warms up; the second is reported
            times.clear()
            for _ in speculative.generate_tokens(pipe.target, ids, max_new_tokens=args.tokens, drafter=d,
                                                 block_size=width, stats=speculative.Stats()):
                pass
        print(f"width {width}: " + ", ".join(f"{k} {1e3 * statistics.median(v):.3f}" for k, v in times.items()),
              flush=True)


if __name__ == "__main__":
    main()
