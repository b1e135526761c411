"""What every dialect of `dflash serve` shares on the request side: limits, errors (`APIError`, answered
in each API's own shape by the app), the body read within its limit, the pydantic types the dialects'
request models are made of (and their validation errors as `APIError`s naming the field), and the one
internal generation request (`GenRequest`) with the parsing of the generation fields every dialect ends
in (sampling, length, stops, streaming, grammars).

The dialects: `openai_api.py` (chat completions, completions), `responses_api.py` and `messages_api.py`
(each turned into a chat completions body). Their request models type each field for the schema
(`/openapi.json`) and check the JSON type of the scalar ones; what a type cannot say (ranges, the shape of
each message or tool, fields that exclude each other) their parsers check, with messages that name the
exact item (messages[2].role)."""

import asyncio
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, SkipValidation
from pydantic_core import PydanticCustomError

from ..decoding import structured
from ..decoding.sampling import Sampler
from ..generate import Pipeline

log = logging.getLogger("dflash.server")

MAX_BODY_BYTES = 1 << 20
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # the hold-back check costs up to len(stop)^2 per token
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
    """A 400 for a bad request, naming the field at fault (`param`) when there is one."""
    return APIError(400, message, param)


def rename_param(param: str | None, message: str, renamed: dict[str, str]) -> tuple[str | None, str]:
    """A chat completions error's field -> the dialect's name for it (and the message with it), for a
    dialect turned into chat completions: the error names the field the client sent."""
    if param in renamed:
        return renamed[param], message.replace(f"'{param}'", f"'{renamed[param]}'")
    return param, message


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, server_error, rate_limit_error, ...")
    param: str | None = Field(description="the field at fault, if any (messages[0].role)")
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape (every route but the Messages API's)."""

    error: ErrorDetail


async def read_json(request, limit: int) -> tuple[bytes, dict]:
    """The request body, as read and as a JSON object: 413 past `limit` bytes, 400 when it is not a JSON
    object. Read here rather than by FastAPI: the limit holds while reading, and the key and readiness
    checks come first (see app.py's `JSONRoute`)."""
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
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"the body is not valid JSON: {e}"[:200]) from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return raw, body


# --- request models: the pieces ------------------------------------------------------------------
# A field whose shape the dialect's parser checks item by item (a message, a tool, a stop list) is typed
# SkipValidation[...]: the schema has its type, and the parser's message names the item (messages[2].role).

_KINDS = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    # an int of any size is finite (math.isfinite would overflow converting a huge one to a float)
    "number": (lambda v: isinstance(v, float) and math.isfinite(v) or isinstance(v, int) and not isinstance(v, bool),
               "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "an object"),
}


def _kind(kind: str, schema_type: type) -> Any:
    """A field type checked exactly as `_field(body, name, kind)` checks it (null: absent), the value kept
    as sent (1 stays 1, where pydantic's float would make it 1.0), typed `schema_type` in the schema."""
    ok, what = _KINDS[kind]

    def check(value):
        if value is not None and not ok(value):
            raise PydanticCustomError("wrong_type", "must be {what}", {"what": what})
        return value

    return Annotated[schema_type | None, PlainValidator(check, json_schema_input_type=schema_type | None)]


# The JSON types of top-level fields: checked by pydantic, the error naming the field (`validation_error`).
Int = _kind("int", int)
Number = _kind("number", float)
Bool = _kind("bool", bool)
Str = _kind("str", str)
Object = _kind("object", dict[str, Any])


def doc(description: str, **schema) -> Any:
    """A field's default (None: absent) with its description and JSON schema keywords (`minimum`, ...)
    that the dialect's parser enforces: documented in the schema, checked with the parser's message."""
    return Field(None, description=description, json_schema_extra=schema or None)


def required(*names: str) -> Callable[[dict, type], None]:
    """A model's json_schema_extra: `names` are required in the schema; the model gives them a default so
    that their absence gets the parser's message ("'messages' must be a non-empty array"), as before."""
    def extra(schema: dict, cls: type) -> None:
        schema["required"] = [*schema.get("required", []), *names]
        for name in names:
            schema["properties"][name].pop("default", None)
    return extra


class ResponseModel(BaseModel):
    """A 200 answer's body (or a part of one), as `/openapi.json` documents it. The routes build the dict
    themselves (field order and nulls as sent): these models describe it, they do not serialize it. Each
    field the server sends is declared (nullable ones as `X | None`, absent-or-not ones with a default);
    more may come later, so others are allowed."""

    model_config = ConfigDict(extra="allow")


class RequestModel(BaseModel):
    """A request body (or a part of one). Fields the model does not name are kept and passed on, as the
    parsers always ignored what they do not read (and refuse by name what they do not implement)."""

    model_config = ConfigDict(extra="allow")

    def given(self) -> dict:
        """The fields the client sent (extra ones too), as sent: what the dialect's parser reads."""
        return {k: v for k, v in self.__dict__.items() if k in self.model_fields_set} | (self.model_extra or {})


