"""The Python the loop `dflash serve` runs calls around each pass (drafter, prompt lookup, datastore, adaptive width,
fallback; greedy, no stop token, 512 tokens, the bench's first chat and code prompts, the second of two runs): each
timed call's count, its seconds per pass of the loop, and its median per call. `block_size` is the controller's
choice of width, asked on every cycle the drafter's offer comes first (it then declines where the width is 1).

    python docs/bench/cpu-avx2-zen3/loop_calls.py
"""

import collections
import statistics
import time

import torch

from dflash_torch.bench_prompts import collect_prompts, encode
from dflash_torch.decoding import proposers as P
from dflash_torch.decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrated
from dflash_torch.decoding.fallback import FallbackController
from dflash_torch.decoding.lookup import VerifyCosts
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load

T: dict[str, list[float]] = collections.defaultdict(list)


def timed(name, f):
    def call(*a, **k):
        t = time.perf_counter()
        out = f(*a, **k)
        T[name].append(time.perf_counter() - t)
        return out
    return call


def main() -> None:
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    p = load(draft="auto", quantize="auto", quiet=True)
    adaptive, costs = AdaptiveBlockSize(dict(calibrated(p)), p.drafter.block_size), VerifyCosts()
    WithFallback.block_size = timed("block_size", WithFallback.block_size)
    P.LookupProposer.offer = timed("lookup offer", P.LookupProposer.offer)
    P.LookupProposer.observe = timed("lookup observe", P.LookupProposer.observe)
    P.DrafterProposer.observe = timed("drafter observe", P.DrafterProposer.observe)
    P.DrafterProposer.draft = timed("drafter draft", P.DrafterProposer.draft)
    prompts = collect_prompts("all", None, 1)
    for suite in ("chat", "code"):
        ids = encode(p, prompts[suite][0])
        for _ in range(2):  # the first run warms up
            T.clear()
            st = Stats()
            list(generate_tokens(p.target, ids, max_new_tokens=512, drafter=p.drafter, stop_token_ids=[], stats=st,
                                 controller=WithFallback(FallbackController(), adaptive), lookup=True,
                                 lookup_costs=costs))
        n = st.cycles
        print(f"{suite}: {n} passes, {st.decode_s / n * 1e3:.3f} ms a pass; " + "; ".join(
            f"{k} {len(v)} calls, {sum(v) / n * 1e3:.3f} ms a pass, median {statistics.median(v) * 1e3:.3f} ms"
            for k, v in T.items()), flush=True)


if __name__ == "__main__":
    main()
