"""Anthropic's Messages API (`POST /v1/messages`) on top of the server's chat completions.

A Messages request becomes the equivalent chat completions body (`to_chat`), runs through the same
path (so the tokens are the same: greedy output equals target-only output), and the answer comes back
as a `message` (`to_message`) or as the Messages API's server-sent events (`events`). Text, system
prompts, tools (`tool_use` / `tool_result` blocks), `tool_choice`, stop sequences, thinking blocks
from a model that reasons, and `/v1/messages/count_tokens`. Images and documents are refused. The request
model (`MessagesRequest`) and the answers' (`MessageResponse`, `TokenCount`) are what `/openapi.json`
documents; `to_chat` checks each message and block.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation

from .protocol import Int, Number, RequestModel, ResponseModel, Str, doc, required

# Fields the Messages API has that this server does not implement: refused, never silently ignored.
UNSUPPORTED = ("container", "mcp_servers", "context_management")
# Chat completions field -> the Messages API's name, for error messages that name what the client sent.
RENAMED = {"stop": "stop_sequences"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


# --- the request model ---------------------------------------------------------------------------


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str | None = None
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ThinkingBlock(RequestModel):
    """Earlier thinking: dropped, as the chat templates of reasoning models drop it from history."""

    type: Literal["thinking", "redacted_thinking"]


class Message(RequestModel):
    role: Literal["user", "assistant"] = Field(description="a last assistant message is a prefilled reply")
    content: str | list[TextBlock | ToolResultBlock | ToolUseBlock | ThinkingBlock]


class ClientTool(RequestModel):
    type: Literal["custom"] = "custom"
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict, description="a JSON schema of the input")


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="type tool: the tool")
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled"] = Field(description="handed to the chat template as enable_thinking")


class MessagesPrompt(RequestModel):
    """What a Messages request and a token count share: the prompt."""

    model_config = ConfigDict(json_schema_extra=required("messages"))

    messages: SkipValidation[Annotated[list[Message], Field(min_length=1)]] = doc("the conversation")
    system: SkipValidation[str | list[TextBlock] | None] = doc("the system prompt")
    thinking: SkipValidation[ThinkingConfig | None] = doc("thinking on or off, for templates that read enable_thinking")
    tools: SkipValidation[list[ClientTool] | None] = doc("client tools (server tools are refused)")
    tool_choice: SkipValidation[ToolChoice | None] = doc("any: a call is forced; tool: that tool's")


class MessagesRequest(MessagesPrompt):
    """A Messages API body."""

    model: Str = doc("any name: the server answers with the one model it serves")
    max_tokens: Int = doc("tokens to generate at most; one beyond the context left is cut to it", minimum=1)
    stream: SkipValidation[bool] = Field(False, description="answer as the Messages API's server-sent events")
    temperature: Number = doc("0: greedy (the default)", minimum=0, maximum=2)
    top_p: Number = doc("nucleus sampling (1: off)", exclusiveMinimum=0, maximum=1)
    top_k: Int = doc("the k most likely tokens only (0 or -1: off)", minimum=-1)
    stop_sequences: SkipValidation[list[Annotated[str, Field(min_length=1)]] | None] = doc(
        "text that ends the generation")
    metadata: SkipValidation[dict[str, Any] | None] = doc("ignored")


class CountTokensRequest(MessagesPrompt):
    """A token count's body: the prompt of a Messages request (the rest of one is ignored, unchecked)."""

    model: SkipValidation[str | None] = doc("ignored")


class ErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, overloaded_error, ...")
    message: str


class ErrorResponse(BaseModel):
    """Anthropic's error shape, with the field at fault (if any) as `param`."""

    type: Literal["error"]
    error: ErrorDetail
    param: str | None = None


# --- the response models (the 200 bodies, documented; built as dicts by to_message and the app) -------


class TextOut(ResponseModel):
    type: Literal["text"]
    text: str


