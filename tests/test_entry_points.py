"""Every entry point runs a prompt the same way, on the real default model.

The embedded default model (SmolLM2-135M-Instruct from its Q4_1 GGUF, quantized weights: bfloat16
activations, where a rounding difference between two ways of running a prompt flips near-tie tokens)
with its shipped drafter, found through the registry. Greedy, 96 new tokens: `dflash generate --json`
(no flags), the Python API (`generate(pipe, ids, max_tokens=96)`) and `dflash serve` (its defaults:
drafter, prompt lookup, fallback, adaptive block size, prefix cache), a first request and the same
request again from the prefix cache, give the same text and token ids. Each entry point loads the model
itself (`generate.load` decides how prompts run, once, for all of them).

Several prompts are ones whose greedy text changes when the prefill's attention is one fused pass
instead of one query at a time (measured: their tokens differ from the 14th to the 50th), so an entry
point that ran prompts another way would fail here. The model is loaded once per process for each
entry point (module-scoped fixtures); the file takes about two minutes on two cores.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import time

import pytest
import torch

from dflash_torch import cli, generate, load, registry
from dflash_torch.decoding.speculative import _run_prompt
from dflash_torch.serve import engine as engine_module
from dflash_torch.serve.app import create_app
from dflash_torch.serve.engine import ServerConfig

pytestmark = pytest.mark.slow
generate_module = importlib.import_module("dflash_torch.generate")  # the package's `generate` is the function

MAX_TOKENS = 96
PROMPTS = [
    "Write a Python function that reverses a linked list, and explain it.",  # issue 21's
    # greedy text differs from the 14th, 35th, 50th and 14th token with a fused prefill
    "Explain the difference between a list and a tuple in Python.",
    "Write a short story about a robot who learns to paint.",
    "Summarize the causes of the French Revolution in a paragraph.",
    "How do I make a cup of green tea?",
]


@pytest.fixture(scope="module")
def api():
    """The Python API's pipeline, with the settings `dflash generate` defaults to (`--quantize auto`:
    the GGUF's 4-bit weights; the library's own default is to keep them as loaded, in float32)."""
    assert cli.build_parser().parse_args(["generate", "x"]).quantize == "auto"
    return load(quantize="auto", quiet=True)


@pytest.fixture(scope="module")
def api_runs(api) -> dict:
    """prompt -> the Python API's Result, computed on first use and shared by the tests below."""
    return {}


def api_result(api, api_runs: dict, prompt: str):
    if prompt not in api_runs:
        api_runs[prompt] = generate(api, api.encode(prompt), max_tokens=MAX_TOKENS)
    return api_runs[prompt]


