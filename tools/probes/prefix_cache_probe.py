"""Time to first token over a conversation, with and without the prefix cache (docs/performance.md).

Runs the same multi-turn chat through the default model and drafter twice, the way `dflash serve` runs
requests (drafter, prompt lookup, greedy): once with a prefix cache, once without. Each turn's prompt is
the conversation so far (earlier replies included) and a new user message. Prints per turn the prompt
length, the tokens taken from the cache, the prefill time both ways and whether the replies are equal.

    python tools/probes/prefix_cache_probe.py --quantize int4
    python tools/probes/prefix_cache_probe.py --quantize int4 --disk   # every later turn read back from files

With quantized weights the server makes prefills attend one query at a time (`quantize.exact_prefill`), so
that reused keys and values are the ones a cold prefill computes; `--fused-prefill` shows what happens
without that.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from dflash_torch.decoding.prefix_cache import DiskStore, PrefixCache
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import load
from dflash_torch.models.quantize import exact_prefill

TURNS = [
    "Explain what a hash table is, with a short Python example.",
    "How does it handle collisions?",
    "Compare that with a binary search tree in a few sentences.",
    "Which one would you use for an autocomplete feature, and why?",
    "Summarise our conversation in three bullet points.",
]


def conversation(pipe, prefix: PrefixCache | None, max_tokens: int, replies: list[str] | None = None,
                 between: bool = False):
    """[(prompt tokens, cached tokens, seconds to the first token, reply ids, reply text)] per turn. With
    `replies`, those are the conversation's earlier answers instead of this run's own (so that two runs
    see the same prompts even where their replies differ). `between`: another short conversation runs
    before each turn (with a one-entry prefix cache it pushes this one out to the disk store)."""
    messages, rows = [], []
    for i, text in enumerate(TURNS):
        if between:
            other = pipe.encode_messages([{"role": "user", "content": f"Say the number {i}."}])
            list(generate_tokens(pipe.target, other, max_new_tokens=4, drafter=pipe.drafter, prefix=prefix))
        messages.append({"role": "user", "content": text})
        prompt = pipe.encode_messages(messages)
        stats = Stats()
        t0 = time.perf_counter()
        reply = []
        for token in generate_tokens(pipe.target, prompt, max_new_tokens=max_tokens, drafter=pipe.drafter,
                                     stop_token_ids=pipe.stop_token_ids, stats=stats, lookup=True, prefix=prefix):
            if not reply:
                first = time.perf_counter() - t0
            reply.append(token)
        text = pipe.decode([t for t in reply if t not in pipe.stop_token_ids])
        rows.append((len(prompt), stats.cached_tokens, first, reply, text))
        messages.append({"role": "assistant", "content": replies[i] if replies else text})
    return rows


@torch.inference_mode()
def prefill_cost(pipe, lengths: list[int]) -> None:
    """A cold prefill's time with fused attention and one query at a time (best of 3 each)."""
    attn = [m for m in pipe.target.modules() if hasattr(m, "exact_max_t")]

    def best(n: int) -> float:
        times = []
        for _ in range(3):
            cache = pipe.target.new_cache(n)
            ids = torch.randint(0, 40000, (1, n), generator=torch.Generator().manual_seed(n))
            t0 = time.perf_counter()
            pipe.target(ids, cache, logits="last")
            times.append(time.perf_counter() - t0)
        return min(times)

    print("prompt tokens  prefill fused  one query at a time")
    for n in lengths:
        saved = [m.exact_max_t for m in attn]
        fused = best(n)
        exact_prefill(pipe.target)
        each = best(n)
        for m, v in zip(attn, saved):
            m.exact_max_t = v
        print(f"{n:13d}  {fused * 1e3:10.0f} ms  {each * 1e3:13.0f} ms (+{100 * (each / fused - 1):.0f}%)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", default=None, choices=["int8", "int4"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-cost", metavar="N,N,...", default=None,
                   help="instead: time cold prefills of these lengths, fused and one query at a time")
    p.add_argument("--disk", action="store_true",
                   help="warm run with one entry in memory and a disk store, another conversation between turns")
    p.add_argument("--fused-prefill", action="store_true",
                   help="quantized: keep the fused prefill attention (what the server does not do)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load(None, "auto", "cpu", "float32", quiet=True, quantize=args.quantize)
    if args.prefill_cost:
        return prefill_cost(pipe, [int(n) for n in args.prefill_cost.split(",")])
    if args.quantize and not args.fused_prefill:
        exact_prefill(pipe.target)  # as `dflash serve` does with a prefix cache: reuse is then exact
    conversation(pipe, PrefixCache(), 8)  # warm-up
    cold = conversation(pipe, None, args.max_tokens)
    if args.disk:
        with tempfile.TemporaryDirectory() as tmp:
            prefix = PrefixCache(max_entries=1, disk=DiskStore(tmp, 1 << 34))
            warm = conversation(pipe, prefix, args.max_tokens, replies=[row[4] for row in cold], between=True)
            print(f"{prefix.disk_hits} turns read back from disk")
    else:
        warm = conversation(pipe, PrefixCache(), args.max_tokens, replies=[row[4] for row in cold])
    print("turn  prompt  cached  time to first token: cold    warm   same reply  first difference at token")
    for i, (c, w) in enumerate(zip(cold, warm), 1):
        diff = next((k for k, (a, b) in enumerate(zip(c[3], w[3])) if a != b), None)
        print(f"{i:4d}  {w[0]:6d}  {w[1]:6d}  {c[2] * 1e3:24.1f} ms {w[2] * 1e3:6.1f} ms  {str(c[3] == w[3]):10s}  "
              f"{'-' if diff is None else diff}")


if __name__ == "__main__":
    main()
