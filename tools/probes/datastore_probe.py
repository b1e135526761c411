"""The drafter's datastore (decoding/datastore.py) in the loop `dflash serve` runs (drafter, prompt lookup, adaptive
width, fallback; greedy, no stop token), with and without it, prompt by prompt in alternating order, each arm with its
own controllers carried from prompt to prompt as a server carries them; the speed of each over the same prompt's
target-only decoding, and every output compared with target-only output.

    python tools/probes/datastore_probe.py --limit 3 --tokens 512
    python tools/probes/datastore_probe.py --limit 3 --tokens 512 --other runs/store.npz   # shipped vs another
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflash_torch.bench_prompts import collect_prompts, encode
from dflash_torch.decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrated
from dflash_torch.decoding.datastore import Datastore
from dflash_torch.decoding.fallback import FallbackController
from dflash_torch.decoding.lookup import VerifyCosts
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load


def serve_arm(p) -> dict:
    """One arm's state, carried from prompt to prompt as a server carries it: the adaptive width (calibrated on
    `p`), the fallback's carried verdict, prompt lookup's measured verify costs."""
    return {"adaptive": AdaptiveBlockSize(dict(calibrated(p)), p.drafter.block_size), "carry": None,
            "costs": VerifyCosts()}


def serve_reply(p, ids: list[int], tokens: int, arm: dict) -> tuple[list[int], Stats]:
    """`tokens` greedy tokens for `ids` in the loop `dflash serve` runs (drafter, lookup, adaptive, fallback)."""
    fallback = FallbackController(carried=arm["carry"])
    st = Stats()
    out = list(generate_tokens(p.target, ids, max_new_tokens=tokens, drafter=p.drafter, stop_token_ids=[], stats=st,
                               controller=WithFallback(fallback, arm["adaptive"]), lookup=True,
                               lookup_costs=arm["costs"]))
    arm["carry"] = fallback.carry()
    return out, st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=3, help="first N prompts of each bench suite")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--other", help="a datastore .npz to compare with the shipped one (instead of none)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    p = load(draft="auto", quantize="auto", quiet=True)
    store = p.drafter.datastore
    if store is None:
        raise SystemExit("datastore_probe: the drafter ships no datastore.npz")
    try:
        stores = ({"without": None, "with": store} if a.other is None
                  else {"shipped": store, "other": Datastore.load(a.other)})
    except ValueError as e:
        raise SystemExit(f"datastore_probe: {e}") from None
    first, second = stores
    arms = {name: serve_arm(p) for name in stores}
    ratios: dict[str, list[float]] = {a: [] for a in stores}
    equal = True
    for suite, prompts in collect_prompts("all", None, a.limit).items():
        for i, prompt in enumerate(prompts):
            ids = encode(p, prompt)
            st = Stats()
            ref = list(generate_tokens(p.target, ids, max_new_tokens=a.tokens, stop_token_ids=[], stats=st))
            base = st.decode_tok_s
            for arm in ((first, second) if i % 2 == 0 else (second, first)):
                p.drafter.datastore = stores[arm]
                out, st = serve_reply(p, ids, a.tokens, arms[arm])
                equal &= out == ref
                ratios[arm].append(st.decode_tok_s / base)
                print(f"{arm:7s} {suite:9s} target-only {base:6.1f} -> {st.decode_tok_s:6.1f} tok/s "
                      f"({st.decode_tok_s / base:.3f}x), {st.acceptance_length_mean:.3f} tokens per pass; "
                      f"lookup kept {st.lookup_accepted} of {st.lookup_drafted}, datastore {st.datastore_accepted} of "
                      f"{st.datastore_drafted} in {st.datastore_cycles} passes", flush=True)
    p.drafter.datastore = store
    for arm, r in ratios.items():
        print(f"{arm:7s} over target-only: median {statistics.median(r):.3f}x, mean {statistics.mean(r):.3f}x "
              f"({len(r)} prompts)")
    better = sum(w > wo for w, wo in zip(ratios[second], ratios[first]))
    gain = statistics.geometric_mean([w / wo for w, wo in zip(ratios[second], ratios[first])])
    print(f"{second} faster than {first} on {better} of {len(ratios[second])} prompts ({gain:.3f}x prompt by prompt, "
          f"geometric mean); all outputs equal to target-only: {equal}")


if __name__ == "__main__":
    main()
