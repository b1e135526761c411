"""The HTTP app of `dflash serve` (FastAPI): routes take a request of their dialect (a pydantic model:
`openai_api.py`, `responses_api.py`, `messages_api.py`), submit a job to the engine (`engine.py`) and
answer, streamed (server-sent events) or whole, in each dialect's shape. `/openapi.json` documents every
route's request body; `/docs` and `/redoc` are off.

This module does not use `from __future__ import annotations`: FastAPI reads the handlers' annotations
(`request: Request`, imported inside create_app to keep `dflash --help` light) as real classes.
"""

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from ..generate import Pipeline, check_lengths, freeze_heap, load
from . import fim, messages_api, openai_api, responses_api
from .engine import Engine, Job, ServerConfig
from .messages_api import CountTokensRequest, MessagesRequest
from .openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    completion_logprobs,
    continue_final,
    forced_tool,
    parse_logprobs,
    parse_messages,
    parse_prompt,
    parse_tools,
    usage,
)
from .protocol import (
    ANTHROPIC_ERRORS,
    ENDPOINTS,
    APIError,
    ErrorResponse,
    GenRequest,
    _field,
    bad,
    compile_grammar,
    parse_common,
    read_json,
    rename_param,
    validation_error,
)
from .responses_api import ResponsesRequest, chat_to_response, responses_to_chat
from .tool_calls import forced_call_grammar

