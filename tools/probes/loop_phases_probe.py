"""Where a pass of the loop `dflash serve` runs spends its time (drafter, prompt lookup, datastore, adaptive width,
fallback; greedy, no stop token, 512 tokens): the target's forward, the rest of the verify (acceptance, deferred
LM head rows), the offers, the draft, the commit and the proposers' bookkeeping, per pass, beside target-only
decoding's step. The loop is `speculative._speculate` with timers between its statements (the same calls in the
same order); each suite's first prompt, the second of two runs (the first warms the controllers).

    python tools/probes/loop_phases_probe.py [--widths]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from dflash_torch.bench_prompts import collect_prompts, encode
from dflash_torch.decoding import speculative as S
from dflash_torch.decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrated
from dflash_torch.decoding.fallback import FallbackController
from dflash_torch.decoding.lookup import VerifyCosts
from dflash_torch.decoding.proposers import plain_step, ranked
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load

T: dict[str, float] = collections.defaultdict(float)
W: dict[tuple, list[float]] = collections.defaultdict(list)  # (width, tree, source) -> each verify's seconds


def timed_speculate(target, token, cache, proposers, rules, taps, max_new_tokens, stops, stats, logprobs):
    """speculative._speculate with timers (no logprobs)."""
    device, t0 = S._device(target), time.perf_counter()
    while True:
        remaining = max_new_tokens - stats.generated_tokens
        t_cycle = time.perf_counter()
        pos = cache.length
        offers = ranked([p.offer(remaining) for p in proposers])
        t1 = time.perf_counter()
        draft = None
        for offer in offers:
            draft = offer.proposer.draft(token, remaining, device)
            if draft is not None:
                break
        draft = draft or plain_step(token, device)
        t2 = time.perf_counter()
        out, rows, bonus, logits = S._verify(target, draft, cache, taps, rules)
        t3 = time.perf_counter()
        accepted = len(rows) - 1
        tokens = draft.token_list()
        new = S._committed([tokens[r] for r in rows[1:]] + [bonus], remaining, stops)
        rules.commit(new)
        hidden = out.hidden
        if draft.parents is not None:
            rows = rows[: len(new)]
            cache.keep_rows(pos, rows)
            hidden = hidden[:, rows] if hidden is not None else None
            stats.record_tree(rows)
        cache.crop(pos + len(new))
        now = time.perf_counter()
        for p in proposers:
            p.observe(draft, accepted, new, hidden, now - t_cycle)
        stats.record_cycle(draft.width - 1, accepted, len(new), source=getattr(draft.source, "name", None))
        stats.generated_tokens += len(new)
        stats.decode_s = now - t0
        t4 = time.perf_counter()
        T["offers"] += t1 - t_cycle
        T["draft"] += t2 - t1
        T["verify"] += t3 - t2
        W[draft.width, draft.parents is not None, getattr(draft.source, "name", "plain")].append(t3 - t2)
        T["commit"] += now - t3
        T["observe, record"] += t4 - now
        T["passes"] += 1
        yield from new
        token = new[-1]
        if token in stops or stats.generated_tokens >= max_new_tokens:
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", action="store_true", help="also each kind of pass's verify time (width, source)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    S._speculate = timed_speculate
    p = load(draft="auto", quantize="auto", quiet=True)
    flat_pass = p.target._flat  # the pass itself, which the loops call (speculative._runner) or forward does

    def timed_pass(*args, **kw):
        t = time.perf_counter()
        out = flat_pass(*args, **kw)
        T["forward"] += time.perf_counter() - t
        return out

    p.target._flat = timed_pass
    adaptive, carry, costs = AdaptiveBlockSize(dict(calibrated(p)), p.drafter.block_size), None, VerifyCosts()
    print("ms per pass; verify includes the forward")
    for suite, prompts in collect_prompts("all", None, 1).items():
        ids = encode(p, prompts[0])
        for _ in range(2):
            T.clear()
            W.clear()
            st, fallback = Stats(), FallbackController(carried=carry)
            list(generate_tokens(p.target, ids, max_new_tokens=a.tokens, drafter=p.drafter, stop_token_ids=[],
                                 stats=st, controller=WithFallback(fallback, adaptive), lookup=True,
                                 lookup_costs=costs))
            carry = fallback.carry()
        n = T.pop("passes")
        parts = ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in T.items())
        T.clear()
        ref = Stats()
        list(generate_tokens(p.target, ids, max_new_tokens=a.tokens, stop_token_ids=[], stats=ref))
        steps = a.tokens - 1
        print(f"{suite:9s} {n:.0f} passes, {st.decode_s / n * 1e3:.3f} ms a pass ({parts}); target-only "
              f"{ref.decode_s / steps * 1e3:.3f} ms a step (forward {T['forward'] / steps * 1e3:.3f})", flush=True)
        if a.widths:  # each kind of pass's verify, median ms (count) and over the target-only step
            step = ref.decode_s / steps
            print("  " + "; ".join(f"{w}{' tree' if tree else ''} {src} {statistics.median(v) * 1e3:.2f} ({len(v)}, "
                                   f"{statistics.median(v) / step:.2f})" for (w, tree, src), v in sorted(W.items())))


if __name__ == "__main__":
    main()
