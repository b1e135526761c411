"""The 200 answers' models (`ResponseModel`s): what `/openapi.json` documents for each route's 200 is what the
server sends. Real requests against the tiny chat model of server_support.py, in variants that bring out each
optional part (n > 1, log-probabilities, echo, a cut answer, a stop string, tool calls, a think block), each
body validated strictly (JSON types as sent: a string where an int belongs, or a bool for an int, fails)
and with nothing in it the model does not declare.
"""

from __future__ import annotations

import httpx
import pydantic
import pytest
import torch

from dflash_torch.generate import load
from dflash_torch.serve import messages_api, openai_api, responses_api
from dflash_torch.serve.protocol import ResponseModel

from .server_support import MSGS, WEATHER, make_chat_model, script_generation, serve

ROUTES = {"/v1/chat/completions": openai_api.ChatCompletion, "/v1/completions": openai_api.Completion,
          "/v1/responses": responses_api.ResponseObject, "/v1/messages": messages_api.MessageResponse,
          "/v1/messages/count_tokens": messages_api.TokenCount}
STREAMED = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
U = [{"role": "user", "content": "Weather in Paris?"}]
CALL = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
THINK = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: see server_support.one_thread
    target, draft = make_chat_model(tmp_path_factory.mktemp("answers"))
    yield load(str(target), str(draft), device="cpu", dtype="float32")
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def server(pipe):
    with serve(pipe, max_tokens=16) as base:
        yield base


def undeclared(value, where: str = "") -> list[str]:
    """The fields of a validated answer that its model does not declare (extra="allow" keeps them)."""
    if isinstance(value, ResponseModel):
        out = [f"{where}.{k}" for k in value.model_extra or {}]
        for name in type(value).model_fields:
            out += undeclared(getattr(value, name), f"{where}.{name}")
        return out
    if isinstance(value, list):
        return [w for i, v in enumerate(value) for w in undeclared(v, f"{where}[{i}]")]
    return []


def check(base: str, path: str, body: dict) -> pydantic.BaseModel:
    """POST body; the 200 answer, validated with the route's documented model."""
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), (path, r.text[:300])
    answer = ROUTES[path].model_validate_json(r.text, strict=True)
    assert not undeclared(answer), (path, undeclared(answer), r.text[:300])
    assert set(r.json()) == set(type(answer).model_fields), path  # every top-level field declared and sent
    return answer


