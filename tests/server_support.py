"""Shared helpers of the server tests (tests/test_server_*.py): `dflash serve` run in-process on a random
loopback port.

The model is a tiny random Llama with a real character-level tokenizer and chat template (the zlab
fixture has no tokenizer), so the official `openai` client can talk to it in text. The fixtures here
(one_thread, chat_model, pipe, server) are module-scoped: a test module binds the ones its tests use to
names of its own (one_thread, which is autouse, always; chat_model wherever pipe or server is used) and gets
its own instances.
"""

from __future__ import annotations

import json
import socket
import string
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch

from dflash_torch.generate import Pipeline, generate, load
from dflash_torch.serve.app import create_app
from dflash_torch.serve.engine import ServerConfig

from .conftest import make_drafter, make_hf_model

SPECIALS = ["[UNK]", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
TEMPLATE = (  # `preamble`: a template variable, for --chat-template-args / chat_template_kwargs
    "{{ preamble | default('') }}{% if tools %}<|system|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a haiku about rain"}]
OK_MSGS = [{"role": "user", "content": "hi"}]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def make_chat_model(path: Path, specials: list[str] = SPECIALS, **overrides) -> tuple[Path, Path]:
    """A tiny random Llama whose vocab is a character-level tokenizer with a chat template, and a
    random drafter for it: (target dir, drafter dir). `overrides`: config values (make_hf_model)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    # One token per printable ASCII character (a BPE without merges splits text into characters);
    # the last id is the drafter's mask token.
    chars = list(dict.fromkeys(string.printable[:95] + "\n"))
    vocab = {t: i for i, t in enumerate(specials + chars + ["<|mask|>"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials + ["<|mask|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|end|>")
    fast.chat_template = TEMPLATE
    target = make_hf_model("llama", path / "target", vocab_size=len(vocab), eos_token_id=vocab["<|end|>"],
                           bos_token_id=None, pad_token_id=None, **overrides)
    fast.save_pretrained(target)
    return target, make_drafter(target, path / "draft")


class ScriptedDrafter:
    """Wraps a real drafter (which keeps its cache in step) and replaces its proposals: `script` is
    the full token sequence to propose from (the target's own greedy continuation: an oracle); past
    it, or without one, it proposes `wrong`, a token the target never picks here. `delay` seconds per
    proposal make a slow drafter."""

    def __init__(self, real, script: list[int] = (), wrong: int = 0, delay: float = 0.0) -> None:
        self.real, self.script, self.wrong, self.delay = real, list(script), wrong, delay
        self.block_size, self.mask_token_id = real.block_size, real.mask_token_id
        self.target_layer_ids = real.target_layer_ids

    def new_cache(self, max_len: int):
        return self.real.new_cache(max_len)

    def propose(self, target, block, ctx, cache):
        logits = self.real.propose(target, block, ctx, cache)
        time.sleep(self.delay)
        pos = cache.length  # the drafter has taken in ctx: this is the position of the block's first token
        want = [self.script[i] if i < len(self.script) else self.wrong for i in range(pos + 1, pos + block.shape[1])]
        out = torch.full_like(logits, -1e4)
        out[0, torch.arange(len(want)), torch.tensor(want)] = 1e4
        return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Two shared cores: intra-op threads on these tiny matrices only fight each other (~20x slower).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> tuple[Path, Path]:
    return make_chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def pipe(chat_model) -> Pipeline:
    return load(str(chat_model[0]), str(chat_model[1]), device="cpu", dtype="float32")


@contextmanager
def serve(pipe: Pipeline | None = None, loader=None, **config) -> Iterator[str]:
    """Run the app under uvicorn in a thread on a free loopback port; yield its base URL once it is up."""
    import uvicorn

    app = create_app(ServerConfig(**config), loader=loader or (lambda: pipe))
    # proto IPPROTO_TCP, as uvicorn's own sockets have it: asyncio sets TCP_NODELAY only on such sockets, and
    # without it every response waited ~40 ms for the client's delayed ACK (Nagle), counted in each TTFT
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    if loader is None:
        while httpx.get(base + "/health").status_code != 200:
            assert time.time() < deadline, "model did not become ready"
            time.sleep(0.02)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def server(pipe) -> Iterator[str]:
    with serve(pipe, fastpath_max_tokens=4) as base:
        yield base


def client(base: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)


def solo(pipe: Pipeline, ids: list[int], max_tokens: int) -> str:
    """The reference: target-only greedy text from the Python API."""
    return generate(pipe, ids, max_tokens, use_draft=False).text


def metrics_json(base: str) -> dict:
    return httpx.get(base + "/metrics", params={"format": "json"}).json()


def sse_text(lines: Iterator[str]) -> tuple[str, list[dict]]:
    """(concatenated delta text, the parsed chunks) of a streamed chat or completion."""
    chunks = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in chunks if c.get("choices"))
    return text, chunks


def script_generation(pipe: Pipeline, monkeypatch) -> dict:
    """Make the server's generations the token ids of script["text"] (one token per character) and then
    a stop token: for behaviour the tiny random model cannot show (tool calls, reasoning)."""
    from dflash_torch.serve import engine as engine_module

    script = {"text": ""}

    def scripted(target, prompt, *, max_new_tokens, **kw):
        yield from pipe.encode(script["text"], chat=False)[:max_new_tokens]
        yield pipe.stop_token_ids[0]

    monkeypatch.setattr(engine_module, "generate_tokens", scripted)
    return script
