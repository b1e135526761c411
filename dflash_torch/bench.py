"""`dflash bench`: target-only vs DFlash decoding speed and draft acceptance on prompt suites.

Protocol: every prompt is tokenized once; for each generation length and repeat, the target-only
baseline and DFlash run on the same token ids one after the other in this process, after a warm-up
that is not counted. Decode tok/s excludes the prefill (TTFT is reported on its own) and is pooled
over the prompts of a repeat (tokens / seconds); the median over repeats is reported. Optional peers
(Hugging Face `generate`, its prompt-lookup decoding, llama.cpp) run afterwards on the same ids, so
their weights are not in memory while ours are measured. The DFlash runs use prompt-lookup drafts too
unless --no-lookup (`--no-draft --lookup`: prompt lookup alone in their place), and the target-only
fallback of generate/serve with --fallback.

Artifacts (--out DIR): results.json, summary.md, throughput.png, acceptance.png. results.json (`SCHEMA`):
  command, created, model {name, path, draft}, baseline_only, note, machine {cpu, cores, torch_threads, torch,
  device, dtype, ...}, versions, settings {suites, max_tokens, repeats, ignore_eos, sampling, peers, lookup,
  fallback, adaptive, ...}, and
  runs: one per suite x length with suite, max_tokens, prompts, baseline_tok_s, dflash_tok_s, speedup,
  acceptance_length_mean, acceptance_rate, acceptance_per_position, ttft_s, peak_memory_mb, hf_tok_s,
  hf_prompt_lookup_tok_s, llamacpp_tok_s, outputs_match, lookup_passes, lookup_accepted_share, datastore_passes,
  datastore_accepted_share, tree_passes, tree_side_kept,
  verify_widths {width: passes; 1 = a plain step}, per_prompt, ...
  (null where not measured).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .bench_longctx import row_fields
from .bench_prompts import SUITES, Prompt, collect_prompts, encode
from .bench_report import PEER_FIELDS, show_table, summary_markdown, write_json, write_plots

SCHEMA = "dflash-bench/1"
PEERS = ("hf", "llamacpp")
WARMUP_TOKENS = 16


# --- measuring ----------------------------------------------------------------------------------


@dataclass
class Timing:
    """One generation: tokens produced, time to the first token, and the decode time after it."""

    tokens: int
    ttft_s: float
    decode_s: float


def pooled_tok_s(timings: list[Timing]) -> float | None:
    """Decode tokens per second over several generations (first tokens excluded: they are prefill)."""
    seconds = sum(t.decode_s for t in timings)
    tokens = sum(max(t.tokens - 1, 0) for t in timings)
    return tokens / seconds if seconds > 0 else None


def median_or_none(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def reset_peak_memory(device) -> None:
    """Start a new peak-memory window (CUDA allocator stats; on Linux, the process' peak RSS)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # "5" resets VmHWM (peak RSS) to the current RSS; without it the peak is since process start
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mb(device) -> float | None:
    """Peak memory since `reset_peak_memory`: allocated tensors on CUDA, process peak RSS elsewhere."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux


def run_ours(pipe, ids: list[int], max_tokens: int, use_draft: bool, args) -> tuple[Timing, object, list[int]]:
    """One generation through this package: (timing, Stats, token ids)."""
    from .cli import sampler_from_args
    from .decoding.speculative import Stats
    from .generate import stream

    stats = Stats()
    sampler = sampler_from_args(args)  # fresh: same seed each run
    controller = fallback = None
    if use_draft and getattr(args, "fallback", False) and pipe.drafter is not None:
        from .decoding.fallback import FallbackController

        controller = fallback = FallbackController()
    if use_draft and getattr(args, "adaptive", False) and pipe.drafter is not None:
        from .decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrate

        if getattr(args, "_costs", None) is None:  # calibrated once per bench run
            args._costs = calibrate(pipe.target, pipe.drafter)
        controller = AdaptiveBlockSize(dict(args._costs), pipe.drafter.block_size)
        controller = controller if fallback is None else WithFallback(fallback, controller)
    lookup = getattr(args, "lookup", None)
    lookup = use_draft and (pipe.drafter is not None if lookup is None else lookup)
    out = list(stream(pipe, ids, max_tokens, block_size=args.block_size, use_draft=use_draft, sampler=sampler,
                      stop_token_ids=[] if args.ignore_eos else None, stats=stats, controller=controller,
                      lookup=lookup, prefill_chunk=getattr(args, "prefill_step_size", None)))
    return Timing(stats.generated_tokens, stats.prefill_s, stats.decode_s), stats, out


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HFPeer:
    """Hugging Face transformers `generate` on the same model directory, float32, greedy."""

    name = "hf"

    def __init__(self, pipe, ignore_eos: bool) -> None:
        import torch
        import transformers

        from . import loading

        # generation-config chatter and the weight-loading bar would break our progress bar
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.torch, self.device = torch, pipe.device
        self.model = loading.hf_model(pipe.model_path, torch.float32)
        self.model = self.model.to(pipe.device).eval()
        self.stops = [] if ignore_eos else list(pipe.stop_token_ids)
        self.ignore_eos = ignore_eos

    def run(self, ids: list[int], max_tokens: int, prompt_lookup: bool = False) -> Timing:
        torch = self.torch
        kwargs = {"prompt_lookup_num_tokens": 10} if prompt_lookup else {}
        if self.ignore_eos:
            kwargs["min_new_tokens"] = max_tokens  # suppresses EOS so every run reaches the full length
        clock = _FirstTokenClock()
        x = torch.tensor([ids], device=self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=self.stops or None, pad_token_id=self.stops[0] if self.stops else 0,
                streamer=clock, **kwargs,
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        first = clock.first or end
        return Timing(out.shape[1] - len(ids), first - t0, end - first)


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the GGUF file, greedy, on our token ids."""

    name = "llamacpp"

    def __init__(self, gguf: Path, n_ctx: int, stops: list[int], threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, verbose=False)
        self.stops = set(stops)

    def run(self, ids: list[int], max_tokens: int) -> Timing:
        # generate(reset=True) keeps the KV cache of a common prefix: a repeat of the same prompt would then
        # skip its prefill, so its TTFT would not be a prefill. Every bench run starts from an empty cache.
        self.llm.reset()
        return self.run_reusing(ids, max_tokens)[0]

    def run_reusing(self, ids: list[int], max_tokens: int) -> tuple[Timing, list[int]]:
        """(timing, tokens) of one generation that reuses the KV cache of the prefix it shares with the
        previous call (llama-cpp-python's prompt reuse), as a multi-turn chat does."""
        out, first = [], None
        t0 = time.perf_counter()
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(tok)
            first = first or time.perf_counter()
            if tok in self.stops or len(out) >= max_tokens:
                break
        end = time.perf_counter()
        return Timing(len(out), (first or end) - t0, end - (first or end)), out


def llamacpp_gguf(model: str | None) -> tuple[Path | None, str | None]:
    """(GGUF path, None) for the llama.cpp peer, or (None, why it cannot run)."""
    from . import loading

    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama-cpp-python is not installed (pip install llama-cpp-python)"
    if model is None:
        try:
            return loading.default_gguf(), None
        except loading.ModelError as e:
            return None, str(e)
    if Path(model).suffix == ".gguf" and Path(model).expanduser().is_file():
        return Path(model).expanduser(), None
    return None, f"it needs a GGUF model file (--model FILE.gguf); {model!r} is not one"


# --- the run ------------------------------------------------------------------------------------


@dataclass
class Row:
    """Everything measured for one suite at one generation length."""

    suite: str
    max_tokens: int
    prompts: list[tuple[Prompt, list[int]]]
    skipped: list[str] = field(default_factory=list)
    # engine -> one list of Timings (one per prompt) per repeat
    timings: dict[str, list[list[Timing]]] = field(default_factory=dict)
    stats: list = field(default_factory=list)  # DFlash Stats of every run
    outputs_match: bool | None = None
    peak_memory_mb: float | None = None
    block_size: int | None = None

    def tok_s(self, engine: str) -> float | None:
        return median_or_none([pooled_tok_s(r) for r in self.timings.get(engine, [])])

    def ttft(self, engine: str) -> float | None:
        return median_or_none([t.ttft_s for r in self.timings.get(engine, []) for t in r])

    def to_dict(self) -> dict:
        """This row in the results.json schema (fields that were not measured are null)."""
        base, dfl = self.tok_s("baseline"), self.tok_s("dflash")
        drafted, accepted, lengths = [], [], []
        for s in self.stats:
            lengths += s.acceptance_lengths
            for k, (d, a) in enumerate(zip(s.drafted_per_position, s.accepted_per_position)):
                if k == len(drafted):
                    drafted.append(0)
                    accepted.append(0)
                drafted[k] += d
                accepted[k] += a
        has_draft = "dflash" in self.timings
        lookup_kept = sum(s.lookup_accepted for s in self.stats)
        store_kept = sum(s.datastore_accepted for s in self.stats)
        kept_all = sum(s.accepted_tokens for s in self.stats)
        d = {
            "suite": self.suite,
            "max_tokens": self.max_tokens,
            "prompts": len(self.prompts),
            "skipped_prompts": self.skipped,
            "repeats": len(self.timings.get("baseline", [])),
            "baseline_tok_s": _r(base, 4),
            "dflash_tok_s": _r(dfl, 4),
            "speedup": _r(dfl / base, 4) if dfl is not None and base else None,
            "acceptance_length_mean": _r(sum(lengths) / len(lengths), 4) if lengths else None,
            "acceptance_rate": _r(sum(accepted) / sum(drafted), 4) if sum(drafted) else None,
            "acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)],
            "drafted_per_position": drafted,
            "verify_passes": len(lengths),
            # passes per width (1 = a plain step): what the fallback, --adaptive and prompt lookup chose
            "verify_widths": _sum_widths(self.stats),
            "lookup_passes": sum(s.lookup_cycles for s in self.stats),
            # passes over a tree of drafts, and of those the ones that kept a path off the first choices
            "tree_passes": sum(s.tree_cycles for s in self.stats),
            "tree_side_kept": sum(s.tree_side_kept for s in self.stats),
            # shares of the accepted drafted tokens that came from prompt lookup and from the drafter's datastore
            # (the rest: the drafter itself)
            "lookup_accepted_share": _r(lookup_kept / kept_all, 4) if kept_all else None,
            "datastore_passes": sum(s.datastore_cycles for s in self.stats),
            "datastore_accepted_share": _r(store_kept / kept_all, 4) if kept_all else None,
            "block_size": self.block_size,
            "ttft_s": _r(self.ttft("dflash" if has_draft else "baseline"), 5),
            "baseline_ttft_s": _r(self.ttft("baseline"), 5),
            "peak_memory_mb": _r(self.peak_memory_mb, 1),
            "generated_tokens_mean": _r(_mean_tokens(self.timings.get("baseline", [])), 1),
            "outputs_match": self.outputs_match,
            "baseline_tok_s_repeats": [_r(pooled_tok_s(r), 4) for r in self.timings.get("baseline", [])],
            "dflash_tok_s_repeats": [_r(pooled_tok_s(r), 4) for r in self.timings.get("dflash", [])],
        }
        for engine, key in PEER_FIELDS.items():
            d[key] = _r(self.tok_s(engine), 4)
        d.update(row_fields(self))  # prefill tok/s, the peers' TTFT, acceptance early and late
        d["per_prompt"] = self.per_prompt()
        return d

    def per_prompt(self) -> list[dict]:
        """Medians over repeats for each prompt, to find the prompts that drive a row's numbers."""
        n = len(self.prompts)
        out = []
        for i, (p, ids) in enumerate(self.prompts):
            d = {"id": p.id, "prompt_tokens": len(ids)}
            for engine in ("baseline", "dflash", *PEER_FIELDS):
                reps = self.timings.get(engine)
                if reps:
                    d[f"{engine}_tok_s"] = _r(median_or_none([pooled_tok_s([r[i]]) for r in reps]), 4)
            d["generated_tokens"] = median_or_none([r[i].tokens for r in self.timings.get("baseline", [])])
            lengths = [x for s in self.stats[i::n] for x in s.acceptance_lengths]
            d["acceptance_length_mean"] = _r(sum(lengths) / len(lengths), 4) if lengths else None
            out.append(d)
        return out


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _mean_tokens(repeats: list[list[Timing]]) -> float | None:
    all_t = [t.tokens for r in repeats for t in r]
    return sum(all_t) / len(all_t) if all_t else None


def parse_lengths(text: str) -> list[int]:
    """"256,512" -> [256, 512]."""
    try:
        lengths = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--max-tokens must be comma-separated integers, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--max-tokens needs positive lengths, got {text!r}")
    return lengths


def parse_peers(values: list[str] | None) -> list[str]:
    """--peer hf --peer llamacpp, or --peer hf,llamacpp -> ["hf", "llamacpp"]."""
    peers = []
    for v in values or []:
        for p in v.split(","):
            p = p.strip().lower()
            if not p:
                continue
            if p not in PEERS:
                raise ValueError(f"unknown --peer {p!r}; choose from {', '.join(PEERS)}")
            if p not in peers:
                peers.append(p)
    return peers


def machine_info(pipe) -> dict:
    """What the numbers were measured on."""
    import torch

    from .loading import cpu_name

    info = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": str(pipe.device),
        "dtype": str(pipe.dtype).removeprefix("torch."),
        "quantize": getattr(pipe, "quantize", None),
        "lm_head": getattr(pipe, "lm_head", None),
        # tokens the drafter proposes from (its draft vocabulary), None: the whole vocabulary
        "draft_vocab": (None if getattr(pipe.drafter, "draft_vocab", None) is None
                        else len(pipe.drafter.draft_vocab)),
        "cuda_graphs": getattr(pipe.target, "use_graphs", False),  # a cudagraph.GraphedTarget
        "draft_window": getattr(pipe.drafter, "window", None),  # (sinks, size) the drafter attends to; None: all
        "platform": platform.platform(),
        "python": platform.python_version(),
        "memory": "torch.cuda.max_memory_allocated" if pipe.device.type == "cuda" else "peak RSS of the process",
    }
    if pipe.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(pipe.device)
    return info


