"""The engine behind `dflash serve`: one worker thread owns the model and runs one generation at a time;
requests wait in a bounded FIFO queue (429 when it is full). The worker detokenizes, cuts stop strings and
hands text deltas to the request's event loop (`Job`), so a streamed and a non-streamed answer are the same
text; a client that goes away sets its job's cancel flag, checked after every token. `Metrics` counts what
the engine did."""

import asyncio
import logging
import math
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrate
from ..decoding.fallback import FallbackController
from ..decoding.lookup import VerifyCosts
from ..decoding.prefix_cache import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DiskStore, PrefixCache
from ..decoding.sampling import Sampler, TokenLogprobs
from ..decoding.speculative import Stats, generate_tokens
from ..decoding.structured import Constraint, GrammarRefused
from ..generate import Detokenizer, Pipeline, prompt_logprobs
from .metrics import Metrics
from .protocol import MAX_BODY_BYTES, APIError, bad, logprob_entry
from .reasoning import ReasoningSplitter, has_think_tags, starts_inside
from .tool_calls import ToolCallStream

log = logging.getLogger("dflash.server")


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


# Events of a generation go to the request's handler at most this often (the first and the last at once):
# a stream's chunk then holds the tokens of up to this long, at a tenth of the wake-ups at 300 tok/s.
EMIT_INTERVAL_S = 0.03


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
    grammar_param: str | None = None  # the field that asked for it (response_format, guided_regex, tool_choice)
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
    # events not yet handed to the loop, and when the last hand-over was (emit)
    held_events: list = field(default_factory=list)
    handed_at: float = float("-inf")  # (the first event goes at once)
    text_out: bool = False  # a delta has been handed over (the first one goes at once: the TTFT)
    emit_lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, kind: str, payload=None) -> None:
        """Hand ("delta", text) / ("logprobs", [entry]) / ("done", info) / ("error", APIError) to the
        handler, from any thread. Log-probability entries come just before the delta whose text they
        made (a token whose text is held back, as a possible stop string's start, waits with it).

        Events go over at most every EMIT_INTERVAL_S, in order; the first text and the last events at once:
        each hand-over wakes the event loop's thread, which on a machine with as many cores as compute
        threads takes a core from a pass (one wake-up per token cost 6% of decode speed on 2 cores)."""
        with self.emit_lock:
            self.held_events.append((kind, payload))
            now = time.perf_counter()
            first_text = kind == "delta" and not self.text_out
            self.text_out = self.text_out or kind == "delta"
            if (kind not in ("done", "cancelled", "error") and not first_text
                    and now - self.handed_at < EMIT_INTERVAL_S):
                return
            batch, self.held_events, self.handed_at = self.held_events, [], now
            try:  # under the lock: batches from two threads reach the loop in the order they were taken
                self.loop.call_soon_threadsafe(self._put, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _put(self, batch: list) -> None:
        for event in batch:
            self.events.put_nowait(event)

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
            "datastore_cycles": s.datastore_cycles, "datastore_accepted": s.datastore_accepted,
            "tree_cycles": s.tree_cycles, "tree_side_kept": s.tree_side_kept,
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
        self.lookup_costs = VerifyCosts()  # seconds per verify width, measured by prompt lookup
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
        if getattr(pipe, "loaded_in", threading.get_ident()) != threading.get_ident():
            # libgomp throttles once two threads' OpenMP teams outnumber the CPUs: every parallel region
            # then waits for a sleeping thread (a decode step 4x slower on 2 cores); `dflash serve` loads here
            log.warning("dflash serve: the model was loaded in another thread; if that thread ran torch ops, "
                        "passes here can be several times slower (load it in the engine's loader instead: "
                        "docs/performance.md, \"One thread runs the model\")")
        c = self.config
        if c.adaptive and c.fallback and c.block_size is None and pipe.drafter is not None:
            # seconds per cycle by block size, measured before the server reports ready (not in the
            # first request's time); one estimator for all requests, so what a request learned about
            # acceptance, and when the full block is due for a try, carry into the next one
            self.adaptive = AdaptiveBlockSize(calibrate(pipe.target, pipe.drafter), pipe.drafter.block_size)
        self.reasoning = c.reasoning_parser == "think" or (
            c.reasoning_parser == "auto" and has_think_tags(pipe.tokenizer))
        try:  # the chat template compiled now, not in the first request's time (~20 ms: first_request_probe.py)
            pipe.encode_messages([{"role": "user", "content": "Hi"}])
        except Exception:  # no tokenizer, or a template that wants other messages: the first request will say
            pass
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
            if isinstance(e, GrammarRefused):
                # The grammar allowed none of the model's tokens (a vocabulary without a character the format
                # needs next: a tokenizer without byte fallback): the request's format, not a server fault.
                log.info("dflash serve: %s: %s", job.id, str(e).splitlines()[0][:300])
                job.emit("error", APIError(400, "the output format asks for text this model's tokens cannot write "
                                           f"(after {job.completion_tokens} tokens)", job.grammar_param, counted=True))
                finish, status = "error", 400
            else:
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
        if finish != "error":  # a failure has sent its error already
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


# --- the app ------------------------------------------------------------------------------------


def _weights(pipe) -> str:
    """The weight format for the start-up log: "int4", "int4, LM head int8", "not quantized"."""
    if not pipe.quantize:
        return "not quantized"
    head = getattr(pipe, "lm_head", pipe.quantize)
    return pipe.quantize if head == pipe.quantize else f"{pipe.quantize}, LM head {head or 'not quantized'}"
