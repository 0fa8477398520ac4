"""``plinth serve [MODEL]``: the OpenAI-compatible HTTP server.

Endpoints: /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings (--task embed), /classify
(--task classify), /pooling, /v1/score and /v1/rerank (either), /v1/models,
/tokenize, /detokenize, /health, /version, /metrics (and, with --allow-runtime-lora-updating,
/v1/load_lora_adapter and /v1/unload_lora_adapter; with --enable-weight-updates, /update_weights and
/reset_prefix_cache; with --enable-sleep-mode, /sleep, /wake_up and /is_sleeping). With --api-key (or $PLINTH_API_KEY) every route needs
``Authorization: Bearer <key>`` but /health, /ping, /version and /metrics.

On SIGTERM (or Ctrl-C) the server stops accepting connections, lets in-flight requests finish
for up to --shutdown-timeout seconds, aborts the rest, and exits with status 0.

On a CPU, --max-num-batched-tokens defaults to 256 here (2048 elsewhere): a step runs the decodes of
every stream and the prefill chunks of new requests together, so the per-step token budget bounds how
long a new prompt can hold up the streams already running (their inter-token latency).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from plinth.config import MAX_TIMEOUT_S
from plinth.core.gc_pause import GcPause
from plinth.entrypoints.engine_args import add_engine_args, engine_config_from_args
from plinth.entrypoints.openai.reasoning_parsers import resolve_reasoning_parser
from plinth.entrypoints.openai.tool_parsers import resolve_tool_parser
from plinth.errors import UserFacingError

logger = logging.getLogger(__name__)

API_KEY_ENV = "PLINTH_API_KEY"

#: ``plinth serve`` on a CPU: the per-step token budget (decodes plus prefill chunks) when
#: --max-num-batched-tokens is not given (at least --max-num-seqs, so every stream decodes each step). Measured on
#: two AVX512-BF16 cores with vLLM's load client, 256-token prompts (benchmarks/RESULTS.md, session 44): 512 and 256
#: give the same output rate (8 streams 270.5 / 268.3 tok/s, 32 streams 333.0 / 331.3) with p99 inter-token
#: latencies of 348 / 200 ms and 385 / 223 ms; 128 costs 8-10% of the output (249.5, 298.1) for 132 / 146 ms.
#: (Earlier code, with a costlier step: 2048 let one step prefill eight prompts, p99 ~1.9 s.)
CPU_SERVE_TOKEN_BUDGET = 256


class ServeError(UserFacingError):
    """The server cannot start as asked (bad flag value, port taken)."""


def add_parser(subparsers: Any, name: str, help_text: str) -> None:
    p = subparsers.add_parser(name, help=help_text, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, "serve")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health, /ping, /version and "
                        f"/metrics (default: ${API_KEY_ENV})")
    g.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                   help="the largest request body read, in bytes; larger ones are refused with a 413 "
                        "(default: 256 MiB; 0: no limit)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted (default: %(default)s)")
    g.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="do not log one line per HTTP request")
    g.add_argument("--disable-log-requests", "--enable-log-requests", action="store_true",
                   help="accepted as vLLM's flags; plinth never logs request contents (only the access line)")
    g.add_argument("--disable-uvicorn-access-log", dest="access_log", action="store_false",
                   help="vLLM's name of --no-access-log")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="accepted as vLLM's flag (how much of a prompt its request log shows); plinth never logs "
                        "prompts")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="a response to a request without an X-Request-Id header gets a new one (a request's own is "
                        "always echoed)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="do not serve the API's schema at /openapi.json (the /docs and /redoc pages are never served)")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="the HTTP server's (uvicorn's) log level (default: plinth's)")
    add_api_args(g)
    g.add_argument("--allowed-origins", default=None, metavar="JSON",
                   help="CORS: the origins browsers may call from, a JSON list (e.g. '[\"http://localhost:3000\"]'); "
                        "off by default")
    g.add_argument("--allowed-methods", default=None, metavar="JSON",
                   help='CORS: methods (with --allowed-origins; default ["*"])')
    g.add_argument("--allowed-headers", default=None, metavar="JSON",
                   help='CORS: headers (with --allowed-origins; default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (with --allowed-origins)")
    g.add_argument("--root-path", default=None, help="the path prefix a proxy serves this server under")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM) ...")
    g.add_argument("--ssl-certfile", default=None, help="... and this certificate chain (PEM)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter serve adapters from folders on this "
                        "machine while running (with --enable-lora; off by default: they read server-side paths)")
    g.add_argument("--enable-weight-updates", action="store_true",
                   help="POST /update_weights loads new values for the model's weights from a safetensors checkpoint "
                        "on this machine (reinforcement learning), POST /reset_prefix_cache forgets the prefix cache "
                        "(off by default: they read server-side paths and change what every client gets)")
    # None: the engine's default, or CPU_SERVE_TOKEN_BUDGET on a CPU (see serving_config)
    p.set_defaults(func=run)


def add_api_args(g: Any) -> None:
    """The flags that shape the API's answers (``serve`` and ``run-batch``)."""
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model's tool-call format (hermes, llama3_json, mistral, glm45, qwen3_coder, deepseek_v3, "
                        "kimi_k2, gpt_oss, or one a plugin adds): enables "
                        "tool_choice 'auto', the default for chat requests with tools")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag for tool_choice 'auto' (needs --tool-call-parser, which turns 'auto' on by "
                        "itself here)")
    g.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="the role of chat replies to requests with add_generation_prompt (the default); without it a "
                        "reply continues the last message and has its role (default: %(default)s)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed reply ends with a usage chunk, as if the request's stream_options asked for "
                        "one (vLLM's flag; non-streamed replies always carry their usage)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted as vLLM's flag; usage always has prompt_tokens_details.cached_tokens")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens as 'token_id:N' (requests may still say return_tokens_as_token_ids: false)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served as models of these names (with --enable-lora): NAME=PATH, or a JSON "
                        "object '{\"name\": NAME, \"path\": PATH}'")


