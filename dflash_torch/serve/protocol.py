"""The OpenAI-style request side of `dflash serve`: limits, errors in the API's shape, and the parsing
of request bodies (common generation fields, grammars, log-probabilities, messages, tools, prompts), and
the Responses API mapped onto chat completions and back."""

import asyncio
import json
import logging
import math
from dataclasses import dataclass

from ..decoding import structured
from ..decoding.sampling import Sampler
from ..generate import Pipeline

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


