"""`dflash profile`: where one cycle's time goes, and the speedup ceiling it implies.

For each block size B it times one target decode step, one verify pass over B positions and one
draft pass, and prints the best possible speedup for an acceptance length tau:
    speedup <= tau * t_decode / (t_verify(B) + t_draft(B)).
With --ops it also lists the heaviest operators of a decode step (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from .decoding.proposers import DrafterProposer
from .decoding.sampling import Sampler
from .decoding.speculative import HEAD_FIRST_ROWS, Stats


def _time_rounds(fns: dict, repeats: int) -> dict:
    """Median seconds of each function, timed in rounds that call each of them once: a machine whose
    speed drifts over seconds then slows or speeds all of them alike, so their ratios hold."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) for key, t in times.items()}


@torch.inference_mode()
def profile_pipeline(pipe, sizes: list[int], context: int = 128, repeats: int = 10) -> dict:
    """Median seconds of a decode step, and of verify and draft passes per block size (timed in rounds
    that run each once, so that a drift in the machine's speed does not skew their ratios)."""
    target, drafter = pipe.target, pipe.drafter
    device = target.embed_tokens.weight.device
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    taps = drafter.target_layer_ids if drafter else ()
    cache = target.new_cache(context + max(sizes) + 1)
    out = target(prompt, cache, logits="last", taps=taps)
    last = int(prompt[0, -1])  # the token a draft block starts from

    def step(b):
        cache.crop(context)
        target(prompt[:, :b], cache, logits="all" if b > 1 else "last", taps=taps)

    def short(b):  # a greedy cycle that keeps fewer than HEAD_FIRST_ROWS drafts: the head on those rows only
        cache.crop(context)
        target.head(target(prompt[:, :b], cache, logits="rows", taps=taps).final[:HEAD_FIRST_ROWS])

    fns = {("decode", 1): lambda: step(1)}
    for b in sizes:
        fns[("verify", b)] = lambda b=b: step(b)
        if b > HEAD_FIRST_ROWS and getattr(target, "defers_head", None) is not None and target.defers_head(b):
            fns[("short", b)] = lambda b=b: short(b)
        if drafter is not None and 1 < b <= drafter.block_size:
            # the draft as a greedy cycle makes it: the loop's own proposer (a tree of b - 1 candidates and the
            # selector's chances where the target verifies trees, else a chain; the draft vocabulary's rows)
            prop = DrafterProposer(drafter, target, b, context + b + 1, out.hidden, Sampler(), None, None, None,
                                   Stats(), None)
            # the first cycle's draft also fuses the whole prompt's features; later ones only a few:
            # time the steady state, with the context already cached and a handful of new features
            prop.draft(last, b, device)
            steady, seen = out.hidden[:, :4], prop.cache.length  # seen: fewer slots than positions if windowed

            def draft_steady(prop=prop, steady=steady, seen=seen, b=b):
                prop.cache.crop(seen - 4)
                prop.pending = [steady]
                prop.draft(last, b, device)

            fns[("draft", b)] = draft_steady
    t = _time_rounds(fns, repeats)
    return {"context": context, "decode_s": t[("decode", 1)],
            "verify_s": {b: t[("verify", b)] for b in sizes},
            "draft_s": {b: t[("draft", b)] for b in sizes if ("draft", b) in t},
            "verify_short_s": {b: t[("short", b)] for b in sizes if ("short", b) in t}}


def cmd_profile(args: argparse.Namespace) -> int:
    from .generate import load

    pipe = load(args.model, None if args.no_draft else args.draft, args.device, args.dtype, quantize=args.quantize,
                cuda_graphs=args.cuda_graphs, draft_vocab=args.draft_vocab,
                draft_window=args.draft_window, draft_sinks=args.draft_sinks)
    sizes = [int(s) for s in args.sizes.split(",")]
    r = profile_pipeline(pipe, sizes, args.context, args.repeats)
    d = r["decode_s"]
    print(f"threads {torch.get_num_threads()}, device {pipe.device}, dtype {pipe.dtype}, context {args.context}")
    vocab = getattr(pipe.drafter, "draft_vocab", None)
    if vocab is not None:
        print(f"draft passes: LM head rows of the drafter's draft vocabulary ({len(vocab)} tokens; "
              "--no-draft-vocab for the whole head)")
    print(f"decode step: {d * 1e3:.2f} ms ({1 / d:.1f} tok/s)")
    head = f"{'B':>3} {'verify ms':>10} {'draft ms':>9} {'cycle/decode':>13}"
    print(head + f" {'ceiling tau=2':>14} {'tau=3':>6} {'tau=4':>6}")
    for b in sizes:
        v, dr = r["verify_s"][b], r["draft_s"].get(b, 0.0)
        ratio = (v + dr) / d
        ceil = " ".join(f"{t / ratio:6.2f}" for t in (2, 3, 4))
        print(f"{b:>3} {v * 1e3:>10.2f} {dr * 1e3:>9.2f} {ratio:>13.2f}  {ceil}")
    if r["verify_short_s"]:  # greedy verify passes run the LM head on the rows they read (speculative._accept)
        print(f"verify passes that keep fewer than {HEAD_FIRST_ROWS} drafts (the LM head on {HEAD_FIRST_ROWS} "
              "rows): " + ", ".join(f"B={b} {s * 1e3:.2f} ms ({s / d:.2f} decode steps)"
                                   for b, s in r["verify_short_s"].items()))
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        cache = pipe.target.new_cache(args.context + 2)
        ids = torch.randint(0, pipe.target.config.vocab_size, (1, args.context)).to(pipe.device)
        with torch.inference_mode():
            pipe.target(ids, cache)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.repeats):
                    cache.crop(args.context)
                    pipe.target(ids[:, :1], cache)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if args.json:
        print(json.dumps(r))
    return 0


def add_parser(sub) -> None:
    from .cli import _common_model_args

    p = sub.add_parser("profile", help="time decode, verify and draft passes; print the speedup ceiling")
    _common_model_args(p, decoding=False, quantize="none")
    p.add_argument("--sizes", default="2,4,8,16", help="block sizes to time")
    p.add_argument("--context", type=int, default=128, help="tokens already in the cache")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--ops", action="store_true", help="also list the heaviest operators of a decode step")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile)
