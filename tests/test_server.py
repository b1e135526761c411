"""`dflash serve`: the OpenAI-compatible server, run in-process on a random loopback port.

The model is a tiny random Llama with a real character-level tokenizer and chat template (the zlab
fixture has no tokenizer), so the official `openai` client can talk to it in text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import socket
import string
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch

from dflash_torch import cli, loading
from dflash_torch.decoding.fallback import FallbackController
from dflash_torch.decoding.speculative import generate_tokens
from dflash_torch.generate import Pipeline, generate, load
from dflash_torch.serve.app import create_app
from dflash_torch.serve.engine import ServerConfig, TextStream
from dflash_torch.serve.openai_api import parse_messages
from dflash_torch.serve.responses_api import responses_to_chat
from dflash_torch.serve.server import parse_bytes

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


# --- the OpenAI API -----------------------------------------------------------------------------


def test_openai_client_matches_generate(server, pipe, chat_model, capsys):
    c = client(server)
    want = generate(pipe, pipe.encode_messages(MSGS), 40)
    assert want.text == solo(pipe, pipe.encode_messages(MSGS), 40)  # lossless, as a sanity check

    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=40)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(pipe.encode_messages(MSGS)), 40)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 40

    s = c.chat.completions.create(model="tiny", messages=MSGS, max_completion_tokens=40, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(s)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40

    ids = pipe.encode("Once upon a time", chat=False)
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30)
    assert r.choices[0].text == solo(pipe, ids, 30) and r.usage.prompt_tokens == len(ids)
    s = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30, stream=True)
    assert "".join(ch.choices[0].text for ch in s) == solo(pipe, ids, 30)
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=30)  # token ids work too (vLLM)
    assert r.choices[0].text == solo(pipe, ids, 30)

    # list-of-parts content is joined; `dflash generate` gives the same text as the server
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    r = c.chat.completions.create(model="tiny", messages=parts, max_tokens=20)
    assert r.choices[0].message.content == solo(pipe, pipe.encode("Hello\nthere"), 20)
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(chat_model[0]), "--draft", str(chat_model[1]), "--device", "cpu",
                     "--prompt", "Hello\nthere", "--max-tokens", "20", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] == r.choices[0].message.content

    assert [m.id for m in c.models.list().data] == [str(chat_model[0])]
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_stop_strings_are_cut_streamed_or_not(server, pipe):
    full = solo(pipe, pipe.encode_messages(MSGS), 60)
    stop = full[25:28]
    want = full[: full.find(stop)]
    body = {"messages": MSGS, "max_tokens": 60, "stop": ["never-there", stop]}
    r = httpx.post(server + "/v1/chat/completions", json=body).json()
    assert r["choices"][0]["message"]["content"] == want and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < 60
    # streamed: the text that could start the stop string is held back, so it never goes out
    with httpx.stream("POST", server + "/v1/chat/completions", json=body | {"stream": True}) as resp:
        text, chunks = sse_text(resp.iter_lines())
    assert text == want and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == r["choices"][0]["stop_reason"] == stop
    r = httpx.post(server + "/v1/completions", json={"prompt": "Once upon", "max_tokens": 40, "stop": "@"}).json()
    assert "@" not in r["choices"][0]["text"]


def _reference_logprobs(pipe: Pipeline, ids: list[int], n: int, top: int) -> list[tuple]:
    """(token, logprob, top ids) of target-only greedy decoding, from one full pass over the output."""
    tokens = solo_ids(pipe, ids, n)
    cache = pipe.target.new_cache(len(ids) + n)
    logits = pipe.target(torch.tensor([ids + tokens]), cache, logits="all").logits[0, len(ids) - 1 : -1]
    lp = logits.float().log_softmax(-1)
    return [(t, lp[i, t].item(), lp[i].topk(top).indices.tolist()) for i, t in enumerate(tokens)]


def solo_ids(pipe: Pipeline, ids: list[int], n: int) -> list[int]:
    return list(generate_tokens(pipe.target, ids, max_new_tokens=n, stop_token_ids=pipe.stop_token_ids))


def test_logprobs(server, pipe):
    """Each token's log-probability under the target, streamed or not, chat or completions, with the
    drafter and prompt lookup on: what one target pass over the same output gives."""
    c = client(server)
    ids = pipe.encode_messages(MSGS)
    ref = _reference_logprobs(pipe, ids, 40, 3)
    r = c.chat.completions.create(model="t", messages=MSGS, max_tokens=40, logprobs=True, top_logprobs=3)
    got = r.choices[0].logprobs.content
    # special tokens are in the entries (by name) but not in the text, as the text skips them
    assert len(got) == 40 and "".join(e.token for e in got if e.token not in SPECIALS) == r.choices[0].message.content
    assert any(e.token in SPECIALS for e in got)  # this random model does emit some
    for e, (t, lp, top) in zip(got, ref):
        assert e.token == pipe.token_bytes(t).decode() and bytes(e.bytes) == e.token.encode()
        assert abs(e.logprob - lp) < 1e-4 and len(e.top_logprobs) == 3
        assert [x.token for x in e.top_logprobs] == [pipe.token_bytes(i).decode() for i in top]
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-6  # greedy: the chosen token is the best
    s = c.chat.completions.create(model="t", messages=MSGS, max_tokens=40, logprobs=True, top_logprobs=3,
                                  stream=True)
    streamed = [e for ch in s if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in got]
    # float32: verify passes of other widths round differently (the prefix cache and the widths differ)
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, got))
    r = c.chat.completions.create(model="t", messages=MSGS, max_tokens=10, logprobs=True)
    assert [e.top_logprobs for e in r.choices[0].logprobs.content] == [[]] * 10
    assert c.chat.completions.create(model="t", messages=MSGS, max_tokens=5).choices[0].logprobs is None

    prompt = "Once upon a time"
    ref = _reference_logprobs(pipe, pipe.encode(prompt, chat=False), 30, 2)
    r = c.completions.create(model="t", prompt=prompt, max_tokens=30, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(t for t in lp.tokens if t not in SPECIALS) == r.choices[0].text and len(lp.tokens) == 30
    assert all(abs(a - b[1]) < 1e-4 for a, b in zip(lp.token_logprobs, ref))
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(30)]
    assert all(len(d) <= 2 and max(d.values()) >= v - 1e-6 for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    s = c.completions.create(model="t", prompt=prompt, max_tokens=30, logprobs=2, stream=True)
    chunks = [ch.choices[0].logprobs for ch in s if ch.choices[0].logprobs]
    assert [t for x in chunks for t in x.tokens] == lp.tokens
    assert [o for x in chunks for o in x.text_offset] == lp.text_offset

    # a stop string: no entry for the token that completes it or for text held back before it
    full = solo(pipe, ids, 60)
    stop = full[25:28]
    for stream in (False, True):
        body = {"messages": MSGS, "max_tokens": 60, "stop": [stop], "logprobs": True, "stream": stream}
        if stream:
            with httpx.stream("POST", server + "/v1/chat/completions", json=body) as resp:
                text, chunks = sse_text(resp.iter_lines())
            entries = [e for ch in chunks if ch.get("choices") and ch["choices"][0]["logprobs"]
                       for e in ch["choices"][0]["logprobs"]["content"]]
        else:
            out = httpx.post(server + "/v1/chat/completions", json=body).json()["choices"][0]
            text, entries = out["message"]["content"], out["logprobs"]["content"]
        assert text == full[: full.find(stop)]
        assert "".join(e["token"] for e in entries if e["token"] not in SPECIALS) == text


def test_penalties_and_logit_bias(server, pipe):
    """OpenAI's presence/frequency penalties, vLLM's repetition_penalty and logit_bias: the server (drafter
    and prompt lookup on) gives what target-only decoding with the same settings gives."""
    from dflash_torch.decoding.sampling import Sampler

    c = client(server)
    ids = pipe.encode_messages(MSGS)
    settings = {"presence_penalty": 0.7, "frequency_penalty": 0.5}
    extra = {"repetition_penalty": 1.3, "logit_bias": {"40": 2.5, "41": -100}}
    want = generate(pipe, ids, 40, use_draft=False, sampler=Sampler(
        **settings, repetition_penalty=1.3, logit_bias={40: 2.5, 41: -100})).text
    assert want != solo(pipe, ids, 40)  # they change the output
    r = c.chat.completions.create(model="t", messages=MSGS, max_tokens=40, extra_body=extra, **settings)
    assert r.choices[0].message.content == want
    x = pipe.tokenizer.convert_tokens_to_ids("x")
    r = c.completions.create(model="t", prompt="Once upon", max_tokens=12, logit_bias={str(x): 100})
    assert r.choices[0].text == "x" * 12


def test_echo_scores_the_prompt(server, pipe):
    """Completions with echo: the prompt comes back before the completion, and with logprobs each prompt
    token's log-probability given the ones before it (none for the first), as evaluation harnesses
    (lm-eval's loglikelihood: echo, logprobs 1, max_tokens 0 or 1, a batch of one token list) read it."""
    c = client(server)
    text = "Once upon a time there"
    ids = pipe.encode(text, chat=False)
    cache = pipe.target.new_cache(len(ids))
    lp = pipe.target(torch.tensor([ids]), cache, logits="all").logits[0].float().log_softmax(-1)
    want = [lp[i, t].item() for i, t in enumerate(ids[1:])]

    r = c.completions.create(model="t", prompt=text, max_tokens=0, echo=True, logprobs=1)
    out = r.choices[0]
    assert out.text == text and r.usage.completion_tokens == 0 and out.finish_reason == "length"
    assert out.logprobs.token_logprobs[0] is None and out.logprobs.top_logprobs[0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(out.logprobs.token_logprobs[1:], want))
    assert len(out.logprobs.tokens) == len(ids) and "".join(out.logprobs.tokens) == text
    greedy = [lp[i].argmax().item() == t for i, t in enumerate(ids[1:])]  # is_greedy, as lm-eval checks it
    assert [max(d, key=d.get) == tok for d, tok in zip(out.logprobs.top_logprobs[1:], out.logprobs.tokens[1:])] \
        == greedy

    # one token list in a list; one new token: the prompt's entries, then the completion's
    body = {"prompt": [ids], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    r = httpx.post(server + "/v1/completions", json=body).json()["choices"][0]
    assert r["text"] == pipe.decode(ids) + solo(pipe, ids, 1) and len(r["logprobs"]["tokens"]) == len(ids) + 1
    assert all(abs(a - b) < 1e-4 for a, b in zip(r["logprobs"]["token_logprobs"][1:-1], want))
    with httpx.stream("POST", server + "/v1/completions", json=body | {"stream": True}) as resp:
        streamed, chunks = sse_text(resp.iter_lines())
    assert streamed == r["text"]
    assert [t for ch in chunks if ch["choices"][0]["logprobs"] for t in ch["choices"][0]["logprobs"]["tokens"]] \
        == r["logprobs"]["tokens"]
    r = c.completions.create(model="t", prompt=text, max_tokens=5, echo=True)  # echo alone: text only
    assert r.choices[0].text == text + solo(pipe, ids, 5) and r.choices[0].logprobs is None
    for body, param in (({"prompt": text, "max_tokens": 0}, "max_tokens"),  # 0 only with echo
                        ({"prompt": text, "echo": "yes"}, "echo")):
        r = httpx.post(server + "/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = httpx.post(server + "/v1/chat/completions", json={"messages": MSGS, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_prompt_logprobs_in_pieces(pipe):
    from dflash_torch.generate import prompt_logprobs

    ids = pipe.encode("The quick brown fox jumps over the lazy dog", chat=False)
    whole, pieces = prompt_logprobs(pipe, ids, 3), prompt_logprobs(pipe, ids, 3, chunk=4)
    assert len(whole.entries) == len(pieces.entries) == len(ids) - 1
    for (a, ia, va), (b, ib, vb) in zip(whole.entries, pieces.entries):
        assert abs(a - b) < 1e-4 and ia[0] == ib[0] and max(abs(x - y) for x, y in zip(va, vb)) < 1e-4
    assert prompt_logprobs(pipe, ids[:1]).entries == []


def test_structured_output(server, pipe):
    """response_format (json_schema, json_object), vLLM's guided_* fields and the Responses API's
    text.format: the server (drafter and lookup on) returns target-only's constrained output."""
    c = client(server)
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    ids = pipe.encode_messages(MSGS)
    want = generate(pipe, ids, 60, use_draft=False, grammar=("json_schema", schema))
    r = c.chat.completions.create(model="t", messages=MSGS, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "ab", "schema": schema, "strict": True}})
    assert r.choices[0].message.content == want.text
    s = c.chat.completions.create(model="t", messages=MSGS, max_tokens=60, stream=True,
                                  extra_body={"guided_json": json.dumps(schema)})
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == want.text
    out = c.responses.create(model="t", input=MSGS[1]["content"], instructions=MSGS[0]["content"],
                             max_output_tokens=60, text={"format": {"type": "json_schema", "name": "ab",
                                                                    "schema": schema}})
    assert out.output_text == want.text

    for body, kind, spec in (({"guided_choice": ["apple", "banana"]}, "choice", ["apple", "banana"]),
                             ({"guided_regex": "(ab|cd)+x"}, "regex", "(ab|cd)+x"),
                             ({"response_format": {"type": "json_object"}}, "json_object", None),
                             ({"guided_grammar": 'start: "yes" | "no"'}, "lark", 'start: "yes" | "no"')):
        want = generate(pipe, ids, 40, use_draft=False, grammar=(kind, spec))
        r = httpx.post(server + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 40} | body).json()
        assert r["choices"][0]["message"]["content"] == want.text, body
        if want.finish_reason == "stop" and kind in ("choice", "lark"):
            assert want.text in ("apple", "banana", "yes", "no")
    ids = pipe.encode("Once upon", chat=False)
    r = c.completions.create(model="t", prompt="Once upon", max_tokens=30, extra_body={"guided_regex": "[0-9]{4}"})
    assert r.choices[0].text == generate(pipe, ids, 30, use_draft=False, grammar=("regex", "[0-9]{4}")).text
    assert re.fullmatch("[0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"


def test_several_choices(server, pipe):
    """n > 1: the choices are generated one after the other, choice i sampling with seed + i, so each is
    what a request for that one choice gives; usage counts every choice's tokens."""
    c = client(server)
    r = c.chat.completions.create(model="t", messages=MSGS, max_tokens=20, n=2)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert [ch.message.content for ch in r.choices] == [solo(pipe, pipe.encode_messages(MSGS), 20)] * 2
    assert r.usage.completion_tokens == 40
    r = c.chat.completions.create(model="t", messages=MSGS, max_tokens=20, n=3, temperature=1.0, seed=5)
    texts = [ch.message.content for ch in r.choices]
    for i in range(3):
        one = c.chat.completions.create(model="t", messages=MSGS, max_tokens=20, temperature=1.0, seed=5 + i)
        assert one.choices[0].message.content == texts[i]
    assert len(set(texts)) > 1
    s = c.chat.completions.create(model="t", messages=MSGS, max_tokens=20, n=3, temperature=1.0, seed=5, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(s)
    got = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
           for i in range(3)]
    assert got == texts and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert len({ch.id for ch in chunks}) == 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        ch.finish_reason for ch in r.choices]
    r = c.completions.create(model="t", prompt="Once upon", max_tokens=10, n=2, temperature=1.0, seed=1)
    assert [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == 20


def test_generate_command_penalties(pipe, chat_model, capsys):
    from dflash_torch.decoding.sampling import Sampler

    base = ["generate", "--model", str(chat_model[0]), "--draft", str(chat_model[1]), "--device", "cpu",
            "--prompt", "Hello", "--max-tokens", "20", "--json"]
    assert cli.main(base + ["--presence-penalty", "0.8", "--repetition-penalty", "1.2"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    want = generate(pipe, pipe.encode("Hello"), 20, use_draft=False,
                    sampler=Sampler(presence_penalty=0.8, repetition_penalty=1.2)).token_ids
    assert got == want
    x = pipe.tokenizer.convert_tokens_to_ids("x")
    assert cli.main(base + ["--logit-bias", json.dumps({str(x): 100})]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] == "x" * 20
    for bad in ('{"a": 1}', '{"100000": 1}'):
        assert cli.main(base + ["--logit-bias", bad]) == 2
        assert "logit" in capsys.readouterr().err


def test_generate_command_logprobs(pipe, chat_model, capsys):
    base = ["generate", "--model", str(chat_model[0]), "--draft", str(chat_model[1]), "--device", "cpu",
            "--prompt", "Hello", "--max-tokens", "12"]
    assert cli.main(base + ["--json", "--logprobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = _reference_logprobs(pipe, pipe.encode("Hello"), 12, 2)
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"] == [t for t, _, _ in ref]
    for e, (t, lp, top) in zip(out["logprobs"], ref):
        assert abs(e["logprob"] - lp) < 1e-4 and [x["token_id"] for x in e["top_logprobs"]] == top
        assert e["token"] == pipe.token_bytes(t).decode()
    for bad in (["--logprobs", "2"], ["--json", "--logprobs", "21"]):  # needs --json; at most 20
        assert cli.main(base + bad) == 2
        assert "--logprobs" in capsys.readouterr().err


def test_token_bytes_of_a_byte_level_tokenizer(chat_model, tmp_path):
    """Byte-level BPE pieces map back to their bytes, also a piece that holds part of a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {chr(b) if 33 <= b < 127 else None: b for b in range(256)}
    del table[None]
    vocab = {"\u00c3": 0, "\u00a9": 1, "\u0120w": 2, "\u00c3\u00a9": 3} | {ch: 4 + i for i, ch in enumerate(table)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    p = dataclasses.replace(Pipeline(None, fast, [], tmp_path, "t"))
    assert [p.token_bytes(i) for i in range(4)] == [b"\xc3", b"\xa9", b" w", "é".encode()]
    assert p.token_bytes(vocab["a"]) == b"a"


def test_text_stream_holds_back_stop_prefixes():
    pipe = type("P", (), {"decode": staticmethod(lambda ids: "".join(map(chr, ids)))})()
    ts = TextStream(pipe, ["<stop>", "xyz"])
    out = [ts.add(ord(ch)) for ch in "ab<stX<st"]
    assert "".join(out) == "ab<stX" and out[2:5] == ["", "", ""]  # "<st" waited until "X" ruled it out
    assert [ts.add(ord(ch)) for ch in "op>more"] == ["", "", ""] + [""] * 4 and ts.stopped
    ts = TextStream(pipe, ["xyz"])
    assert "".join(ts.add(ord(ch)) for ch in "abxy") == "ab" and ts.finish() == "xy"  # released at the end


def test_eight_concurrent_clients_get_their_solo_output(server, pipe):
    prompts = [f"Prompt number {i}: {'abcdefgh'[i] * i}" for i in range(8)]
    want = [solo(pipe, pipe.encode(p), 16 + i) for i, p in enumerate(prompts)]
    got: list[str | None] = [None] * 8

    def ask(i: int) -> None:
        msgs = [{"role": "user", "content": prompts[i]}]
        if i % 2:
            s = client(server).chat.completions.create(model="t", messages=msgs, max_tokens=16 + i, stream=True)
            got[i] = "".join(ch.choices[0].delta.content or "" for ch in s)
        else:
            got[i] = client(server).chat.completions.create(model="t", messages=msgs, max_tokens=16 + i) \
                .choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want


def test_seeded_sampling_is_reproducible(server):
    def ask(seed: int, stream: bool = False) -> str:
        body = {"messages": MSGS, "max_tokens": 30, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": seed}
        if stream:
            with httpx.stream("POST", server + "/v1/chat/completions", json=body | {"stream": True}) as r:
                return sse_text(r.iter_lines())[0]
        return httpx.post(server + "/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    first = ask(7)
    assert ask(7) == first and ask(7, stream=True) == first
    assert any(ask(seed) != first for seed in (8, 9, 10))  # and the seed matters


def test_fastpath_runs_short_requests_target_only(server, pipe):
    ids = pipe.encode("Hi")
    for max_tokens, mode in ((4, "fastpath"), (12, "dflash")):
        r = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": max_tokens}).json()
        assert r["choices"][0]["message"]["content"] == solo(pipe, ids, max_tokens)
        assert metrics_json(server)["recent"][-1]["mode"].startswith(mode)


# --- hostile input ------------------------------------------------------------------------------

OK_MSGS = [{"role": "user", "content": "hi"}]
BAD = [  # (path, body: dict or raw bytes, status, param)
    ("/v1/chat/completions", b"{", 400, None),
    ("/v1/chat/completions", b"\xff\xfe", 400, None),
    ("/v1/chat/completions", b"[" * 100_000, 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature"),
    ("/v1/chat/completions", [], 400, None),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [1]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "top_k": -5}, 400, "top_k"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "min_p": 1.5}, 400, "min_p"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "seed": 2**70}, 400, "seed"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "n": 17}, 400, "n"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "stop": 5}, 400, "stop"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "stop": ["a"] * 17}, 400, "stop"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "stop": "a" * 257}, 400, "stop"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "stream_options": "x"}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "logprobs": 1}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "logit_bias": {"5": "1"}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "logit_bias": [1]}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "frequency_penalty": "a"}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "guided_regex": "(a"}, 400, "guided_regex"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "guided_choice": []}, 400, "guided_choice"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "guided_json": "{"}, 400, "guided_json"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "guided_grammar": "start: nope"}, 400, "guided_grammar"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "guided_regex": "a", "guided_choice": ["a"]}, 400,
     "guided_choice"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "yaml"}}}, 400, "text"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": -1}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": OK_MSGS, "model": 5}, 400, "model"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 512}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * (2 << 20)}, 413, None),
]


def test_malformed_and_hostile_requests_get_4xx_json(server, pipe):
    for path, body, status, param in BAD:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server + path, headers={"content-type": "application/json"}, **kw)
        assert r.status_code == status, (path, str(body)[:80], r.text[:200])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["param"] == param, (str(body)[:80], err)
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/chat/completions", 405)):
        r = httpx.request(method, server + path)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    # chunked (no content-length) oversized body
    r = httpx.post(server + "/v1/completions", content=iter([b'{"prompt": "', b"x" * (2 << 20), b'"}']))
    assert r.status_code == 413
    # still healthy and still exact
    r = client(server).chat.completions.create(model="t", messages=OK_MSGS, max_tokens=10)
    assert r.choices[0].message.content == solo(pipe, pipe.encode("hi"), 10)
    assert 'status="400"' in httpx.get(server + "/metrics").text


def test_api_key(pipe):
    with serve(pipe, api_key="sekret") as base:
        assert httpx.get(base + "/v1/models").status_code == 401
        for key in ("wrong", "sekret"):
            try:
                r = client(base, key).chat.completions.create(model="t", messages=OK_MSGS, max_tokens=3)
                assert key == "sekret" and r.usage.completion_tokens == 3
            except openai.AuthenticationError as e:
                assert key == "wrong" and e.status_code == 401 and e.code == "invalid_api_key"
        assert httpx.get(base + "/health").status_code == 200


def test_allowed_origins(pipe):
    """--allowed-origins: a browser's preflight from a listed origin is answered (without the API key), its
    requests carry the CORS header; another origin, or a server without the option, gets none."""
    page, other = "http://localhost:3000", "http://evil.example"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    with serve(pipe, api_key="k", allowed_origins=[page]) as base:
        r = httpx.options(base + "/v1/chat/completions", headers={"Origin": page} | preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = httpx.post(base + "/v1/chat/completions", json={"messages": OK_MSGS, "max_tokens": 2},
                       headers={"Origin": page, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = httpx.options(base + "/v1/chat/completions", headers={"Origin": other} | preflight)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    with serve(pipe) as base:
        r = httpx.get(base + "/v1/models", headers={"Origin": page})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_served_model_name(pipe):
    with serve(pipe, served_model_name="house-model") as base:
        assert [m.id for m in client(base).models.list()] == ["house-model"]
        r = client(base).chat.completions.create(model="house-model", messages=OK_MSGS, max_tokens=2)
        assert r.model == "house-model"
        assert httpx.get(base + "/health").json()["model"] == "house-model"


def test_health_is_503_while_loading_then_200(pipe):
    gate = threading.Event()

    def slow_load():
        gate.wait(10)
        return pipe

    with serve(loader=slow_load) as base:
        assert httpx.get(base + "/health").status_code == 503
        r = httpx.post(base + "/v1/chat/completions", json={"messages": OK_MSGS})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        gate.set()
        deadline = time.time() + 10
        while httpx.get(base + "/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.02)
        assert httpx.post(base + "/v1/chat/completions", json={"messages": OK_MSGS, "max_tokens": 2}).status_code == 200

    def broken():
        raise FileNotFoundError("no such model")

    with serve(loader=broken) as base:
        time.sleep(0.2)
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and "no such model" in r.json()["error"]


def test_a_failing_startup_summary_does_not_stop_the_worker(pipe, monkeypatch):
    from dflash_torch.serve import engine as engine_module

    def broken(self):
        raise AttributeError("no such field")

    monkeypatch.setattr(engine_module.Engine, "_banner", broken)
    with serve(pipe) as base:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": OK_MSGS, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# --- the worker: queue, cancellation, metrics, fallback -----------------------------------------


def test_queue_full_429_and_disconnect_frees_the_worker(pipe):
    # A drafter that is always wrong and slow, without the fallback: 400 tokens would take ~20 s.
    slow = dataclasses.replace(pipe, drafter=ScriptedDrafter(pipe.drafter, delay=0.05))
    with serve(slow, max_queue=1, fallback=False) as base:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body) as long:
            lines = long.iter_lines()
            assert next(lines).startswith("data: ")
            assert metrics_json(base)["queue"]["running"] == 1
            short: dict = {}
            waiter = threading.Thread(target=lambda: short.update(r=client(base).completions.create(
                model="t", prompt="Hello", max_tokens=3)))
            waiter.start()
            deadline = time.time() + 10
            while metrics_json(base)["queue"]["waiting"] != 1:
                assert time.time() < deadline
                time.sleep(0.01)
            r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
            t0 = time.time()
        waiter.join(10)  # leaving the `with` closed the stream: the worker drops it within a cycle
        assert time.time() - t0 < 3
        assert short["r"].choices[0].text == solo(pipe, pipe.encode("Hello", chat=False), 3)
        cancelled = metrics_json(base)["recent"][-2]
        assert cancelled["status"] == 499 and cancelled["completion_tokens"] < 100
        # a non-streamed request whose client gives up is dropped as fast
        with pytest.raises(httpx.TimeoutException):
            httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 400}, timeout=0.5)
        t0 = time.time()
        while metrics_json(base)["queue"]["running"]:
            assert time.time() - t0 < 3
            time.sleep(0.01)
        assert metrics_json(base)["recent"][-1]["status"] == 499


def test_live_metrics_while_a_long_request_runs(pipe):
    ids = pipe.encode("Once upon a time", chat=False)
    want = generate(pipe, ids, 300, use_draft=False)
    oracle = ScriptedDrafter(pipe.drafter, script=ids + want.token_ids, delay=0.02)
    with serve(dataclasses.replace(pipe, drafter=oracle), fallback=False) as base:
        done: dict = {}
        t = threading.Thread(target=lambda: done.update(r=client(base).completions.create(
            model="t", prompt="Once upon a time", max_tokens=300)))
        t.start()
        seen = None
        while t.is_alive() and seen is None:
            text = httpx.get(base + "/metrics").text
            values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
            if values["dflash_requests_running"] == 1 and values["dflash_live_tokens_per_second"] > 0:
                seen = values
                current = metrics_json(base)["current"]
            time.sleep(0.01)
        t.join(60)
        assert seen is not None, "never saw the request in flight"
        assert seen["dflash_live_acceptance_rate"] > 0.5 and seen["dflash_live_acceptance_length_mean"] > 2
        assert current is None or current["acceptance_rate"] > 0.5
        assert done["r"].choices[0].text == want.text
        final = httpx.get(base + "/metrics").text
        for name in ("dflash_spec_decode_num_drafts_total", "dflash_spec_decode_num_draft_tokens_total",
                     "dflash_spec_decode_num_accepted_tokens_total",
                     'dflash_spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                     "dflash_time_to_first_token_seconds_count", "dflash_decode_tokens_per_second_count"):
            assert any(ln.startswith(name + " ") and float(ln.split()[-1]) > 0 for ln in final.splitlines()), name
        widths = {ln.split('"')[1]: float(ln.split()[-1]) for ln in final.splitlines()
                  if ln.startswith("dflash_verify_passes_total{")}  # passes by width, as the loop chose them
        assert sum(v for w, v in widths.items() if int(w) > 1) > 0
        row = httpx.get(base + "/metrics.json").json()["recent"][-1]
        assert row["mode"] == "dflash+lookup" and row["acceptance_length_mean"] > 2 and row["decode_tok_s"] > 0


def test_acceptance_collapse_falls_back_to_target_only(pipe):
    ids = pipe.encode_messages(MSGS)
    want = generate(pipe, ids, 80, use_draft=False)
    assert 0 not in want.token_ids  # so a drafter proposing token 0 ([UNK]) is always wrong
    wrong = dataclasses.replace(pipe, drafter=ScriptedDrafter(pipe.drafter, wrong=0, delay=0.004))
    with serve(wrong, lookup=False) as base:  # the drafter alone: prompt lookup would keep tokens
        r = client(base).chat.completions.create(model="t", messages=MSGS, max_tokens=80)
        assert r.choices[0].message.content == want.text
        row = metrics_json(base)["recent"][-1]
        assert row["mode"] == "dflash+fallback" and row["acceptance_rate"] == 0 and row["lookup_cycles"] == 0
        assert row["fallback_events"][0]["event"] == "fallback"
        assert 'dflash_fallback_events_total{event="fallback"}' in httpx.get(base + "/metrics").text
        # the next request starts where this one ended: target-only, probing when the probe is due
        carried = row["fallback_events"][-1]
        r = client(base).chat.completions.create(model="t", messages=MSGS, max_tokens=80)
        assert r.choices[0].message.content == want.text
        row = metrics_json(base)["recent"][-1]
        assert row["mode"] == "dflash+fallback" and row["fallback_events"][0]["event"] == "carried"
        if carried["event"] == "fallback":  # no probe since: the gap left is what the last request left
            left = carried["token"] + carried["probe_in_tokens"] - 79  # the controller sees 79 (not the prefill's)
            assert row["fallback_events"][0]["probe_in_tokens"] == left


def test_fallback_controller_policy():
    c = FallbackController(window=4, measure_steps=2, probe_after=10, probe_budget=100)  # gap: probe_after
    assert c.block_size(None) > 1
    for _ in range(5):  # the first cycle is skipped, then a window of slow speculative cycles
        c.observe(8, 1, 0.010)
    assert c.state == "measure" and c.block_size(None) == 1
    for _ in range(2):
        c.observe(1, 1, 0.002)
    assert c.state == "target" and c.events[-1]["event"] == "fallback" and c.events[-1]["probe_in_tokens"] == 10
    while c.state == "target":
        c.observe(1, 1, 0.002)
    assert c.events[-1]["event"] == "probe" and c.block_size(None) > 1
    for _ in range(5):  # the probe is fast this time (its first cycle is not timed): speculation resumes
        c.observe(8, 5, 0.004)
    assert c.state == "speculate" and c.events[-1]["event"] == "resume" and c.fallbacks == 1
    slower = FallbackController(window=4, target_s_per_token=0.002, probe_after=10, probe_budget=0.05)
    for _ in range(5):  # each timed cycle lost 8 ms against 1 token at 2 ms: 32 ms, 5% of it is 320 tokens
        slower.observe(8, 1, 0.010)
    assert slower.state == "target" and slower.events[-1]["probe_in_tokens"] == 320
    carry = slower.carry()
    assert carry == {"probe_in_tokens": 320, "probe_after": 640}
    nxt = FallbackController(carried=carry)
    assert nxt.state == "target" and nxt.block_size(None) == 1 and nxt.fallbacks == 1
    for _ in range(320):
        nxt.observe(1, 1, 0.002)
    assert nxt.state == "speculate" and nxt.events[-1] == {"event": "probe", "token": 320}
    assert FallbackController().carry() is None
    fast = FallbackController(window=4, target_s_per_token=0.002)  # a known baseline: no measuring
    for _ in range(20):
        fast.observe(8, 4, 0.004)
    assert fast.state == "speculate" and not fast.events


def test_greedy_output_is_identical_in_every_mode(pipe):
    ids = pipe.encode_messages(MSGS)
    want = generate(pipe, ids, 60, use_draft=False).token_ids

    def run(controller) -> list[int]:
        return list(generate_tokens(pipe.target, ids, max_new_tokens=60, drafter=pipe.drafter,
                                    stop_token_ids=pipe.stop_token_ids, controller=controller))

    assert run(None) == want
    assert run(FallbackController(window=2, measure_steps=1, probe_after=3, margin=-1.0)) == want  # always falls back
    assert run(FallbackController(window=2, target_s_per_token=1.0)) == want  # never does


def test_serve_command_line(chat_model):
    args = cli.build_parser().parse_args(
        ["serve", "--model", "m", "--no-draft", "--host", "0.0.0.0", "--port", "9", "--fastpath-max-tokens", "8",
         "--api-key", "k", "--max-tokens", "5", "--block-size", "4", "--max-queue", "3", "--device", "cpu",
         "--dtype", "float32"])
    assert (args.model, args.no_draft, args.host, args.port, args.fastpath_max_tokens, args.api_key) == (
        "m", True, "0.0.0.0", 9, 8, "k")
    assert (args.max_tokens, args.block_size, args.max_queue, args.device, args.dtype) == (5, 4, 3, "cpu", "float32")
    defaults = cli.build_parser().parse_args(["serve"])
    assert (defaults.host, defaults.port, defaults.model, defaults.draft) == ("127.0.0.1", 8000, None, "auto")
    assert (defaults.prefix_cache_max_entries, defaults.prefix_cache_max_bytes, defaults.no_prefix_cache) == (
        4, 2 << 30, False)
    sized = cli.build_parser().parse_args(["serve", "--prefix-cache-max-bytes", "512MB", "--no-prefix-cache",
                                           "--prefix-cache-l2-dir", "/tmp/x", "--prefix-cache-l2-max-bytes", "1GB"])
    assert sized.prefix_cache_max_bytes == 512 << 20 and sized.no_prefix_cache
    assert (sized.prefix_cache_l2_dir, sized.prefix_cache_l2_max_bytes) == ("/tmp/x", 1 << 30)
    assert defaults.prefix_cache_l2_dir is None and defaults.prefill_step_size is None
    assert cli.build_parser().parse_args(["serve", "--prefill-step-size", "512"]).prefill_step_size == 512
    assert parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("4096") == 4096
    for bad in ("lots", "-1GB", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    # a model that cannot be loaded stops the server with exit status 2
    assert cli.main(["serve", "--model", str(chat_model[0].parent / "missing"), "--port", "0"]) == 2


def test_conversation_turns_start_from_the_prefix_cache(pipe, tmp_path):
    """The second and third turns of a chat reuse the earlier turns' caches (usage reports the cached
    prompt tokens, OpenAI's prompt_tokens_details) and answer what a server without the cache answers."""
    turns = ["Write a haiku about rain", "Now one about snow", "And one about wind"]

    def chat(base: str) -> list:
        c, msgs, out = client(base), [MSGS[0]], []
        for text in turns:
            msgs.append({"role": "user", "content": text})
            r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=24)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            out.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
        return out

    with serve(pipe) as base:
        warm = chat(base)
        info = metrics_json(base)
        again = httpx.post(base + "/v1/chat/completions",
                           json={"messages": MSGS[:1] + [{"role": "user", "content": turns[0]}], "max_tokens": 24})
        assert again.json()["choices"][0]["message"]["content"] == warm[0][0]  # the same prompt: replayed
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with serve(pipe, prefix_cache_max_entries=1, prefix_cache_l2_dir=str(tmp_path)) as base:
        # one entry in memory: a second conversation in between pushes the first to a file, and back
        c = client(base)
        first = chat(base)
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Other"}], max_tokens=8)
        msgs = [MSGS[0]] + [m for t, (text, _) in zip(turns, first) for m in (
            {"role": "user", "content": t}, {"role": "assistant", "content": text})]
        r = c.chat.completions.create(model="tiny", messages=msgs + [{"role": "user", "content": "More"}],
                                      max_tokens=8)
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        assert metrics_json(base)["prefix_cache"]["disk"]["hits"] == 1
        assert [t for t, _ in first] == [t for t, _ in warm]
    assert list(tmp_path.iterdir()) == []  # the run's files went with it
    with serve(pipe, prefix_cache_max_entries=0) as base:
        cold = chat(base)
        assert metrics_json(base)["prefix_cache"] is None
    assert [t for t, _ in warm] == [t for t, _ in cold]
    assert warm[0][1] == 0 and all(n > 0 for _, n in warm[1:]) and all(n == 0 for _, n in cold)
    assert info["prefix_cache"]["hits"] == 2 and info["prefix_cache"]["entries"] >= 1
    assert info["metrics"]["prefix_cache_cached_tokens_total"] == warm[1][1] + warm[2][1]
    assert [row["cached_tokens"] for row in info["recent"]] == [n for _, n in warm]


def test_out_of_memory_empties_the_prefix_cache(pipe, monkeypatch):
    from dflash_torch.serve import engine as engine_module

    with serve(pipe) as base:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8})
        assert r.status_code == 200 and metrics_json(base)["prefix_cache"]["entries"] == 1

        def oom(*a, **k):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            yield

        monkeypatch.setattr(engine_module, "generate_tokens", oom)
        r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8})
        assert r.status_code == 500 and metrics_json(base)["prefix_cache"]["entries"] == 0
        monkeypatch.undo()
        r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8})
        assert r.status_code == 200  # and it serves on