def check_tool_flags(args: argparse.Namespace) -> None:
    """The tool-call flags (and ``--response-role``), checked before the model loads.

    Raises:
        ServeError: ``--enable-auto-tool-choice`` without ``--tool-call-parser``; an empty ``--response-role``.
        ValueError: an unknown parser (naming the registered ones).
    """
    if not args.response_role.strip():
        raise ServeError("--response-role must name a role (default: assistant)")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ServeError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)")
    resolve_tool_parser(args.tool_call_parser)


def lora_modules(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``--lora-modules`` as ``(name, path)`` pairs.

    Raises:
        ServeError: a malformed entry, a repeated name, or adapters without --enable-lora.
    """
    out: list[tuple[str, str]] = []
    for item in getattr(args, "lora_modules", None) or ():
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except json.JSONDecodeError:
                spec = None
            name, path = (spec.get("name"), spec.get("path")) if isinstance(spec, dict) else (None, None)
        else:
            name, _, path = item.partition("=")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ServeError(f"--lora-modules takes NAME=PATH or '{{\"name\": ..., \"path\": ...}}', got {item!r}")
        if any(name == n for n, _ in out):
            raise ServeError(f"--lora-modules names {name!r} twice")
        out.append((name, path))
    if out and not args.enable_lora:
        raise ServeError("--lora-modules needs --enable-lora")
    return out


def request_limit(value: int | None) -> int | None:
    """``--max-request-bytes`` as ``build_app`` takes it (``None``: the default; 0: no limit).

    Raises:
        ServeError: a negative value.
    """
    from plinth.entrypoints.openai.api_server import DEFAULT_MAX_REQUEST_BYTES

    if value is None:
        return DEFAULT_MAX_REQUEST_BYTES
    if value < 0:
        raise ServeError(f"--max-request-bytes must be 0 (no limit) or more, got {value}")
    return value or None


def api_app(front: Any, args: argparse.Namespace, **kwargs: Any) -> Any:
    """The server app of ``front`` with the API flags (:func:`add_api_args`) and the engine's reasoning parser.

    Raises:
        ServeError: a ``--lora-modules`` adapter cannot be served.
    """
    from plinth.entrypoints.openai.api_server import build_app

    try:
        return build_app(front, tool_parser=resolve_tool_parser(args.tool_call_parser),
                         reasoning_parser=resolve_reasoning_parser(args.reasoning_parser),
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                         lora_modules=lora_modules(args), response_role=args.response_role,
                         force_include_usage=args.enable_force_include_usage, **kwargs)
    except ValueError as exc:
        raise ServeError(f"--lora-modules: {exc}") from None


# After the grace period the remaining requests are aborted, so their clients get a final
# chunk (finish_reason "abort"); uvicorn cancels whatever is still running this much later.
ABORT_FLUSH_S = 3.0


def _server_class() -> Any:
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with plinth's shutdown: after ``grace_s`` seconds the engine aborts
        what is left (clients get a proper final response), and a SIGTERM/SIGINT shutdown ends
        with a normal return (uvicorn would re-raise the signal, so the process would die of it
        instead of exiting with status 0)."""

        def __init__(self, config: uvicorn.Config, grace_s: float, on_grace_expired: Callable[[], None]):
            super().__init__(config)
            self.grace_s = grace_s
            self.on_grace_expired = on_grace_expired

        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.get_running_loop().call_later(self.grace_s, self._grace_expired)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        def _grace_expired(self) -> None:
            if self.server_state.tasks:
                logger.warning("shutdown grace period (%.1f s) over: aborting %d unfinished request(s)",
                               self.grace_s, len(self.server_state.tasks))
            self.on_grace_expired()

        def handle_exit(self, sig: int, frame: Any) -> None:
            """The first SIGTERM/SIGINT starts the graceful stop; a second one ends the grace at once (the engine
            aborts what is left, so every client still gets its final response); only a third forces the exit."""
            if self.should_exit and not self._cut_short and sig in (signal.SIGINT, signal.SIGTERM):
                self._cut_short = True
                logger.warning("second stop signal: ending the shutdown grace period now")
                try:
                    asyncio.get_running_loop().call_soon_threadsafe(self._grace_expired)
                except RuntimeError:   # (no loop running in this thread)
                    self._grace_expired()
                return
            if self._cut_short:   # a third: out now (uvicorn itself forces only on a second SIGINT)
                self.force_exit = True
            super().handle_exit(sig, frame)

        _cut_short = False

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                _stop_if_requested()   # (one that came just before these handlers)
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def serving_config(args: argparse.Namespace) -> Any:
    """The engine configuration of ``plinth serve``: the flags, with the serving budget on a CPU.

    Raises:
        ConfigError, SelectionError: a bad flag value, or a forced platform that cannot run.
    """
    if args.max_num_batched_tokens is None and args.enable_chunked_prefill:
        from plinth.platforms.selection import select_platform

        platform = select_platform(args.platform)
        if platform.device_type == "cpu":
            budget = max(CPU_SERVE_TOKEN_BUDGET, args.max_num_seqs or platform.scheduler_defaults(0)[0])
            logger.info("serving on a CPU: %d tokens per step (decodes plus prefill chunks; "
                        "--max-num-batched-tokens changes it)", budget)
            args.max_num_batched_tokens = budget
            config = engine_config_from_args(args)
            if config.scheduler.max_num_batched_tokens != budget:   # (a plugin's override chose another)
                return config
            return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                             budget_is_default=True))
    return engine_config_from_args(args)


