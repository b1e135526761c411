"""Tool calls, reasoning and fill-in-the-middle through the server, on a real (tiny, random) model: with the
drafter and prompt lookup on, the reply is the one a target-only server gives for the same request, greedy."""

from __future__ import annotations

import json

import pytest

from dflash_torch.generate import load

from .server_support import SPECIALS, client, make_chat_model, metrics_json, serve

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>"]
UNIT = {"type": "function", "function": {"name": "unit", "parameters": {
    "type": "object", "properties": {"u": {"enum": ["C", "F"]}, "city": {"type": "string", "maxLength": 8}},
    "required": ["u", "city"], "additionalProperties": False}}}
LIGHTS = {"type": "function", "function": {"name": "lights", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    """(speculative, target-only) pipelines of one tiny chat model with FIM tokens: the same target weights."""
    # a 1024-token context: the tools' JSON alone takes about 400 (one token per character)
    target, draft = make_chat_model(tmp_path_factory.mktemp("kinds"), SPECIALS + FIM, max_position_embeddings=1024)
    return (load(str(target), str(draft), device="cpu", dtype="float32"),
            load(str(target), None, device="cpu", dtype="float32"))


def _both(pipes, call, **config):
    """call(base) on a server with the drafter (and prompt lookup) and on a target-only one; the first
    server's request must have verified drafts (a verify pass wider than one token)."""
    out = []
    for pipe in pipes:
        with serve(pipe, **config) as base:
            out.append(call(base))
            row = metrics_json(base)["recent"][-1]
        speculative = any(int(w) > 1 for w in row["verify_widths"])
        assert speculative == (pipe is pipes[0]), row
    return out


def test_tool_calls_equal_target_only(pipes):
    """tool_choice "required" / a named function: the call (name and arguments, generated under the call
    grammar) is target-only's; several prompts, so the arguments differ between them."""
    checked = 0
    for text in ("Use a tool.", "Set the unit for Rome", "Turn the kitchen lights on", "x"):
        for choice in ("required", {"type": "function", "function": {"name": "unit"}}):
            def call(base, text=text, choice=choice):
                r = client(base).chat.completions.create(
                    model="t", messages=[{"role": "user", "content": text}], tools=[UNIT, LIGHTS],
                    tool_choice=choice, max_tokens=150)
                c = r.choices[0]
                return c.finish_reason, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]

            got, want = _both(pipes, call)
            assert got == want, (text, choice)
            assert want[0] == "tool_calls" and want[1], want  # a call, whose arguments parse as JSON
            assert all(isinstance(json.loads(args), dict) for _, args in want[1])
            checked += 1
    assert checked == 8


def test_reasoning_equals_target_only(pipes):
    """--reasoning-parser think, the reply made to hold a think block (a regex: this random model writes no
    tags of its own): reasoning_content and content are target-only's, both non-empty."""
    pattern = "<think>[a-z ]{4,40}</think>\n\n[a-zA-Z ,.]{4,40}"
    for text in ("Why is the sky blue?", "Think first", "q"):
        def call(base, text=text):
            r = client(base).chat.completions.create(
                model="t", messages=[{"role": "user", "content": text}], max_tokens=100,
                extra_body={"guided_regex": pattern})
            m = r.choices[0].message
            return m.model_extra.get("reasoning_content"), m.content, r.usage.completion_tokens

        got, want = _both(pipes, call, reasoning_parser="think")
        assert got == want, text
        assert want[0] and want[1], want  # the think block came back apart from the answer


def test_fill_in_the_middle_equals_target_only(pipes):
    """Completions with a suffix (the FIM prompt format): the fill is target-only's, for several prompts."""
    cases = [("def add(a, b):\n    ", "\n\nprint(add(1, 2))"), ("The capital of France is ", "."),
             ("x = [", "]\nprint(x)")]
    for prompt, suffix in cases:
        def call(base, prompt=prompt, suffix=suffix):
            r = client(base).completions.create(model="t", prompt=prompt, suffix=suffix, max_tokens=40)
            return r.choices[0].text, r.usage.completion_tokens, r.usage.prompt_tokens

        got, want = _both(pipes, call)
        assert got == want, prompt
        assert want[0] and want[1] > 0
