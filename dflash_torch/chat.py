"""`dflash chat`: talk to a model in the terminal.

Each turn's prompt is the whole conversation through the chat template; the prefix cache keeps the
last turn's caches, so only the new message is prefilled (as `dflash serve` does). Replies stream as
they are decided, by speculative decoding with the same fallback as `generate` and `serve`.
Commands: /reset (forget the conversation), /exit (or end of input). Ctrl-C stops a reply.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    from .cli import _common_model_args, _grammar_args, _sampling_args, json_object

    p = sub.add_parser("chat", help="chat with a model in the terminal (multi-turn, prefix cache)")
    _common_model_args(p)
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--max-tokens", type=int, default=512, help="longest reply, in tokens")
    p.add_argument("--chat-template-args", type=json_object, default={}, metavar="JSON",
                   help="variables for the chat template, e.g. '{\"enable_thinking\": false}'")
    _sampling_args(p)
    _grammar_args(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    """Read messages from stdin, stream replies to stdout, one statistics line per reply to stderr."""
    from .cli import grammar_from_args, sampler_from_args
    from .decoding.adaptive import use_adaptive
    from .decoding.fallback import FallbackController
    from .decoding.prefix_cache import PrefixCache
    from .decoding.speculative import Stats, generate_tokens
    from .generate import Detokenizer, check_lengths, load

    if args.max_tokens < 1 or (args.prefill_step_size is not None and args.prefill_step_size < 1):
        raise ValueError("--max-tokens and --prefill-step-size must be >= 1")
    sampler = sampler_from_args(args)
    grammar = grammar_from_args(args)
    pipe = load(args.model, None if args.no_draft else args.draft, args.device, args.dtype, quantize=args.quantize,
                cuda_graphs=args.cuda_graphs, draft_vocab=args.draft_vocab,
                draft_window=args.draft_window, draft_sinks=args.draft_sinks)
    pipe._need_tokenizer()  # chat is text: a model without a tokenizer cannot take part
    # Reuse is exact with quantized weights: `load` makes their prefills attend one query at a time.
    prefix = PrefixCache()
    use_draft = pipe.drafter is not None and not args.no_draft
    lookup = use_draft if args.lookup is None else args.lookup
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    carry = None  # the fallback's state at the end of the last reply (speculation was slower: stay off)
    adaptive = None
    if use_draft and use_adaptive(args.adaptive, args.block_size, sampler):
        from .decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrated

        # seconds per cycle by block size, measured once on this machine (kept in the cache)
        adaptive = AdaptiveBlockSize(calibrated(pipe), pipe.drafter.block_size)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:  # not on every platform
            pass
    print(f"dflash chat: {pipe.name}; /reset forgets the conversation, /exit or Ctrl-D ends it", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = list(system)
            print("dflash chat: conversation forgotten", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        ids = pipe.encode_messages(messages, args.chat_template_args)
        max_tokens = min(args.max_tokens, pipe.max_context - len(ids))  # a reply may use what is left
        try:
            if max_tokens < 1:
                raise ValueError(f"the conversation ({len(ids)} tokens) fills the model's context of "
                                 f"{pipe.max_context} tokens")
            check_lengths(pipe, ids, max_tokens)
        except ValueError as e:
            messages.pop()
            print(f"dflash chat: {e}; /reset starts a new conversation", file=sys.stderr)
            continue
        controller = fallback = None
        if use_draft and (sampler.greedy or sampler.seed is None):
            controller = fallback = FallbackController(carried=carry)
        if adaptive is not None:  # one estimator for the whole conversation: what a reply learned carries on
            adaptive.history.clear()
            controller = adaptive if fallback is None else WithFallback(fallback, adaptive)
        stats, detok, reply = Stats(), Detokenizer(pipe), []
        gen = generate_tokens(pipe.target, ids, max_new_tokens=max_tokens, drafter=pipe.drafter if use_draft else None,
                              block_size=args.block_size, stop_token_ids=pipe.stop_token_ids, sampler=sampler,
                              stats=stats, controller=controller, lookup=lookup, prefix=prefix,
                              prefill_chunk=args.prefill_step_size,
                              constraint=pipe.constraint(*grammar) if grammar is not None else None)
        try:
            for token in gen:
                if token in pipe.stop_token_ids:
                    break
                reply.append(token)
                sys.stdout.write(detok.add(token))
                sys.stdout.flush()
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        finally:
            gen.close()
        print()
        if fallback is not None:
            carry = fallback.carry()
        messages.append({"role": "assistant", "content": pipe.decode(reply)})
        cached = f", {stats.cached_tokens} of {len(ids)} prompt tokens cached" if stats.cached_tokens else ""
        print(f"dflash: {len(reply)} tokens, {stats.decode_tok_s:.1f} tok/s, first token after "
              f"{stats.prefill_s * 1000:.0f} ms{cached}, mode {stats.mode}", file=sys.stderr)