def _json_list(value: str, flag: str) -> tuple[str, ...]:
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        items = None
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise ServeError(f"{flag} must be a JSON list of strings, e.g. '[\"http://localhost:3000\"]', got {value!r}")
    return tuple(items)


def cors_settings(args: argparse.Namespace) -> Any:
    """The CORS settings the flags ask for (``None``: no ``--allowed-origins``, no CORS)."""
    from plinth.entrypoints.openai.api_server import CorsSettings

    cors_flags = args.allow_credentials or args.allowed_methods is not None or args.allowed_headers is not None
    if args.allowed_origins is None:
        if cors_flags:
            raise ServeError("--allow-credentials, --allowed-methods and --allowed-headers need --allowed-origins")
        return None
    origins = _json_list(args.allowed_origins, "--allowed-origins")
    if args.allow_credentials and "*" in origins:
        raise ServeError("--allow-credentials needs explicit --allowed-origins, not '*'")
    return CorsSettings(origins, args.allow_credentials, _json_list(args.allowed_methods or '["*"]', "--allowed-methods"),
                        _json_list(args.allowed_headers or '["*"]', "--allowed-headers"))


def check_tls_files(keyfile: str, certfile: str) -> None:
    """Load the key and certificate as the server will, before the model loads: a key that does not match the
    certificate, a file that is no PEM, or a key behind a pass phrase is a one-line error naming both files
    (never a prompt for the pass phrase).

    Raises:
        ServeError: naming the files and the problem.
    """
    import ssl

    def no_pass_phrase() -> str:
        raise ServeError(f"--ssl-keyfile {keyfile!r} is encrypted with a pass phrase; give an unencrypted key")

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=no_pass_phrase)
    except (ssl.SSLError, OSError) as exc:
        raise ServeError(f"--ssl-keyfile {keyfile!r} and --ssl-certfile {certfile!r} cannot serve HTTPS: "
                         f"{getattr(exc, 'reason', None) or exc}") from None


