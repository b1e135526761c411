"""Two drafters in the loop `dflash serve` runs (drafter, prompt lookup, the drafter's datastore, adaptive width,
fallback; greedy, no stop token), prompt by prompt in alternating order, each with its own controllers carried from
prompt to prompt as a server carries them; the speed of each over the same prompt's target-only decoding, and every
output compared with target-only output.

    python tools/probes/drafter_ab_probe.py --other runs/sel12/drafter --limit 3 --tokens 512
"""

from __future__ import annotations

import argparse
import statistics

import torch
from datastore_probe import serve_arm, serve_reply  # (this folder: a script's own is on the path)

from dflash_torch.bench_prompts import collect_prompts, encode
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="auto", help="the first drafter (default: the model's registered one)")
    ap.add_argument("--other", required=True, help="the second drafter (its datastore.npz, if any, with it)")
    ap.add_argument("--limit", type=int, default=3, help="first N prompts of each bench suite")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    arms = {}
    for name, draft in (("first", a.draft), ("other", a.other)):
        p = load(draft=draft, quantize="auto", quiet=True)
        arms[name] = {"p": p, **serve_arm(p), "ratios": []}
    equal = True
    for suite, prompts in collect_prompts("all", None, a.limit).items():
        for i, prompt in enumerate(prompts):
            p0 = arms["first"]["p"]
            ids = encode(p0, prompt)
            st = Stats()
            ref = list(generate_tokens(p0.target, ids, max_new_tokens=a.tokens, stop_token_ids=[], stats=st))
            base = st.decode_tok_s
            for name in (("first", "other") if i % 2 == 0 else ("other", "first")):
                s = arms[name]
                out, st = serve_reply(s["p"], ids, a.tokens, s)
                equal &= out == ref
                s["ratios"].append(st.decode_tok_s / base)
                print(f"{name:5s} {suite:9s} target-only {base:6.1f} -> {st.decode_tok_s:6.1f} tok/s "
                      f"({st.decode_tok_s / base:.3f}x), {st.acceptance_length_mean:.3f} tokens per pass, "
                      f"{st.tree_cycles} tree passes", flush=True)
    for name, s in arms.items():
        r = s["ratios"]
        print(f"{name:5s} over target-only: median {statistics.median(r):.3f}x, mean {statistics.mean(r):.3f}x")
    pairs = list(zip(arms["other"]["ratios"], arms["first"]["ratios"]))
    print(f"other faster than first on {sum(o > f for o, f in pairs)} of {len(pairs)} prompts "
          f"({statistics.geometric_mean([o / f for o, f in pairs]):.3f}x prompt by prompt, geometric mean); "
          f"all outputs equal to target-only: {equal}")


if __name__ == "__main__":
    main()
