"""`dflash serve`: an OpenAI-compatible HTTP server (chat, completions, responses, models, health, metrics),
with Anthropic's Messages API beside it (`messages_api.py`).

One worker thread owns the model and runs one generation at a time; requests wait in a bounded FIFO
queue (429 when it is full). The worker detokenizes, cuts stop strings and hands text deltas to the
request's event loop, so a streamed and a non-streamed answer are the same text. A client that goes
away sets its job's cancel flag, which the worker checks after every token.

    dflash serve                      # the embedded default model on http://127.0.0.1:8000
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

This module does not use `from __future__ import annotations`: FastAPI reads the handlers' annotations
(`request: Request`, imported inside create_app to keep `dflash --help` light) as real classes.
"""

import argparse
import asyncio
import dataclasses
import hmac
import itertools
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from ..decoding import structured
from ..decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrate
from ..decoding.fallback import FallbackController
from ..decoding.prefix_cache import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DiskStore, PrefixCache
from ..decoding.sampling import Sampler, TokenLogprobs
from ..decoding.speculative import Stats, generate_tokens
from ..decoding.structured import Constraint
from ..generate import Detokenizer, Pipeline, check_lengths, load, prompt_logprobs
from . import fim, messages_api
from .reasoning import ReasoningSplitter, has_think_tags, starts_inside
from .tool_calls import ToolCallStream, forced_call_grammar

log = logging.getLogger("dflash.server")

MAX_BODY_BYTES = 1 << 20
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # the hold-back check costs up to len(stop)^2 per token
ROLES = ("system", "user", "assistant", "tool")
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
             "/v1/messages": "messages", "/v1/messages/count_tokens": "messages",
             "/v1/models": "models", "/tokenize": "tokenize", "/detokenize": "detokenize",
             "/health": "health", "/metrics": "metrics", "/metrics.json": "metrics"}
# Accepted by OpenAI but not implemented here: refuse rather than silently answer something else.
UNSUPPORTED = ("functions",)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n: choices per request, generated one after the other
ANTHROPIC_ERRORS = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


@dataclass
class ServerConfig:
    """Everything `dflash serve` takes; also what tests build apps from."""

    model: str | None = None
    draft: str | None = "auto"  # None: no drafter
    host: str = "127.0.0.1"
    port: int = 8000
    fastpath_max_tokens: int = 0  # requests with max_tokens <= this run target-only
    api_key: str | None = None
    served_model_name: str | None = None  # the model id clients see (default: the model's name)
    allowed_origins: list[str] = field(default_factory=list)  # CORS: web pages that may call the API ("*": any)
    max_tokens: int = 256  # default when a request gives none (clipped to the context left)
    block_size: int | None = None
    max_queue: int = 64
    device: str = "auto"
    dtype: str = "auto"
    quantize: str | None = None  # "int8", "int4" (weight-only quantized target), "auto" or None / "none"
    cuda_graphs: bool = False  # decode/verify passes replayed as CUDA graphs
    draft_vocab: bool = True  # the drafter's draft vocabulary where it has one (False: the whole LM head)
    draft_window: int | None = None  # the drafter attends to its first draft_sinks and last draft_window positions
    # (0: all of them; None: as the drafter's config says)
    draft_sinks: int = 64
    adaptive: bool = False  # adaptive block size (inside the fallback's decision)
    fallback: bool = True  # target-only fallback when speculation is slower
    lookup: bool | None = None  # prompt-lookup drafts beside the drafter (None: on whenever the drafter is)
    prefix_cache_max_entries: int = DEFAULT_MAX_ENTRIES  # finished requests' caches kept for reuse (0: off)
    prefix_cache_max_bytes: int = DEFAULT_MAX_BYTES
    prefix_cache_l2_dir: str | None = None  # entries pushed out of memory go to files here (None: dropped)
    prefix_cache_l2_max_bytes: int = 16 << 30
    chat_template_args: dict = field(default_factory=dict)  # chat template variables (a request's own win)
    reasoning_parser: str = "auto"  # "think": <think>...</think> -> reasoning_content; "auto": when the
    # tokenizer has those tags as tokens; "none": reasoning stays in the content
    prefill_step_size: int | None = None  # prompts run in passes of at most this many tokens (None: one)
    max_body_bytes: int = MAX_BODY_BYTES
    recent: int = 32  # finished requests kept for /metrics?format=json


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None, counted: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers
        self.counted = counted  # already in dflash_requests_total (the worker counts the jobs it ran)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# --- request parsing ----------------------------------------------------------------------------

_KINDS = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v), "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "an object"),
}


def _field(body: dict, name: str, kind: str, default=None):
    """body[name] checked against `kind`; null or absent gives `default`."""
    value = body.get(name)
    if value is None:
        return default
    ok, what = _KINDS[kind]
    if not ok(value):
        raise bad(f"'{name}' must be {what}, got {json.dumps(value)[:40]}", name)
    return value


@dataclass
class GenRequest:
    """What the two completion endpoints have in common, validated."""

    max_tokens: int | None
    max_tokens_param: str  # the name the client used, for error messages
    stops: list[str]
    stream: bool
    include_usage: bool
    sampler: Sampler
    logprobs: int | None = None  # None: not asked for; k: each token's log-probability and its k best
    grammar: tuple | str | None = None  # structured output: parse_grammar's, then the compiled grammar
    n: int = 1  # choices
    fit: bool = False  # a max_tokens beyond the context left is cut to it (else: a 400)
    one_call: bool = False  # parallel_tool_calls false: at most one tool call per reply


def parse_common(body: dict, min_tokens: int = 1) -> GenRequest:
    """Validate the sampling, length, stop and streaming fields of a request body (`min_tokens`: the
    least max_tokens allowed; 0 for a completion that echoes the prompt, to score it)."""
    _field(body, "model", "str")
    for name in UNSUPPORTED:
        if body.get(name):
            raise bad(f"'{name}' is not supported by this server", name)
    n = _field(body, "n", "int", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad(f"'n' must be in [1, {MAX_CHOICES}]", "n")
    max_tokens, max_tokens_param = None, "max_tokens"
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are given
        value = _field(body, name, "int")
        if value is not None:
            if value < min_tokens:
                raise bad(f"'{name}' must be >= {min_tokens}, got {value}", name)
            max_tokens, max_tokens_param = value, name
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    ok = isinstance(stops, list) and len(stops) <= MAX_STOPS
    if not ok or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad(f"'stop' must be a string of 1 to {MAX_STOP_CHARS} characters or a list of at most {MAX_STOPS} "
                  "of them", "stop")
    options = _field(body, "stream_options", "object", {})
    include_usage = _field(options, "include_usage", "bool", False)
    temperature = _field(body, "temperature", "number", 0.0)  # greedy by default, like `dflash generate`
    if not 0 <= temperature <= 2:
        raise bad("'temperature' must be in [0, 2]", "temperature")
    top_p = _field(body, "top_p", "number", 1.0)
    if not 0 < top_p <= 1:
        raise bad("'top_p' must be in (0, 1]", "top_p")
    top_k = _field(body, "top_k", "int", 0)
    if top_k < -1:
        raise bad("'top_k' must be >= 0 (or -1: off)", "top_k")
    min_p = _field(body, "min_p", "number", 0.0)
    if not 0 <= min_p < 1:
        raise bad("'min_p' must be in [0, 1)", "min_p")
    seed = _field(body, "seed", "int")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise bad("'seed' must fit in 64 bits", "seed")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        penalties[name] = float(_field(body, name, "number", 0.0))
        if not -2 <= penalties[name] <= 2:
            raise bad(f"'{name}' must be in [-2, 2]", name)
    penalties["repetition_penalty"] = float(_field(body, "repetition_penalty", "number", 1.0))  # vLLM's field
    if not 0 < penalties["repetition_penalty"] <= 10:
        raise bad("'repetition_penalty' must be in (0, 10] (1: off)", "repetition_penalty")
    raw, bias = _field(body, "logit_bias", "object", {}), None
    if raw:
        try:
            bias = {int(k): float(v) for k, v in raw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        except (TypeError, ValueError):
            bias = {}
        if not len(bias) == len(raw) <= MAX_LOGIT_BIAS or not all(t >= 0 and -100 <= v <= 100
                                                                   for t, v in bias.items()):
            raise bad(f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]",
                      "logit_bias")
    sampler = Sampler(float(temperature), float(top_p), max(top_k, 0), float(min_p), seed, **penalties,
                      logit_bias=bias)
    return GenRequest(max_tokens, max_tokens_param, stops, _field(body, "stream", "bool", False), include_usage,
                      sampler, grammar=parse_grammar(body), n=n)


GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "lark"}