def bind_quietly(uv_config: Any) -> Any:
    """uvicorn's ``bind_socket`` without its "Uvicorn running on ..." line: the socket is bound before the model loads
    but listens only once it has (plinth's own "serving ... on" line says when); that line would announce a server that
    refuses connections for as long as the model takes to load, or one whose load then fails."""
    uv_logger = logging.getLogger("uvicorn.error")

    def not_running_yet(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Uvicorn running on")

    uv_logger.addFilter(not_running_yet)
    try:
        return uv_config.bind_socket()
    finally:
        uv_logger.removeFilter(not_running_yet)


def run(args: argparse.Namespace) -> int:
    startup = GcPause(freeze=True)   # no garbage collection while the server imports and loads the model
    previous = _interrupt_the_start()
    try:
        return _serve(args, startup)
    finally:
        startup.end()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: a SIGTERM or SIGINT came before the server ran (set by the start's handler: the KeyboardInterrupt it raises can
#: be swallowed where it lands, in a finalizer run by the collector, so the start checks this too)
_STOP_REQUESTED = threading.Event()


def _interrupt_the_start() -> dict[int, Any]:
    """Until the server runs (it then handles the signals itself: a graceful stop), SIGTERM and SIGINT interrupt
    the start, so what was started (worker processes, the socket) is stopped and the reason is said; the previous
    handlers (none off the main thread, where an embedding program's own handlers stand)."""
    _STOP_REQUESTED.clear()

    def interrupt(signum: int, frame: Any) -> None:
        _STOP_REQUESTED.set()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}


def _stop_if_requested() -> None:
    """Raises KeyboardInterrupt where a stop signal came during the start and its own interrupt was lost."""
    if _STOP_REQUESTED.is_set():
        raise KeyboardInterrupt("a stop signal during the start")


def _serve(args: argparse.Namespace, startup: GcPause) -> int:
    import uvicorn

    from plinth.core.async_engine import AsyncLLMEngine

    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be in 0..65535, got {args.port}")
    if not 0 <= args.shutdown_timeout <= MAX_TIMEOUT_S:   # NaN fails too
        raise ServeError(f"--shutdown-timeout must be between 0 and {MAX_TIMEOUT_S:g} seconds (a week), got "
                         f"{args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():   # e.g. --api-key "$KEY" with KEY unset
        raise ServeError("--api-key is empty: give the key clients must send, or leave the flag out to serve "
                         "without one")
    if args.api_key is None and API_KEY_ENV in os.environ and not os.environ[API_KEY_ENV].strip():
        raise ServeError(f"{API_KEY_ENV} is set but empty: give the key clients must send, or unset it to serve "
                         f"without one")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is not None and (api_key != api_key.strip() or not api_key.isprintable()):
        # (HTTP strips a header value's outer whitespace and cannot carry a newline: every request would be a 401)
        raise ServeError(f"{'--api-key' if args.api_key is not None else API_KEY_ENV} has whitespace at an end or a "
                         "control character (a newline read from a key file?), which no client can send in its "
                         "Authorization header; give the key alone")
    if args.enable_weight_updates and api_key is None:
        logger.warning("--enable-weight-updates without an API key: anyone who reaches this server can load "
                       "checkpoints from its disk into the model (give --api-key or $%s)", API_KEY_ENV)
    if args.enable_sleep_mode and api_key is None:
        logger.warning("--enable-sleep-mode without an API key: anyone who reaches this server can put the engine "
                       "to sleep (POST /sleep) and so stop it serving (give --api-key or $%s)", API_KEY_ENV)
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ServeError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path is not None and not os.path.isfile(path):
            raise ServeError(f"{flag} {path!r} is not a file")
    if args.ssl_certfile is not None:
        check_tls_files(args.ssl_keyfile, args.ssl_certfile)
    cors = cors_settings(args)
    max_request_bytes = request_limit(args.max_request_bytes)
    lora_modules(args)   # a malformed --lora-modules fails before the model loads
    if args.allow_runtime_lora_updating and not args.enable_lora:
        raise ServeError("--allow-runtime-lora-updating needs --enable-lora")
    check_tool_flags(args)
    resolve_reasoning_parser(args.reasoning_parser)
    config = serving_config(args)
    model = config.model.model
    if model is not None and config.model.load_format != "dummy" and not os.path.exists(os.path.expanduser(model)):
        raise ServeError(f"model path {model!r} does not exist")   # before the socket is bound and announced
    uv_config = uvicorn.Config(
        "plinth.entrypoints.openai.api_server:build_app",   # replaced by the app below
        host=args.host, port=args.port, log_level=args.uvicorn_log_level or logging.getLogger().getEffectiveLevel(),
        timeout_graceful_shutdown=args.shutdown_timeout + ABORT_FLUSH_S, access_log=args.access_log,
        root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
    )
    try:
        sock = bind_quietly(uv_config)   # fail on a taken port before the model loads
    except SystemExit as exc:
        raise ServeError(f"cannot listen on {args.host}:{args.port}") from exc
    try:
        front = AsyncLLMEngine.from_config(config)
        try:
            uv_config.app = api_app(front, args, api_key=api_key, cors=cors,
                                    allow_lora_updates=args.allow_runtime_lora_updating,
                                    allow_weight_updates=args.enable_weight_updates,
                                    openapi=not args.disable_fastapi_docs,
                                    max_request_bytes=max_request_bytes,
                                    request_id_headers=args.enable_request_id_headers)
            server = _server_class()(uv_config, args.shutdown_timeout, lambda: front.shutdown(wait=False))
            host, port = sock.getsockname()[:2]
            logger.info("serving %s on %s://%s:%d%s", front.served_model_name,
                        "https" if args.ssl_certfile else "http", f"[{host}]" if ":" in host else host, port,
                        " (API key required on every route but /health, /ping, /version, /metrics)" if api_key else "")
            startup.end()   # the collector back on; what the start-up made is frozen (never garbage)
            _stop_if_requested()
            server.run(sockets=[sock])
        finally:
            front.shutdown(timeout_s=max(args.shutdown_timeout, 1.0))
    finally:
        sock.close()
    return 0