@pytest.fixture(scope="module")
def cli_load():
    """`dflash generate` runs in this process (`cli.main`), loading the model itself; its loads are kept
    by their arguments, so the five calls share one pipeline loaded with exactly the CLI's arguments
    (loading is deterministic, and a generation leaves nothing behind in the pipeline)."""
    real, kept = generate_module.load, {}

    def kept_load(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in kept:
            kept[key] = real(*args, **kwargs)
        return kept[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generate_module, "load", kept_load)
        yield kept


def cli_generate(prompt: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["generate", prompt, "--max-tokens", str(MAX_TOKENS), "--json"]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def served():
    """`dflash serve` with no flags (its config as `cmd_serve` builds it from the defaults), through
    the app's own loader, under the test client. The server's replies carry text only: the token ids
    its worker commits are recorded on the way out of `generate_tokens` (prompt, tokens) per request."""
    from fastapi.testclient import TestClient

    args = cli.build_parser().parse_args(["serve"])
    assert args.quantize == "auto" and args.adaptive is None and not args.no_draft and not args.no_prefix_cache
    assert args.fastpath_max_tokens == 0 and args.prefill_step_size is None
    config = ServerConfig(quantize="auto", adaptive=True)  # cmd_serve: adaptive unless --no-adaptive
    requests, real = [], engine_module.generate_tokens

    def recording(target, prompt, **kwargs):
        tokens = []
        requests.append((list(prompt), tokens))
        for t in real(target, prompt, **kwargs):
            tokens.append(t)
            yield t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "generate_tokens", recording)
        app = create_app(config)
        with TestClient(app) as client:
            engine = app.state.engine
            while client.get("/health").status_code != 200:  # the worker loads the model
                assert engine.error is None and engine.thread.is_alive(), engine.error
                time.sleep(0.2)
            yield client, engine, requests


def serve_chat(served, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, list[int], list[int], int]:
    """One greedy chat request -> (text, prompt ids, completion ids, prompt tokens the cache held)."""
    client, _, requests = served
    before = len(requests)
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(requests) == before + 1
    body, (prompt_ids, ids) = r.json(), requests[-1]
    assert body["usage"]["completion_tokens"] == len(ids)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return body["choices"][0]["message"]["content"], prompt_ids, ids, cached


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_generate_api_and_server_give_the_same_tokens(i, api, api_runs, cli_load, served):
    prompt = PROMPTS[i]
    ids = api.encode(prompt)
    ours = api_result(api, api_runs, prompt)
    assert api.exact_prefill  # quantized: prefills one query at a time (generate.load)
    assert len(ours.token_ids) == MAX_TOKENS or ours.finish_reason == "stop"

    got = cli_generate(prompt)
    assert (got["token_ids"], got["text"]) == (ours.token_ids, ours.text)
    assert got["stats"]["prompt_tokens"] == len(ids) and got["finish_reason"] == ours.finish_reason
    assert len(cli_load) == 1 and next(iter(cli_load.values())) is not api  # the CLI's own load

    engine = served[1]
    assert engine.pipe is not api and engine.pipe.exact_prefill and engine.prefix is not None
    engine.prefix.clear()
    if i % 2:
        # The first request starts from another prompt's entry, whose chat-template preamble (its system
        # message) it shares: its prefill's new positions attend to keys and values an earlier request
        # computed. Even prompts start from an empty cache.
        serve_chat(served, PROMPTS[i - 1], max_tokens=1)
    text, prompt_ids, tokens, cached = serve_chat(served, prompt)
    assert prompt_ids == ids
    assert (tokens, text) == (ours.token_ids, ours.text), f"first request ({cached} prompt tokens cached)"
    assert 0 < cached < len(ids) - 8 if i % 2 else cached == 0
    text, prompt_ids, tokens, cached = serve_chat(served, prompt)  # again: the prefix cache holds it all
    assert cached == len(ids)
    assert (tokens, text) == (ours.token_ids, ours.text), "the same request again, from the prefix cache"


def test_speculative_equals_target_only_with_the_shipped_drafter(api, api_runs):
    """The shipped drafter, loaded through the registry (no --draft), proposes tokens that the target
    keeps, and speculative decoding (drafter and prompt lookup) gives exactly target-only decoding."""
    assert api.draft_path == registry.SHIPPED / "smollm2-135m-instruct"
    assert registry.drafter_for(api.name, json.loads((api.model_path / "config.json").read_text())) == str(
        api.draft_path)
    drafted = accepted = 0
    for prompt in PROMPTS:
        spec = api_result(api, api_runs, prompt)
        plain = generate(api, api.encode(prompt), max_tokens=MAX_TOKENS, use_draft=False)
        assert spec.stats.mode == "dflash+lookup" and plain.stats.mode == "target-only"
        assert spec.token_ids == plain.token_ids, prompt
        drafted += spec.stats.drafted_tokens - spec.stats.lookup_drafted
        accepted += spec.stats.accepted_tokens - spec.stats.lookup_accepted
    assert drafted > 0 and accepted > 0  # the drafter's own proposals, not only lookup's, were verified


@torch.inference_mode()
def test_chunked_prefill_is_the_one_pass_prefill(api, api_runs):
    """`--prefill-step-size`: a prompt run in passes of any size gives the one-pass prefill's logits,
    drafter features and keys/values bit for bit (one query at a time, row-invariant quantized kernels),
    hence the same tokens."""
    target, taps = api.target, api.drafter.target_layer_ids
    prompt = api.encode(PROMPTS[1])
    n = len(prompt)
    one = target.new_cache(n + 1)
    want_logits, want_hidden = _run_prompt(target, prompt, one, taps, None, api.device)
    for chunk in (1, 5, 16, n - 1):
        cache = target.new_cache(n + 1)
        logits, hidden = _run_prompt(target, prompt, cache, taps, chunk, api.device)
        assert torch.equal(logits, want_logits), chunk
        assert torch.equal(hidden, want_hidden), chunk
        assert torch.equal(cache.k[..., :n, :], one.k[..., :n, :]) and torch.equal(
            cache.v[..., :n, :], one.v[..., :n, :]), chunk
    chunked = generate(api, prompt, max_tokens=MAX_TOKENS, prefill_chunk=7)
    assert chunked.token_ids == api_result(api, api_runs, PROMPTS[1]).token_ids