def parse_grammar(body: dict) -> tuple[str, str, object] | None:
    """What the output must follow, as (field, kind, spec) for `compile_grammar`: OpenAI's response_format
    (json_object, json_schema), or vLLM's guided_json / guided_regex / guided_choice / guided_grammar
    (Lark); None for free text."""
    given = [name for name in GUIDED if body.get(name) is not None]
    try:
        fmt = structured.parse_response_format(body.get("response_format"))
    except ValueError as e:
        raise bad(str(e), "response_format") from None
    if fmt is not None:
        given.append("response_format")
    if len(given) > 1:
        raise bad(f"give one way to constrain the output, not {' and '.join(given)}", given[1])
    if not given:
        return None
    name = given[0]
    kind, spec = fmt if name == "response_format" else (GUIDED[name], body[name])
    if name == "guided_json" and isinstance(spec, str):  # vLLM takes the schema as JSON text too
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise bad("'guided_json' must be a JSON schema", name) from None
    return name, kind, spec


async def compile_grammar(given: tuple[str, str, object] | None) -> str | None:
    """parse_grammar's (field, kind, spec) -> the llguidance grammar, compiled off the event loop (a large
    schema can take a while); a 400 naming the field when it does not compile."""
    if given is None:
        return None
    name, kind, spec = given
    try:
        return await asyncio.to_thread(structured.grammar, kind, spec)
    except ValueError as e:
        raise bad(str(e), name) from None


def parse_logprobs(body: dict, endpoint: str) -> int | None:
    """None when the request does not ask for log-probabilities, else how many alternatives per token.
    Chat: 'logprobs': true and 'top_logprobs': 0-20; completions: 'logprobs': 0-20 (the alternatives)."""
    if endpoint == "chat":
        top = _field(body, "top_logprobs", "int")
        if not _field(body, "logprobs", "bool", False):
            if top is not None:
                raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        top = 0 if top is None else top
        param = "top_logprobs"
    else:
        top = _field(body, "logprobs", "int")
        if top is None:
            return None
        param = "logprobs"
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"'{param}' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param)
    return top


