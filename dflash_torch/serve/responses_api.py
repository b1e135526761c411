"""OpenAI's Responses API (`POST /v1/responses`) on top of the server's chat completions: the request and
answer models (what `/openapi.json` documents), the request turned into the equivalent chat completions body
(`responses_to_chat`), and the answer turned back into a `response` object (`chat_to_response`) or the
Responses API's server-sent events (`events`). Text input and message items, instructions, function tools
with function_call / function_call_output items, JSON output formats, reasoning effort; nothing is stored.
"""

import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, SkipValidation

from .openai_api import ToolChoice, usage
from .protocol import Bool, Int, Number, Object, RequestModel, ResponseModel, Str, _field, bad, doc, required

# Responses fields this adapter does not implement: refused, never silently ignored.
RESPONSES_UNSUPPORTED = ("previous_response_id", "conversation", "background", "include", "prompt",
                         "max_tool_calls", "top_logprobs")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# Chat completions field -> the Responses API's name, for error messages that name what the client sent.
RENAMED = {"max_tokens": "max_output_tokens"}


# --- the request model ---------------------------------------------------------------------------


class TextContent(RequestModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field("{}", description="JSON text")


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict, description="a JSON schema of the arguments")


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="json_schema: the schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ReasoningConfig(RequestModel):
    effort: Literal[REASONING_EFFORTS] | None = Field(None, description="none and minimal: thinking off "
                                                                        "(templates that read enable_thinking)")
    summary: Literal["auto"] | None = Field(None, description="no summaries are made")


class ResponsesRequest(RequestModel):
    """A Responses API body."""

    model_config = ConfigDict(json_schema_extra=required("input"))

    model: Str = doc("any name: the server answers with the one model it serves")
    input: SkipValidation[Annotated[str, Field(min_length=1)] | Annotated[
        list[MessageItem | FunctionCallItem | FunctionCallOutputItem], Field(min_length=1)]] = doc(
        "text (one user message) or items")
    instructions: Str = doc("a system message before the input")
    max_output_tokens: Int = doc("tokens to generate at most", minimum=1)
    temperature: Number = doc("0: greedy (the default)", minimum=0, maximum=2)
    top_p: Number = doc("nucleus sampling (1: off)", exclusiveMinimum=0, maximum=1)
    stream: Bool = doc("answer as the response.* server-sent events")
    text: SkipValidation[TextConfig | None] = doc("the output's format: text, json_object or json_schema")
    reasoning: SkipValidation[ReasoningConfig | None] = doc("effort switches thinking on or off")
    tools: SkipValidation[list[FunctionTool] | None] = doc("function tools")
    tool_choice: SkipValidation[ToolChoice | None] = doc("as chat completions takes it")
    parallel_tool_calls: Bool = doc("false: at most one call per reply")
    chat_template_kwargs: Object = doc("vLLM's: chat template variables")
    metadata: SkipValidation[dict[str, str] | None] = doc("returned as given")


# --- the response model (the 200 body, documented; built as a dict by chat_to_response) ------------


class OutputText(ResponseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(ResponseModel):
    type: Literal["message"]
    id: str
    status: Literal["completed"]
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(ResponseModel):
    """A reasoning model's think block."""

    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    status: Literal["completed"]
    content: list[ReasoningText]


class OutputFunctionCall(ResponseModel):
    type: Literal["function_call"]
    id: str
    call_id: str = Field(description="what a function_call_output item answers")
    name: str
    arguments: str = Field(description="the arguments as JSON text")
    status: Literal["completed"]


OutputItem = Annotated[ReasoningItem | OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class OutputTextFormat(ResponseModel):
    type: str


class OutputTextConfig(ResponseModel):
    format: OutputTextFormat


class InputTokensDetails(ResponseModel):
    cached_tokens: int = Field(description="read from the prefix cache")


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(ResponseModel):
    """A Responses API `response` (`stream` false); the request's settings come back as given."""

    id: str
    object: Literal["response"]
    created_at: int = Field(description="Unix time, seconds")
    model: str
    status: Literal["completed", "incomplete"]
    incomplete_details: IncompleteDetails | None
    error: None
    instructions: str | None
    output: list[OutputItem] = Field(description="reasoning, then the message, then the function calls")
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool | None
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    metadata: Any = Field(description="the request's, as given ({} without one)")
    text: OutputTextConfig
    store: Literal[False]
    usage: ResponseUsage


# --- to chat completions and back ----------------------------------------------------------------


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


async def events(job, body: dict, model: str) -> AsyncIterator[str]:
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

    skeleton = {"id": f"resp_{suffix}", "object": "response", "created_at": created, "model": model,
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
        out = {"id": job.id, "created": created, "model": model, "usage": usage(payload),
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
