"""`dflash serve` parsing the model's output: tool calls (OpenAI tool_calls, streamed in any chunking,
forced by tool_choice) and reasoning (think blocks as reasoning_content)."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from dflash_torch import loading
from dflash_torch.serve.openai_api import parse_messages

from . import server_support
from .server_support import WEATHER, client, script_generation, serve

# the shared module-scoped fixtures (one_thread: autouse); this module gets its own instances
one_thread, chat_model, pipe, server = (server_support.one_thread, server_support.chat_model, server_support.pipe,
                                        server_support.server)


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
