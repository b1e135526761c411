"""`/openapi.json`: the request model of every route with a body, and a bounded property-based run against it
(schemathesis, on the loopback server of server_support.py with the same tiny chat model): no answer is a 5xx,
and every error comes in the shape of the route's API, naming nothing but a string or null as its field.

The run is fixed: derandomized Hypothesis, a set number of examples per operation, positive (what the schema
allows) and negative (what it does not) ones. The model's context is small (192 tokens), so that no example
can ask for a long generation: a max_tokens beyond what is left is a 400 like any other.
"""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from dflash_torch.generate import load

from .server_support import MSGS, make_chat_model, serve

EXAMPLES = 30  # per operation and mode
BODIES = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
          "/v1/responses": "ResponsesRequest", "/v1/messages": "MessagesRequest",
          "/v1/messages/count_tokens": "CountTokensRequest", "/tokenize": "TokenizeRequest",
          "/detokenize": "DetokenizeRequest"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target, draft = make_chat_model(tmp_path_factory.mktemp("openapi"), max_position_embeddings=192)
    pipe = load(str(target), str(draft), device="cpu", dtype="float32")
    with serve(pipe, max_tokens=16) as base:
        yield base


def test_openapi_documents_every_request_body(server):
    spec = httpx.get(server + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in BODIES.items():
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}, path
        # errors: the API's own shape, not FastAPI's 422
        assert set(spec["paths"][path]["post"]["responses"]) == {"200", "4XX"}, path
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and {"max_tokens", "stop", "tools", "response_format", "logprobs",
                                                 "n", "seed", "stream"} <= set(chat["properties"])
    assert schemas["CompletionRequest"]["required"] == ["prompt"] and "suffix" in schemas["CompletionRequest"][
        "properties"]
    assert schemas["ResponsesRequest"]["required"] == ["input"] and "max_output_tokens" in schemas[
        "ResponsesRequest"]["properties"]
    assert schemas["MessagesRequest"]["required"] == ["messages"] and "stop_sequences" in schemas[
        "MessagesRequest"]["properties"]
    assert all(schemas[m].get("additionalProperties") is True for m in BODIES.values())  # others are ignored
    for page in ("/docs", "/redoc"):  # off: they would load their scripts from a CDN
        assert httpx.get(server + page).status_code == 404


U = [{"role": "user", "content": "hi"}]
ONCE_5XX = [  # (path, body, status, param): what the fuzzing found answered with a 500
    ("/v1/chat/completions", {"messages": U, "temperature": 10**400}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": U, "presence_penalty": 10**400}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": U, "logit_bias": {"5": 10**400}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": U, "tool_choice": {"type": "function", "function": "x"}}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": U, "response_format": {"type": "json_schema", "json_schema": "x"}}, 400,
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "\u00e9"}, 400, "guided_regex"),  # not in its vocabulary
    ("/v1/chat/completions", {"messages": U, "guided_choice": ["\u00df"], "stream": True}, 200, None),  # an event
    ("/v1/completions", {"prompt": "hi", "temperature": 1e-300}, 200, None),  # greedy
    ("/v1/completions", {"prompt": "hi", "temperature": 1.6, "top_p": 5e-324}, 200, None),
    ("/v1/completions", {"prompt": "hi", "temperature": 1, "repetition_penalty": 1e-300}, 200, None),
    ("/v1/messages", {"messages": U, "temperature": 1e-300, "max_tokens": 4}, 200, None),
    # the Responses API's errors name its own fields
    ("/v1/responses", {"input": "hi", "max_output_tokens": "4"}, 400, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
]


def test_inputs_that_were_5xx_are_answered(server):
    for path, body, status, param in ONCE_5XX:
        r = httpx.post(server + path, json=body | {"max_tokens": 4} if path != "/v1/responses" else body)
        assert r.status_code == status, (path, body, r.text[:300])
        if status == 400:
            assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error", r.text
        elif body.get("stream"):  # the format cannot be followed: an error event naming the field, not a 500
            assert '"param": "guided_choice"' in r.text and "server_error" not in r.text, r.text[:300]
    # the body is JSON whatever the content-type says (curl -d sends form-urlencoded), as before the models
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {"content-type": "text/plain"}, {}):
        r = httpx.post(server + "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}], '
                       b'"max_tokens": 2}', headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, (headers, r.text[:200])
    assert 'status="500"' not in httpx.get(server + "/metrics").text


def _error_shape(path: str, response) -> str | None:
    """What is wrong with a 4xx answer's body, or None when it is in the route's API's error shape."""
    try:
        body = response.json()
    except ValueError:
        return f"not JSON: {response.text[:200]!r}"
    if path.startswith("/v1/messages"):  # Anthropic's
        ok = (isinstance(body, dict) and set(body) == {"type", "error", "param"} and body["type"] == "error"
              and set(body["error"]) == {"type", "message"} and isinstance(body["error"]["type"], str))
        message = body["error"]["message"] if ok else None
    else:  # OpenAI's
        ok = isinstance(body, dict) and set(body) == {"error"} and set(body["error"]) == {"message", "type", "param",
                                                                                         "code"}
        message = body["error"]["message"] if ok else None
    param = body.get("param", body.get("error", {}).get("param")) if ok else None
    if not ok or not isinstance(message, str) or not message or not (param is None or isinstance(param, str)):
        return f"not in the API's error shape: {response.text[:300]}"
    return None


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_only_errors_in_the_apis_shape(server):
    schema = schemathesis.openapi.from_url(server + "/openapi.json")
    failures: list[str] = []
    calls = 0
    start = time.perf_counter()
    for result in schema.get_all_operations():
        op = result.ok()
        has_input = op.body or op.query
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,):
            name = f"{op.method.upper()} {op.path} ({mode.value})"

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            def check(case):
                nonlocal calls
                calls += 1
                response = case.call(base_url=server, timeout=60)
                assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
                if response.status_code >= 400:
                    wrong = _error_shape(case.path, response)
                    assert wrong is None, wrong

            try:
                check()
            except Exception as e:  # one report for all operations
                failures.append(f"{name}: {type(e).__name__}: {str(e)[:1500]}")
    elapsed = time.perf_counter() - start
    assert not failures, "\n\n".join(failures)
    assert calls >= 7 * 2 * EXAMPLES // 2, calls  # the body routes ran (some schemas allow fewer examples)
    # streamed answers fail in events, after a 200: the engine's own count says none did
    assert 'status="500"' not in httpx.get(server + "/metrics").text
    # and it still serves
    r = httpx.post(server + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    print(f"schemathesis: {calls} requests in {elapsed:.0f} s")