def test_chat_template_args(pipe, chat_model, capsys):
    """--chat-template-args sets chat template variables for every request; a request's
    chat_template_kwargs (vLLM's field) override them; anything but an object is a 400."""
    plain = len(pipe.encode_messages(MSGS))
    assert len(pipe.encode_messages(MSGS, {"preamble": "xyz"})) == plain + 3  # one token per character
    with serve(pipe, chat_template_args={"preamble": "ab"}) as base:
        def tokens(**extra):
            r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **extra})
            return r.json()["usage"]["prompt_tokens"] if r.status_code == 200 else r
        assert tokens() == plain + 2
        assert tokens(chat_template_kwargs={"preamble": "abcd"}) == plain + 4
        assert tokens(chat_template_kwargs={}) == plain + 2
        bad = tokens(chat_template_kwargs="x")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    args = cli.build_parser().parse_args(["serve", "--chat-template-args", '{"enable_thinking": false}'])
    assert args.chat_template_args == {"enable_thinking": False}
    for bad_arg in ("[1]", "{oops"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", "--chat-template-args", bad_arg])
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(chat_model[0]), "--no-draft", "--device", "cpu", "--prompt", "Hi",
                     "--chat-template-args", '{"preamble": "Q"}', "--max-tokens", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["prompt_tokens"]
    assert got == len(pipe.encode("Hi")) + 1


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


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


def test_tool_calls(pipe, monkeypatch):
    """Tools reach the chat template; a `<tool_call>{json}</tool_call>` in the model's text comes back as
    OpenAI tool_calls (streamed or not, finish_reason "tool_calls"); history with calls and tool results
    renders; what the server does not do is a 400. The tiny model cannot call tools, so the generation
    is scripted: token ids of a fixed text (one token per character)."""
    script = script_generation(pipe, monkeypatch)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    with serve(pipe) as base:
        c = client(base)
        script["text"] = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        r = c.chat.completions.create(model="tiny", messages=user, tools=[WEATHER], max_tokens=200)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Let me look."
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        with_tools = len(pipe.encode_messages(user, tools=[WEATHER]))
        assert r.usage.prompt_tokens == with_tools > len(pipe.encode_messages(user))

        chunks = list(c.chat.completions.create(model="tiny", messages=user, tools=[WEATHER], max_tokens=200,
                                                stream=True))
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        assert content == "Let me look." and [tc.function.name for tc in calls] == ["get_weather"]
        assert calls[0].index == 0 and json.loads(calls[0].function.arguments) == {"city": "Paris"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # the conversation goes on with the call and its result in the history
        history = user + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
        script["text"] = "It is sunny."
        r = c.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=200)
        assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
        rendered = pipe.decode(pipe.encode_messages(parse_messages(history), tools=[WEATHER]))
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered

        # parallel_tool_calls false: of two calls the model wrote, the first (streamed or not)
        script["text"] = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                          '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
        r = c.chat.completions.create(model="tiny", messages=user, tools=[WEATHER], max_tokens=200)
        assert [json.loads(t.function.arguments)["city"] for t in r.choices[0].message.tool_calls] == ["Paris", "Rome"]
        r = c.chat.completions.create(model="tiny", messages=user, tools=[WEATHER], max_tokens=200,
                                      parallel_tool_calls=False)
        assert [json.loads(t.function.arguments)["city"] for t in r.choices[0].message.tool_calls] == ["Paris"]
        assert r.choices[0].message.content is None
        chunks = list(c.chat.completions.create(model="tiny", messages=user, tools=[WEATHER], max_tokens=200,
                                                parallel_tool_calls=False, stream=True))
        assert len([tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]) == 1

        # a call of an undeclared tool stays text; tool_choice "none" shows no tools and parses nothing
        script["text"] = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
        r = c.chat.completions.create(model="tiny", messages=user, tools=[WEATHER], max_tokens=200)
        assert r.choices[0].message.content == script["text"] and r.choices[0].finish_reason == "stop"
        script["text"] = 'ok<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
        r = c.chat.completions.create(model="tiny", messages=user, tools=[WEATHER], tool_choice="none",
                                      max_tokens=200)
        assert r.choices[0].message.content == script["text"]
        assert r.usage.prompt_tokens == len(pipe.encode_messages(user))

        def post(**body):
            return httpx.post(base + "/v1/chat/completions", json={"messages": user, "max_tokens": 5} | body)

        for body, param in [({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
                            ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
                            ({"tools": [{"type": "function"}]}, "tools[0]"),
                            ({"tools": "get_weather"}, "tools"),
                            ({"messages": user + [{"role": "assistant", "tool_calls": "x"}]}, "messages[1].tool_calls"),
                            ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]},
                             "messages[0].tool_call_id")]:
            r = post(**body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, body
    plain = dataclasses.replace(pipe)
    plain.tokenizer = loading.load_tokenizer(pipe.model_path)  # a copy of its own
    plain.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="does not take tools"):
        plain.encode_messages(user, tools=[WEATHER])
    with serve(plain) as base:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": user, "tools": [WEATHER]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_responses_api(server, pipe, monkeypatch):
    """/v1/responses (non-streamed) through the official client: the same greedy text as chat
    completions, usage and incomplete status, function tools and their outputs, clear 400s."""
    c = client(server)
    ids = pipe.encode("Write a haiku about rain")
    r = c.responses.create(model="tiny", input="Write a haiku about rain", max_output_tokens=20)
    assert r.output_text == solo(pipe, ids, 20) and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.id.startswith("resp_")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ids), 20)
    text = [{"type": "input_text", "text": "Write a haiku about rain"}]
    r = c.responses.create(model="tiny", instructions="Be brief.", max_output_tokens=30,
                           input=[{"role": "user", "content": text}])
    chat = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=30)
    assert r.output_text == chat.choices[0].message.content

    # streamed: the same text in output_text.delta events, then the whole response
    events = list(c.responses.create(model="tiny", input="Write a haiku about rain", max_output_tokens=20,
                                     stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == solo(pipe, ids, 20)
    assert events[-1].response.output_text == solo(pipe, ids, 20)
    assert [e.sequence_number for e in events] == list(range(len(events)))

    script = script_generation(pipe, monkeypatch)
    script["text"] = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = c.responses.create(model="tiny", input="Weather in Paris?", tools=[tool], max_output_tokens=200)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"}
    events = list(c.responses.create(model="tiny", input="Weather in Paris?", tools=[tool], max_output_tokens=200,
                                     stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    assert events[-1].type == "response.completed" and events[-1].response.output[0].name == "get_weather"
    script["text"] = "Sunny."
    r = c.responses.create(model="tiny", tools=[tool], max_output_tokens=200, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert r.output_text == "Sunny."

    for name, value in (("tools", [WEATHER]), ("chat_template_kwargs", {"a": 1}), ("messages", MSGS)):
        r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name  # chat fields: refused, not ignored

    def post(**body):
        return httpx.post(server + "/v1/responses", json={"input": "hi", "max_output_tokens": 4} | body)

    # reasoning effort: thinking on or off, for the templates that read enable_thinking
    for effort, think in (("minimal", False), ("high", True)):
        chat = responses_to_chat({"input": "hi", "reasoning": {"effort": effort, "summary": "auto"}})
        assert chat["chat_template_kwargs"] == {"enable_thinking": think}
    assert responses_to_chat({"input": "hi", "reasoning": {"effort": "none"}, "chat_template_kwargs": {
        "enable_thinking": True, "x": 1}})["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}
    assert c.responses.create(model="tiny", input="hi", max_output_tokens=4, reasoning={"effort": "low"}).output_text

    for body, param in [({"stream": "yes"}, "stream"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"reasoning": {"effort": "max"}}, "reasoning"), ({"reasoning": {"summary": "detailed"}},
                                                                          "reasoning"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
                        ({"tools": [{"type": "web_search"}]}, "tools[0]"), ({"input": []}, "input"),
                        ({"text": {"format": {"type": "json_schema"}}}, "text"),
                        ({"input": [{"type": "reasoning"}]}, "input[0].type"),
                        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
                        ({"input": [{"role": "user", "content": 3}]}, "input[0].content")]:
        r = post(**body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, body


def test_messages_api(server, pipe, monkeypatch):
    """Anthropic's /v1/messages through the official `anthropic` client: the same greedy text as chat
    completions (streamed or not), stop sequences, usage, count_tokens, tool_use and tool_result
    blocks, thinking blocks, x-api-key, and errors in Anthropic's shape."""
    a = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=60)
    user = [{"role": "user", "content": "Write a haiku about rain"}]
    chat = client(server).chat.completions.create(model="tiny", messages=MSGS, max_tokens=20)
    m = a.messages.create(model="tiny", system="Be brief.", messages=user, max_tokens=20)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.id.startswith("msg_")
    def prompt_tokens(u) -> int:  # Anthropic's input_tokens leave out what was read from the (prefix) cache
        return u.input_tokens + u.cache_read_input_tokens

    assert (prompt_tokens(m.usage), m.usage.output_tokens) == (len(pipe.encode_messages(MSGS)), 20)
    assert m.usage.cache_read_input_tokens > 0  # the chat request just before had the same prompt
    blocks = [{"type": "text", "text": "Be brief."}]  # system as blocks, content as blocks: the same prompt
    m2 = a.messages.create(model="tiny", system=blocks, max_tokens=20,
                           messages=[{"role": "user", "content": [{"type": "text", "text": user[0]["content"]}]}])
    assert m2.content[0].text == m.content[0].text
    assert a.messages.count_tokens(model="tiny", system="Be brief.", messages=user).input_tokens == \
        prompt_tokens(m.usage)
    # a max_tokens beyond the context (Anthropic's clients send large ones) is cut to what is left
    room = pipe.max_context - prompt_tokens(m.usage)
    r = httpx.post(server + "/v1/messages", json={"messages": user, "system": "Be brief.", "max_tokens": 10**6})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] <= room
    r = httpx.post(server + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # chat completions: refused

    with a.messages.stream(model="tiny", system="Be brief.", messages=user, max_tokens=20) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == final.content[0].text == m.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 20

    # a stop sequence: the text ends before it, and the answer says which one
    full = m.content[0].text
    cut = full[len(full) // 2:len(full) // 2 + 2]
    m = a.messages.create(model="tiny", system="Be brief.", messages=user, max_tokens=20,
                          stop_sequences=["\x00never", cut])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == cut
    assert m.content[0].text == full[:full.index(cut)]
    r = client(server).chat.completions.create(model="tiny", messages=MSGS, max_tokens=20, stop=[cut])
    assert r.choices[0].model_extra["stop_reason"] == cut  # vLLM's field on chat completions too
    with a.messages.stream(model="tiny", system="Be brief.", messages=user, max_tokens=20,
                           stop_sequences=[cut]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == cut

    # a prefilled reply (the last message is the assistant's): the model continues it, as chat completions'
    # continue_final_message does (vLLM's field)
    prefilled = MSGS + [{"role": "assistant", "content": "Rain"}]
    ids = pipe.encode_messages(parse_messages(prefilled), continue_final=True)
    assert pipe.tokenizer.decode(ids).endswith("<|user|>Write a haiku about rain<|end|><|assistant|>Rain")
    m = a.messages.create(model="t", system="Be brief.", messages=user + prefilled[-1:], max_tokens=12)
    assert m.content[0].text == solo(pipe, ids, 12) and prompt_tokens(m.usage) == len(ids)
    empty = a.messages.create(model="t", system="Be brief.", messages=user + [{"role": "assistant", "content": ""}],
                              max_tokens=12)
    assert empty.content[0].text == solo(pipe, pipe.encode_messages(MSGS), 12)
    r = client(server).chat.completions.create(model="t", messages=prefilled, max_tokens=12,
                                               extra_body={"continue_final_message": True})
    assert r.choices[0].message.content == m.content[0].text and r.usage.prompt_tokens == len(ids)
    r = httpx.post(server + "/v1/chat/completions", json={"messages": MSGS, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    r = httpx.post(server + "/tokenize", json={"messages": prefilled, "continue_final_message": True})
    assert r.json()["tokens"] == ids

    # errors: Anthropic's shape, naming the field the client sent
    for body, param in [({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
                        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                         "messages[0].content[0]"),
                        ({"stop_sequences": ["x"] * 99}, "stop_sequences"), ({"max_tokens": 0}, "max_tokens"),
                        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
                        ({"tool_choice": {"type": "tool"}}, "tool_choice"), ({"mcp_servers": []}, "mcp_servers"),
                        ({"thinking": "on"}, "thinking"), ({"temperature": 3}, "temperature")]:
        r = httpx.post(server + "/v1/messages", json={"model": "t", "messages": user, "max_tokens": 4} | body)
        e = r.json()
        assert r.status_code == 400 and e["type"] == "error" and e["param"] == param, body
        assert e["error"]["type"] == "invalid_request_error" and param.split("[")[0] in e["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="images and documents"):
        a.messages.create(model="t", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])

    script = script_generation(pipe, monkeypatch)
    weather = {"name": "get_weather", "description": "Weather in a city",
               "input_schema": WEATHER["function"]["parameters"]}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    script["text"] = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    m = a.messages.create(model="t", messages=ask, tools=[weather], max_tokens=200)
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.stop_reason == "tool_use"
    call = m.content[1]
    assert (call.name, call.input, m.content[0].text) == ("get_weather", {"city": "Paris"}, "Let me look.")
    assert prompt_tokens(m.usage) == len(pipe.encode_messages(ask, tools=[WEATHER]))
    with a.messages.stream(model="t", messages=ask, tools=[weather], max_tokens=200) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and final.content[1].id == final.content[1].id
    # the call and its result go back in the history: rendered as chat completions would render them
    script["text"] = "It is sunny."
    history = ask + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    m = a.messages.create(model="t", messages=history, tools=[weather], max_tokens=200)
    assert m.content[0].text == "It is sunny." and m.stop_reason == "end_turn"
    as_chat = ask + [{"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    counted = a.messages.count_tokens(model="t", messages=history, tools=[weather]).input_tokens
    assert counted == prompt_tokens(m.usage) == len(pipe.encode_messages(parse_messages(as_chat), tools=[WEATHER]))
    # tool_choice any: a forced call of some tool; disable_parallel_tool_use keeps one tool_use block
    script["text"] = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                      '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    m = a.messages.create(model="t", messages=ask, tools=[weather], max_tokens=200)
    assert [b.input["city"] for b in m.content] == ["Paris", "Rome"]
    m = a.messages.create(model="t", messages=ask, tools=[weather], max_tokens=200,
                          tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.input["city"] for b in m.content] == ["Paris"]

    # thinking blocks from a reasoning model, streamed or not
    script["text"] = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
    with serve(pipe, reasoning_parser="think", api_key="sekret") as base:
        a = anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0, timeout=60)
        m = a.messages.create(model="t", messages=ask, max_tokens=200)
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert (m.content[0].thinking, m.content[1].text) == ("\nThe user wants weather.\n", "It is sunny.")
        with a.messages.stream(model="t", messages=ask, max_tokens=200) as s:
            final = s.get_final_message()
        assert final.model_dump()["content"] == m.model_dump()["content"]
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                model="t", messages=ask, max_tokens=5)


def test_fill_in_the_middle(pipe, tmp_path, monkeypatch):
    """Completions with a `suffix`: the prompt in the model's fill-in-the-middle format (its FIM tokens), the
    fill stopped by the format's end tokens too; a model without FIM tokens answers 400."""
    from dflash_torch.serve import engine as engine_module

    fim = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>"]
    target, draft = make_chat_model(tmp_path, SPECIALS + fim)
    coder = load(str(target), str(draft), device="cpu", dtype="float32")
    ids = coder.encode("<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n\nprint(add(1, 2))<|fim_middle|>",
                       chat=False)
    marks = [ids.index(coder.tokenizer.convert_tokens_to_ids(t)) for t in fim[:3]]  # one token each
    assert marks[0] == 0 and marks[1] < marks[2] == len(ids) - 1
    with serve(coder) as base:
        c = client(base)
        r = c.completions.create(model="t", prompt="def add(a, b):\n    ", suffix="\n\nprint(add(1, 2))", max_tokens=16)
        assert r.choices[0].text == solo(coder, ids, 16) and r.usage.prompt_tokens == len(ids)
        for body in ({"echo": True}, {"prompt": [5, 6]}):
            resp = httpx.post(base + "/v1/completions", json={"prompt": "x", "suffix": "y", "max_tokens": 2} | body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "suffix"
        # the fill ends where the model writes <|fim_pad|>, even where its own stop tokens would not end it
        pad = coder.tokenizer.convert_tokens_to_ids("<|fim_pad|>")

        def scripted(target, prompt, *, max_new_tokens, **kw):
            yield from coder.encode("return a + b", chat=False) + [pad] + coder.encode("junk", chat=False)

        monkeypatch.setattr(engine_module, "generate_tokens", scripted)
        r = c.completions.create(model="t", prompt="def add(a, b):\n    ", suffix="\n", max_tokens=40)
        assert r.choices[0].text == "return a + b" and r.choices[0].finish_reason == "stop"
        r = c.completions.create(model="t", prompt="def add(a, b):\n    ", max_tokens=40)
        assert r.choices[0].text == "return a + bjunk"  # no suffix: an ordinary completion
    with serve(pipe) as base:
        resp = httpx.post(base + "/v1/completions", json={"prompt": "x", "suffix": "y", "max_tokens": 2})
        assert resp.status_code == 400 and "fill-in-the-middle" in resp.json()["error"]["message"]


def test_tool_call_stream_any_chunking():
    """Content before a call streams out whatever the chunk boundaries (a partial marker is held back);
    calls parse at the end; anything that is not a clean call of a declared tool stays content."""
    import random as rnd

    from dflash_torch.serve.tool_calls import ToolCallStream

    call = '<tool_call>{"name": "get_weather", "arguments": %s}</tool_call>'
    cases = [  # text -> (content, names of calls)
        ("a < b and <tool not a call", ("a < b and <tool not a call", [])),
        ("Sure." + call % '{"city": "Oslo"}', ("Sure.", ["get_weather"])),
        (call % "{}" + "\n" + call % '"{\\"city\\": \\"Rome\\"}"', ("", ["get_weather", "get_weather"])),
        ('<tool_call>{"name": "other", "arguments": {}}</tool_call>', (None, [])),
        ("<tool_call>{not json</tool_call>", (None, [])),
        (call % "{}" + " and then some prose", (None, [])),
        ("cut short <tool_call>{\"name\": \"get_w", (None, [])),
        # Qwen3-Coder / Qwen3.5 XML
        ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", ("Checking.\n", ["get_weather"])),
        ("<tool_call><function=rm_rf></function></tool_call>", (None, [])),
        ("<tool_call><function=get_weather>oops<parameter=city>X</parameter></function></tool_call>", (None, [])),
        # Llama 3.x: the bare JSON is the whole reply
        (' {"name": "get_weather", "parameters": {"city": "Oslo"}}', ("", ["get_weather"])),
        ('{"name": "get_weather", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "X"}}',
         ("", ["get_weather", "get_weather"])),
        ('{"answer": 42}', (None, [])),
        ('{"name": "get_weather", "parameters": {}} and more', (None, [])),
        ("  Hello {there}", (None, [])),
    ]
    rng = rnd.Random(0)
    for text, (content, names) in cases:
        for _ in range(20):
            stream, out, i = ToolCallStream([WEATHER]), [], 0
            while i < len(text):
                j = i + rng.randint(1, 6)
                out.append(stream.feed(text[i:j]))
                i = j
            rest, calls = stream.finish()
            assert "".join(out) + rest == (text if content is None else content), text
            assert [c["function"]["name"] for c in calls] == names, text
    stream = ToolCallStream([WEATHER])
    stream.feed(call % '"{\\"city\\": \\"Rome\\"}"')
    assert json.loads(stream.finish()[1][0]["function"]["arguments"]) == {"city": "Rome"}
    stream = ToolCallStream([WEATHER])  # XML values: strings stay strings (schema), the rest is JSON
    stream.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n"
                "</parameter>\n<parameter=units>\ncelsius\n</parameter>\n</function>\n</tool_call>")
    assert json.loads(stream.finish()[1][0]["function"]["arguments"]) == {"city": "42", "days": 3, "units": "celsius"}


def test_model_without_tokenizer_takes_token_ids(zlab, monkeypatch):
    # The published-format fixture has no tokenizer: completions take token ids, chat is a clear 400.
    pipe = load(str(zlab / "target"), str(zlab / "draft"), device="cpu", dtype="float32")
    case = json.loads((zlab / "expected.json").read_text())["generate"][0]
    prompt = case["prompt"]
    decoded = []  # the text is empty without a tokenizer: the ids the worker decodes are what it generated
    decode = pipe.decode
    monkeypatch.setattr(pipe, "decode", lambda ids: decoded.append(list(ids)) or decode(ids))
    with serve(pipe) as base:
        r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 24})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
        assert metrics_json(base)["recent"][-1]["mode"].startswith("dflash")
        served = decoded[-1]
        # speculative, through the server == target-only greedy here == the reference implementation's greedy
        assert served == generate(pipe, prompt, 24, use_draft=False).token_ids == case["greedy_output"][:24]
        r = httpx.post(base + "/v1/chat/completions", json={"messages": OK_MSGS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        # logprobs name each token's text: a clear 400 (was a 500 from the worker), and the server serves on
        r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "logprobs": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_reasoning_splitter_any_chunking():
    import random as _random

    from dflash_torch.serve.reasoning import ReasoningSplitter

    cases = [("<think>\nstep one\n</think>\n\nThe answer.", False, "\nstep one\n", "The answer."),
             ("still thinking</think>\nDone <think>not a tag here</think>", True, "still thinking",
              "Done <think>not a tag here</think>"),
             ("No thinking at all, <think> is text.", False, "", "No thinking at all, <think> is text."),
             (" \n<think>a</thi", False, "a</thi", ""),  # cut off inside the block: all reasoning
             ("<thi", False, "", "<thi")]
    for text, inside, reasoning, content in cases:
        for seed in range(30):
            rng, sp, got = _random.Random(seed), ReasoningSplitter(inside), ["", ""]
            i = 0
            while i < len(text):
                n = rng.randint(1, 6)
                for k, part in enumerate(sp.feed(text[i : i + n])):
                    got[k] += part
                i += n
            for k, part in enumerate(sp.finish()):
                got[k] += part
            assert got == [reasoning, content], (text, seed, got)


def test_reasoning_tags_detected(pipe):
    from dflash_torch.serve.reasoning import has_think_tags, starts_inside

    assert starts_inside("<|assistant|><think>\n") and not starts_inside("<think>a</think>\n<|assistant|>")
    assert not starts_inside("<|assistant|>")
    assert not has_think_tags(pipe.tokenizer) and not has_think_tags(None)
    fake = type("T", (), {"get_vocab": lambda self: {"<think>": 5, "</think>": 6, "a": 1}})()
    assert has_think_tags(fake)


def test_reasoning_content(pipe, monkeypatch):
    """--reasoning-parser think: the think block comes back as reasoning_content (streamed as
    delta.reasoning_content), the rest as content; a tool call after the block is still parsed;
    completions and --reasoning-parser none keep the text whole. Scripted output, as for tool calls."""
    script = script_generation(pipe, monkeypatch)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    script["text"] = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
    with serve(pipe, reasoning_parser="think") as base:
        c = client(base)
        r = c.chat.completions.create(model="t", messages=user, max_tokens=200)
        m = r.choices[0].message
        assert m.content == "It is sunny." and m.model_extra["reasoning_content"] == "\nThe user wants weather.\n"
        thought = len("<think>\nThe user wants weather.\n</think>")  # one token per character
        assert r.usage.completion_tokens_details.reasoning_tokens == thought
        chunks = list(c.chat.completions.create(model="t", messages=user, max_tokens=200, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(d.content or "" for d in deltas) == "It is sunny."
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
            "\nThe user wants weather.\n"
        r = c.completions.create(model="t", prompt="x", max_tokens=200)
        assert r.choices[0].text == script["text"]
        # the Responses API: the think block as a reasoning item before the message, streamed or not
        r = c.responses.create(model="t", input="Weather in Paris?", max_output_tokens=200)
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "It is sunny."
        assert r.output[0].content[0].text == "\nThe user wants weather.\n"
        assert r.usage.output_tokens_details.reasoning_tokens == thought
        events = list(c.responses.create(model="t", input="Weather in Paris?", max_output_tokens=200, stream=True))
        deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(e.delta for e in deltas) == "\nThe user wants weather.\n"
        assert {e.output_index for e in deltas} == {0}
        assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
        assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]
        assert [o.model_dump(exclude={"id"}) for o in events[-1].response.output] == [
            o.model_dump(exclude={"id"}) for o in r.output]
        call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        script["text"] = "<think>Use the tool.</think>" + call
        r = c.chat.completions.create(model="t", messages=user, tools=[WEATHER], max_tokens=300)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name \
            == "get_weather"
        assert r.choices[0].message.model_extra["reasoning_content"] == "Use the tool."
        assert r.usage.completion_tokens_details.reasoning_tokens == len("<think>Use the tool.</think>")
        events = list(c.responses.create(model="t", input="Weather in Paris?", tools=[
            {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}],
            max_output_tokens=300, stream=True))
        done = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
        assert done == [(0, "reasoning"), (1, "function_call")]
        script["text"] = "A plain answer."
        r = c.chat.completions.create(model="t", messages=user, max_tokens=200)
        m = r.choices[0].message
        assert m.content == "A plain answer." and "reasoning_content" not in m.model_extra
        assert r.usage.completion_tokens_details.reasoning_tokens == 0
    script["text"] = "<think>hm</think>ok"
    with serve(pipe, reasoning_parser="none") as base:
        r = client(base).chat.completions.create(model="t", messages=user, max_tokens=200)
        assert r.choices[0].message.content == "<think>hm</think>ok"
    with serve(pipe) as base:  # auto: this tokenizer has no <think> token, so no parsing
        r = client(base).chat.completions.create(model="t", messages=user, max_tokens=200)
        assert r.choices[0].message.content == "<think>hm</think>ok"


def test_tokenize_and_detokenize(server, pipe):
    """vLLM's /tokenize and /detokenize: the prompt tokens a request would run, and text back."""
    r = httpx.post(server + "/tokenize", json={"messages": MSGS}).json()
    assert r["tokens"] == pipe.encode_messages(MSGS) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == pipe.max_context
    r = httpx.post(server + "/tokenize", json={"prompt": "Once upon"}).json()
    assert r["tokens"] == pipe.encode("Once upon", chat=False)
    back = httpx.post(server + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "Once upon"
    for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": MSGS}, "prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "ab"}, "tokens")):
        resp = httpx.post(server + path, json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (path, body)


def test_forced_tool_calls(server, pipe):
    """tool_choice "required" or a named function: a grammar in the template's call format makes the
    reply a call (even from this random model), with arguments that follow the tool's schema."""
    c = client(server)
    unit = {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
        "additionalProperties": False}}}
    light = {"type": "function", "function": {"name": "lights", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
        "additionalProperties": False}}}
    user = [{"role": "user", "content": "Use a tool."}]
    for choice, names in (("required", {"set_unit", "lights"}), ({"type": "function", "function": {"name": "lights"}},
                                                                   {"lights"})):
        r = c.chat.completions.create(model="t", messages=user, tools=[unit, light], tool_choice=choice, max_tokens=100)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name in names
        args = json.loads(call.function.arguments)
        if call.function.name == "set_unit":
            assert args in ({"unit": "C"}, {"unit": "F"})
        else:
            assert set(args) == {"on"} and isinstance(args["on"], bool)
        chunks = list(c.chat.completions.create(model="t", messages=user, tools=[unit, light], tool_choice=choice,
                                                max_tokens=100, stream=True))
        streamed = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [tc.function.name for tc in streamed] == [call.function.name]
    for body, param in (({"tool_choice": "required"}, "tool_choice"),  # no tools
                        ({"tools": [unit], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": [unit], "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice"),
                        ({"tools": [unit], "tool_choice": "sometimes"}, "tool_choice")):
        resp = httpx.post(server + "/v1/chat/completions", json={"messages": user, "max_tokens": 5} | body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, body


def test_forced_call_grammar_formats():
    from dflash_torch.serve.tool_calls import forced_call_grammar

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert forced_call_grammar("... <tool_call> ...", tools).startswith('start: "<tool_call>"')
    assert '"parameters"' in forced_call_grammar('Respond as {"name": ..., "parameters": ...}', tools)
    assert forced_call_grammar("<tool_call><function=NAME>", tools) is None  # XML calls: not forced
    assert forced_call_grammar("no tools here", tools) is None


def test_warns_when_the_model_was_loaded_in_another_thread(pipe, chat_model, caplog):
    """A pipeline loaded in this thread and served from the engine's worker: a warning (OpenMP teams of two
    threads can make every pass several times slower); loaded by the engine's own loader: none."""
    import logging

    with caplog.at_level(logging.WARNING, logger="dflash.server"):
        with serve(pipe) as base:
            assert httpx.get(base + "/health").status_code == 200
        assert any("loaded in another thread" in r.getMessage() for r in caplog.records)
        caplog.clear()
        with serve(loader=lambda: load(str(chat_model[0]), str(chat_model[1]), device="cpu", dtype="float32")) as base:
            deadline = time.time() + 60
            while httpx.get(base + "/health").status_code != 200:
                assert time.time() < deadline, "model did not become ready"
                time.sleep(0.05)
        assert not any("loaded in another thread" in r.getMessage() for r in caplog.records)


def test_events_go_over_in_order_first_text_and_last_at_once(monkeypatch):
    """Job.emit holds events for up to EMIT_INTERVAL_S (one event-loop wake-up per token cost decode speed):
    the first text and the final event go over at once, everything in order, nothing lost."""
    import asyncio

    from dflash_torch.decoding.sampling import Sampler
    from dflash_torch.serve import engine as engine_mod

    def drain(q) -> list:
        out = []
        while not q.empty():
            out.append(q.get_nowait())
        return out

    loop = asyncio.new_event_loop()
    try:
        monkeypatch.setattr(engine_mod, "EMIT_INTERVAL_S", 1e9)
        job = engine_mod.Job("chat", [1], 8, Sampler(), [], loop)
        job.emit("logprobs", ["a"])  # before any text: goes at once (nothing handed over yet)
        job.emit("delta", "x")  # the first text: at once
        for i in range(4):
            job.emit("delta", str(i))  # held
        loop.run_until_complete(asyncio.sleep(0))
        assert drain(job.events) == [("logprobs", ["a"]), ("delta", "x")]
        job.emit("done", {"n": 1})
        loop.run_until_complete(asyncio.sleep(0))
        assert drain(job.events) == [("delta", "0"), ("delta", "1"), ("delta", "2"), ("delta", "3"), ("done", {"n": 1})]
        monkeypatch.setattr(engine_mod, "EMIT_INTERVAL_S", 0.0)  # no holding: each event as it comes
        job = engine_mod.Job("chat", [1], 8, Sampler(), [], loop)
        for i in range(3):
            job.emit("delta", str(i))
            loop.run_until_complete(asyncio.sleep(0))
            assert drain(job.events) == [("delta", str(i))]
    finally:
        loop.close()
