"""``plinth run-batch``: a file of OpenAI Batch API requests, run offline through the server's routes.

Each input line is one request in OpenAI's batch format::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}

(``url``: ``/v1/chat/completions``, ``/v1/completions``; ``/v1/embeddings`` with ``--task embed``; ``/classify``
with ``--task classify``; ``/v1/score``, ``/v1/rerank`` and ``/pooling`` with either). Each
result is one output line in OpenAI's batch output format, written as soon as its request finishes::

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "chatcmpl-...",
     "body": {...the route's response...}}, "error": null}

A request the route refuses keeps its response (``status_code`` 400 and the error body) and also has ``error``
set; a line that is not a request (not JSON, no ``custom_id``, another method or URL, ``stream: true``) has
``response: null`` and ``error`` (a line without a usable ``custom_id``, or repeating an earlier line's, is
named ``<line N>``). The requests run concurrently through the same handlers as ``plinth serve``
(in this process; no port is opened), so bodies mean exactly what they mean to the server. Rerunning the command
after an interruption skips the requests whose results are final in ``--output`` (answered, with a status below
500); the others (server errors, lines that were not requests) are dropped from it and run again. Each result also
carries a ``fingerprint`` of its request (method, URL, body): a rerun whose line of a ``custom_id`` with a result
asks for another request stops, naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import uuid
from collections.abc import Container
from pathlib import Path
from typing import Any

from plinth.core.request import encodable_text
from plinth.entrypoints.engine_args import add_engine_args, engine_config_from_args
from plinth.entrypoints.generate_cmd import check_output, fingerprint, home_path, output_lock, torn_record
from plinth.entrypoints.serve_cmd import add_api_args, api_app, check_tool_flags, lora_modules
from plinth.errors import CliError

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank", "/classify",
          "/pooling")
#: requests in flight at once by default: enough to fill the engine's batch, not the whole file
DEFAULT_CONCURRENCY = 256


def add_parser(subparsers: Any, name: str, help_text: str) -> None:
    p = subparsers.add_parser(name, help=help_text, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, "run-batch")
    g = p.add_argument_group("batch")
    add_api_args(g)
    g.add_argument("--input", "-i", required=True, help="the requests: OpenAI batch JSONL")
    g.add_argument("--output", "-o", required=True, help="the results: OpenAI batch output JSONL (appended; resumed)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help=f"requests in flight at once (default: the larger of {DEFAULT_CONCURRENCY} and twice the "
                        "engine's max_num_seqs, at most what its waiting queue takes)")
    p.set_defaults(func=run)


#: the custom_id of the result of a line without a usable one (``<line N>``)
_ANONYMOUS = re.compile(r"<line \d+>")


def _invalid(custom_id: Any, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": "invalid_request", "message": message}}


def _final(record: Any) -> bool:
    """Whether a result record is final: its request was answered with a status below 500."""
    response = record.get("response") if isinstance(record, dict) else None
    return isinstance(response, dict) and isinstance(response.get("status_code"), int) and response["status_code"] < 500


def settled_ids(output: Path, inp: Path | None = None) -> dict[str, str | None]:
    """The ``custom_id``s with a final result in ``output`` (see :func:`_final`), each with its request's
    fingerprint (``None`` in records written before plinth kept one). Other records and a last line cut short by an
    interrupted write are dropped from the file (rewritten whole, then renamed over it), so that a rerun writes each
    request's result once.

    Raises:
        CliError: a line that is not a ``plinth run-batch`` record, or (given the input file ``inp``) a final result
            of another request than ``inp``'s line of its ``custom_id`` (the file is left alone).
    """
    if not output.exists():
        return {}
    data = output.read_bytes()
    lines = data.split(b"\n")
    kept: list[bytes] = []
    ids: dict[str, str | None] = {}
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):   # not JSON (a 5,000-digit number, nesting deeper than Python's stack)
            if n == len(lines) and torn_record(raw, b'{"id": "batch_req_'):   # an interrupted write
                continue
            record = None
        if not (isinstance(record, dict) and "custom_id" in record and "response" in record):
            raise CliError(f"{output} line {n} is not a result of plinth run-batch; give another --output "
                           "(an existing results file is resumed, never overwritten)")
        if _final(record) and str(record["custom_id"]) not in ids:
            ids[str(record["custom_id"])] = record.get("fingerprint")
            kept.append(raw.rstrip(b"\r"))
    if inp is not None:
        _check_same_requests(output, ids, inp)
    body = b"".join(line + b"\n" for line in kept)
    if body != data:
        partial = output.with_name(output.name + ".partial")
        partial.write_bytes(body)
        os.replace(partial, output)
    return ids


def _request_fingerprint(item: dict[str, Any]) -> str | None:
    """The fingerprint of a request line: its method, URL and body (``None``: a body too deep to encode)."""
    try:
        return fingerprint({"method": item.get("method", "POST"), "url": item.get("url"), "body": item.get("body")})
    except (ValueError, RecursionError):
        return None


def _check_same_requests(output: Path, done: dict[str, str | None], inp: Path) -> None:
    """Refuse results in ``output`` of other requests than ``inp``'s lines of the same ``custom_id`` (the line changed
    since, or another input file), naming them; a result is never reused for another request, nor overwritten.

    Raises:
        CliError: naming the ``custom_id``s.
    """
    changed, seen = [], set()
    for item, _ in _lines(inp):
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(custom_id, str) or custom_id in seen:   # (a repeated custom_id's line is not its request)
            continue
        seen.add(custom_id)
        if done.get(custom_id) not in (None, _request_fingerprint(item)):
            changed.append(repr(custom_id))
    if changed:
        raise CliError(f"--output {str(output)!r} holds results of other requests for {len(changed)} custom_id(s) of "
                       f"--input {str(inp)!r}: {', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''} (the "
                       "line changed since they were written); give another --output, or delete their lines from it "
                       "to run them again")


def _lines(path: Path) -> Any:
    """``(item, line number)`` for each line of ``path`` that is not blank (``item``: the decoded JSON, or the
    exception that stopped decoding it).

    Raises:
        CliError: the file cannot be read as UTF-8 text.
    """
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read --input {path}: {exc}") from None
    for n, line in enumerate(text.split("\n"), 1):   # not splitlines(): JSON strings may hold U+2028 and the like
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            yield json.loads(line), n
        except (ValueError, RecursionError) as exc:   # JSONDecodeError, a huge integer, nesting too deep to parse
            yield exc, n


def read_requests(path: Path, done: Container[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(requests to run, results for lines that are not requests)``, skipping ``custom_id``s in ``done``.

    Raises:
        CliError: the file cannot be read as UTF-8 text.
    """
    requests, invalid = [], []
    seen: set[str] = set()
    for item, n in _lines(path):
        anonymous = f"<line {n}>"   # the custom_id of the result of a line without a usable one
        if isinstance(item, Exception):
            reason = item.msg if isinstance(item, json.JSONDecodeError) else str(item)
            invalid.append(_invalid(anonymous, f"line {n} is not JSON: {reason}"))
            continue
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(custom_id, str) or not custom_id:
            invalid.append(_invalid(anonymous, f"line {n}: a request is an object with a string custom_id"))
            continue
        if not encodable_text(custom_id):
            invalid.append(_invalid(anonymous, f"line {n}: custom_id is not valid Unicode text (a lone surrogate "
                                               "escape)"))
            continue
        if _ANONYMOUS.fullmatch(custom_id):   # the names of lines without a usable custom_id: kept unique
            invalid.append(_invalid(anonymous, f"line {n}: custom_id {custom_id!r} is reserved for lines without a "
                                               "usable one"))
            continue
        if custom_id in seen:   # its result goes under the line's name: custom_ids stay unique in the results
            invalid.append(_invalid(anonymous, f"line {n}: custom_id {custom_id!r} appears more than once"))
            continue
        seen.add(custom_id)
        if custom_id in done:
            continue
        problem = None
        if item.get("method", "POST") != "POST":
            problem = f"line {n}: method must be POST, got {item.get('method')!r}"
        elif item.get("url") not in ROUTES:
            problem = f"line {n}: url must be one of {', '.join(ROUTES)}, got {item.get('url')!r}"
        elif not isinstance(item.get("body"), dict):
            problem = f"line {n}: body must be a JSON object"
        elif item["body"].get("stream") not in (None, False):   # (the server would stream any true-ish value)
            problem = f"line {n}: stream is not supported in a batch"
        if problem is None:
            try:   # encoded here, once: a body nested too deeply to encode again is this line's error
                item["_payload"] = json.dumps(item["body"]).encode()
                item["_fingerprint"] = _request_fingerprint(item)
            except (ValueError, RecursionError) as exc:
                problem = f"line {n}: the body cannot be encoded as JSON ({type(exc).__name__})"
        if problem is not None:
            invalid.append(_invalid(custom_id, problem))
        else:
            requests.append(item)
    return requests, invalid


