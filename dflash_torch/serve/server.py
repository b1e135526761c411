"""`dflash serve`: an OpenAI-compatible HTTP server (chat, completions, responses, models, health, metrics),
with Anthropic's Messages API beside it. This module is the command (its arguments and start-up); the
server is `app.py` (routes), `protocol.py` (what the dialects share: errors, request model types, the
generation fields), one module per dialect (`openai_api.py`: chat and completions; `responses_api.py`;
`messages_api.py`: Anthropic's), and `engine.py` (the worker thread, its queue and jobs, metrics).

    dflash serve                      # the embedded default model on http://127.0.0.1:8000
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
"""

import argparse
import logging

from ..decoding.prefix_cache import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES

log = logging.getLogger("dflash.server")


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

    # Here, not at the top: `dflash --help` reads this module, and the app needs the server extra (pydantic).
    from .app import create_app
    from .engine import ServerConfig

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
