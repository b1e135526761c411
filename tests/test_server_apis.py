"""`dflash serve`'s APIs beside OpenAI's chat and text completions: the Responses API (/v1/responses),
Anthropic's Messages API (/v1/messages), vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from dflash_torch.serve.openai_api import parse_messages
from dflash_torch.serve.responses_api import responses_to_chat

from . import server_support
from .server_support import MSGS, WEATHER, client, script_generation, serve, solo

# the shared module-scoped fixtures (one_thread: autouse); this module gets its own instances
one_thread, chat_model, pipe, server = (server_support.one_thread, server_support.chat_model, server_support.pipe,
                                        server_support.server)


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