async def call_route(app: Any, path: str, body: dict[str, Any] | bytes) -> tuple[int, Any]:
    """POST ``body`` (an object, or its JSON bytes) to the ASGI ``app``'s ``path`` in this process: ``(status,
    decoded JSON body)``."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    delivered = False
    finished = asyncio.Event()
    status, chunks = 500, []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await finished.wait()   # this client never goes away before its response is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    try:
        await app(scope, receive, send)
    except Exception as exc:   # the app answered 500 (or nothing) and re-raised: that request fails, not the batch
        if status < 500:
            status = 500
        if not chunks:
            chunks = [json.dumps({"error": {"message": f"internal error: {type(exc).__name__}",
                                            "type": "server_error"}}).encode()]
    finally:
        finished.set()
    raw = b"".join(chunks)
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:   # not a JSON reply (never final: a rerun tries the request again)
        return max(status, 502), {"error": {"message": f"the route's reply is not JSON: "
                                                       f"{raw.decode('utf-8', 'replace')[:500]}",
                                            "type": "server_error"}}


def result_record(request: dict[str, Any], status: int, body: Any) -> dict[str, Any]:
    """The OpenAI batch output line of one answered request."""
    error = None
    if status != 200:
        info = body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else {}
        error = {"code": info.get("code") or f"http_{status}", "message": info.get("message") or f"HTTP {status}"}
    request_id = body.get("id") if isinstance(body, dict) else None
    if not isinstance(request_id, str):   # an error body has no id; OpenAI's request_id is always a string
        request_id = f"req_{uuid.uuid4().hex}"
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request["custom_id"],
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": error,
            "fingerprint": request.get("_fingerprint")}   # (plinth's: a rerun skips it only for the same request)


def _queue_full(status: int, body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return status == 503 and isinstance(error, dict) and error.get("code") == "queue_full"


async def run_requests(app: Any, requests: list[dict[str, Any]], concurrency: int, write: Any,
                       healthy: Any = lambda: True) -> tuple[int, int]:
    """Run ``requests`` through ``app`` with ``concurrency`` workers, calling ``write(record)`` as each finishes
    (a full waiting queue is waited out); ``(failed, not run)``. Once ``healthy()`` is false (the engine died)
    nothing more is sent and unanswered requests get no record, so a rerun runs them."""
    from tqdm.auto import tqdm

    failed = 0
    pending = iter(requests)
    answered = 0

    async def worker(bar: Any) -> None:
        nonlocal failed, answered
        for request in pending:
            if not healthy():
                return
            delay = 0.01
            while True:
                try:
                    status, body = await call_route(app, request["url"], request.get("_payload", request["body"]))
                except Exception as exc:  # noqa: BLE001 - one request's failure must not cancel the others
                    status, body = 500, {"error": {"message": f"internal error: {type(exc).__name__}",
                                                   "type": "server_error"}}
                if not _queue_full(status, body):
                    break
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
            if status >= 500 and not healthy():
                return   # the engine is gone: no record, the rerun runs it
            record = result_record(request, status, body)
            failed += record["error"] is not None
            answered += 1
            write(record)
            bar.update(1)

    with tqdm(total=len(requests), unit="req", disable=None, file=sys.stderr) as bar:
        await asyncio.gather(*(worker(bar) for _ in range(min(concurrency, max(len(requests), 1)))))
    return failed, len(requests) - answered


def run(args: argparse.Namespace) -> int:
    inp, out = home_path(args.input), home_path(args.output)
    if not inp.is_file():
        raise CliError(f"--input {args.input!r} is not a file")
    check_output(inp, out)
    if args.enable_sleep_mode:
        raise CliError("plinth run-batch has no use for --enable-sleep-mode: nothing puts its engine to sleep")
    if args.enable_lora and not args.lora_modules:
        raise CliError("--enable-lora serves the adapters of --lora-modules NAME=PATH, which a request's 'model' "
                       "names; give them (plinth run-batch loads no adapters while it runs)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise CliError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    config = engine_config_from_args(args)
    from plinth.entrypoints.openai.reasoning_parsers import resolve_reasoning_parser

    check_tool_flags(args)   # an unknown parser fails before the model loads
    resolve_reasoning_parser(args.reasoning_parser)
    lora_modules(args)   # and so does a malformed --lora-modules
    with output_lock(out):
        return _run(args, config, inp, out)


def _run(args: argparse.Namespace, config: Any, inp: Path, out: Path) -> int:
    done = settled_ids(out, inp)
    requests, invalid = read_requests(inp, done)
    print(f"{len(requests)} requests to run, {len(done)} already done, {len(invalid)} invalid", file=sys.stderr)

    from plinth.core.async_engine import AsyncLLMEngine

    front = AsyncLLMEngine.from_config(config)
    try:
        scheduler = front.config.scheduler if front.config is not None else config.scheduler
        # enough to keep the engine's batch full, never more than its waiting queue takes
        concurrency = args.max_concurrency or max(DEFAULT_CONCURRENCY, 2 * (scheduler.max_num_seqs or 0))
        if scheduler.max_waiting_requests is not None:
            concurrency = min(concurrency, (scheduler.max_num_seqs or 1) + scheduler.max_waiting_requests)
        app = api_app(front, args)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", encoding="utf-8") as f:
            def write(record: dict[str, Any]) -> None:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()

            for record in invalid:
                write(record)
            failed, not_run = asyncio.run(run_requests(app, requests, concurrency, write,
                                                       lambda: front.is_healthy))
            os.fsync(f.fileno())
    finally:
        front.shutdown()
    if not_run:
        print(f"the engine stopped: {not_run} requests were not run; rerun the command to run them "
              f"({front.dead_error})", file=sys.stderr)
        return 1
    print(f"{len(requests) - failed} succeeded, {failed + len(invalid)} failed; results in {out}", file=sys.stderr)
    return 0