log = logging.getLogger("dflash.server")


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(config: ServerConfig | None = None, loader: Callable[[], Pipeline] | None = None,
               on_load_error: Callable[[BaseException], None] | None = None):
    """The FastAPI app. The model loads in the worker thread once the app starts (/health: 503 until then).

    loader: returns the Pipeline to serve (default: `load` with the config's model, drafter, device, dtype).
    """
    from fastapi import APIRouter, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from fastapi.routing import APIRoute
    from starlette.exceptions import HTTPException

    config = config or ServerConfig()
    def load_and_freeze() -> Pipeline:
        pipe = load(config.model, config.draft, config.device, config.dtype, quantize=config.quantize,
                    cuda_graphs=config.cuda_graphs, draft_vocab=config.draft_vocab, draft_window=config.draft_window,
                    draft_sinks=config.draft_sinks)
        freeze_heap()  # a server loads once: full garbage collections then skip what loading left (~110 ms each)
        return pipe

    loader = loader or load_and_freeze
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

    # The schema, not the pages that show it: /docs and /redoc would load scripts from a CDN.
    app = FastAPI(title="dflash-torch", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
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
            param, message = rename_param(e.param, e.message, messages_api.RENAMED)
            kind = ANTHROPIC_ERRORS.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
            return JSONResponse(messages_api.error_body(kind, message) | {"param": param}, status_code=e.status,
                                headers=e.headers)
        body = e.body()
        if request.url.path == "/v1/responses":
            body["error"]["param"], body["error"]["message"] = rename_param(e.param, e.message, responses_api.RENAMED)
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return await api_error(request, APIError(e.status_code, str(e.detail), code=str(e.status_code)))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):  # a request model's field of the wrong type
        return await api_error(request, validation_error(e.errors()))

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

    class ParsedRequest(Request):
        """A request whose body the route has read and parsed (`JSONRoute`), as FastAPI's handler reads it."""

        def __init__(self, request: Request, raw: bytes, body: dict) -> None:
            # FastAPI takes a body for JSON only when its content-type says so; the server always took it as
            # JSON whatever the client said (curl -d sends application/x-www-form-urlencoded).
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            super().__init__(request.scope | {"headers": [*headers, (b"content-type", b"application/json")]},
                             request.receive)
            self._raw, self._parsed = raw, body

        async def body(self) -> bytes:
            return self._raw

        async def json(self) -> dict:
            return self._parsed

    class JSONRoute(APIRoute):
        """A route that takes a JSON body (its handler's request model). What every such route checks first,
        before FastAPI validates the body against the model: the key, the model ready, then the body read
        within --max-body-bytes (413 past it, while reading) as a JSON object."""

        def get_route_handler(self):
            handler = super().get_route_handler()

            async def checked(request: Request):
                authorize(request)
                engine.ready()
                raw, body = await read_json(request, config.max_body_bytes)
                return await handler(ParsedRequest(request, raw, body))

            return checked

    # The routes with a body; errors of those not in the Messages API are OpenAI's (4XX: no 422 in the schema).
    bodies = APIRouter(route_class=JSONRoute, responses={"4XX": {"model": ErrorResponse,
                                                                 "description": "the error; param: the field"}})
    anthropic_errors = {"4XX": {"model": messages_api.ErrorResponse, "description": "the error; param: the field"}}

    def answer(model, what: str, streams: bool = True) -> dict:
        """The 200 of a route, documented (not serialized by FastAPI: the handlers' dicts go out as built)."""
        if not streams:
            return {200: {"model": model, "description": what}}
        return {200: {"model": model, "description": f"{what}; with stream: true, server-sent events instead",
                      "content": {"text/event-stream": {"schema": {"type": "string"}}}}}

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

    @bodies.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's: {"prompt": text} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}: the
        prompt tokens a completion or chat request with that input would run (template and tools included)."""
        body = body.given()
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

    @bodies.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """vLLM's: {"tokens": [ids]} -> {"prompt": text} (special tokens kept)."""
        body = body.given()
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

    @bodies.post("/v1/chat/completions", responses=answer(openai_api.ChatCompletion, "the chat completion"))
    async def chat(request: Request, body: ChatCompletionRequest):
        """OpenAI's chat completions."""
        return await chat_answer(request, body.given())

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

    @bodies.post("/v1/responses", responses=answer(responses_api.ResponseObject, "the response"))
    async def responses(request: Request, body: ResponsesRequest):
        """OpenAI's Responses API through chat completions (`responses_api`)."""
        body = body.given()
        chat = responses_to_chat(body)
        if chat["stream"]:
            return await chat_answer(request, chat,
                                     streamer=lambda job, req: responses_api.events(job, body, engine.name))
        return chat_to_response(await chat_answer(request, chat), body)

    def messages_chat(body: MessagesRequest | CountTokensRequest) -> dict:
        """The chat completions body a Messages API request stands for."""
        try:
            return messages_api.to_chat(body.given())
        except messages_api.MessagesError as e:
            raise bad(str(e), e.param) from None

    @bodies.post("/v1/messages", responses=anthropic_errors | answer(messages_api.MessageResponse, "the message"))
    async def messages(request: Request, body: MessagesRequest):
        """Anthropic's Messages API through chat completions (`messages_api`)."""
        chat = messages_chat(body)
        # Anthropic's clients send a large max_tokens whatever the model (a required field; Claude Code's is
        # 32,000): one beyond a local model's context is cut to what is left, not refused.
        if chat["stream"]:
            return await chat_answer(request, chat, streamer=lambda job, req: messages_api.events(job, engine.name),
                                     fit=True)
        return messages_api.to_message(await chat_answer(request, chat, fit=True), engine.name)

    @bodies.post("/v1/messages/count_tokens",
                 responses=anthropic_errors | answer(messages_api.TokenCount, "the prompt's tokens", streams=False))
    async def count_tokens(body: CountTokensRequest):
        """Anthropic's token count: the prompt tokens a /v1/messages request would run."""
        chat = messages_chat(body)
        args = config.chat_template_args | chat.get("chat_template_kwargs", {})
        messages = parse_messages(chat["messages"])
        ids = await asyncio.to_thread(engine.encode, messages=messages, template_args=args, tools=parse_tools(chat),
                                      continue_final=continue_final(chat, messages))
        return {"input_tokens": len(ids)}

    @bodies.post("/v1/completions", responses=answer(openai_api.Completion, "the completion"))
    async def completions(request: Request, body: CompletionRequest):
        """OpenAI's (legacy) completions: a prompt continued (or filled in the middle, given a suffix)."""
        body = body.given()
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
        grammar_param = req.grammar[0] if req.grammar else None  # the field that asked for it
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
                      grammar=req.grammar, grammar_param=grammar_param, id=f"{jobs[0].id}-{i}" if jobs else "",
                      stop_ids=stop_ids,
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

    app.include_router(bodies)
    return app


# --- the command --------------------------------------------------------------------------------


