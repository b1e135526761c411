"""`dflash bench --replay`: multi-turn conversations replayed through the real server (`dflash serve`).

Each conversation's user turns are sent one after another to /v1/chat/completions (streamed), with the
assistant turns replaced by the server's own replies, so the context grows turn by turn as in a chat. Per
turn: prompt tokens, tokens the prefix cache held (the server's usage.prompt_tokens_details.cached_tokens),
time to the first token and decode tok/s as the client sees them, and whether the reply equals target-only
decoding of the same messages (the Python API with the drafter off, which also gives a cold-prefill TTFT).
With --peer llamacpp the same conversations run through llama-cpp-python, whose generate() keeps the KV
cache of the prefix a call shares with the previous one (its prompt reuse), with its own replies.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPLAY_SCHEMA = "dflash-bench-replay/1"
DEFAULT_CONVERSATIONS = 3


def read_conversations(path: str | Path) -> list[dict]:
    """Conversations from JSONL: {"id", "messages": [{"role", "content"}]} a line. The user (and system)
    messages are replayed in order; assistant messages are dropped (the model's replies take their place)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"replay file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        msgs = row.get("messages") if isinstance(row, dict) else None
        ok = isinstance(msgs, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                            and isinstance(m.get("content"), str) for m in msgs)
        if not ok:
            raise ValueError(f"{where}: expected {{\"id\", \"messages\": [{{\"role\", \"content\"}}, ...]}}")
        kept = [m for m in msgs if m["role"] in ("system", "user")]
        if not any(m["role"] == "user" for m in kept):
            raise ValueError(f"{where}: the conversation has no user message")
        out.append({"id": str(row.get("id", f"{path.stem}-{n}")), "messages": kept})
    if not out:
        raise ValueError(f"{path}: no conversations in the file")
    return out


def conversations_for(spec: str, limit: int | None) -> list[dict]:
    """The conversations of --replay: "sharegpt" (built in: ShareGPT conversations with 8+ user turns) or a file."""
    if spec == "sharegpt":
        from .bench_longctx import sharegpt_multiturn

        return sharegpt_multiturn(limit or DEFAULT_CONVERSATIONS)
    convs = read_conversations(spec)
    return convs[:limit] if limit else convs


def serve_flags(args) -> list[str]:
    """The `dflash serve` flags that load and run the pipeline as this bench's options ask: the model, the
    drafter and its settings, precision, and how generation runs (what `dflash serve` then does by default:
    drafter, prompt lookup, fallback, adaptive width, prefix cache)."""
    flags = ["--device", args.device, "--dtype", args.dtype, "--quantize", args.quantize,
             "--draft-sinks", str(args.draft_sinks), "--draft-vocab" if args.draft_vocab else "--no-draft-vocab"]
    flags += ["--model", str(args.model)] if args.model else []
    flags += ["--no-draft"] if args.no_draft else ["--draft", str(args.draft)]
    for flag, value in (("--draft-window", args.draft_window), ("--block-size", args.block_size),
                        ("--prefill-step-size", args.prefill_step_size)):
        flags += [flag, str(value)] if value is not None else []
    for name, value in (("adaptive", args.adaptive), ("lookup", args.lookup)):
        flags += [] if value is None else [f"--{name}" if value else f"--no-{name}"]
    return flags + (["--cuda-graphs"] if args.cuda_graphs else [])


@contextmanager
def server_process(flags: list[str], log, timeout: float = 600.0) -> Iterator[str]:
    """`dflash serve FLAGS` in a process of its own on a free loopback port, as a user runs it; yields its
    base URL once /health reports the model loaded, and stops it after.

    Not a server thread in this process: this process runs torch too (the target-only references), and
    two threads that both run OpenMP regions on a machine with as many cores as threads make libgomp
    stop spinning between regions (it throttles when it manages more threads than there are CPUs), so
    every parallel region then waits for a thread to wake up: a 135M model's decode step measured 12.8 ms
    against 3.0 in the thread that had loaded it (2 cores). `dflash serve` loads and runs everything in
    its one worker thread, and is timed here the same way."""
    import subprocess
    import tempfile

    import httpx

    from .loading import ModelError

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # (the port stays free for the server to bind: nothing else here asks for one)
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_torch.cli", "serve", "--port", str(port), *flags],
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.time() + timeout
            while True:
                if proc.poll() is not None:  # (a bad model or flag: `dflash bench` prints it, no traceback)
                    err.seek(0)
                    tail = err.read()[-2000:].strip()
                    raise ModelError(f"dflash serve exited with status {proc.returncode} before it was ready: "
                                     f"{tail}")
                if time.time() > deadline:
                    raise ModelError(f"dflash serve was not ready within {timeout:.0f} s")
                try:
                    if httpx.get(base + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            log(f"server ready at {base}: dflash serve {' '.join(flags)}")
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def chat_turn(base: str, messages: list[dict], max_tokens: int, sampling: dict, client=None) -> dict:
    """One streamed chat completion: its text, TTFT and decode tok/s (client side), and the usage. `client`:
    an httpx.Client kept across turns, as chat clients keep theirs (a new one costs ~50 ms of TLS set-up
    before the request even leaves, which would be counted in the TTFT); None: one for this call."""
    import httpx

    if client is None:
        with httpx.Client(timeout=None) as client:
            return chat_turn(base, messages, max_tokens, sampling, client)
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    text, usage, first = [], None, None
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices") or []:
                delta = (c.get("delta") or {}).get("content")
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
    end = time.perf_counter()
    usage = usage or {}
    n = usage.get("completion_tokens", 0)
    first = first or end
    return {"text": "".join(text), "ttft_s": first - t0, "decode_s": end - first, "completion_tokens": n,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def _tok_s(tokens: int, seconds: float) -> float | None:
    return round((tokens - 1) / seconds, 2) if tokens > 1 and seconds > 0 else None


def replay_ours(pipe, conv: dict, max_tokens: int, base: str, sampling: dict, log, cold: str | None = None,
                client=None) -> tuple[list[dict], str | None]:
    """([one record per turn], why it stopped early or None) of one conversation through the server.
    `cold`: a second server of the same pipeline without a prefix cache, whose TTFT for the same request
    (its first token only) is the cold prefill of the same context, timed the same way."""
    from .generate import generate

    messages, turns = [], []
    for m in conv["messages"]:
        messages.append(m)
        if m["role"] != "user":
            continue
        ids = pipe.encode_messages(messages)
        if len(ids) + max_tokens > pipe.max_context:
            why = (f"turn {len(turns) + 1}: {len(ids)} prompt + {max_tokens} tokens exceed the context of "
                   f"{pipe.max_context}")
            log(f"{conv['id']}: stopped at {why}")
            return turns, why
        got = chat_turn(base, messages, max_tokens, sampling, client)
        ref = generate(pipe, ids, max_tokens, use_draft=False)  # target-only, cold prefill
        cold_s = chat_turn(cold, messages, 1, sampling, client)["ttft_s"] if cold else None
        turns.append({
            "turn": len(turns) + 1, "prompt_tokens": got["prompt_tokens"], "cached_tokens": got["cached_tokens"],
            "ttft_s": round(got["ttft_s"], 5), "decode_tok_s": _tok_s(got["completion_tokens"], got["decode_s"]),
            "completion_tokens": got["completion_tokens"],
            "target_only_ttft_s": round(ref.stats.prefill_s, 5),
            "cold_ttft_s": None if cold_s is None else round(cold_s, 5),
            "ttft_over_cold": None if not cold_s else round(got["ttft_s"] / cold_s, 4),
            "output_matches_target_only": got["text"] == ref.text if sampling["temperature"] == 0 else None,
        })
        messages.append({"role": "assistant", "content": got["text"]})
    return turns, None


def replay_llamacpp(peer, pipe, conv: dict, max_tokens: int) -> list[dict]:
    """The conversation through llama-cpp-python with its own replies, reusing the KV cache across turns."""
    peer.llm.reset()
    messages, turns, held = [], [], []
    for m in conv["messages"]:
        messages.append(m)
        if m["role"] != "user":
            continue
        ids = pipe.encode_messages(messages)
        if len(ids) + max_tokens > pipe.max_context:
            break
        reused = 0  # what generate() will keep: the common prefix with the tokens its cache holds
        while reused < min(len(held), len(ids)) and held[reused] == ids[reused]:
            reused += 1
        timing, toks = peer.run_reusing(ids, max_tokens)
        held = ids + toks[:-1]  # the last sampled token has not been evaluated into the cache
        turns.append({"turn": len(turns) + 1, "prompt_tokens": len(ids), "reused_tokens": reused,
                      "ttft_s": round(timing.ttft_s, 5), "decode_tok_s": _tok_s(timing.tokens, timing.decode_s),
                      "completion_tokens": timing.tokens})
        messages.append({"role": "assistant", "content": pipe.decode([t for t in toks if t not in peer.stops])})
    return turns


def cmd_replay(args) -> int:
    """`dflash bench --replay`: run the conversations, print a table, write replay.json / replay.md to --out."""
    import torch

    from .bench import LlamaCppPeer, command_line, llamacpp_gguf, machine_info, parse_lengths, parse_peers, versions
    from .bench_report import write_json
    from .generate import load

    log = lambda msg: print(f"dflash bench: {msg}", file=sys.stderr)
    max_tokens = parse_lengths(args.max_tokens)[0]
    peers = parse_peers(args.peer)
    if args.suite is not None or args.prompts is not None:
        raise ValueError("--replay runs conversations of its own: give it without --suite or --prompts")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    convs = conversations_for(args.replay, args.limit)
    pipe = load(args.model, None if args.no_draft else args.draft, args.device, args.dtype, quantize=args.quantize,
                cuda_graphs=args.cuda_graphs, draft_vocab=args.draft_vocab,
                draft_window=args.draft_window, draft_sinks=args.draft_sinks)
    if pipe.tokenizer is None:
        raise ValueError(f"--replay sends chat messages, and {pipe.model_path} has no tokenizer")
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
                "seed": args.seed}
    sampling = {k: v for k, v in sampling.items() if v is not None}
    # as `dflash serve` runs by default: drafter, prompt lookup, fallback, adaptive width, prefix cache
    flags = serve_flags(args)
    config = dict(block_size=args.block_size, adaptive=args.block_size is None and args.adaptive is not False,
                  lookup=args.lookup, prefill_step_size=args.prefill_step_size, serve_flags=flags)
    results = {
        "schema": REPLAY_SCHEMA, "command": command_line(args), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"name": pipe.name, "path": str(pipe.model_path),
                  "draft": str(pipe.draft_path) if pipe.draft_path else None},
        "machine": machine_info(pipe), "versions": versions(peers),
        "settings": {"replay": args.replay, "max_tokens": max_tokens, "sampling": sampling, "server": config,
                     "peers": peers, "peers_skipped": {}},
        "conversations": [],
    }
    import httpx

    # beside it, the same server without a prefix cache: the cold prefill of each turn's context, timed alike
    with server_process(flags, log) as base, server_process([*flags, "--no-prefix-cache"], log) as cold, \
            httpx.Client(timeout=None) as client:
        for url in (base, cold):
            chat_turn(url, [{"role": "user", "content": "Hi"}], 8, sampling, client)  # warm-up, not counted
        for conv in convs:
            turns, why = replay_ours(pipe, conv, max_tokens, base, sampling, log, cold, client)
            results["conversations"].append({"id": conv["id"], "turns": turns, "stopped": why})
            log(f"{conv['id']}: {len(turns)} turns")
    if "llamacpp" in peers:
        gguf, why = llamacpp_gguf(args.model)
        if why:
            results["settings"]["peers_skipped"]["llamacpp"] = why
            log(f"peer llamacpp skipped: {why}")
        else:
            peer = LlamaCppPeer(gguf, pipe.max_context, pipe.stop_token_ids, torch.get_num_threads())
            for conv, row in zip(convs, results["conversations"]):
                row["llamacpp_turns"] = replay_llamacpp(peer, pipe, conv, max_tokens)
    table = replay_table(results)
    print(table, file=sys.stderr if args.json else sys.stdout)
    if args.out:
        out = Path(args.out).expanduser()
        write_json(out, results)
        (out / "results.json").replace(out / "replay.json")  # not results.json: that name holds the suites' schema
        (out / "replay.md").write_text(f"# dflash bench --replay\n\n```\n{results['command']}\n```\n\n{table}\n")
        log(f"wrote {out}/replay.json, replay.md")
    if args.json:
        print(json.dumps(results))
    return 0


def replay_table(results: dict) -> str:
    """A markdown table: one line per conversation turn (llama.cpp's columns when it ran)."""
    lc = any("llamacpp_turns" in c for c in results["conversations"])
    header = ["Conversation", "Turn", "Prompt", "Cached", "TTFT ms", "Cold TTFT ms", "TTFT / cold", "Decode tok/s",
              "Target-only TTFT ms", "Output = target-only"]
    header += ["llama.cpp reused", "llama.cpp TTFT ms", "llama.cpp tok/s"] if lc else []
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "--:" for i in range(len(header)))
             + "|"]
    for c in results["conversations"]:
        peer = {t["turn"]: t for t in c.get("llamacpp_turns", [])}
        for t in c["turns"]:
            match = {True: "yes", False: "no", None: "-"}[t["output_matches_target_only"]]
            cells = [c["id"], str(t["turn"]), str(t["prompt_tokens"]), str(t["cached_tokens"]),
                     fmt(1000 * t["ttft_s"], ".0f"), fmt(t.get("cold_ttft_s") and 1000 * t["cold_ttft_s"], ".0f"),
                     fmt(t.get("ttft_over_cold"), ".1%"), fmt(t["decode_tok_s"], ".1f"),
                     fmt(1000 * t["target_only_ttft_s"], ".0f"), match]
            if lc:
                p = peer.get(t["turn"])
                cells += ["-", "-", "-"] if p is None else [str(p["reused_tokens"]), fmt(1000 * p["ttft_s"], ".0f"),
                                                           fmt(p["decode_tok_s"], ".1f")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
