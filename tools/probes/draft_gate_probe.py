"""How much any choice of when to draft could get from the drafter here: the drafter alone (no lookup, no fallback,
chains) at a fixed width W on the held-out prompts (`--quantize auto`, greedy), each cycle's outcome (drafts kept)
beside two signals known at its start or after its draft pass: the target's probability of the token it just chose
(known before drafting) and the drafter's own probability of its first draft (known only after the draft pass).

From those records and `dflash profile`'s costs of a plain step, a W-row verify pass and a W-wide draft (measured in
the same process, after 128 positions), tokens per second over a target-only step for these policies, each cycle
priced alone (a bound: the real loop's cycles would fall elsewhere):

  always          draft every cycle at width W
  own p1 >= t     draft every cycle, verify the draft only where the drafter's first choice had p1 >= t (else the
                  pass is a plain step: the draft pass is paid either way); the best t
  free gate       as "own p1 >= t", but as if that signal came without the draft pass (a predictor as good as the
                  drafter's confidence, for free); the best t
  oracle          a plain step wherever no draft would be kept, a W-wide cycle elsewhere: no policy does better

    python tools/probes/draft_gate_probe.py --width 2
    python tools/probes/draft_gate_probe.py --width 4 --per-kind 4 --tokens 256
"""

from __future__ import annotations

import argparse

import torch

from dflash_torch import data
from dflash_torch.decoding import proposers, speculative
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load
from dflash_torch.profile import profile_pipeline

BUCKETS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 1.01)


def table(rec: list[tuple[float, int]], label: str) -> None:
    print(f"by {label}:")
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        s = [kept for p, kept in rec if lo <= p < hi]
        if s:
            print(f"  [{lo:.2f}, {min(hi, 1.0):.2f}) {len(s):5d} cycles ({len(s) / len(rec):4.0%}): first draft kept "
                  f"{sum(k >= 1 for k in s) / len(s):.2f}, drafts kept {sum(s) / len(s):.2f}")


def rate(cycles: list[tuple[float, float]], t_step: float) -> float:
    """Tokens per second over a target-only step's: cycles as (tokens, seconds)."""
    return sum(n for n, _ in cycles) * t_step / sum(s for _, s in cycles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2, help="verify width W (the drafter drafts W - 1 tokens)")
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=60, help="rounds for the costs (dflash profile's)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    p = load(quantize="auto", quiet=True)
    proposers.TREES = False  # chains: the drafter's first choices
    drafter, propose, verify = p.drafter, p.drafter.propose, speculative._verify
    seen: dict = {}
    rec: list[tuple[float, float, int]] = []  # (target's p of its last token, drafter's p1, drafts kept)

    def recording_propose(target, block, ctx, cache, full=True):
        logits = propose(target, block, ctx, cache, full)
        seen["p1"] = logits[0, 0].float().softmax(-1).max().item()
        return logits

    def recording_verify(target, draft, cache, taps, rules):
        out, rows, bonus, logits = verify(target, draft, cache, taps, rules)
        if draft.width > 1 and "target_p" in seen:
            rec.append((seen["target_p"], seen["p1"], len(rows) - 1))
        # the target's probability of the token it chose at the last kept row: known before the next draft
        seen["target_p"] = logits[len(rows) - 1].float().softmax(-1).max().item()
        return out, rows, bonus, logits

    drafter.propose, speculative._verify = recording_propose, recording_verify
    for chats in data.heldout_prompts(args.per_kind, args.per_kind, args.per_kind).values():
        for msgs in chats:
            seen.clear()
            ids = data.encode_chat(p.tokenizer, msgs)
            list(generate_tokens(p.target, ids, max_new_tokens=args.tokens, drafter=drafter, block_size=args.width,
                                 stop_token_ids=p.stop_token_ids, stats=Stats()))
    drafter.propose, speculative._verify = propose, verify
    prof = profile_pipeline(p, [args.width], repeats=args.repeats)
    step, ver, dra = prof["decode_s"], prof["verify_s"][args.width], prof["draft_s"][args.width]
    print(f"width {args.width}: {len(rec)} drafter cycles; plain step {1e3 * step:.2f} ms, verify {1e3 * ver:.2f} ms "
          f"({ver / step:.2f} steps), draft {1e3 * dra:.2f} ms ({dra / step:.2f} steps)")
    table([(t, k) for t, _, k in rec], "the target's probability of its last token (before the draft)")
    table([(d, k) for _, d, k in rec], "the drafter's probability of its first draft (after the draft)")
    always = rate([(k + 1, dra + ver) for _, _, k in rec], step)
    oracle = rate([(k + 1, dra + ver) if k else (1, step) for _, _, k in rec], step)
    gates = [i / 20 for i in range(21)]
    own = max((rate([(k + 1, dra + ver) if d >= t else (1, dra + step) for _, d, k in rec], step), t) for t in gates)
    free = max((rate([(k + 1, dra + ver) if d >= t else (1, step) for _, d, k in rec], step), t) for t in gates)
    print(f"tokens/s over target-only: always {always:.3f}; own p1 >= {own[1]:.2f} {own[0]:.3f}; "
          f"free gate p1 >= {free[1]:.2f} {free[0]:.3f}; oracle {oracle:.3f}")


if __name__ == "__main__":
    main()