class ThinkingOut(ResponseModel):
    """A reasoning model's think block (unsigned: an empty signature)."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class ToolUseOut(ResponseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentOut = Annotated[ThinkingOut | TextOut | ToolUseOut, Field(discriminator="type")]


class MessageUsage(ResponseModel):
    input_tokens: int = Field(description="not read from the prefix cache")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="read from the prefix cache")
    cache_creation_input_tokens: int


class MessageResponse(ResponseModel):
    """A `message` (`stream` false)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentOut] = Field(description="thinking, then text, then tool_use blocks")
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(ResponseModel):
    input_tokens: int


class MessagesError(ValueError):
    """A bad Messages request: the message and the field it names."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _text(content, where: str, allowed: tuple[str, ...] = ("text",)) -> tuple[str, list[dict]]:
    """A string or a list of content blocks -> (the text blocks joined, the other blocks of `allowed` types)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise MessagesError(f"{where} must be a string or a list of content blocks", where)
    texts, others = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            shown = json.dumps(kind)[:40] if kind is not None else "not a block"
            raise MessagesError(f"{where}[{j}]: blocks of type {', '.join(allowed)} only here, got {shown}"
                                + (" (images and documents are not supported)" if kind in ("image", "document")
                                   else ""), f"{where}[{j}]")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise MessagesError(f"{where}[{j}].text must be a string", f"{where}[{j}]")
            texts.append(block["text"])
        else:
            others.append(block)
    return "\n".join(texts), others