def validation_error(errors: list[dict]) -> APIError:
    """Pydantic's (FastAPI's) validation errors -> the 400 of the first, naming its field: the message of
    a wrong type is `_field`'s ("'max_tokens' must be an integer, got \"10\"")."""
    e = errors[0]
    loc = list(e.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if e.get("type") == "wrong_type" and param:
        shown = json.dumps(e.get("input"), default=str)[:40]
        return bad(f"'{param}' must be {e['ctx']['what']}, got {shown}", param)
    where = f"'{param}': " if param else ""
    return bad(f"{where}{e.get('msg', 'invalid request')}"[:300], param)


# --- the one generation request ----------------------------------------------------------------

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


class StreamOptions(RequestModel):
    include_usage: bool | None = None


class JSONSchemaSpec(RequestModel):
    name: str | None = None
    schema_: dict[str, Any] | str = Field(alias="schema", description="the JSON schema (or its JSON text)")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class GenerationFields(RequestModel):
    """The generation fields every dialect ends in (`parse_common`, `parse_grammar`): sampling, length,
    stops, streaming, output constraints. The OpenAI dialects take them as they are; the others map theirs
    onto these names."""

    model: Str = doc("any name: the server answers with the one model it serves")
    n: Int = doc("choices, generated one after the other (default 1)", minimum=1, maximum=MAX_CHOICES)
    max_tokens: Int = doc("tokens to generate at most (default: the server's --max-tokens, within the context)",
                          minimum=1)
    max_completion_tokens: Int = doc("the newer name of max_tokens (wins when both are given)", minimum=1)
    stop: SkipValidation[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)] | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)] | None] \
        = doc("text that ends the generation (not part of the answer)")
    stream: Bool = doc("answer as server-sent events")
    stream_options: SkipValidation[StreamOptions | None] = doc("include_usage: a last chunk with the usage")
    temperature: Number = doc("0: greedy (the default)", minimum=0, maximum=2)
    top_p: Number = doc("nucleus sampling (1: off)", exclusiveMinimum=0, maximum=1)
    top_k: Int = doc("the k most likely tokens only (0 or -1: off)", minimum=-1)
    min_p: Number = doc("tokens at least min_p times as likely as the best (0: off)", minimum=0, exclusiveMaximum=1)
    seed: Int = doc("the sampler's seed (choice i of n: seed + i)", minimum=-(2**63), maximum=2**64 - 1)
    presence_penalty: Number = doc("OpenAI's", minimum=-2, maximum=2)
    frequency_penalty: Number = doc("OpenAI's", minimum=-2, maximum=2)
    repetition_penalty: Number = doc("vLLM's (1: off)", exclusiveMinimum=0, maximum=10)
    logit_bias: SkipValidation[dict[str, Annotated[float, Field(ge=-100, le=100)]] | None] = doc(
        f"token id -> a bias in [-100, 100] added to its logit (at most {MAX_LOGIT_BIAS})")
    response_format: SkipValidation[ResponseFormat | None] = doc("text, any JSON object, or JSON that follows a schema")
    guided_json: SkipValidation[dict[str, Any] | str | None] = doc("vLLM's: a JSON schema the output follows")
    guided_regex: SkipValidation[str | None] = doc("vLLM's: a regular expression the whole output matches")
    guided_choice: SkipValidation[list[str] | None] = doc("vLLM's: the output is one of these")
    guided_grammar: SkipValidation[str | None] = doc("vLLM's: a Lark grammar the output follows")


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
    for name in ("presence_penalty", "frequency_penalty"):  # in range before float(): a huge int overflows it
        value = _field(body, name, "number", 0.0)
        if not -2 <= value <= 2:
            raise bad(f"'{name}' must be in [-2, 2]", name)
        penalties[name] = float(value)
    value = _field(body, "repetition_penalty", "number", 1.0)  # vLLM's field
    if not 0 < value <= 10:
        raise bad("'repetition_penalty' must be in (0, 10] (1: off)", "repetition_penalty")
    penalties["repetition_penalty"] = float(value)
    raw, bias = _field(body, "logit_bias", "object", {}), None
    if raw:
        try:
            bias = {int(k): float(v) for k, v in raw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        except (TypeError, ValueError, OverflowError):  # OverflowError: float() of a huge int
            bias = {}
        if not len(bias) == len(raw) <= MAX_LOGIT_BIAS or not all(t >= 0 and -100 <= v <= 100
                                                                   for t, v in bias.items()):
            raise bad(f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]",
                      "logit_bias")
    # (values so small that float32 would break them: the Sampler takes the nearest that does not)
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
    value = body.get("response_format")
    if isinstance(value, dict) and not isinstance(value.get("json_schema") or {}, dict):  # (it would raise a 500)
        raise bad("'response_format.json_schema' must be an object {'name', 'schema'}", "response_format")
    try:
        fmt = structured.parse_response_format(value)
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


def logprob_entry(pipe: Pipeline, token: int, logprob: float, top_ids: list[int], top_lps: list[float]) -> dict:
    """One token of a chat completion's 'logprobs.content': its text, bytes and best alternatives."""
    def one(t: int, lp: float) -> dict:
        b = pipe.token_bytes(t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
    return one(token, logprob) | {"top_logprobs": [one(t, lp) for t, lp in zip(top_ids, top_lps)]}


