"""How each cycle's width is chosen, compared in the loop `dflash serve` runs (drafter, prompt lookup, datastore;
greedy, no stop token): serve's defaults (adaptive width inside the target-only fallback) against other policies,
prompt by prompt in rotating order, each arm's controllers carried from prompt to prompt as a server carries them;
the speed of each over the same prompt's target-only decoding, and every output compared with target-only output.

    python tools/probes/policy_ab_probe.py --arms defaults,adaptive --limit 3 --tokens 512

Arms: `defaults` (WithFallback(FallbackController, AdaptiveBlockSize)), `adaptive` (the adaptive width alone),
`fixedN` (the drafter at width N every cycle the free proposers do not take), `nodrafter` (prompt lookup and the
datastore only), `frozencosts` (the defaults with prompt lookup's verify costs in a plain dict, which never forgets
a width's time: before `lookup.VerifyCosts`).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflash_torch.bench_prompts import collect_prompts, encode
from dflash_torch.decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrated
from dflash_torch.decoding.fallback import FallbackController
from dflash_torch.decoding.lookup import VerifyCosts
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load


class Fixed:
    def __init__(self, width: int) -> None:
        self.width = width

    def block_size(self, stats) -> int:
        return self.width

    def observe(self, block_size: int, committed: int, seconds: float) -> None:
        pass


def controller(name: str, p, arm: dict):
    if name in ("defaults", "frozencosts"):
        return WithFallback(FallbackController(carried=arm.get("carry")), arm["adaptive"])
    if name == "adaptive":
        return arm["adaptive"]
    if name.startswith("fixed") and name[5:].isdigit() and int(name[5:]) >= 1:
        return Fixed(int(name[5:]))
    if name == "nodrafter":
        return Fixed(1)
    raise SystemExit(f"policy_ab_probe: unknown arm {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="defaults,adaptive", help="comma-separated policies (see the docstring)")
    ap.add_argument("--limit", type=int, default=3, help="first N prompts of each bench suite")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    names = a.arms.split(",")
    bad = [n for n in names if n not in ("defaults", "adaptive", "nodrafter", "frozencosts")
           and not (n.startswith("fixed") and n[5:].isdigit() and int(n[5:]) >= 1)]
    if bad:
        raise SystemExit(f"policy_ab_probe: unknown arm(s) {', '.join(bad)}: defaults, adaptive, fixedN, nodrafter, "
                         "frozencosts")
    p = load(draft="auto", quantize="auto", quiet=True)
    arms = {n: {"adaptive": AdaptiveBlockSize(dict(calibrated(p)), p.drafter.block_size), "carry": None,
                "costs": {} if n == "frozencosts" else VerifyCosts(), "ratios": []} for n in names}
    equal, k = True, 0
    for suite, prompts in collect_prompts("all", None, a.limit).items():
        for prompt in prompts:
            ids = encode(p, prompt)
            st = Stats()
            ref = list(generate_tokens(p.target, ids, max_new_tokens=a.tokens, stop_token_ids=[], stats=st))
            base = st.decode_tok_s
            order = names[k % len(names):] + names[: k % len(names)]
            k += 1
            for n in order:
                arm = arms[n]
                c = controller(n, p, arm)
                st = Stats()
                out = list(generate_tokens(p.target, ids, max_new_tokens=a.tokens, drafter=p.drafter, stop_token_ids=[],
                                           stats=st, controller=c, lookup=True, lookup_costs=arm["costs"]))
                if n in ("defaults", "frozencosts"):
                    arm["carry"] = c.fallback.carry()
                equal &= out == ref
                arm["ratios"].append(st.decode_tok_s / base)
                print(f"{n:10s} {suite:9s} target-only {base:6.1f} -> {st.decode_tok_s:6.1f} tok/s "
                      f"({st.decode_tok_s / base:.3f}x), {st.acceptance_length_mean:.3f} tokens per pass, "
                      f"{st.widths.get(1, 0)} plain of {st.cycles}; drafter passes "
                      f"{st.cycles - st.widths.get(1, 0) - st.lookup_cycles - st.datastore_cycles}", flush=True)
    first = names[0]
    for n in names:
        r = arms[n]["ratios"]
        line = f"{n:10s} over target-only: median {statistics.median(r):.3f}x, mean {statistics.mean(r):.3f}x"
        if n != first:
            gain = statistics.geometric_mean([x / y for x, y in zip(r, arms[first]["ratios"])])
            line += f"; {gain:.3f}x {first} prompt by prompt"
        print(line)
    print(f"all outputs equal to target-only: {equal}")


if __name__ == "__main__":
    main()