def to_chat(body: dict) -> dict:
    """A `/v1/messages` request -> the equivalent chat completions request body."""
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise MessagesError(f"'{name}' is not supported by this server's /v1/messages", name)
    messages: list[dict] = []
    if body.get("system") is not None:
        system, _ = _text(body["system"], "system")
        messages.append({"role": "system", "content": system})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise MessagesError("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(given):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            text, results = _text(m.get("content"), f"{where}.content", ("text", "tool_result"))
            for r in results:  # tool results first: they answer the assistant turn just before
                out, _ = _text(r.get("content", ""), f"{where}.content.tool_result.content")
                if not isinstance(r.get("tool_use_id"), str):
                    raise MessagesError(f"{where}: a tool_result needs its 'tool_use_id'", f"{where}.content")
                messages.append({"role": "tool", "tool_call_id": r["tool_use_id"],
                                 "content": ("Error: " + out) if r.get("is_error") else out})
            if text or not results:
                messages.append({"role": "user", "content": text})
        elif role == "assistant":
            # Earlier thinking is dropped, as the chat templates of reasoning models drop it from history.
            text, blocks = _text(m.get("content"), f"{where}.content",
                                 ("text", "tool_use", "thinking", "redacted_thinking"))
            calls = []
            for b in blocks:
                if b["type"] != "tool_use":
                    continue
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise MessagesError(f"{where}: a tool_use block needs a 'name' and an object 'input'",
                                        f"{where}.content")
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            msg = {"role": "assistant", "content": text}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
        else:
            raise MessagesError(f"{where}.role must be 'user' or 'assistant', got {json.dumps(role)[:40]}",
                                f"{where}.role")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise MessagesError("'stream' must be a boolean", "stream")
    chat = {"messages": messages, "stream": stream}
    if messages[-1]["role"] == "assistant":  # a prefilled reply: the model continues it
        if messages[-1].get("tool_calls"):
            raise MessagesError("the last message may be the assistant's only as text to continue",
                                f"messages[{len(given) - 1}]")
        if messages[-1]["content"]:
            chat["continue_final_message"] = True
        else:  # an empty one prefills nothing
            messages.pop()
    for src, dst in (("max_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("top_k", "top_k"), ("stop_sequences", "stop"), ("model", "model")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    thinking = body.get("thinking")
    if thinking is not None:  # templates that can switch reasoning off read enable_thinking (Qwen3)
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
            raise MessagesError("'thinking' must be {'type': 'enabled' | 'disabled', ...}", "thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise MessagesError("'tools' must be an array", "tools")
        chat["tools"] = []
        for i, t in enumerate(tools):
            ok = isinstance(t, dict) and t.get("type", "custom") == "custom" and isinstance(t.get("name"), str)
            if not ok or not isinstance(t.get("input_schema", {}), dict):
                raise MessagesError(f"tools[{i}] must be a client tool {{'name', 'description', 'input_schema'}} "
                                    "(server tools are not supported)", f"tools[{i}]")
            function = {"name": t["name"], "parameters": t.get("input_schema", {"type": "object"})}
            if t.get("description") is not None:
                function["description"] = t["description"]
            chat["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none") or (kind == "tool" and not isinstance(choice.get("name"), str)):
            raise MessagesError("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or "
                                "{'type': 'tool', 'name': ...}", "tool_choice")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
            "type": "function", "function": {"name": choice["name"]}}
        if choice.get("disable_parallel_tool_use") is True:
            chat["parallel_tool_calls"] = False
    return chat


def stop_reason(finish: str, stop: str | None) -> str:
    """A chat finish_reason (and the stop string that ended the text, if one did) -> stop_reason."""
    if finish == "stop":
        return "stop_sequence" if stop is not None else "end_turn"
    return STOP_REASONS.get(finish, "end_turn")


def tool_use(call: dict) -> dict:
    """An OpenAI tool call -> a tool_use content block."""
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:  # the parser only returns calls whose arguments are JSON; be safe anyway
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": args}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The Messages API's usage: input tokens not read from the prefix cache, and those read from it."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def to_message(out: dict, model: str) -> dict:
    """A chat.completion answer -> a `message`."""
    choice, u = out["choices"][0], out["usage"]
    msg = choice["message"]
    content = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content += [tool_use(c) for c in msg.get("tool_calls") or []]
    return {"id": "msg_" + out["id"].split("-", 1)[-1], "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(choice["finish_reason"], choice["stop_reason"]),
            "stop_sequence": choice["stop_reason"],
            "usage": usage(u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"])}


def sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | data, ensure_ascii=False)}\n\n"


def error_body(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


async def events(job, model: str) -> AsyncIterator[str]:
    """The Messages API's server-sent events for one generation (a server `Job`): message_start, a
    thinking block and a text block as their deltas arrive, each tool call as a tool_use block, then
    message_delta (stop reason, usage) and message_stop."""
    mid = "msg_" + job.id.split("-", 1)[-1]
    index, open_kind = -1, None  # the content block being streamed

    def start(kind: str, block: dict) -> str:
        nonlocal index, open_kind
        index, open_kind = index + 1, kind
        return sse("content_block_start", {"index": index, "content_block": block})

    def close() -> str:
        nonlocal open_kind
        open_kind = None
        return sse("content_block_stop", {"index": index})

    try:
        yield sse("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": usage(len(job.prompt_ids), 0)}})
        while True:
            kind, payload = await job.events.get()
            if kind == "reasoning":
                if open_kind != "thinking":
                    if open_kind:
                        yield close()
                    yield start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                yield sse("content_block_delta", {"index": index,
                                                  "delta": {"type": "thinking_delta", "thinking": payload}})
            elif kind == "delta":
                if open_kind != "text":
                    if open_kind == "thinking":
                        yield sse("content_block_delta", {"index": index,
                                                          "delta": {"type": "signature_delta", "signature": ""}})
                    if open_kind:
                        yield close()
                    yield start("text", {"type": "text", "text": ""})
                yield sse("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": payload}})
            elif kind == "logprobs":
                continue
            elif kind == "error":
                yield sse("error", error_body("api_error", payload.message))
                return
            elif kind == "cancelled":
                return
            else:
                break
        if open_kind:
            yield close()
        calls = payload.get("tool_calls") or []
        for call in calls:
            block = tool_use(call)
            yield start("tool_use", block | {"input": {}})
            yield sse("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                        "partial_json": json.dumps(block["input"])}})
            yield close()
        u = usage(payload["prompt_tokens"], payload["completion_tokens"], payload.get("cached_tokens", 0))
        yield sse("message_delta", {"delta": {"stop_reason": stop_reason(payload["finish_reason"], payload.get("stop")),
                                              "stop_sequence": payload.get("stop")}, "usage": u})
        yield sse("message_stop", {})
    finally:
        job.cancel.set()