def test_openapi_documents_each_answer(server):
    spec = httpx.get(server + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in ROUTES.items():
        ok = spec["paths"][path]["post"]["responses"]["200"]
        assert ok["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}
        assert ("text/event-stream" in ok["content"]) == (path in STREAMED), path
        schema = schemas[model.__name__]
        assert set(schema["properties"]) == set(model.model_fields) and schema.get("additionalProperties") is True
        assert set(schema["required"]) == {k for k, f in model.model_fields.items() if f.is_required()}, path


def test_strict_models_refuse_wrong_types():
    assert messages_api.TokenCount.model_validate_json('{"input_tokens": 3}', strict=True).input_tokens == 3
    for wrong in ('{"input_tokens": "3"}', '{"input_tokens": true}', '{"input_tokens": 3.5}', "{}"):
        with pytest.raises(pydantic.ValidationError):
            messages_api.TokenCount.model_validate_json(wrong, strict=True)
    with pytest.raises(pydantic.ValidationError):  # a finish_reason the server never sends
        openai_api.CompletionChoice.model_validate_json(
            '{"index": 0, "text": "", "logprobs": null, "finish_reason": "cancelled", "stop_reason": null}',
            strict=True)


def test_chat_and_completions_answers(server):
    chat = "/v1/chat/completions"
    r = check(server, chat, {"messages": MSGS, "max_tokens": 3})
    assert r.choices[0].finish_reason == "length" and r.choices[0].logprobs is None
    r = check(server, chat, {"messages": MSGS, "max_tokens": 4, "n": 2, "logprobs": True, "top_logprobs": 2,
                             "temperature": 1.0, "seed": 3})
    assert len(r.choices) == 2 and all(c.logprobs and len(c.logprobs.content[0].top_logprobs) == 2
                                       for c in r.choices)
    check(server, chat, {"messages": MSGS, "max_tokens": 8, "stop": [c for c in "aeiou "]})
    check(server, chat, {"messages": MSGS, "max_tokens": 4, "tools": [WEATHER]})  # tools offered, no call made

    comp = "/v1/completions"
    r = check(server, comp, {"prompt": "Once upon", "max_tokens": 3})
    assert r.choices[0].finish_reason == "length" and r.choices[0].logprobs is None
    r = check(server, comp, {"prompt": "Once upon", "max_tokens": 3, "echo": True, "logprobs": 2, "n": 2,
                             "temperature": 0.8, "seed": 1})
    lp = r.choices[1].logprobs
    assert len(r.choices) == 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert r.choices[0].text.startswith("Once upon") and lp.text_offset[:2] == [0, 1]
    r = check(server, comp, {"prompt": [10, 11, 12], "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.usage.completion_tokens == 0
    check(server, comp, {"prompt": "Once upon", "max_tokens": 8, "stop": [c for c in "aeiou "]})


def test_responses_and_messages_answers(server):
    r = check(server, "/v1/responses", {"input": "hi", "max_output_tokens": 3})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    r = check(server, "/v1/responses", {
        "input": [{"role": "user", "content": "hi"}], "instructions": "Be brief.", "max_output_tokens": 4,
        "temperature": 0.5, "top_p": 0.9, "metadata": {"k": "v"}, "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]})
    assert r.instructions == "Be brief." and r.metadata == {"k": "v"} and r.tools[0]["name"] == "get_weather"

    r = check(server, "/v1/messages", {"messages": U, "max_tokens": 3})
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    check(server, "/v1/messages", {"messages": U, "max_tokens": 8, "system": "Be brief.",
                                   "stop_sequences": list("aeiou "), "tools": [ANTHROPIC_WEATHER], "temperature": 0.7})
    r = check(server, "/v1/messages/count_tokens", {"messages": U, "tools": [ANTHROPIC_WEATHER]})
    assert r.input_tokens > 0


def test_tool_calls_and_reasoning_answers(pipe, monkeypatch):
    """What the tiny model cannot write, scripted (server_support.script_generation): tool calls, a think block."""
    script = script_generation(pipe, monkeypatch)
    with serve(pipe, reasoning_parser="think") as base:
        script["text"] = CALL
        r = check(base, "/v1/chat/completions", {"messages": U, "tools": [WEATHER], "max_tokens": 200})
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name
        script["text"] = CALL.split(".", 1)[1]  # only the call: content null
        r = check(base, "/v1/chat/completions", {"messages": U, "tools": [WEATHER], "max_tokens": 200})
        assert r.choices[0].message.content is None and r.choices[0].message.tool_calls
        script["text"] = "Sunny, says" + " the forecast" * 3
        r = check(base, "/v1/chat/completions", {"messages": U, "max_tokens": 200, "stop": ["forecast"]})
        assert r.choices[0].stop_reason == "forecast" and r.choices[0].message.content == "Sunny, says the "
        r = check(base, "/v1/completions", {"prompt": "x", "max_tokens": 200, "stop": ["forecast"]})
        assert r.choices[0].stop_reason == "forecast"
        r = check(base, "/v1/messages", {"messages": U, "max_tokens": 200, "stop_sequences": ["forecast"]})
        assert r.stop_reason == "stop_sequence" and r.stop_sequence == "forecast"

        script["text"] = THINK + CALL
        # (no logprobs here: the scripted generation computes none)
        r = check(base, "/v1/chat/completions", {"messages": U, "tools": [WEATHER], "max_tokens": 200})
        m = r.choices[0].message
        assert m.reasoning_content and m.tool_calls and r.usage.completion_tokens_details.reasoning_tokens > 0
        r = check(base, "/v1/responses", {"input": "Weather in Paris?", "max_output_tokens": 200, "tools": [
            {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]})
        assert [o.type for o in r.output] == ["reasoning", "message", "function_call"] and r.status == "completed"
        r = check(base, "/v1/messages", {"messages": U, "max_tokens": 200, "tools": [ANTHROPIC_WEATHER]})
        assert [b.type for b in r.content] == ["thinking", "text", "tool_use"] and r.stop_reason == "tool_use"
        script["text"] = THINK
        r = check(base, "/v1/messages", {"messages": U, "max_tokens": 200})
        assert [b.type for b in r.content] == ["thinking", "text"] and r.stop_reason == "end_turn"