def logprob_entry(pipe: Pipeline, token: int, logprob: float, top_ids: list[int], top_lps: list[float]) -> dict:
    """One token of a chat completion's 'logprobs.content': its text, bytes and best alternatives."""
    def one(t: int, lp: float) -> dict:
        b = pipe.token_bytes(t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
    return one(token, logprob) | {"top_logprobs": [one(t, lp) for t, lp in zip(top_ids, top_lps)]}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """Chat-style entries -> the legacy completions 'logprobs' object (offsets count characters of the
    completion text from `offset`)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} if e["logprob"] is not None
                             else None for e in entries],
            "text_offset": offsets}


def parse_messages(value) -> list[dict]:
    """OpenAI chat messages -> [{"role", "content": str}] (text parts joined; developer = system)."""
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {json.dumps(m.get('role'))[:40]}",
                      f"{where}.role")
        content = m.get("content")
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None and content is None:  # an assistant turn that only called tools
            content = ""
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}",
                              f"{where}.content")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        msg = {"role": role, "content": content}
        if calls is not None:
            msg["tool_calls"] = parse_history_calls(calls, f"{where}.tool_calls")
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise bad(f"{where}.{key} must be a string", f"{where}.{key}")
                    msg[key] = m[key]
        out.append(msg)
    return out


def parse_history_calls(calls, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, for the chat template: arguments as an object (the
    templates render them with tojson), as vLLM hands them over."""
    if not isinstance(calls, list):
        raise bad(f"{where} must be an array", where)
    out = []
    for i, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad(f"{where}[{i}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise bad(f"{where}[{i}].function.arguments is not JSON", where) from None
        if not isinstance(args, dict):
            raise bad(f"{where}[{i}].function.arguments must be a JSON object", where)
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def parse_tools(body: dict) -> list[dict] | None:
    """`tools` (functions only) and `tool_choice`: the tools to show the model, or None ("none")."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
        (choice.get("function") or {}).get("name"), str)
    if choice not in (None, "auto", "none", "required") and not named:
        raise bad("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
                  "{'name': ...}}", "tool_choice")
    if (choice == "required" or named) and tools is None:
        raise bad("'tool_choice' forces a call: give 'tools'", "tool_choice")
    if tools is None or choice == "none":
        return None
    if not isinstance(tools, list) or not tools:
        raise bad("'tools' must be a non-empty array", "tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'description', "
                      "'parameters'}}}}", f"tools[{i}]")
        if not isinstance(f.get("parameters", {}), dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
    if named and choice["function"]["name"] not in {t["function"]["name"] for t in tools}:
        raise bad(f"'tool_choice' names {choice['function']['name']!r}, which is not in 'tools'", "tool_choice")
    return tools


def continue_final(body: dict, messages: list[dict]) -> bool:
    """vLLM's `continue_final_message`: the reply continues the last message (an assistant's), as the start
    of the answer the client wrote (what Anthropic's API does whenever the last message is the assistant's)."""
    if not _field(body, "continue_final_message", "bool", False):
        return False
    if messages[-1]["role"] != "assistant":
        raise bad("'continue_final_message' needs the last message to be the assistant's", "continue_final_message")
    return True


def forced_tool(body: dict) -> tuple[bool, str | None]:
    """(a call is forced, the tool it must be: None for any) from `tool_choice` (checked by parse_tools)."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        return True, choice["function"]["name"]
    return choice == "required", None


def parse_prompt(value) -> str | list[int]:
    """A completions prompt: a string, a list of token ids, or a list holding one of these (a batch of
    one, as evaluation harnesses send)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad("'prompt' is empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    raise bad("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


# --- the Responses API, on top of chat completions ----------------------------------------------

# Responses fields this adapter does not implement: refused, never silently ignored.
RESPONSES_UNSUPPORTED = ("previous_response_id", "conversation", "background", "include", "prompt",
                         "max_tool_calls", "top_logprobs")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def responses_to_chat(body: dict) -> dict:
    """A `/v1/responses` request -> the equivalent chat completions request body (text input, function
    tools, function calls and their outputs in `input`)."""
    for name in RESPONSES_UNSUPPORTED:
        if body.get(name) is not None:
            raise bad(f"'{name}' is not supported by this server's /v1/responses", name)
    fmt = _field(body, "text", "object", {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("'text.format.type' must be 'text', 'json_object' or 'json_schema'", "text")
    messages: list[dict] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": _field(body, "instructions", "str")})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a non-empty string or array of items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            content = item.get("content")
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}.role must be user, assistant, system or developer", f"{where}.role")
            if not isinstance(content, (str, list)):
                raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    ok = isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                    if not ok or not isinstance(part.get("text"), str):
                        raise bad(f"{where}.content[{j}] must be a text part (input_text or output_text)",
                                  f"{where}.content")
                    parts.append({"type": "text", "text": part["text"]})
                content = parts
            messages.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # several calls of one turn: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise bad(f"{where}.output must be a string", f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        else:
            raise bad(f"{where}: items of type message, function_call or function_call_output only",
                      f"{where}.type")
    chat = {"messages": messages, "stream": bool(_field(body, "stream", "bool", False))}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("tool_choice", "tool_choice"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("model", "model"), ("chat_template_kwargs", "chat_template_kwargs")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    reasoning = _field(body, "reasoning", "object", {})
    if reasoning.get("summary") not in (None, "auto"):  # auto: the model decides, and these give none
        raise bad("'reasoning.summary' other than 'auto' is not supported (no summaries are made)", "reasoning")
    if reasoning.get("effort") is not None:  # to the templates that can switch thinking off (Qwen3's)
        if reasoning["effort"] not in REASONING_EFFORTS:
            raise bad(f"'reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning")
        think = {"enable_thinking": reasoning["effort"] not in ("none", "minimal")}
        chat["chat_template_kwargs"] = think | _field(body, "chat_template_kwargs", "object", {})
    if body.get("tools") is not None:
        tools = body["tools"]
        if not isinstance(tools, list):
            raise bad("'tools' must be an array", "tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise bad(f"tools[{i}]: only function tools are supported", f"tools[{i}]")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                            if k in t}} for t in tools]
    if fmt["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":  # the Responses API has the schema at the top of the format
        if not isinstance(fmt.get("schema"), dict):
            raise bad("'text.format.schema' must be a JSON schema object", "text")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    return chat


def chat_to_response(out: dict, body: dict) -> dict:
    """A chat.completion answer -> a Responses API `response` object (item ids as `response_events` streams
    them)."""
    choice, usage = out["choices"][0], out["usage"]
    msg, suffix = choice["message"], out["id"].split("-", 1)[-1]
    output = []
    if msg.get("reasoning_content"):  # a thinking model's think block
        output.append({"type": "reasoning", "id": f"rs_{suffix}", "summary": [], "status": "completed",
                       "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    if msg.get("content"):
        output.append({"type": "message", "id": f"msg_{suffix}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": msg["content"], "annotations": []}]})
    for k, c in enumerate(msg.get("tool_calls") or []):
        output.append({"type": "function_call", "id": f"fc_{suffix}_{k}", "call_id": c["id"],
                       "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                       "status": "completed"})
    cut = choice["finish_reason"] == "length"
    return {
        "id": f"resp_{suffix}", "object": "response", "created_at": out["created"], "model": out["model"],
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "instructions": body.get("instructions"), "output": output,
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 0.0), "top_p": body.get("top_p", 1.0),
        "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
        "text": {"format": {"type": "text"}}, "store": False,
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {
                      "reasoning_tokens": usage["completion_tokens_details"]["reasoning_tokens"]},
                  "total_tokens": usage["total_tokens"]},
    }


class TextStream:
    """Committed tokens -> text deltas, with stop strings cut out and never emitted: text that could
    be the start of a stop string is held back until it is known not to be one."""

    def __init__(self, pipe: Pipeline, stops: list[str]) -> None:
        self.pipe, self.stops = pipe, stops
        self.detok = Detokenizer(pipe)
        self.sent = 0  # characters handed out so far
        self.stopped = False  # a stop string was found
        self.stop: str | None = None  # which one (the earliest in the text)

    def add(self, token: int) -> str:
        self.detok.add(token)
        return self._advance(self.detok.sent, final=False)

    def finish(self) -> str:
        """The rest of the text once generation is over (incomplete characters included)."""
        return self._advance(self.pipe.decode(self.detok.ids), final=True)

    def _advance(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        # No stop can start before `sent`: such a start would have been held back (see below).
        hits = [(i, s) for s in self.stops if (i := text.find(s, self.sent)) >= 0]
        end = min(hits)[0] if hits else len(text)
        self.stopped = bool(hits)
        if hits:
            self.stop = min(hits, key=lambda h: (h[0], -len(h[1])))[1]  # at one place, the longest one
        if not hits and not final:
            end -= max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            end = max(end, self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta


# --- jobs and the worker ------------------------------------------------------------------------


@dataclass
class Job:
    """One generation: its inputs, its channel back to the request handler and what it did."""

    endpoint: str
    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    fastpath: bool = False
    tools: list[dict] | None = None  # tools shown to the model: its text is parsed for calls
    logprobs: int | None = None  # GenRequest.logprobs
    grammar: str | None = None  # GenRequest.grammar
    echo: str | None = None  # completions' echo: this text (the prompt) comes before the completion
    tool_calls: list[dict] = field(default_factory=list)
    stop: str | None = None  # the stop string that ended the text
    stop_ids: tuple[int, ...] = ()  # token ids that end it beside the model's own (a fill-in-the-middle's)
    one_call: bool = False  # GenRequest.one_call
    reasoning_tokens: int = 0  # generated in the think block (its tags included)
    id: str = ""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    stats: Stats = field(default_factory=Stats)
    controller: FallbackController | None = None
    created: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    completion_tokens: int = 0
    seen: dict = field(default_factory=dict)  # speculative counters already exported

    def emit(self, kind: str, payload=None) -> None:
        """Hand ("delta", text) / ("logprobs", [entry]) / ("done", info) / ("error", APIError) to the
        handler, from any thread. Log-probability entries come just before the delta whose text they
        made (a token whose text is held back, as a possible stop string's start, waits with it)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    @property
    def mode(self) -> str:
        """fastpath, dflash, dflash+lookup, lookup (prompt lookup without a drafter), with
        "+fallback" when it fell back to target-only at least once, or target-only."""
        if self.fastpath:
            return "fastpath"
        if self.stats.mode != "target-only":
            return self.stats.mode + ("+fallback" if self.controller and self.controller.fallbacks else "")
        return "target-only"

    def summary(self) -> dict:
        """This job as one row of /metrics?format=json (live while it runs)."""
        s, now = self.stats, time.perf_counter()
        d = s.as_dict()
        return {
            "id": self.id, "endpoint": self.endpoint, "mode": self.mode,
            "prompt_tokens": len(self.prompt_ids), "completion_tokens": self.completion_tokens,
            "max_tokens": self.max_tokens, "decode_tok_s": round(s.decode_tok_s, 2),
            "acceptance_rate": round(s.acceptance_rate, 4),
            "acceptance_length_mean": round(s.acceptance_length_mean, 4),
            "acceptance_per_position": d["acceptance_per_position"], "cycles": s.cycles,
            "queue_s": round((self.started or now) - self.created, 4),
            "ttft_s": round(self.first_token - self.created, 4) if self.first_token else None,
            "elapsed_s": round(now - self.created, 4),
            "fallback_events": list(self.controller.events) if self.controller else [],
            "lookup_cycles": s.lookup_cycles, "lookup_accepted": s.lookup_accepted,
            "verify_widths": d["verify_widths"], "cached_tokens": s.cached_tokens,
        }


class Engine:
    """The model, its queue, the worker thread that owns both, and the metrics."""

    def __init__(self, config: ServerConfig, loader: Callable[[], Pipeline],
                 on_load_error: Callable[[BaseException], None] | None = None) -> None:
        self.config, self.loader, self.on_load_error = config, loader, on_load_error
        self.pipe: Pipeline | None = None
        self.error: str | None = None
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max(1, config.max_queue))
        self.current: Job | None = None
        self.recent: deque[dict] = deque(maxlen=config.recent)
        self.tokenizer_lock = threading.Lock()  # the handlers encode while the worker decodes
        self.target_s_per_token: float | None = None  # learned from target-only decoding, for the controller
        self.fallback_carry: dict | None = None  # the last request fell back: the next starts fallen back too
        self.lookup_costs: dict[int, float] = {}  # seconds per verify width, measured by prompt lookup
        self.adaptive: AdaptiveBlockSize | None = None  # the adaptive block size, shared by all requests
        self.reasoning = False  # reasoning parsing on (ServerConfig.reasoning_parser, decided at load)
        # caches of finished requests: a conversation's next turn prefills only what is new
        self.prefix = None
        if config.prefix_cache_max_entries > 0:
            disk = (DiskStore(config.prefix_cache_l2_dir, config.prefix_cache_l2_max_bytes)
                    if config.prefix_cache_l2_dir else None)
            self.prefix = PrefixCache(config.prefix_cache_max_entries, config.prefix_cache_max_bytes, disk)
        self.stopping = False
        self.metrics = Metrics(self)
        self.thread = threading.Thread(target=self._main, name="dflash-worker", daemon=True)

    @property
    def name(self) -> str:
        from ..loading import DEFAULT_MODEL_NAME

        if self.config.served_model_name:
            return self.config.served_model_name
        return self.pipe.name if self.pipe else self.config.model or DEFAULT_MODEL_NAME

    def start(self) -> None:
        """Start the worker thread: it loads the model, then serves the queue."""
        self.thread.start()

    def stop(self) -> None:
        """Cancel the request in flight, turn away the waiting ones and let the worker end."""
        self.stopping = True
        job = self.current  # read once: the worker may clear it meanwhile
        if job is not None:
            job.cancel.set()
        while True:
            try:
                waiting = self.queue.get_nowait()
            except queue.Empty:
                break
            if waiting is not None:
                waiting.cancel.set()
                waiting.emit("error", APIError(503, "the server is shutting down", type="service_unavailable"))
        self.queue.put_nowait(None)

    def ready(self) -> Pipeline:
        """The loaded pipeline, or a 503 while loading (or after loading failed)."""
        if self.pipe is None:
            why = f"the model failed to load: {self.error}" if self.error else "the model is still loading"
            raise APIError(503, why, type="service_unavailable", code="model_not_ready", headers={"Retry-After": "5"})
        return self.pipe

    def encode(self, messages: list[dict] | None = None, prompt: str | list[int] | None = None,
               template_args: dict | None = None, tools: list[dict] | None = None,
               continue_final: bool = False) -> list[int]:
        """Prompt token ids for a chat (template applied, with `template_args`) or a completions prompt
        (`continue_final`: the last message, an assistant's, is continued instead of answered)."""
        pipe = self.ready()
        if isinstance(prompt, list):
            return prompt
        param = "messages" if messages is not None else "prompt"
        try:
            with self.tokenizer_lock:
                if messages is not None:
                    return pipe.encode_messages(messages, template_args, tools, continue_final)
                return pipe.encode(prompt, chat=False)
        except Exception as e:  # no tokenizer, a template that rejects these messages
            if tools and "does not take tools" in str(e):
                param = "tools"
            raise bad(f"could not tokenize the {param}: {e}", param) from e

    def submit(self, job: Job) -> None:
        """Queue a job, or answer 429 when the queue is full."""
        job.id = job.id or f"{'chatcmpl' if job.endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if self.stopping:
            raise APIError(503, "the server is shutting down", type="service_unavailable")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            durations = [r["elapsed_s"] for r in list(self.recent)] or [1.0]  # copy: the worker appends
            wait = max(1, math.ceil(self.queue.qsize() * sum(durations) / len(durations)))
            raise APIError(429, f"the server is busy ({self.queue.qsize()} requests waiting); retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(wait)}) from None

    # -- worker thread --

    def _main(self) -> None:
        try:
            pipe = self.loader()
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            log.error("dflash serve: could not load the model: %s", self.error)
            if self.on_load_error:
                self.on_load_error(e)
            return
        c = self.config
        if c.adaptive and c.fallback and c.block_size is None and pipe.drafter is not None:
            # seconds per cycle by block size, measured before the server reports ready (not in the
            # first request's time); one estimator for all requests, so what a request learned about
            # acceptance, and when the full block is due for a try, carry into the next one
            self.adaptive = AdaptiveBlockSize(calibrate(pipe.target, pipe.drafter), pipe.drafter.block_size)
        self.reasoning = c.reasoning_parser == "think" or (
            c.reasoning_parser == "auto" and has_think_tags(pipe.tokenizer))
        self.pipe = pipe  # /health reports ready from here
        try:
            self._banner()
        except Exception:  # the start-up log is not worth a dead worker
            log.exception("dflash serve: could not write the start-up summary")
        while not self.stopping:
            job = self.queue.get()
            if job is None:
                break
            self.current = job
            try:
                self._run(job)
            except Exception as e:  # whatever one request does, the worker lives on for the next
                log.exception("dflash serve: %s failed", job.id)
                job.emit("error", APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
            finally:
                self.current = None

    def _banner(self) -> None:
        p, c = self.pipe, self.config
        drafter = "none (target-only)"
        if p.drafter:
            drafter = f"{p.draft_path} (block {min(c.block_size or p.drafter.block_size, p.drafter.block_size)}"
            vocab = getattr(p.drafter, "draft_vocab", None)
            drafter += "" if vocab is None else f", proposing from {len(vocab)} tokens"
            window = getattr(p.drafter, "window", None)
            if window is not None:
                drafter += f", attending to its first {window[0]} and last {window[1]} positions"
            drafter += ")"
        fastpath = f"max_tokens <= {c.fastpath_max_tokens} target-only" if c.fastpath_max_tokens else "off"
        prefix = "off"
        if self.prefix:
            prefix = f"{c.prefix_cache_max_entries} entries, {c.prefix_cache_max_bytes / 2**20:.0f} MiB"
            if self.prefix.disk is not None:
                gib = c.prefix_cache_l2_max_bytes / 2**30
                prefix += f", then up to {gib:.1f} GiB of files in {self.prefix.disk.dir}"
        log.info("dflash serve: model %s (%s), context %d tokens", p.name, p.model_path, p.max_context)
        adaptive = "off"
        if self.adaptive is not None:  # its costs are still the calibration's here
            adaptive = "on (ms per cycle by block size: " + ", ".join(
                f"{b}: {t * 1e3:.1f}" for b, t in sorted(self.adaptive.costs.items())) + ")"
        log.info("dflash serve: drafter %s; fallback %s; adaptive block size %s; fastpath %s", drafter,
                 "on" if c.fallback and p.drafter else "off", adaptive, fastpath)
        # How prompts run is `load`'s decision, the same for every entry point (generate.load)
        prefill = ("one query at a time, as decode steps (exact prefix reuse, the same tokens as dflash generate)"
                   if getattr(p, "exact_prefill", False) else "fused")
        log.info("dflash serve: device %s, dtype %s, weights %s, prefill %s, queue %d, prefix cache %s", p.device,
                 str(p.dtype).removeprefix("torch."), _weights(p), prefill, c.max_queue, prefix)
        log.info("dflash serve: reasoning parser %s", "<think> ... </think> -> reasoning_content" if self.reasoning
                 else f"off ({'no <think> tokens in the tokenizer' if c.reasoning_parser == 'auto' else 'none'})")
        log.info("dflash serve: ready on http://%s:%d (OpenAI API under /v1, Anthropic's /v1/messages; /health, "
                 "/metrics)", c.host, c.port)

    def _run(self, job: Job) -> None:
        pipe, m = self.pipe, self.metrics
        job.started = time.perf_counter()
        if job.cancel.is_set():  # the client left while waiting
            return self._finish(job, "cancelled", 499)
        use_draft = pipe.drafter is not None and not job.fastpath
        # A seeded sampled request runs a fixed schedule: the random draws depend on the block sizes,
        # and the controller's choices depend on timing, so it would break reproducibility.
        if use_draft and self.config.fallback and (job.sampler.greedy or job.sampler.seed is None):
            job.controller = FallbackController(target_s_per_token=self.target_s_per_token,
                                                carried=self.fallback_carry)
            if self.adaptive is not None:  # made at load, under the same conditions as this branch
                self.adaptive.history.clear()  # the widths of this request only (kept per request, not forever)
                job.controller = WithFallback(job.controller, self.adaptive)
        text = TextStream(pipe, job.stops)
        calls = ToolCallStream(job.tools) if job.tools else None
        stop_ids = [*pipe.stop_token_ids, *job.stop_ids]
        stops = set(stop_ids)
        finish, status = "length", 200
        lp = TokenLogprobs(job.logprobs) if job.logprobs is not None else None
        held: list[dict] = []  # entries of tokens whose text has not gone out yet
        try:
            constraint = None if job.grammar is None else Constraint(
                pipe.tokenizer, job.grammar, pipe.target.config.vocab_size, pipe.stop_token_ids, pipe.token_bytes)
        except Exception as e:  # e.g. a tokenizer the grammar library cannot read
            log.exception("dflash serve: %s: structured output", job.id)
            job.emit("error", APIError(500, f"structured output failed: {type(e).__name__}: {e}", type="server_error",
                                       counted=True))
            return self._finish(job, "error", 500)
        splitter = None
        if job.endpoint == "chat" and self.reasoning:  # where the prompt leaves the model: in a think block?
            with self.tokenizer_lock:
                shown = pipe.tokenizer.decode(job.prompt_ids[-32:], skip_special_tokens=False)
            splitter = ReasoningSplitter(inside=starts_inside(shown))

        def send(delta: str, final: bool = False) -> None:
            """Text out: reasoning apart, tool calls parsed, log-probability entries just before it."""
            nonlocal held
            reasoning = ""
            if splitter is not None:
                reasoning, delta = splitter.feed(delta)
                if final:
                    more = splitter.finish()
                    reasoning, delta = reasoning + more[0], delta + more[1]
            if delta and calls:
                delta = calls.feed(delta)
            if held and (reasoning or delta or final):  # at the end: tokens that printed nothing too
                job.emit("logprobs", held)
                held = []
            if reasoning:
                job.emit("reasoning", reasoning)
            if delta:
                job.emit("delta", delta)

        gen = generate_tokens(
            pipe.target, job.prompt_ids, max_new_tokens=job.max_tokens, drafter=pipe.drafter if use_draft else None,
            block_size=self.config.block_size, stop_token_ids=stop_ids, sampler=job.sampler,
            stats=job.stats, controller=job.controller,
            lookup=not job.fastpath and (use_draft if self.config.lookup is None else self.config.lookup),
            # timings carried over would steer a seeded sampled request's widths: it measures its own
            lookup_costs=self.lookup_costs if job.sampler.greedy or job.sampler.seed is None else None,
            prefix=self.prefix, prefill_chunk=self.config.prefill_step_size, logprobs=lp, constraint=constraint,
        )
        try:
            if job.echo is not None:
                if lp is not None:  # the prompt's tokens scored: the first has nothing before it
                    scored = prompt_logprobs(pipe, job.prompt_ids, job.logprobs)
                    with self.tokenizer_lock:
                        job.emit("logprobs", [logprob_entry(pipe, job.prompt_ids[0], None, [], [])] + [
                            logprob_entry(pipe, t, *e) for t, e in zip(job.prompt_ids[1:], scored.entries)])
                job.emit("delta", job.echo)
            for token in gen if job.max_tokens > 0 else ():
                job.first_token = job.first_token or time.perf_counter()
                job.completion_tokens += 1
                with self.tokenizer_lock:
                    delta = text.add(token)
                    if lp is not None and token not in stops and not text.stopped:
                        held.append(logprob_entry(pipe, token, *lp.entries[job.completion_tokens - 1]))
                before = splitter is not None and splitter.in_block
                if delta:
                    send(delta)
                if before or splitter is not None and splitter.in_block:
                    job.reasoning_tokens += 1  # a think block's token: in it, or one of its tags
                m.sync_live(job)
                if text.stopped or token in stops:
                    finish, job.stop = "stop", text.stop
                    break
                if job.cancel.is_set():
                    finish, status = "cancelled", 499
                    break
            if status == 200:
                if text.stopped:  # tokens past the stop string's start went out as no text
                    held = []
                    tail = ""
                else:
                    with self.tokenizer_lock:
                        tail = text.finish()
                send(tail, final=True)
            if status == 200 and calls:
                rest, job.tool_calls = calls.finish()
                if job.one_call:  # the model wrote several calls, and the client takes one
                    job.tool_calls = job.tool_calls[:1]
                if rest:
                    job.emit("delta", rest)
                if job.tool_calls:
                    finish = "tool_calls"
        except Exception as e:  # a bug or an out-of-memory must not take the worker down
            log.exception("dflash serve: %s failed", job.id)
            if self.prefix is not None and self.prefix.entries and "out of memory" in str(e).lower():
                # the kept caches may be what crowded this request out: free them for the next one
                log.warning("dflash serve: out of memory; prefix cache emptied (%d MiB); see "
                            "--prefix-cache-max-bytes", self.prefix.nbytes >> 20)
                self.prefix.clear()
            job.emit("error", APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error",
                                       counted=True))
            finish, status = "error", 500
        finally:
            gen.close()
        m.sync_live(job)
        if job.controller and job.controller.plain:  # timed like speculative cycles (consumer time excluded)
            self.target_s_per_token = job.controller.target_s_per_token
        if job.controller and status != 500:
            self.fallback_carry = job.controller.carry()
        self._finish(job, finish, status)

    def _finish(self, job: Job, finish: str, status: int) -> None:
        row = job.summary() | {"status": status, "finish_reason": finish}
        self.recent.append(row)
        self.metrics.record(job, status)
        if status != 500:  # a failure has sent its error already
            job.emit("done" if status == 200 else "cancelled", {
                "finish_reason": finish, "prompt_tokens": len(job.prompt_ids),
                "completion_tokens": job.completion_tokens, "cached_tokens": job.stats.cached_tokens,
                "tool_calls": job.tool_calls, "stop": job.stop, "reasoning_tokens": job.reasoning_tokens})
        accept = ""
        if job.stats.mode != "target-only":
            accept = f", acceptance {row['acceptance_rate']:.0%} (mean length {row['acceptance_length_mean']:.2f})"
        fallbacks = job.controller.fallbacks if job.controller else 0
        log.info(
            "%s %d %s: %d prompt%s + %d generated tokens (%s), %.1f tok/s, ttft %s, mode %s%s%s",
            job.id, status, job.endpoint, row["prompt_tokens"],
            f" ({job.stats.cached_tokens} cached)" if job.stats.cached_tokens else "", job.completion_tokens,
            finish, row["decode_tok_s"],
            f"{row['ttft_s'] * 1000:.0f} ms" if row["ttft_s"] is not None else "-", row["mode"], accept,
            f", {fallbacks} fallback(s)" if fallbacks else "",
        )


# --- metrics ------------------------------------------------------------------------------------


class Metrics:
    """Prometheus figures in a private registry (several apps may live in one process)."""

    def __init__(self, engine: Engine) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dflash_requests", "Requests by endpoint and HTTP status (499: the client left)",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("dflash_prefix_cache_cached_tokens",
                                     "Prompt tokens taken from the prefix cache instead of prefilled", registry=r)
        self.prefix_hits = Counter("dflash_prefix_cache_hits", "Requests that started from a cached prefix",
                                   registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Time to first token, queueing included",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tok_s = Histogram("dflash_decode_tokens_per_second", "Decode throughput per request (prefill excluded)",
                               buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000), registry=r)
        self.duration = Histogram("dflash_request_duration_seconds", "Request time, queueing included",
                                  buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.drafts = Counter("dflash_spec_decode_num_drafts", "Speculative cycles that drafted", registry=r)
        self.verify_widths = Counter("dflash_verify_passes", "Target passes after the prefill by width (1 = a plain "
                                     "step): what the adaptive block size, prompt lookup and the fallback chose",
                                     ["width"], registry=r)
        self.draft_tokens = Counter("dflash_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("dflash_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("dflash_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each block position", ["position"], registry=r)
        self.lookup_drafts = Counter("dflash_lookup_num_drafts", "Verify passes whose draft came from prompt lookup",
                                     registry=r)
        self.lookup_accepted = Counter("dflash_lookup_num_accepted_tokens", "Prompt-lookup draft tokens accepted",
                                       registry=r)
        self.fallback_events = Counter("dflash_fallback_events", "Target-only fallback controller events",
                                       ["event"], registry=r)

        def live(f: Callable[[Stats], float]) -> Callable[[], float]:
            def read() -> float:
                job = engine.current  # read once: the worker may clear it meanwhile
                return f(job.stats) if job is not None else 0.0
            return read

        gauges = [
            ("dflash_model_ready", "1 once the model is loaded", lambda: float(engine.pipe is not None)),
            ("dflash_requests_waiting", "Requests in the queue", lambda: engine.queue.qsize()),
            ("dflash_requests_running", "Requests being generated (0 or 1)", lambda: float(engine.current is not None)),
            ("dflash_live_tokens_per_second", "Decode tok/s of the request in flight", live(lambda s: s.decode_tok_s)),
            ("dflash_live_acceptance_rate", "Draft acceptance rate of the request in flight",
             live(lambda s: s.acceptance_rate)),
            ("dflash_live_acceptance_length_mean", "Tokens per verify pass of the request in flight",
             live(lambda s: s.acceptance_length_mean)),
            ("dflash_live_generated_tokens", "Tokens generated so far by the request in flight",
             live(lambda s: s.generated_tokens)),
        ]
        for name, doc, f in gauges:
            Gauge(name, doc, registry=r).set_function(f)

    def sync_live(self, job: Job) -> None:
        """Move the job's new speculative counts and fallback events into the counters (every cycle)."""
        s, seen = job.stats, job.seen
        drafts = s.drafted_per_position[0] if s.drafted_per_position else 0
        for key, counter, value in (("drafts", self.drafts, drafts), ("draft", self.draft_tokens, s.drafted_tokens),
                                    ("accepted", self.accepted, s.accepted_tokens),
                                    ("lookup", self.lookup_drafts, s.lookup_cycles),
                                    ("lookup_accepted", self.lookup_accepted, s.lookup_accepted)):
            if value > seen.get(key, 0):
                counter.inc(value - seen.get(key, 0))
                seen[key] = value
        widths = seen.setdefault("widths", {})
        for w, value in s.widths.items():
            if value > widths.get(w, 0):
                self.verify_widths.labels(width=str(w)).inc(value - widths.get(w, 0))
                widths[w] = value
        per_pos = seen.setdefault("per_pos", [])
        for k, value in enumerate(s.accepted_per_position):
            if k == len(per_pos):
                per_pos.append(0)
            if value > per_pos[k]:
                self.accepted_per_pos.labels(position=str(k)).inc(value - per_pos[k])
                per_pos[k] = value
        events = job.controller.events if job.controller else []
        for e in events[seen.get("events", 0):]:
            self.fallback_events.labels(event=e["event"]).inc()
            if e["event"] == "fallback":
                log.info("%s: speculation %.2f ms/token vs target %.2f ms/token at token %d: target-only, "
                         "probing again in %d tokens", job.id, e["spec_ms_per_token"], e["target_ms_per_token"],
                         e["token"], e["probe_in_tokens"])
            elif e["event"] == "carried":
                log.info("%s: starts target-only (speculation was slower in an earlier request), probing in %d "
                         "tokens", job.id, e["probe_in_tokens"])
            else:
                log.info("%s: %s speculation at token %d", job.id, e["event"], e["token"])
        seen["events"] = len(events)

    def record(self, job: Job, status: int) -> None:
        """Count a finished (or cancelled, or failed) job."""
        self.requests.labels(endpoint=job.endpoint, status=str(status)).inc()
        self.prompt_tokens.inc(len(job.prompt_ids) if job.first_token else 0)
        self.generation_tokens.inc(job.completion_tokens)
        if job.stats.cached_tokens:
            self.cached_tokens.inc(job.stats.cached_tokens)
            self.prefix_hits.inc()
        if job.first_token:
            self.ttft.observe(job.first_token - job.created)
        if job.stats.decode_tok_s > 0:
            self.tok_s.observe(job.stats.decode_tok_s)
        self.duration.observe(time.perf_counter() - job.created)

    def text(self) -> bytes:
        """The Prometheus text exposition."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def as_json(self) -> dict:
        """The same figures as JSON, with the request in flight and the last finished ones."""
        figures: dict = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith(("_created", "_bucket")):
                    continue
                name = s.name.removeprefix("dflash_")
                if s.labels:
                    key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    figures.setdefault(name, {})[key] = s.value
                else:
                    figures[name] = s.value
        e, job = self.engine, self.engine.current
        pipe = e.pipe
        return {
            "model": e.name, "ready": pipe is not None, "error": e.error,
            "drafter": str(pipe.draft_path) if pipe and pipe.drafter else None,
            "device": str(pipe.device) if pipe else None,
            "queue": {"waiting": e.queue.qsize(), "max": e.config.max_queue, "running": int(job is not None)},
            "metrics": figures,
            "prefix_cache": None if e.prefix is None else {
                "entries": len(e.prefix.entries), "max_entries": e.prefix.max_entries, "bytes": e.prefix.nbytes,
                "max_bytes": e.prefix.max_bytes, "hits": e.prefix.hits, "misses": e.prefix.misses,
                "disk": None if e.prefix.disk is None else {
                    "entries": len(e.prefix.disk.entries), "bytes": e.prefix.disk.nbytes,
                    "max_bytes": e.prefix.disk.max_bytes, "hits": e.prefix.disk_hits}},
            "current": job.summary() if job is not None else None,
            "recent": list(e.recent),
        }


# --- the app ------------------------------------------------------------------------------------


async def read_json(request, limit: int) -> dict:
    """The request body as a JSON object: 413 past `limit` bytes, 400 when it is not a JSON object."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body larger than {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body larger than {limit} bytes", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise bad("the client disconnected while sending the body") from None
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:
        raise bad(f"the body is not valid JSON: {e}"[:200]) from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


def _weights(pipe) -> str:
    """The weight format for the start-up log: "int4", "int4, LM head int8", "not quantized"."""
    if not pipe.quantize:
        return "not quantized"
    head = getattr(pipe, "lm_head", pipe.quantize)
    return pipe.quantize if head == pipe.quantize else f"{pipe.quantize}, LM head {head or 'not quantized'}"


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(config: ServerConfig | None = None, loader: Callable[[], Pipeline] | None = None,
               on_load_error: Callable[[BaseException], None] | None = None):
    """The FastAPI app. The model loads in the worker thread once the app starts (/health: 503 until then).

    loader: returns the Pipeline to serve (default: `load` with the config's model, drafter, device, dtype).
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    config = config or ServerConfig()
    loader = loader or (lambda: load(config.model, config.draft, config.device, config.dtype, quantize=config.quantize,
                                     cuda_graphs=config.cuda_graphs, draft_vocab=config.draft_vocab,
                                     draft_window=config.draft_window, draft_sinks=config.draft_sinks))
    engine = Engine(config, loader, on_load_error)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        log.info("dflash serve: shutting down")
        engine.stop()
        # Let the worker leave torch before the interpreter goes (a daemon thread killed mid-op aborts).
        await asyncio.to_thread(engine.thread.join, 10)
        if engine.prefix is not None and engine.prefix.disk is not None and not engine.thread.is_alive():
            engine.prefix.disk.close()  # here: a signal that stops the server may end the process before atexit

    # No generated docs: the handlers take raw requests (errors must be OpenAI-shaped), so they would be empty.
    app = FastAPI(title="dflash-torch", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    if config.allowed_origins:  # browsers ask first (a preflight OPTIONS); the middleware answers it
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        if e.status != 503:
            log.info("%s %s -> %d %s", request.method, request.url.path, e.status, e.message)
        if not e.counted:  # label by endpoint, never by raw path: clients must not create label values
            endpoint = ENDPOINTS.get(request.url.path, "other")
            engine.metrics.requests.labels(endpoint=endpoint, status=str(e.status)).inc()
        if request.url.path.startswith("/v1/messages"):
            param, message = messages_api.rename_param(e.param, e.message)
            kind = ANTHROPIC_ERRORS.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
            return JSONResponse(messages_api.error_body(kind, message) | {"param": param}, status_code=e.status,
                                headers=e.headers)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return await api_error(request, APIError(e.status_code, str(e.detail), code=str(e.status_code)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return await api_error(request, bad(f"invalid request: {e.errors()[:1]}"[:300]))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("dflash serve: %s %s failed", request.method, request.url.path)
        return await api_error(request, APIError(500, f"internal error: {type(e).__name__}", type="server_error"))

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        sent = request.headers.get("authorization", "").encode()
        other = request.headers.get("x-api-key", "").encode()  # how Anthropic's clients send it
        if not (hmac.compare_digest(sent, f"Bearer {config.api_key}".encode())  # constant time
                or hmac.compare_digest(other, config.api_key.encode())):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def request_body(request: Request) -> dict:
        """What every generation endpoint checks first (key, model ready), then its JSON body."""
        authorize(request)
        engine.ready()
        return await read_json(request, config.max_body_bytes)

    @app.get("/health")
    async def health():
        if engine.pipe is None:
            status = "error" if engine.error else "loading"
            return JSONResponse({"status": status, "error": engine.error}, status_code=503)
        return {"status": "ok", "model": engine.name}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        pipe = engine.pipe
        card = {"id": engine.name, "object": "model", "created": int(time.time()), "owned_by": "dflash-torch",
                "max_model_len": pipe.max_context if pipe else None}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: {"prompt": text} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}: the
        prompt tokens a completion or chat request with that input would run (template and tools included)."""
        body = await request_body(request)
        pipe = engine.ready()
        if (body.get("messages") is None) == (body.get("prompt") is None):
            raise bad("give one of 'prompt' (text) or 'messages'", "prompt")
        if body.get("messages") is not None:
            args = config.chat_template_args | _field(body, "chat_template_kwargs", "object", {})
            messages = parse_messages(body["messages"])
            ids = await asyncio.to_thread(engine.encode, messages=messages, template_args=args, tools=parse_tools(body),
                                          continue_final=continue_final(body, messages))
        else:
            ids = await asyncio.to_thread(engine.encode, prompt=_field(body, "prompt", "str"))
        return {"tokens": ids, "count": len(ids), "max_model_len": pipe.max_context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: {"tokens": [ids]} -> {"prompt": text} (special tokens kept)."""
        body = await request_body(request)
        pipe = engine.ready()
        ids = body.get("tokens")
        vocab = pipe.target.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in ids):
            raise bad(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        if pipe.tokenizer is None:
            raise bad("this model has no tokenizer", "tokens")
        with engine.tokenizer_lock:
            return {"prompt": pipe.tokenizer.decode(ids, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics(format: str = "prometheus"):
        if format == "json":
            return engine.metrics.as_json()
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics.json")
    async def metrics_json():
        return engine.metrics.as_json()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await chat_answer(request, await request_body(request))

    async def chat_answer(request: Request, body: dict, streamer=None, fit: bool = False):
        """A chat completions body -> its answer (a stream, or the chat.completion object). `streamer(job,
        req)`: the server-sent events of a streamed answer (default: chat completion chunks). `fit`: cut a
        max_tokens beyond the context left to it."""
        if body.get("echo"):
            raise bad("'echo' belongs to /v1/completions", "echo")
        req = parse_common(body)
        req.fit = fit
        req.one_call = not _field(body, "parallel_tool_calls", "bool", True)
        req.logprobs = parse_logprobs(body, "chat")
        messages = parse_messages(body.get("messages"))
        tools = parse_tools(body)
        forced, name = forced_tool(body)
        if forced:  # the reply is made a call by a grammar in the template's call format
            if req.grammar is not None:
                raise bad("a forced tool call and a response format cannot both hold", "tool_choice")
            tokenizer = engine.ready().tokenizer
            lark = forced_call_grammar(getattr(tokenizer, "chat_template", None) or "", tools, name)
            if lark is None:
                raise bad("this model's tool-call format cannot be forced: use 'tool_choice': 'auto'", "tool_choice")
            req.grammar = ("tool_choice", "lark", lark)
        # vLLM's field: variables for the chat template, over the server's --chat-template-args
        template_args = config.chat_template_args | _field(body, "chat_template_kwargs", "object", {})
        ids = await asyncio.to_thread(engine.encode, messages=messages, template_args=template_args, tools=tools,
                                      continue_final=continue_final(body, messages))
        return await respond(request, "chat", req, ids, tools, streamer)

    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await request_body(request)
        chat = responses_to_chat(body)
        if chat["stream"]:
            return await chat_answer(request, chat, streamer=lambda job, req: response_events(job, body))
        return chat_to_response(await chat_answer(request, chat), body)

    async def response_events(job: Job, body: dict) -> AsyncIterator[str]:
        """The Responses API's server-sent events for one generation: created, the reasoning of a thinking
        model as a reasoning item, text deltas of one message item, then each function call as an item, then
        completed (or incomplete) with the whole response."""
        seq, created = itertools.count(), int(time.time())
        suffix = job.id.split("-", 1)[-1]
        mid, rid = f"msg_{suffix}", f"rs_{suffix}"

        def event(kind: str, **fields) -> str:
            data = {"type": kind, "sequence_number": next(seq)} | fields
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        def message(text: str, status: str) -> dict:
            content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
            return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}

        def reasoning(text: str, status: str) -> dict:
            content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
            return {"type": "reasoning", "id": rid, "summary": [], "status": status, "content": content}

        skeleton = {"id": f"resp_{suffix}", "object": "response", "created_at": created, "model": engine.name,
                    "status": "in_progress", "output": [], "tools": body.get("tools") or [],
                    "tool_choice": body.get("tool_choice", "auto"),
                    "parallel_tool_calls": body.get("parallel_tool_calls", True),
                    "instructions": body.get("instructions"), "error": None, "incomplete_details": None,
                    "metadata": body.get("metadata") or {}}
        part = {"type": "output_text", "text": "", "annotations": []}
        texts: list[str] = []
        thoughts: list[str] = []  # a think block comes first, so the reasoning item is output 0 when there is one

        def reasoning_done() -> list[str]:
            thought = "".join(thoughts)
            return [event("response.reasoning_text.done", item_id=rid, output_index=0, content_index=0, text=thought),
                    event("response.output_item.done", output_index=0, item=reasoning(thought, "completed"))]

        try:
            yield event("response.created", response=skeleton)
            yield event("response.in_progress", response=skeleton)
            while True:
                kind, payload = await job.events.get()
                if kind == "logprobs":  # not part of this endpoint's events
                    continue
                if kind == "reasoning" and not texts:
                    if not thoughts:
                        yield event("response.output_item.added", output_index=0, item=reasoning("", "in_progress"))
                    thoughts.append(payload)
                    yield event("response.reasoning_text.delta", item_id=rid, output_index=0, content_index=0,
                                delta=payload)
                    continue
                if kind == "delta":
                    at = 1 if thoughts else 0
                    if not texts:
                        for e in reasoning_done() if thoughts else []:
                            yield e
                        yield event("response.output_item.added", output_index=at, item=message("", "in_progress"))
                        yield event("response.content_part.added", item_id=mid, output_index=at, content_index=0,
                                    part=part)
                    texts.append(payload)
                    yield event("response.output_text.delta", item_id=mid, output_index=at, content_index=0,
                                delta=payload, logprobs=[])
                    continue
                if kind == "error":
                    yield event("error", code=payload.code or payload.type, message=payload.message, param=None)
                    return
                if kind == "cancelled":
                    return
                if kind == "done":
                    break
            text, at = "".join(texts), 1 if thoughts else 0
            if thoughts and not texts:
                for e in reasoning_done():
                    yield e
            if texts:
                yield event("response.output_text.done", item_id=mid, output_index=at, content_index=0, text=text,
                            logprobs=[])
                yield event("response.content_part.done", item_id=mid, output_index=at, content_index=0,
                            part=part | {"text": text})
                yield event("response.output_item.done", output_index=at, item=message(text, "completed"))
            out = {"id": job.id, "created": created, "model": engine.name, "usage": usage(payload),
                   "choices": [{"finish_reason": payload["finish_reason"],
                                "message": {"content": text or None, "tool_calls": payload.get("tool_calls"),
                                            "reasoning_content": "".join(thoughts) or None}}]}
            response = chat_to_response(out, body)
            first = int(bool(thoughts)) + int(bool(texts))  # the function calls come after those items
            for k, item in enumerate(response["output"][first:], start=first):
                yield event("response.output_item.added", output_index=k,
                            item=item | {"status": "in_progress", "arguments": ""})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                            arguments=item["arguments"])
                yield event("response.output_item.done", output_index=k, item=item)
            done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield event(done, response=response)
        finally:
            job.cancel.set()

    async def messages_request(request: Request) -> tuple[dict, dict]:
        """A Messages API request's body, and the chat completions body it stands for."""
        body = await request_body(request)
        try:
            return body, messages_api.to_chat(body)
        except messages_api.MessagesError as e:
            raise bad(str(e), e.param) from None

    @app.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic's Messages API through chat completions (`messages_api`)."""
        body, chat = await messages_request(request)
        # Anthropic's clients send a large max_tokens whatever the model (a required field; Claude Code's is
        # 32,000): one beyond a local model's context is cut to what is left, not refused.
        if chat["stream"]:
            return await chat_answer(request, chat, streamer=lambda job, req: messages_api.events(job, engine.name),
                                     fit=True)
        return messages_api.to_message(await chat_answer(request, chat, fit=True), engine.name)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """Anthropic's token count: the prompt tokens a /v1/messages request would run."""
        _, chat = await messages_request(request)
        args = config.chat_template_args | chat.get("chat_template_kwargs", {})
        messages = parse_messages(chat["messages"])
        ids = await asyncio.to_thread(engine.encode, messages=messages, template_args=args, tools=parse_tools(chat),
                                      continue_final=continue_final(chat, messages))
        return {"input_tokens": len(ids)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request_body(request)
        echo = _field(body, "echo", "bool", False)
        req = parse_common(body, min_tokens=0 if echo else 1)
        req.logprobs = parse_logprobs(body, "completions")
        for name in ("tools", "tool_choice", "chat_template_kwargs", "messages"):  # chat fields: not here
            if body.get(name) is not None:
                raise bad(f"'{name}' belongs to /v1/chat/completions, not /v1/completions", name)
        prompt = parse_prompt(body.get("prompt"))
        suffix, stop_ids = _field(body, "suffix", "str"), ()
        if suffix is not None:  # fill in the middle, between the prompt and the suffix
            if echo or not isinstance(prompt, str):
                raise bad("'suffix' needs a text prompt and no 'echo'", "suffix")
            pipe = engine.ready()
            try:
                prompt = fim.fim_prompt(pipe.tokenizer, prompt, suffix)
            except (ValueError, AttributeError) as e:
                raise bad(str(e) if isinstance(e, ValueError) else "this model has no tokenizer", "suffix") from None
            stop_ids = tuple(fim.end_token_ids(pipe.tokenizer))
        ids = await asyncio.to_thread(engine.encode, prompt=prompt)
        return await respond(request, "completions", req, ids, echo=prompt if isinstance(prompt, str) else None,
                             echo_ids=echo, stop_ids=stop_ids)

    async def respond(request: Request, endpoint: str, req: GenRequest, ids: list[int],
                      tools: list[dict] | None = None, streamer=None, echo: str | None = None,
                      echo_ids: bool = False, stop_ids: tuple[int, ...] = ()):
        pipe = engine.ready()
        req.grammar = await compile_grammar(req.grammar)
        prompt_param = "messages" if endpoint == "chat" else "prompt"
        room = pipe.max_context - len(ids)
        if room < 1:
            raise bad(f"the prompt ({len(ids)} tokens) fills the model's context of {pipe.max_context} tokens",
                      prompt_param)
        max_tokens = req.max_tokens if req.max_tokens is not None else min(config.max_tokens, room)
        if req.fit:
            max_tokens = min(max_tokens, room)
        if req.grammar is not None and pipe.tokenizer is None:
            raise bad("structured output needs the model's tokenizer, and this model has none", "response_format")
        if req.logprobs is not None and pipe.tokenizer is None:  # each entry carries its token's text
            raise bad("log-probabilities come with each token's text, which needs the model's tokenizer, and "
                      "this model has none", "logprobs")
        bias = req.sampler.logit_bias
        if bias and max(bias) >= pipe.target.config.vocab_size:
            raise bad(f"'logit_bias' names token {max(bias)}, beyond the vocabulary "
                      f"({pipe.target.config.vocab_size} tokens)", "logit_bias")
        try:
            check_lengths(pipe, ids, max(max_tokens, 1))  # 0: echo the prompt only (scored, not continued)
        except ValueError as e:
            raise bad(str(e), req.max_tokens_param if "max_tokens" in str(e) else prompt_param) from None
        jobs = []
        for i in range(req.n):  # choice i samples with seed + i (the same seed would repeat choice 0)
            sampler = req.sampler if i == 0 else dataclasses.replace(
                req.sampler, seed=None if req.sampler.seed is None else req.sampler.seed + i)
            job = Job(endpoint, ids, max_tokens, sampler, req.stops, asyncio.get_running_loop(),
                      fastpath=max_tokens <= config.fastpath_max_tokens, tools=tools, logprobs=req.logprobs,
                      grammar=req.grammar, id=f"{jobs[0].id}-{i}" if jobs else "", stop_ids=stop_ids,
                      one_call=req.one_call)
            if echo_ids:  # the prompt as given (text), or as its tokens decode
                job.echo = echo if echo is not None else pipe.decode(ids)
            try:
                engine.submit(job)
            except APIError:
                for j in jobs:
                    j.cancel.set()
                raise
            jobs.append(job)
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            events = streamer(jobs[0], req) if streamer else stream(jobs, req)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return await collect(request, jobs)

    def logprobs_field(job: Job, entries: list[dict] | None, offset: int = 0) -> dict | None:
        if job.logprobs is None or entries is None:
            return None
        if job.endpoint == "chat":
            return {"content": entries, "refusal": None}
        return completion_logprobs(entries, offset)

    def chunk(job: Job, created: int, text: str | None, finish: str | None, usage: dict | None = None,
              logprobs: dict | None = None, index: int = 0, id: str | None = None) -> dict:
        if job.endpoint == "chat":
            delta = {} if text is None else {"content": text}
            if text == "" and finish is None and logprobs is None:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            out = {"id": id or job.id, "object": "chat.completion.chunk", "created": created, "model": engine.name,
                   "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            out = {"id": id or job.id, "object": "text_completion", "created": created, "model": engine.name,
                   "choices": [choice]}
        if usage is not None:
            out["usage"] = usage
        return out

    def usage(info: dict, more: list[dict] = ()) -> dict:
        """Usage of one generation (`info`, the "done" payload), plus the completions of other choices."""
        p, c = info["prompt_tokens"], info["completion_tokens"] + sum(m["completion_tokens"] for m in more)
        thought = info.get("reasoning_tokens", 0) + sum(m.get("reasoning_tokens", 0) for m in more)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": info.get("cached_tokens", 0)},
                "completion_tokens_details": {"reasoning_tokens": thought}}

    async def stream(jobs: list[Job], req: GenRequest) -> AsyncIterator[str]:
        """Server-sent chunks of each choice in turn (chunk "index" = its choice), then usage and [DONE]."""
        created, rid = int(time.time()), jobs[0].id
        extra = {"usage": None} if req.include_usage else {}
        infos: list[dict] = []
        try:
            for index, job in enumerate(jobs):
                def out(text, finish=None, logprobs=None, job=job, index=index):
                    return _sse(chunk(job, created, text, finish, logprobs=logprobs, index=index, id=rid) | extra)

                if job.endpoint == "chat":
                    yield out("")
                waiting: list[dict] = []  # log-probability entries whose text has not arrived yet
                sent = 0  # characters of text sent (completions' text_offset)
                while True:
                    batch = [await job.events.get()]
                    while not job.events.empty():  # a backlog goes out as one chunk ("done"/"error" come last)
                        batch.append(job.events.get_nowait())
                    text, entries, thought = "", [], ""
                    for k, p in batch:
                        if k == "logprobs":
                            waiting += p
                        elif k == "delta":
                            text, entries, waiting = text + p, entries + waiting, []
                        elif k == "reasoning":
                            thought, entries, waiting = thought + p, entries + waiting, []
                    if thought:  # before the batch's content: a think block comes first
                        mine = None if text else entries  # the entries go with the content when there is some
                        yield _sse(chunk(job, created, None, None, id=rid) | extra | {"choices": [
                            {"index": index, "delta": {"reasoning_content": thought},
                             "logprobs": logprobs_field(job, mine), "finish_reason": None}]})
                        entries = entries if text else []
                    if text:
                        yield out(text, logprobs=logprobs_field(job, entries, sent))
                        sent += len(text)
                    kind, payload = batch[-1]
                    if kind in ("delta", "logprobs", "reasoning"):
                        continue
                    if waiting and kind == "done":  # tokens that printed nothing, at the end
                        yield out("" if job.endpoint == "completions" else None,
                                  logprobs=logprobs_field(job, waiting, sent))
                    if kind == "error":
                        yield _sse(payload.body())
                        return
                    if kind == "cancelled":  # the server is stopping (a client that left reads nothing)
                        return
                    if payload.get("tool_calls"):  # whole calls in one delta, each with its index
                        delta = {"tool_calls": [{"index": i} | c for i, c in enumerate(payload["tool_calls"])]}
                        yield _sse(chunk(job, created, None, None, id=rid) | extra | {"choices": [
                            {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]})
                    last = chunk(job, created, None, payload["finish_reason"], index=index, id=rid) | extra
                    last["choices"][0]["stop_reason"] = payload["stop"]  # vLLM's: the stop string, if one ended it
                    yield _sse(last)
                    infos.append(payload)
                    break
            if req.include_usage:
                yield _sse(chunk(jobs[0], created, None, None, usage(infos[0], infos[1:]), id=rid) | {"choices": []})
            yield _sse("[DONE]")
        finally:
            for job in jobs:
                job.cancel.set()  # the client left (or we are done): stop generating within a cycle

    async def watch_disconnect(request: Request, jobs: list[Job]) -> None:
        # The body has been read, so the next message is http.disconnect: the client left (or we answered).
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for job in jobs:
            job.cancel.set()

    async def collect(request: Request, jobs: list[Job]):
        watcher = asyncio.create_task(watch_disconnect(request, jobs))
        choices, infos = [], []
        try:
            for index, job in enumerate(jobs):
                parts: list[str] = []
                thoughts: list[str] = []
                entries: list[dict] = []
                while True:
                    kind, payload = await job.events.get()
                    if kind == "delta":
                        parts.append(payload)
                    elif kind == "reasoning":
                        thoughts.append(payload)
                    elif kind == "logprobs":
                        entries += payload
                    elif kind == "error":
                        raise payload
                    elif kind == "cancelled":  # the client left (nobody reads this) or the server is stopping
                        raise APIError(503, "the server is shutting down", type="service_unavailable", counted=True)
                    else:
                        break
                text, reason = "".join(parts), payload["finish_reason"]
                if job.endpoint == "chat":
                    message = {"role": "assistant", "content": text}
                    if payload.get("tool_calls"):
                        message = {"role": "assistant", "content": text or None, "tool_calls": payload["tool_calls"]}
                    if thoughts:
                        message["reasoning_content"] = "".join(thoughts)
                    choices.append({"index": index, "message": message, "logprobs": logprobs_field(job, entries),
                                    "finish_reason": reason, "stop_reason": payload["stop"]})
                else:
                    choices.append({"index": index, "text": text, "logprobs": logprobs_field(job, entries),
                                    "finish_reason": reason, "stop_reason": payload["stop"]})
                infos.append(payload)
        finally:
            watcher.cancel()
            for job in jobs:
                job.cancel.set()
        obj = "chat.completion" if jobs[0].endpoint == "chat" else "text_completion"
        return {"id": jobs[0].id, "object": obj, "created": int(time.time()), "model": engine.name,
                "choices": choices, "usage": usage(infos[0], infos[1:])}

    return app


# --- the command --------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    """Register `dflash serve` (picked up by cli.build_parser)."""
    from ..cli import _common_model_args, json_object

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, responses, "
                                            "Anthropic messages, metrics)")
    _common_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--fastpath-max-tokens", type=int, default=0, metavar="N",
                   help="requests with max_tokens <= N run target-only (default 0: off)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id /v1/models lists and answers carry (default: the model's name)")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="web pages (origins such as http://localhost:3000, or '*' for any) whose scripts may call "
                        "the API from a browser (CORS; default: none)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--max-queue", type=int, default=64, metavar="N", help="requests that may wait (then 429)")
    p.add_argument("--prefix-cache-max-entries", type=int, default=DEFAULT_MAX_ENTRIES, metavar="N",
                   help="finished requests whose caches are kept, so a prompt that starts the same way (the next "
                        f"turn of a conversation) prefills only what is new (default {DEFAULT_MAX_ENTRIES}; 0: off)")
    p.add_argument("--prefix-cache-max-bytes", type=parse_bytes, default=DEFAULT_MAX_BYTES, metavar="SIZE",
                   help="memory those caches may hold, e.g. 512MB or 4GB (default 2GB)")
    p.add_argument("--no-prefix-cache", action="store_true", help="keep no caches between requests")
    p.add_argument("--prefix-cache-l2-dir", default=None, metavar="DIR",
                   help="write caches pushed out of memory to files under DIR and read them back when a prompt "
                        "matches (default: off; the files of a run are removed when it ends)")
    p.add_argument("--prefix-cache-l2-max-bytes", type=parse_bytes, default=16 << 30, metavar="SIZE",
                   help="disk those files may take (default 16GB)")
    p.add_argument("--chat-template-args", type=json_object, default={}, metavar="JSON",
                   help="variables for the chat template, e.g. '{\"enable_thinking\": false}' (a request's "
                        "chat_template_kwargs override them)")
    p.add_argument("--reasoning-parser", choices=("auto", "think", "none"), default="auto",
                   help="chat answers: reasoning between <think> and </think> as reasoning_content, apart from the "
                        "content (auto: for models whose tokenizer has those tags; none: left in the content)")
    p.set_defaults(func=cmd_serve)


def parse_bytes(text: str) -> int:
    """'2GB', '512MB', '64KiB' or a plain number of bytes -> bytes (1 KB = 1 KiB = 1024 bytes here)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MB, 4GB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive: {text!r}")
    return int(value * scale)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; exit 2 when the model cannot be loaded."""
    import uvicorn

    if args.max_queue < 1 or args.max_tokens < 1 or (args.block_size is not None and args.block_size < 1):
        raise ValueError("--max-queue, --max-tokens and --block-size must be >= 1")
    if args.prefix_cache_max_entries < 0:
        raise ValueError("--prefix-cache-max-entries must be >= 0")
    if args.prefill_step_size is not None and args.prefill_step_size < 1:
        raise ValueError("--prefill-step-size must be >= 1")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    config = ServerConfig(
        model=args.model, draft=None if args.no_draft else args.draft, host=args.host, port=args.port,
        fastpath_max_tokens=args.fastpath_max_tokens, api_key=args.api_key, max_tokens=args.max_tokens,
        block_size=args.block_size, max_queue=args.max_queue, device=args.device, dtype=args.dtype,
        quantize=getattr(args, "quantize", None), cuda_graphs=getattr(args, "cuda_graphs", False),
        draft_vocab=getattr(args, "draft_vocab", True), draft_window=getattr(args, "draft_window", None),
        draft_sinks=getattr(args, "draft_sinks", 64),
        adaptive=getattr(args, "adaptive", None) is not False,  # on unless --no-adaptive (or --block-size)
        lookup=getattr(args, "lookup", None),
        prefix_cache_max_entries=0 if args.no_prefix_cache else args.prefix_cache_max_entries,
        prefix_cache_max_bytes=args.prefix_cache_max_bytes,
        prefix_cache_l2_dir=args.prefix_cache_l2_dir, prefix_cache_l2_max_bytes=args.prefix_cache_l2_max_bytes,
        chat_template_args=args.chat_template_args, prefill_step_size=args.prefill_step_size,
        reasoning_parser=args.reasoning_parser, allowed_origins=args.allowed_origins,
        served_model_name=args.served_model_name,
    )
    failed: list[BaseException] = []

    def on_load_error(e: BaseException) -> None:
        failed.append(e)
        server.should_exit = True

    app = create_app(config, on_load_error=on_load_error)
    if config.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        log.warning("dflash serve: listening on %s without --api-key: anyone who can reach it can use it", config.host)
    log.info("dflash serve: loading %s on http://%s:%d (/health answers 503 until ready)",
             config.model or "the default model", config.host, config.port)
    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            app.state.engine.stop()  # Ctrl-C: end the generation in flight now, so its stream closes at once
            await super().shutdown(sockets)

    # One line per request comes from the worker, so no access log.
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=5))
    server.run()
    return 2 if failed else 0
