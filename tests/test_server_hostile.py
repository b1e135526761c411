"""`dflash serve` under hostile input and access settings: malformed requests get 4xx JSON errors and the
server stays exact; the API key, allowed origins (CORS), the served model name, health while loading."""

from __future__ import annotations

import threading
import time

import httpx
import openai

from . import server_support
from .server_support import OK_MSGS, client, serve, solo

# the shared module-scoped fixtures (one_thread: autouse); this module gets its own instances
one_thread, chat_model, pipe, server = (server_support.one_thread, server_support.chat_model, server_support.pipe,
                                        server_support.server)


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
