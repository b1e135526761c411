"""The loop `dflash serve` runs (the suites' first LIMIT prompts, no stop token), recording every verify pass whose LM
head waits (`speculative._defers_head`): its width, its source, the offer's expected kept drafts and the drafts kept,
into runs/defer_TOKENS_LIMIT.json (read by the analysis written out in defer_head.txt).

    python docs/bench/cpu-epyc-zen4-headroom/defer_stats.py TOKENS [LIMIT]
"""

import json
import sys

import torch

from dflash_torch.bench_prompts import collect_prompts, encode
from dflash_torch.decoding import speculative as S
from dflash_torch.decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrated
from dflash_torch.decoding.fallback import FallbackController
from dflash_torch.decoding.lookup import VerifyCosts
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load

OFFERS: dict[int, float] = {}  # id(proposer) -> its offer's expected kept drafts, this cycle
RECORDS: list[tuple] = []


def main() -> None:
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    tokens = int(sys.argv[1])
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    p = load(draft="auto", quantize="auto", quiet=True)
    adaptive = AdaptiveBlockSize(dict(calibrated(p)), p.drafter.block_size)
    ranked, accept = S.ranked, S._accept

    def ranked_recorded(offers):
        r = ranked(offers)
        OFFERS.clear()
        OFFERS.update({id(o.proposer): o.expected for o in r})
        return r

    def accept_recorded(target, out, draft, rules):
        res = accept(target, out, draft, rules)
        if out.final is not None:  # the head waited
            RECORDS.append((draft.width, getattr(draft.source, "name", "?"), OFFERS.get(id(draft.source)),
                            len(res[0]) - 1))
        return res

    S.ranked, S._accept = ranked_recorded, accept_recorded
    carry = None
    for prompts in collect_prompts("all", None, limit).values():
        for prompt in prompts:
            fallback = FallbackController(carried=carry)
            list(generate_tokens(p.target, encode(p, prompt), max_new_tokens=tokens, drafter=p.drafter,
                                 stop_token_ids=[], stats=Stats(), controller=WithFallback(fallback, adaptive),
                                 lookup=True, lookup_costs=VerifyCosts()))
            carry = fallback.carry()
    with open(f"runs/defer_{tokens}_{limit}.json", "w") as f:
        json.dump(RECORDS, f)
    print(len(RECORDS), "deferred passes")


if __name__ == "__main__":
    main()
