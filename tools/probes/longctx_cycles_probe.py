"""What each cycle of a short reply after a long prompt costs: `dflash bench --suite longctx`'s prompt of a size,
target-only, then DFlash as the bench runs it with `--fallback --adaptive` (drafter, prompt lookup, fallback,
adaptive width from a fresh calibration), one generation each; per drafter-side cycle its width, who drafted
it, the tokens it committed and its milliseconds, and the adaptive width's learnt growth per position.
(docs/performance.md, "Adaptive block size by default")

    python tools/probes/longctx_cycles_probe.py [--size longctx-7k] [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="longctx-7k", help="longctx-2k, longctx-4k or longctx-7k")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from dflash_torch.bench_longctx import longctx_suites
    from dflash_torch.decoding import proposers
    from dflash_torch.decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrate
    from dflash_torch.decoding.fallback import FallbackController
    from dflash_torch.decoding.speculative import Stats
    from dflash_torch.generate import load, stream

    pipe = load(None, "auto", "cpu", "auto", quantize="auto", quiet=True)
    prompt = longctx_suites(pipe, 1)[args.size][0]
    ids = prompt.ids
    costs = calibrate(pipe.target, pipe.drafter)
    cycles = []
    observe = proposers.DrafterProposer.observe

    def logged(self, draft, accepted, new, hidden, seconds):  # every cycle passes the drafter's observe
        cycles.append((draft.width, getattr(draft.source, "name", None) or "plain", len(new), round(seconds * 1e3, 1)))
        return observe(self, draft, accepted, new, hidden, seconds)

    proposers.DrafterProposer.observe = logged
    print(f"{args.size}: {len(ids)} prompt tokens, {args.tokens} new; calibration (ms):",
          {b: round(t * 1e3, 1) for b, t in costs.items()})
    for use in (False, True):
        stats = Stats()
        cycles.clear()
        adaptive = AdaptiveBlockSize(dict(costs), pipe.drafter.block_size)
        ctl = WithFallback(FallbackController(), adaptive) if use else None
        list(stream(pipe, ids, args.tokens, use_draft=use, stop_token_ids=[], stats=stats, controller=ctl, lookup=use))
        name = "DFlash" if use else "target-only"
        print(f"{name}: decode {stats.decode_tok_s:.1f} tok/s, prefill {stats.prefill_s:.1f} s")
        if use:
            print("cycles (width, drafted by, committed, ms):", cycles)
            print("fallback events:", ctl.fallback.events)
            print("learnt growth (us per position):", {b: round(s * 1e6, 2) for b, s in
                                                       getattr(adaptive, "slopes", {}).items()})


if __name__ == "__main__":
    main()