def versions(peers: list[str]) -> dict:
    out = {"python": platform.python_version()}
    names = ["dflash-torch", "torch", "transformers", "tokenizers", "numpy"]
    if "llamacpp" in peers:
        names.append("llama_cpp_python")
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def command_line(args: argparse.Namespace) -> str:
    """The full command, every option with its effective value, so it reproduces the run."""
    parts = ["dflash", "bench"]
    for flag, dest, is_switch in args._flags:
        value = getattr(args, dest)
        if is_switch and isinstance(flag, tuple):  # --x / --no-x: None (the default) prints nothing
            parts += [] if value is None else [flag[0] if value else flag[1]]
        elif is_switch:
            parts += [flag] if value else []
        elif isinstance(value, list):
            for v in value:
                parts += [flag, str(v)]
        elif value is not None:
            parts += [flag, str(value)]
    return shlex.join(parts)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table; write artifacts to --out; --json prints the results last."""
    from tqdm import tqdm

    from .generate import check_lengths, load

    if getattr(args, "replay", None) is not None:  # a multi-turn conversation through the server instead
        from .bench_replay import cmd_replay

        return cmd_replay(args)
    lengths = parse_lengths(args.max_tokens)
    peers = parse_peers(args.peer)
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    suites = collect_prompts(args.suite, args.prompts, args.limit)
    command = command_line(args)
    out_dir = Path(args.out).expanduser() if args.out else None
    log = lambda msg: print(f"dflash bench: {msg}", file=sys.stderr)

    pipe = load(args.model, None if args.no_draft else args.draft, args.device, args.dtype, quantize=args.quantize,
                cuda_graphs=args.cuda_graphs, draft_vocab=args.draft_vocab,
                draft_window=args.draft_window, draft_sinks=args.draft_sinks)
    if args.suite == "longctx":  # built from the model's own tokenizer, so only now
        from .bench_longctx import longctx_suites

        suites = longctx_suites(pipe, args.limit) | suites
    encoded = {name: [(p, encode(pipe, p)) for p in ps] for name, ps in suites.items()}
    lookup_only = pipe.drafter is None and args.lookup is True  # --no-draft --lookup: prompt lookup alone
    engines = ["baseline"] + (["dflash"] if pipe.drafter is not None or lookup_only else [])
    note = None
    if pipe.drafter is None and not lookup_only:
        note = f"no drafter for {pipe.name}: baseline (target-only) only"
        log(note)

    rows = []
    for name, prompts in encoded.items():
        for n in lengths:
            row = Row(name, n, [])
            for p, ids in prompts:
                try:
                    check_lengths(pipe, ids, n)
                    row.prompts.append((p, ids))
                except ValueError as e:
                    row.skipped.append(p.id)
                    log(f"skipping {name}/{p.id} at {n} tokens: {e}")
            rows.append(row)
    if not any(r.prompts for r in rows):
        raise ValueError("no prompt fits the model's context at the requested --max-tokens")

    # Peers are set up now so that an unusable one is reported before the long run, not after it.
    peer_skips: dict[str, str] = {}
    gguf = None
    if "llamacpp" in peers:
        gguf, why = llamacpp_gguf(args.model)
        if why:
            peer_skips["llamacpp"] = why
            log(f"peer llamacpp skipped: {why}")
    runnable_peers = [p for p in peers if p not in peer_skips]
    peer_engines = (["hf", "hf_prompt_lookup"] if "hf" in runnable_peers else []) + (
        ["llamacpp"] if "llamacpp" in runnable_peers else [])

    results = {
        "schema": SCHEMA,
        "command": command,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"name": pipe.name, "path": str(pipe.model_path),
                  "draft": str(pipe.draft_path) if pipe.draft_path else None},
        "baseline_only": engines == ["baseline"],
        "note": note,
        "machine": machine_info(pipe),
        "versions": versions(peers),
        "settings": {
            "suites": list(encoded), "max_tokens": lengths, "repeats": args.repeats, "ignore_eos": args.ignore_eos,
            "block_size": args.block_size, "limit": args.limit, "peers": peers, "peers_skipped": peer_skips,
            "lookup": engines[-1] == "dflash" and (pipe.drafter is not None if args.lookup is None else args.lookup),
            "fallback": args.fallback, "adaptive": args.adaptive, "prefill_step_size": args.prefill_step_size,
            "peer_interleave": bool(getattr(args, "peer_interleave", False)),
            "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                         "min_p": args.min_p, "seed": args.seed},
            "peer_sampling": "greedy",
            "warmup_tokens": WARMUP_TOKENS,
        },
        "runs": [],
    }

    total = sum(len(r.prompts) for r in rows) * args.repeats * (len(engines) + len(peer_engines))
    bar = tqdm(total=total, unit="gen", desc="bench", file=sys.stderr, dynamic_ncols=True)

    # Warm-up (not counted): first calls pay for lazy initialisation, allocator growth and kernel selection.
    first, warm_n = warmup_request(rows)
    for engine in engines:
        run_ours(pipe, first, warm_n, engine == "dflash", args)
    interleaved = []  # --peer-interleave: the peers' runners, used prompt by prompt right after ours
    if peer_engines and getattr(args, "peer_interleave", False):
        interleaved = peer_runners(pipe, rows, runnable_peers, gguf, args)

    greedy = args.temperature == 0
    for row in rows:
        if not row.prompts:
            continue
        reset_peak_memory(pipe.device)
        outputs: dict[str, list[list[int]]] = {e: [] for e in engines}
        for _ in range(args.repeats):
            for engine in [*engines, *(name for name, _fn in interleaved)]:
                row.timings.setdefault(engine, []).append([])
            for _p, ids in row.prompts:
                for engine in engines:
                    bar.set_description(f"{row.suite} {row.max_tokens} {engine}")
                    timing, stats, toks = run_ours(pipe, ids, row.max_tokens, engine == "dflash", args)
                    row.timings[engine][-1].append(timing)
                    outputs[engine].append(toks)
                    if engine == "dflash":
                        row.stats.append(stats)
                        row.block_size = stats.block_size
                    speed = max(timing.tokens - 1, 0) / max(timing.decode_s, 1e-9)
                    bar.set_postfix_str(f"{timing.tokens} tok, {speed:.1f} tok/s")
                    bar.update()
                for engine, fn in interleaved:  # --peer-interleave: the same prompt, right after ours
                    bar.set_description(f"{row.suite} {row.max_tokens} {engine}")
                    row.timings[engine][-1].append(fn(ids, row.max_tokens))
                    bar.update()
        row.peak_memory_mb = peak_memory_mb(pipe.device)
        if "dflash" in engines and greedy:  # greedy DFlash is lossless: a mismatch is a bug worth surfacing
            row.outputs_match = outputs["baseline"] == outputs["dflash"]
            if not row.outputs_match:
                log(f"warning: {row.suite} @ {row.max_tokens}: DFlash output differs from target-only output")
        results["runs"] = [r.to_dict() for r in rows if r.timings]
        if out_dir:  # partial results survive an interrupted long run
            write_json(out_dir, results)

    if peer_engines and not interleaved:
        run_peers(pipe, rows, runnable_peers, gguf, args, bar, log)
    bar.close()
    results["runs"] = [r.to_dict() for r in rows if r.timings]

    show_table(results, to_stderr=args.json)
    if out_dir:
        write_json(out_dir, results)
        (out_dir / "summary.md").write_text(summary_markdown(results))
        write_plots(results, out_dir, log)
        log(f"wrote {out_dir}/results.json, summary.md, throughput.png, acceptance.png")
    if args.json:
        print(json.dumps(results))
    return 0


def _sum_widths(stats: list) -> dict[str, int]:
    total: dict[int, int] = {}
    for s in stats:
        for w, n in s.widths.items():
            total[w] = total.get(w, 0) + n
    return {str(w): n for w, n in sorted(total.items())}


def warmup_request(rows: list[Row]) -> tuple[list[int], int]:
    """(prompt ids, max tokens) of the warm-up: the first prompt, at a length known to fit the context."""
    row = next(r for r in rows if r.prompts)
    return row.prompts[0][1], min(WARMUP_TOKENS, row.max_tokens)


def peer_runners(pipe, rows: list[Row], peers: list[str], gguf: Path | None, args) -> list[tuple]:
    """[(engine, run(ids, max_tokens) -> Timing)] for the peers, loaded and warmed up (not counted)."""
    import torch

    runners = []
    if "hf" in peers:
        hf = HFPeer(pipe, args.ignore_eos)
        runners += [("hf", lambda ids, n: hf.run(ids, n)), ("hf_prompt_lookup", lambda ids, n: hf.run(ids, n, True))]
    if "llamacpp" in peers:
        longest = max(len(ids) for r in rows for _, ids in r.prompts) + max(r.max_tokens for r in rows)
        lc = LlamaCppPeer(gguf, min(pipe.max_context, longest + 8), [] if args.ignore_eos else pipe.stop_token_ids,
                          torch.get_num_threads())
        runners.append(("llamacpp", lc.run))
    first, warm_n = warmup_request(rows)
    for _, fn in runners:  # warm-up, not counted
        fn(first, warm_n)
    return runners


def run_peers(pipe, rows: list[Row], peers: list[str], gguf: Path | None, args, bar, log) -> None:
    """The same prompts through the peer engines (after ours, so their weights were not resident then)."""
    runners = peer_runners(pipe, rows, peers, gguf, args)
    for row in rows:
        if not row.prompts:
            continue
        for _ in range(args.repeats):
            for engine, _fn in runners:
                row.timings.setdefault(engine, []).append([])
            for _p, ids in row.prompts:
                for engine, fn in runners:
                    bar.set_description(f"{row.suite} {row.max_tokens} {engine}")
                    row.timings[engine][-1].append(fn(ids, row.max_tokens))
                    bar.update()


# --- output -------------------------------------------------------------------------------------


def add_parser(sub) -> None:
    """Register `dflash bench` on the `dflash` sub-command parser."""
    from .cli import _common_model_args, _sampling_args

    b = sub.add_parser("bench", help="benchmark target-only vs DFlash decoding on prompt suites",
                       description=__doc__.split("\n\n")[0])
    _common_model_args(b, quantize="none")  # the README's bench commands measure float32 unless told
    b.add_argument("--suite", default=None, choices=[*SUITES, "all", "longctx"],
                   help="built-in prompt suite (default: chat, unless --prompts is given; all: the short suites; "
                        "longctx: prompts of about 2k, 4k and 7k tokens)")
    b.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help='your prompts, one JSON object a line: {"id", "prompt"}, {"id", "messages"} '
                   'or {"id", "prompt_ids"}')
    b.add_argument("--max-tokens", default="256,512,1024,2048", metavar="N[,N...]",
                   help="comma-separated generation lengths (default: %(default)s)")
    b.add_argument("--repeats", type=int, default=3,
                   help="runs per prompt and length; the median is reported (default: %(default)s)")
    b.add_argument("--ignore-eos", action="store_true", help="never stop early: every run generates --max-tokens")
    b.add_argument("--limit", type=int, default=None, metavar="N", help="first N prompts of each suite")
    b.add_argument("--out", default=None, metavar="DIR", help="write results.json, summary.md and PNG plots here")
    b.add_argument("--json", action="store_true", help="print the results JSON as the last line of stdout")
    b.add_argument("--fallback", action="store_true",
                   help="DFlash runs use the target-only fallback of generate and serve (default: off)")
    b.add_argument("--peer", action="append", default=None, metavar="hf|llamacpp",
                   help="also run a peer engine on the same prompts (repeatable or comma-separated)")
    b.add_argument("--peer-interleave", action="store_true",
                   help="run the peers prompt by prompt right after ours, so that a row's engines see the same "
                        "machine load (default: after all of ours; interleaved, the peak memory column also "
                        "counts the peers, which then live in the same process)")
    b.add_argument("--replay", nargs="?", const="sharegpt", default=None, metavar="FILE.jsonl|sharegpt",
                   help="instead of the suites: replay multi-turn conversations through `dflash serve` (JSONL of "
                        '{"id", "messages"}; without FILE or "sharegpt": built-in ShareGPT ones), one turn after '
                        "another with the model's own replies; the first --max-tokens value per turn")
    _sampling_args(b)
    flags = [(tuple(a.option_strings) if isinstance(a, argparse.BooleanOptionalAction) else a.option_strings[-1],
              a.dest, a.nargs == 0) for a in b._actions if a.option_strings and a.dest != "help"]
    b.set_defaults(func=cmd_bench, _flags=flags)
