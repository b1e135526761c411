"""The `dflash` command: generate, serve, bench, train, models, doctor."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path


def _common_model_args(p: argparse.ArgumentParser, draft: bool = True, decoding: bool = True,
                       quantize: str = "auto") -> None:
    p.add_argument("--model", default=None,
                   help="model directory, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    if draft:
        p.add_argument("--draft", default="auto", help="drafter directory or hub id (default: the registered drafter)")
        p.add_argument("--no-draft", action="store_true", help="target-only decoding")
        p.add_argument("--block-size", type=int, default=None, help="draft block size (default: the drafter's)")
        p.add_argument("--draft-vocab", action=argparse.BooleanOptionalAction, default=True,
                       help="draft logits from the LM head rows of the drafter's draft vocabulary, where it has "
                            "one (draft_vocab.json); --no-draft-vocab: the whole head (default: on)")
        p.add_argument("--draft-window", type=int, default=None, metavar="N",
                       help="the drafter attends to the last N context positions (and the first --draft-sinks) "
                            "instead of all of them: a fixed cost per cycle on long contexts; 0: all (default: "
                            "the drafter's own setting, dflash_config.draft_window, else all)")
        p.add_argument("--draft-sinks", type=int, default=64, metavar="N",
                       help="with --draft-window: the first N positions stay in view (default 64)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--quantize", default=quantize, choices=["auto", "none", "q4_0", "q4_1", "q8_0", "int8", "int4"],
                   help="quantized linear layers in the target and drafter: q4_0 / q4_1 / q8_0 (CPU): GGUF's "
                        "blocks on the exact block kernels; int8 or int4 (CPU): weight-only, PyTorch's kernels; "
                        "auto: on a CPU, a GGUF file's own Q4_0/Q4_1/Q8_0 blocks, int4 for its other 4-bit types "
                        f"(int8 for 5-8 bits), else none (default: {quantize})")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay the target's decode and verify passes as CUDA graphs (CUDA, Llama-family targets)")
    if draft and decoding:  # how generation runs: not for commands that only time passes
        p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                       help="pick the block size per cycle from measured costs and acceptance (default: on for "
                            "generate, chat and serve unless --block-size is given; off for bench)")
        p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                       help="prompt-lookup drafts beside the drafter: copy what followed an earlier occurrence "
                            "of the last tokens (default: on whenever the drafter is used)")
        p.add_argument("--prefill-step-size", type=int, default=None, metavar="N",
                       help="run a prompt in passes of at most N tokens: a long prompt's prefill then needs less "
                            "memory at once (default: one pass)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token the output already has (OpenAI's)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit once per occurrence in the output (OpenAI's)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="tokens of the prompt or the output: a positive logit divided by it, a negative one "
                        "multiplied (transformers'; 1 = off)")
    p.add_argument("--logit-bias", type=json_object, default=None, metavar="JSON",
                   help='added to the logits of token ids, e.g. \'{"2": -100}\'')


def _grammar_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="the output is JSON following this schema (JSON text, or @FILE)")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", default=None, metavar="PATTERN", help="the output matches this regular expression")
    g.add_argument("--lark", default=None, metavar="GRAMMAR",
                   help="the output follows this Lark grammar (text, or @FILE)")


def grammar_from_args(args: argparse.Namespace) -> tuple[str, object] | None:
    """(kind, spec) for `Pipeline.constraint` from the structured-output flags, or None."""
    def text(value: str) -> str:
        if value.startswith("@"):
            try:
                return Path(value[1:]).read_text()
            except OSError as e:
                raise ValueError(f"cannot read {value[1:]}: {e.strerror}") from None
        return value

    from .decoding.structured import grammar

    if args.json_schema is not None:
        try:
            kind, spec = "json_schema", json.loads(text(args.json_schema))
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema is not JSON: {e}") from None
    elif args.json_object:
        kind, spec = "json_object", None
    elif args.regex is not None:
        kind, spec = "regex", args.regex
    elif args.lark is not None:
        kind, spec = "lark", text(args.lark)
    else:
        return None
    grammar(kind, spec)  # a ValueError now, before the model loads
    return kind, spec


def sampler_from_args(args: argparse.Namespace):
    """The Sampler the sampling flags describe (a fresh one: its random generator starts at --seed)."""
    from .decoding.sampling import Sampler

    bias = None
    if args.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in args.logit_bias.items()}
        except (TypeError, ValueError):
            raise ValueError("--logit-bias maps token ids to numbers, e.g. '{\"2\": -100}'") from None
    return Sampler(args.temperature, args.top_p, args.top_k, args.min_p, args.seed,
                   presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                   repetition_penalty=args.repetition_penalty, logit_bias=bias)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from e


def json_object(text: str) -> dict:
    """A command-line JSON object (for --chat-template-args)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def cmd_generate(args: argparse.Namespace) -> int:
    from .decoding.adaptive import use_adaptive
    from .decoding.sampling import TokenLogprobs
    from .decoding.speculative import Stats
    from .generate import Detokenizer, load, stream

    if args.text is not None:
        if args.prompt is not None:
            raise ValueError("give the prompt text once: as an argument or with --prompt, not both")
        args.prompt = args.text
    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    sampler = sampler_from_args(args)
    grammar = grammar_from_args(args)
    pipe = load(args.model, None if args.no_draft else args.draft, args.device, args.dtype, quantize=args.quantize,
                cuda_graphs=args.cuda_graphs, draft_vocab=args.draft_vocab,
                draft_window=args.draft_window, draft_sinks=args.draft_sinks)
    if args.prompt_ids is not None:
        prompt = _parse_ids(args.prompt_ids)
    else:
        prompt = pipe.encode(args.prompt, chat=not args.no_chat_template, template_args=args.chat_template_args)
    controller = fallback = adaptive = None
    if pipe.drafter is not None and not args.no_draft:
        # Speculation only while it pays: drop to target-only when it measures slower. A seeded
        # sampled run keeps a fixed schedule (the random draws depend on the block sizes).
        if not args.no_fallback and (sampler.greedy or sampler.seed is None):
            from .decoding.fallback import FallbackController

            controller = fallback = FallbackController()
        if use_adaptive(args.adaptive, args.block_size, sampler):
            from .decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrated

            adaptive = AdaptiveBlockSize(calibrated(pipe), pipe.drafter.block_size)
            controller = adaptive if fallback is None else WithFallback(fallback, adaptive)
    stats = Stats()
    detok = Detokenizer(pipe)
    ids = []
    if args.logprobs is not None and not args.json:
        raise ValueError("--logprobs is reported in the --json output: add --json")
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        raise ValueError(f"--logprobs must be in [0, 20], got {args.logprobs}")
    lp = TokenLogprobs(args.logprobs) if args.logprobs is not None else None
    constraint = pipe.constraint(*grammar) if grammar is not None else None
    for tok in stream(pipe, prompt, args.max_tokens, block_size=args.block_size,
                      use_draft=not args.no_draft, sampler=sampler, stats=stats, controller=controller,
                      lookup=args.lookup, prefill_chunk=args.prefill_step_size, logprobs=lp, constraint=constraint):
        ids.append(tok)
        if not args.json and pipe.tokenizer is not None:
            sys.stdout.write(detok.add(tok))
            sys.stdout.flush()
    reason = "stop" if ids and ids[-1] in pipe.stop_token_ids else "length"
    if not args.json:
        sys.stdout.write("\n")
    s = stats
    accept = ""
    if s.mode != "target-only":
        accept = f", acceptance length {s.acceptance_length_mean:.2f}, rate {s.acceptance_rate:.0%}"
        if s.lookup_cycles:
            accept += f", {s.lookup_accepted} drafted tokens kept from {s.lookup_cycles} lookup drafts"
        if s.datastore_cycles:
            accept += f", {s.datastore_accepted} from {s.datastore_cycles} datastore drafts"
        if fallback is not None and fallback.fallbacks:
            accept += f", fell back to target-only {fallback.fallbacks}x (speculation was slower)"
    print(
        f"dflash: {s.generated_tokens} tokens, {s.decode_tok_s:.1f} tok/s decode, "
        f"prefill {s.prefill_s * 1000:.0f} ms, {s.cycles} cycles, mode {s.mode}{accept}",
        file=sys.stderr,
    )
    if args.json:
        d = s.as_dict()
        out = {
            "text": pipe.decode(ids),
            "token_ids": ids,
            "finish_reason": reason,
            "stats": {k: d[k] for k in ("generated_tokens", "cycles", "acceptance_length_mean", "acceptance_rate",
                                        "prefill_s", "decode_tok_s")} | {
                "acceptance_per_position": d["acceptance_per_position"], "block_size": d["block_size"],
                "mode": d["mode"], "prompt_tokens": d["prompt_tokens"], "lookup_cycles": d["lookup_cycles"],
                "lookup_drafted": d["lookup_drafted"], "lookup_accepted": d["lookup_accepted"],
                "datastore_cycles": d["datastore_cycles"], "datastore_drafted": d["datastore_drafted"],
                "datastore_accepted": d["datastore_accepted"],
                "verify_widths": d["verify_widths"], "acceptance_lengths": d["acceptance_lengths"],
                "tree_cycles": d["tree_cycles"], "tree_side_kept": d["tree_side_kept"]},
        }
        if lp is not None:
            def text(t: int) -> str:
                return pipe.token_bytes(t).decode("utf-8", errors="replace") if pipe.tokenizer is not None else ""
            out["logprobs"] = [
                {"token_id": t, "token": text(t), "logprob": v,
                 "top_logprobs": [{"token_id": i, "token": text(i), "logprob": x} for i, x in zip(top, vals)]}
                for t, (v, top, vals) in zip(ids, lp.entries)]
        if adaptive is not None:
            used = adaptive.history
            out["stats"]["block_sizes_used"] = {str(b): used.count(b) for b in sorted(set(used))}
        if fallback is not None:
            out["stats"]["fallback_events"] = fallback.events
            if fallback.fallbacks:
                out["stats"]["mode"] = d["mode"] + "+fallback"
        print(json.dumps(out))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from . import registry

    rows = registry.table()
    if args.json:
        print(json.dumps({"registered": rows, "supported_model_types": list(registry.SUPPORTED_TYPES)}))
        return 0
    print("Registered drafters (target base name -> drafter):")
    for r in rows:
        mark = " (shipped)" if r["shipped"] else ""
        print(f"  {r['target']:<32} {r['drafter']}{mark}")
    print("Supported target families (config.json model_type): " + ", ".join(registry.SUPPORTED_TYPES))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import platform

    import torch

    from . import loading, registry

    print(f"python {platform.python_version()} on {platform.machine()}, torch {torch.__version__}")
    print(f"threads: {torch.get_num_threads()}, cuda: {torch.cuda.is_available()}")
    from .models import flat

    probe = flat.script(torch.nn.Identity())  # what decode steps get on a CPU (warns if it cannot compile)
    print(f"torchscript (flat decode and draft passes on CPU): "
          f"{'available' if isinstance(probe, torch.jit.ScriptModule) else 'unavailable: Python flat path'}")
    from . import kernels

    backend = kernels.ensure()  # flat.script above built or loaded them
    narrow = kernels.narrow_rows() if backend == "compiled" else 0
    print("block kernels (q4_0 / q4_1 / q8_0, exact verification): "
          + (f"compiled, {kernels.best_isa()} on this CPU" if backend == "compiled"
             else "PyTorch reference (no C++ compiler found; --quantize auto uses int4/int8)")
          + (f" (1-{narrow - 1} rows on 256-bit VNNI)" if narrow > 1 else ""))
    try:
        print(f"default model GGUF: {loading.default_gguf()}")
    except loading.ModelError as e:
        print(f"default model: {e}")
    print(f"cache: {loading.cache_home()}")
    try:  # what each group of the default model's matrices is stored as and runs as (--quantize auto)
        from .generate import load

        pipe = load(None, draft=None, device="cpu", quiet=True, quantize="auto")
        config = json.loads((pipe.model_path / "config.json").read_text())
        for line in loading.weight_report(pipe.target, config):
            print(f"default model weights, {line}")
    except (loading.ModelError, OSError, ValueError) as e:
        print(f"default model weights: not loaded ({e})")
    shipped = registry.drafter_for(loading.DEFAULT_MODEL_NAME)
    print(f"default drafter: {shipped or 'not shipped in this install (target-only)'}")
    # optional packages: what each one adds, and whether it is here
    from importlib.metadata import PackageNotFoundError, version

    for package, use in (("flash-linear-attention", "Qwen3.5 Gated DeltaNet kernels on CUDA"),
                         ("llama-cpp-python", "dflash bench --peer llamacpp"),
                         ("llguidance", "structured output: response_format, --json-schema, --regex"),
                         ("transformers", "GGUF conversion, other tokenizers, --peer hf, training data")):
        try:
            found = version(package)
        except PackageNotFoundError:
            found = "not installed"
        print(f"{package} ({use}): {found}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="DFlash speculative decoding on PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    _common_model_args(g)
    g.add_argument("--prompt", default=None, help="prompt text (chat template applied)")
    g.add_argument("text", nargs="?", default=None, help="the prompt text, as an alternative to --prompt")
    g.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids")
    g.add_argument("--no-chat-template", action="store_true", help="use the prompt text as is")
    g.add_argument("--chat-template-args", type=json_object, default={}, metavar="JSON",
                   help="variables for the chat template, e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's log-probability under the target and its K best alternatives "
                        "(0-20)")
    g.add_argument("--no-fallback", action="store_true",
                   help="keep speculating even when it measures slower than target-only (to measure a drafter)")
    _sampling_args(g)
    _grammar_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list registered drafters and supported families")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    d = sub.add_parser("doctor", help="check the installation")
    d.set_defaults(func=cmd_doctor)

    # Each of these modules defines its own sub-command (its heavy imports happen when it runs).
    for module in ("chat", "serve.server", "bench", "train", "profile"):
        if importlib.util.find_spec(f"dflash_torch.{module}") is not None:
            importlib.import_module(f"dflash_torch.{module}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .loading import ModelError

    try:
        return args.func(args)
    except (ModelError, ValueError, FileNotFoundError) as e:
        print(f"dflash: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
