"""OpenAI's chat completions (`POST /v1/chat/completions`) and completions (`POST /v1/completions`), and
vLLM's `/tokenize` and `/detokenize` beside them: the request and answer models (what `/openapi.json`
documents) and the parsing of what is theirs (messages, tools, prompts, log-probabilities) on top of the
generation fields every dialect shares (`protocol.GenerationFields`, `protocol.parse_common`).

Chat completions is also the internal form of the other dialects: a Responses or Messages request becomes
a chat completions body (`responses_api`, `messages_api`), which these parsers read.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, SkipValidation

from .protocol import (
    MAX_TOP_LOGPROBS,
    Bool,
    GenerationFields,
    Int,
    Object,
    RequestModel,
    ResponseModel,
    Str,
    _field,
    bad,
    doc,
    required,
)

ROLES = ("system", "user", "assistant", "tool")


# --- request models ------------------------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str | dict[str, Any] = Field("{}", description="the arguments as JSON text (or an object)")


class ToolCall(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


Content = Annotated[str | list[TextPart], Field(description="text, or text parts (joined by newlines)")]


class SystemMessage(RequestModel):
    role: Literal["system", "developer"] = Field(description="developer: the same as system")
    content: Content


class UserMessage(RequestModel):
    role: Literal["user"]
    content: Content


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: Content | None = Field(None, description="null or absent: a turn that only called tools")
    tool_calls: list[ToolCall] | None = Field(None, description="the calls it made")


class ToolMessage(RequestModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = Field(None, description="the call this answers")
    name: str | None = None


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionSpec(RequestModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict, description="a JSON schema of the arguments")


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class ChatFields(RequestModel):
    """What a chat request and /tokenize's chat form share: the conversation and its tools."""

    tools: SkipValidation[Annotated[list[Tool], Field(min_length=1)] | None] = doc("functions the model may call")
    tool_choice: SkipValidation[ToolChoice | None] = doc("required or a named function: a call is forced")


Messages = Annotated[list[ChatMessage], Field(min_length=1)]
TEMPLATE_KWARGS = "vLLM's: chat template variables (over the server's --chat-template-args)"
CONTINUE_FINAL = "vLLM's: continue the last message (an assistant's) instead of answering"


class ChatCompletionRequest(ChatFields, GenerationFields):
    """A chat completions body."""

    model_config = ConfigDict(json_schema_extra=required("messages"))

    messages: SkipValidation[Messages] = doc("the conversation")
    chat_template_kwargs: Object = doc(TEMPLATE_KWARGS)
    continue_final_message: Bool = doc(CONTINUE_FINAL)
    parallel_tool_calls: Bool = doc("false: at most one tool call per reply")
    logprobs: Bool = doc("each token's log-probability")
    top_logprobs: Int = doc("and its most likely alternatives (needs logprobs)", minimum=0, maximum=MAX_TOP_LOGPROBS)


Prompt = str | list[int] | Annotated[list[str], Field(max_length=1)] | Annotated[list[list[int]], Field(max_length=1)]


class CompletionRequest(GenerationFields):
    """A completions body: a prompt (text or token ids, one per request), continued."""

    model_config = ConfigDict(json_schema_extra=required("prompt"))

    prompt: SkipValidation[Prompt] = doc("text or token ids (or a list holding one of these)")
    max_tokens: Int = doc("tokens to generate at most (0 with echo: score the prompt only)", minimum=0)
    echo: Bool = doc("the prompt, scored, before the completion (max_tokens 0: the prompt only)")
    logprobs: Int = doc("each token's log-probability and this many alternatives", minimum=0,
                        maximum=MAX_TOP_LOGPROBS)
    suffix: Str = doc("fill in the middle: the text after the completion (models with FIM tokens)")


class TokenizeRequest(ChatFields):
    """vLLM's /tokenize: a prompt, or messages (with tools and template variables), as a request would run."""

    prompt: Str = doc("text (give this or messages)")
    messages: SkipValidation[Messages | None] = doc("a conversation (give this or prompt)")
    # read with messages only (and then checked by the parser): a prompt request ignores them, as it did
    chat_template_kwargs: SkipValidation[dict[str, Any] | None] = doc(TEMPLATE_KWARGS)
    continue_final_message: SkipValidation[bool | None] = doc(CONTINUE_FINAL)


class DetokenizeRequest(RequestModel):
    """vLLM's /detokenize: token ids back to text (special tokens kept)."""

    model_config = ConfigDict(json_schema_extra=required("tokens"))

    tokens: SkipValidation[list[Annotated[int, Field(ge=0)]]] = doc("token ids in the vocabulary")


# --- response models (the 200 bodies, documented; the answer is built as a dict in app.collect) ------


class TopLogprob(ResponseModel):
    token: str = Field(description="the token's text (invalid UTF-8 replaced)")
    logprob: float
    bytes: list[int] = Field(description="the token's bytes")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the most likely alternatives (top_logprobs of them)")


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob]
    refusal: None


class CalledFunction(ResponseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ChatCompletionToolCall(ResponseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatCompletionMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null: a reply that only called tools")
    tool_calls: list[ChatCompletionToolCall] | None = Field(None, description="present when it called tools")
    reasoning_content: str | None = Field(None, description="a reasoning model's think block (--reasoning-parser)")


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = Field(description="with logprobs: true")
    finish_reason: Literal["stop", "length", "tool_calls"]
    stop_reason: str | None = Field(description="vLLM's: the stop string that ended the text, if one did")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = Field(description="read from the prefix cache")


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int = Field(description="in the think block (its tags included)")


class CompletionUsage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int = Field(description="of every choice")
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class ChatCompletion(ResponseModel):
    """A chat completion (`stream` false): one choice per `n`."""

    id: str
    object: Literal["chat.completion"]
    created: int = Field(description="Unix time, seconds")
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage


class CompletionLogprobs(ResponseModel):
    """The legacy log-probabilities: one entry per token in each list."""

    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null: an echoed prompt's first token")
    top_logprobs: list[dict[str, float] | None] = Field(description="token -> log-probability")
    text_offset: list[int] = Field(description="each token's offset in the choice's text (characters)")


class CompletionChoice(ResponseModel):
    index: int
    text: str = Field(description="the completion (after the prompt, with echo)")
    logprobs: CompletionLogprobs | None = Field(description="with logprobs")
    finish_reason: Literal["stop", "length"]
    stop_reason: str | None = Field(description="vLLM's: the stop string that ended the text, if one did")


class Completion(ResponseModel):
    """A (legacy) completion (`stream` false): one choice per `n`."""

    id: str
    object: Literal["text_completion"]
    created: int = Field(description="Unix time, seconds")
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


# --- parsing -------------------------------------------------------------------------------------


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
    function = choice.get("function") if isinstance(choice, dict) else None
    named = isinstance(function, dict) and choice.get("type") == "function" and isinstance(function.get("name"), str)
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


# --- the answer ----------------------------------------------------------------------------------


def usage(info: dict, more: list[dict] = ()) -> dict:
    """Usage of one generation (`info`, the "done" payload), plus the completions of other choices."""
    p, c = info["prompt_tokens"], info["completion_tokens"] + sum(m["completion_tokens"] for m in more)
    thought = info.get("reasoning_tokens", 0) + sum(m.get("reasoning_tokens", 0) for m in more)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": info.get("cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": thought}}
