"""``plinth generate``: one prompt from the command line, or a whole file of prompts.

File mode reads JSONL, CSV or Parquet rows and writes one JSON line per finished row to
``--output``, as soon as each row finishes. Rerunning the same command after an interruption
skips the rows already in the output file: nothing is lost and nothing is done twice. A result is matched to its
row by id and by a fingerprint of the request (prompt and sampling parameters): a row changed since its result was
written stops the run, naming it.

A row has an ``id`` (default: its 1-based row number), one of ``prompt`` (text),
``messages`` (a chat conversation, list of {role, content}) or ``prompt_token_ids``, and
optionally any sampling parameter (``temperature``, ``max_tokens``, ``stop``, ``seed``, ...)
overriding the command-line defaults for that row.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import hashlib
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plinth.core.request import SamplingParams, SamplingParamsError, encodable_text, json_logprob
from plinth.entrypoints.engine_args import add_engine_args, engine_config_from_args
from plinth.errors import CliError, RequestFailedError

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
#: the fields a row gives its prompt in (exactly one of them)
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


class RowError(ValueError):
    def __init__(self, line: int, message: str):
        super().__init__(f"row {line}: {message}")
        self.line = line


def add_parser(subparsers: Any, name: str, help_text: str) -> None:
    p = subparsers.add_parser(name, help=help_text, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, "generate")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    g.add_argument("--chat", action="store_true", help="format --prompt with the chat template")
    g.add_argument("--input", default=None, help="prompts file: .jsonl, .csv or .parquet")
    g.add_argument("--output", default=None, help="results file (.jsonl); required with --input")
    g.add_argument("--bad-rows", choices=["fail", "skip"], default=None,
                   help="a malformed row stops the run (fail, the default) or is reported with its line and "
                        "skipped; rows written before a failure stay in the output, and a rerun resumes")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens at most per prompt (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence tokens up to --max-tokens")
    p.set_defaults(func=run)


def read_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """Yield (line number, row or RowError) from a JSONL, CSV or Parquet file. CSV and Parquet rows carry
    ``_cells: True`` (their text cells may hold JSON lists and numbers to decode, see :func:`parse_row`).

    Raises:
        ValueError: an unsupported suffix, or a CSV/Parquet file that cannot be read (naming the file).
    """
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        with path.open("rb") as f:
            for i, raw in enumerate(f, 1):
                if i == 1 and raw.startswith(b"\xef\xbb\xbf"):   # a UTF-8 byte order mark
                    raw = raw[3:]
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield i, RowError(i, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at position {exc.start})")
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield i, RowError(i, f"invalid JSON: {exc.msg} at column {exc.pos + 1}")
                    continue
                except (ValueError, RecursionError) as exc:   # an integer of too many digits, nesting too deep
                    yield i, RowError(i, f"invalid JSON: {_json_problem(exc)}")
                    continue
                yield i, row if isinstance(row, dict) else RowError(i, "expected a JSON object")
    elif suffix == ".csv":   # the csv module: a record's line is where it starts, quoted line breaks included
        _lift_csv_field_limit()
        try:
            with path.open(encoding="utf-8-sig", newline="") as f:
                reader = csv.reader(f)
                header = next(reader, None)
                while header == []:   # blank lines before the header
                    header = next(reader, None)
                if header is None:
                    return
                while True:
                    start = reader.line_num + 1   # where the next record starts (blank lines are empty records)
                    rec = next(reader, None)
                    if rec is None:
                        break
                    if not rec:
                        continue
                    if len(rec) > len(header):
                        yield start, RowError(start, "more cells than the header has columns")
                    else:
                        cells = dict(zip(header, rec, strict=False))   # missing trailing cells: absent
                        yield start, {**{k: v for k, v in cells.items() if not _is_missing(v)}, "_cells": True}
        except (UnicodeDecodeError, csv.Error) as exc:
            raise ValueError(f"cannot read {path} as CSV: {exc}") from None
    elif suffix == ".parquet":
        try:
            import pandas as pd
        except ImportError:
            raise ValueError("reading Parquet files needs pandas and pyarrow (pip install pandas pyarrow)") from None
        try:
            frame = pd.read_parquet(path)
        except (ValueError, OSError, ImportError) as exc:
            raise ValueError(f"cannot read {path} as Parquet: {exc}") from None
        for i, rec in enumerate(frame.to_dict(orient="records")):
            yield i + 1, {**{k: _plain(v) for k, v in rec.items() if not _is_missing(v)}, "_cells": True}
    else:
        raise ValueError(f"unsupported input file type {suffix!r}: use .jsonl, .csv or .parquet")


def _lift_csv_field_limit() -> None:
    """Let the csv module read cells of any length (its default limit is 131,072 characters: a long prompt)."""
    limit = sys.maxsize
    while True:
        try:
            csv.field_size_limit(limit)
            return
        except OverflowError:   # larger than a C long here
            limit //= 2


def _json_problem(exc: BaseException) -> str:
    """What made a JSON text unreadable beyond a syntax error, in one line."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split(";")[0]


def _plain(value: Any) -> Any:
    """A Parquet cell as the JSON form of the same row would give it: nested arrays as lists, numpy scalars as
    Python numbers, and the keys of a struct that this row does not use (pyarrow fills every key any row used,
    with null) left out."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v == "") or (isinstance(v, float) and math.isnan(v))


#: waiting requests a file run keeps queued when --max-waiting-requests is not given
FILE_QUEUE = 512

INT_FIELDS = {f.name for f in dataclasses.fields(SamplingParams) if f.type in ("int", "int | None")}
REAL_FIELDS = {f.name for f in dataclasses.fields(SamplingParams) if f.type == "float"}


def _coerce(name: str, value: Any, default: Any, cells: bool) -> Any:
    """A row's value for sampling field ``name``. CSV and Parquet text cells (``cells``) are decoded to
    the field's type (JSON for lists and mappings); Parquet numbers come as numpy scalars, and a null in
    an integer column turns it into floats, so integral floats become ints for integer fields."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and name in INT_FIELDS and value.is_integer():
        return int(value)
    if not (cells and isinstance(value, str)):
        return value
    if name in ("stop_token_ids", "allowed_token_ids"):
        return json.loads(value) if value.startswith("[") else [int(value)]
    if name in ("stop", "bad_words"):   # a JSON list of strings, else the cell is one string ("[/INST]" included)
        if value.startswith('["'):   # meant as a JSON list: it must be one
            decoded = json.loads(value)
            if not (isinstance(decoded, list) and all(isinstance(x, str) for x in decoded)):
                raise ValueError(f"expected a JSON list of strings, got {value!r}")
            return decoded
        return [value]
    if name in ("logit_bias", "structured_outputs", "extra_args"):
        return json.loads(value) if value.strip() else None
    if isinstance(default, bool):
        flag = value.strip().lower()
        if flag not in ("1", "true", "yes", "0", "false", "no"):
            raise ValueError(f"expected true or false, got {value!r}")
        return flag in ("1", "true", "yes")
    if name in INT_FIELDS:
        return int(value)
    if isinstance(default, float):
        return float(value)
    return value


def _chat_messages(line: int, value: Any) -> list[dict[str, Any]]:
    """A row's ``messages``, checked as the server reads a request's (:func:`plain_messages`; image parts are taken
    here and read when the row runs, where the model takes images: :func:`chat_prompt`)."""
    from plinth.entrypoints.openai.tools import plain_messages
    from plinth.multimodal.images import ImageParts

    if not (isinstance(value, list) and value and all(isinstance(m, dict) for m in value)):
        raise RowError(line, "'messages' must be a non-empty list of {role, content} objects")
    try:
        plain_messages(value, ImageParts("<image>", load=False, video_placeholder="<video>"))
    except ValueError as exc:
        raise RowError(line, str(exc)) from None
    return value


def chat_prompt(engine: Any, messages: list[dict[str, Any]]) -> tuple[list[int], dict[str, Any] | None]:
    """A chat row's prompt ids and its images' ``multi_modal_data`` (``None``: none), its image parts read as the
    server reads them (data URLs; ``file://`` and ``http(s)://`` where ``--allowed-local-media-path`` and
    ``--allowed-media-domains`` allow).

    Raises:
        ValueError: image parts for a model without image inputs, or an image that cannot be read.
    """
    from plinth.entrypoints.openai.tools import plain_messages

    support = engine.images
    parts = support.parts() if support is not None else None
    ids = engine.tokenize(engine.render_chat(plain_messages(messages, parts)), add_special_tokens=False)
    return ids, (parts.multi_modal_data() if parts is not None else None)


def parse_row(line: int, row: dict[str, Any], base: SamplingParams) -> tuple[str, Any, SamplingParams, bool]:
    """Validate one row: (id, prompt, sampling params, is_chat)."""
    cells = bool(row.pop("_cells", False))
    rid = row.get("id")
    if rid is None:   # absent, null or an empty cell: the row number
        rid = line
    elif cells and isinstance(rid, float) and rid.is_integer():   # a Parquet integer column with a null in it
        rid = int(rid)
    if not isinstance(rid, str | int) or isinstance(rid, bool):
        raise RowError(line, f"'id' must be a string or an integer, got {rid!r}")
    rid = str(rid)
    if not encodable_text(rid):
        raise RowError(line, f"'id' is not valid Unicode text (a lone surrogate escape): {rid!r}")
    sources = [k for k in PROMPT_FIELDS if row.get(k) is not None]   # a null one is absent, as an empty cell
    if len(sources) != 1:
        raise RowError(line, "needs exactly one of 'prompt', 'messages', 'prompt_token_ids'")
    key = sources[0]
    value = row[key]
    if cells and isinstance(value, str) and key != "prompt":
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(line, f"{key!r} is not valid JSON: {exc.msg}") from None
        except (ValueError, RecursionError) as exc:
            raise RowError(line, f"{key!r} is not valid JSON: {_json_problem(exc)}") from None
    if hasattr(value, "tolist"):
        value = value.tolist()
    if key == "prompt" and (not isinstance(value, str) or not value):
        raise RowError(line, "'prompt' must be a non-empty string")
    if key == "messages":
        value = _chat_messages(line, value)
    if key == "prompt_token_ids" and not (isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise RowError(line, "'prompt_token_ids' must be a non-empty list of integers")
    unknown = set(row) - SAMPLING_FIELDS - {"id", *PROMPT_FIELDS}
    if unknown:
        raise RowError(line, f"unknown field(s) {', '.join(sorted(unknown))}")
    overrides = {}
    for k in sorted(SAMPLING_FIELDS & {f for f, v in row.items() if v is not None}):   # null: the default
        try:
            overrides[k] = _coerce(k, row[k], getattr(base, k), cells)
        except (ValueError, TypeError, RecursionError) as exc:
            raise RowError(line, f"{k}: {_json_problem(exc) if isinstance(exc, RecursionError) else exc}") from None
    try:
        params = base.clone(**overrides)
    except (SamplingParamsError, ValueError, TypeError, RecursionError) as exc:   # (extra_args nested very deeply)
        raise RowError(line, _json_problem(exc) if isinstance(exc, RecursionError) else str(exc)) from None
    return rid, value, params, key == "messages"


def fingerprint(payload: Any) -> str:
    """A short hash of a request's JSON form (keys sorted), written with its result so that a rerun knows whether the
    result is of the same request (see :func:`row_fingerprint`)."""
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


_PLAIN_PARAMS = SamplingParams()


def row_fingerprint(prompt: Any, params: SamplingParams, is_chat: bool) -> str:
    """The fingerprint of a row's request: its prompt (text, messages or token ids) and every sampling parameter
    that differs from ``SamplingParams()``'s (command-line defaults included), so that the same request gives the
    same fingerprint from a JSONL, CSV or Parquet row."""
    kind = "messages" if is_chat else "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    changed = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
               if getattr(params, f.name) != getattr(_PLAIN_PARAMS, f.name)}
    for name in REAL_FIELDS & set(changed):   # a JSON 2 is a CSV cell's or a flag's 2.0 (and -0.0 is 0.0)
        changed[name] = float(changed[name]) + 0.0
    return fingerprint({kind: prompt, "params": changed})


def add_when_room(engine: Any, request_id: str, prompt: Any, params: SamplingParams, step: Any,
                  multi_modal_data: dict[str, Any] | None = None) -> None:
    """``engine.add_request``, calling ``step()`` (which steps the engine) while its waiting queue is full
    (``--max-waiting-requests``).

    Raises:
        QueueFullError: the queue is full with nothing running, so it can never take the request.
    """
    from plinth.core.scheduler import QueueFullError

    while True:
        try:
            if multi_modal_data is None:
                engine.add_request(request_id, prompt, params)
            else:
                engine.add_request(request_id, prompt, params, multi_modal_data=multi_modal_data)
            return
        except QueueFullError:
            if not engine.has_unfinished_requests():
                raise
            step()


def torn_record(raw: bytes, start: bytes) -> bool:
    """Whether ``raw`` (a file's last line, without its newline) can be a record cut short: it begins like one.
    Anything else (a user's notes, say) is not a results file, and is not touched."""
    return raw.startswith(start) or start.startswith(raw)


def done_ids(output: Path) -> dict[str, str | None]:
    """Ids already in ``output`` (a results file of an earlier run), each with its request's fingerprint (``None``
    in records written before plinth kept one). A last line cut short by an interrupted write is removed; any other
    line that is not a result record stops the run before anything is changed.

    Raises:
        CliError: the file holds lines that are not ``plinth generate`` records.
    """
    if not output.exists():
        return {}
    data = output.read_bytes()
    lines = data.split(b"\n")
    ids: dict[str, str | None] = {}
    torn = False
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            ok = isinstance(rec, dict) and "id" in rec and "outputs" in rec
        except (json.JSONDecodeError, UnicodeDecodeError):
            if n == len(lines) and torn_record(raw, b'{"id": '):   # an interrupted write: run it again
                with output.open("r+b") as f:
                    f.truncate(len(data) - len(raw))
                torn = True
                break
            ok = False
        except (ValueError, RecursionError):   # JSON no record holds: a 5,000-digit number, nesting too deep
            ok = False
        if not ok:
            raise CliError(f"{output} line {n} is not a result of plinth generate; give another --output "
                           "(an existing results file is resumed, never overwritten)")
        ids[str(rec["id"])] = rec.get("fingerprint")
    if not torn and lines[-1].strip():   # a complete last record without its newline
        with output.open("ab") as f:
            f.write(b"\n")
    return ids


def _check_unused_flags(args: argparse.Namespace) -> None:
    """Refuse the engine flags this command takes (they are every command's) but has no use for, before the model
    loads: they would change nothing."""
    from plinth.config import LoRAConfig

    lora = LoRAConfig()
    unused = (
        ("--enable-lora", args.enable_lora,
         "a row cannot name an adapter (`plinth run-batch --lora-modules NAME=PATH` runs requests naming one, as "
         "LLM.generate(..., lora_request=) does)"),
        ("--max-loras, --max-lora-rank or --max-cpu-loras",
         (args.max_loras, args.max_lora_rank, args.max_cpu_loras) != (lora.max_loras, lora.max_lora_rank,
                                                                       lora.max_cpu_loras),
         "they size LoRA adapters, which its rows cannot name"),
        ("--scheduling-policy priority", args.scheduling_policy == "priority",
         "its rows carry no priority, so every one would rank the same (`plinth run-batch` takes a body's "
         "priority, LLM.generate(..., priority=) a list)"),
        ("--enable-prompt-embeds", args.enable_prompt_embeds,
         "its rows cannot give prompt embeddings (`plinth run-batch` takes /v1/completions' prompt_embeds)"),
        ("--enable-sleep-mode", args.enable_sleep_mode, "nothing puts its engine to sleep"),
        ("--served-model-name", args.served_model_name is not None, "its results name no model"),
        ("--override-generation-config", args.override_generation_config is not None,
         "its defaults are its own flags (--max-tokens, --temperature, --top-p, --top-k) and a row's values "
         "override them"),
    )
    for flag, given, why in unused:
        if given:
            raise CliError(f"plinth generate has no use for {flag}: {why}")


def home_path(value: str) -> Path:
    """A path flag's value with a leading ``~`` or ``~user`` expanded where it names a home folder (``~notes.jsonl``,
    naming no user, is that file: ``Path.expanduser`` raises ``RuntimeError`` for it)."""
    return Path(os.path.expanduser(value))


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse option combinations that would be ignored and paths that cannot work, before the model loads."""
    if args.input is None and not args.prompt:
        raise CliError("give --prompt TEXT or --input FILE")
    if args.input is not None and args.prompt:
        raise CliError("give either --prompt or --input, not both")
    if args.input is None:
        for flag, given in (("--output", args.output is not None), ("--bad-rows", args.bad_rows is not None)):
            if given:
                raise CliError(f"{flag} applies to --input files; --prompt prints its results")
        return
    if args.chat:
        raise CliError("--chat formats --prompt; in an --input file give the conversation as 'messages'")
    if args.output is None:
        raise CliError("--input needs --output FILE.jsonl")
    inp, out = home_path(args.input), home_path(args.output)
    if not inp.exists():
        raise CliError(f"input file {args.input!r} does not exist")
    if not inp.is_file():
        raise CliError(f"input {args.input!r} is not a file")
    check_output(inp, out)


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock for a run writing ``out``, so that a second run on the same results file stops at once
    instead of adding the same rows again. The lock is a hidden file beside it (``.<name>.lock``, kept: the results
    file itself may be replaced while the run holds the lock, when a torn or retried record is cleaned up).

    Raises:
        CliError: another run holds it.
    """
    try:
        import fcntl
    except ImportError:   # no advisory locks here (Windows): runs are not guarded against each other
        yield
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.with_name(f".{out.name}.lock").open("a", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CliError(f"--output {str(out)!r} is being written by another run; wait for it to end (a rerun "
                           "then goes on from its results)") from None
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def check_output(inp: Path, out: Path) -> None:
    """Refuse an ``--output`` that is the input, not a file, or in no writable directory (its missing
    folders are made when it is written).

    Raises:
        CliError: naming the problem.
    """
    if out.exists() and (not out.is_file() or os.path.samefile(inp, out)):
        raise CliError(f"--output {str(out)!r} " + ("is the input file" if out.is_file() else "is not a file"))
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise CliError(f"cannot write --output {str(out)!r} ({parent} is not a writable directory)")


def run(args: argparse.Namespace) -> int:
    if args.task != "generate":   # before the model loads
        raise CliError(f"plinth generate generates text; a model run with --task {args.task} is served by "
                       f"`plinth serve --task {args.task}`, `plinth run-batch --task {args.task}` or "
                       f"LLM(model, task={args.task!r}) from Python")
    base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    _check_unused_flags(args)
    _check_paths(args)
    from plinth.core.engine import LLMEngine

    if args.input is None:
        return _run_prompts(LLMEngine(engine_config_from_args(args)), args, base)
    inp, output, bad_rows = home_path(args.input), home_path(args.output), args.bad_rows or "fail"
    with output_lock(output):
        skip = done_ids(output)
        # the most sequences an idle engine takes at once (known before it loads when both flags are given)
        room = (args.max_waiting_requests + args.max_num_seqs
                if args.max_waiting_requests is not None and args.max_num_seqs is not None else None)
        checked = _checked_rows(inp, base, skip, bad_rows, room)
        if checked is None:
            return 2
        rows, bad, changed = checked
        if changed:   # never reused as the new request's result, never overwritten
            raise CliError(f"--output {args.output!r} holds results of other requests for {len(changed)} row(s) of "
                           f"{args.input!r}: {', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''} (the row "
                           "or the sampling flags changed since they were written); give another --output, or delete "
                           "those ids' lines from it to run them again")
        if args.max_waiting_requests is None:   # rows are tokenized and queued as they are needed
            args.max_waiting_requests = max([FILE_QUEUE, args.max_num_seqs or 0] + [r[3].n for r in rows])
        print(f"{len(rows)} rows to run, {len(skip)} already done, {bad} skipped", file=sys.stderr)
        if not rows:   # nothing to do: the model is not loaded
            return 0
        return _run_file(LLMEngine(engine_config_from_args(args)), inp, output, rows, bad_rows)


def _run_prompts(engine: Any, args: argparse.Namespace, base: SamplingParams) -> int:
    import jinja2

    prompts: list[Any] = list(args.prompt)
    if args.chat:
        try:
            prompts = [engine.tokenize(engine.render_chat([{"role": "user", "content": text}]),
                                       add_special_tokens=False) for text in prompts]
        except (jinja2.TemplateError, ValueError) as exc:
            raise CliError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
    outs: dict[str, Any] = {}

    def step() -> None:
        for out in engine.step(final_only=True):
            if out.finished:
                outs[out.request_id] = out

    for i, prompt in enumerate(prompts):
        add_when_room(engine, f"cli-{i}", prompt, base, step)
    while engine.has_unfinished_requests():
        step()
    several = len(args.prompt) > 1
    errors = 0
    for i in range(len(args.prompt)):
        if several:
            print(f"=== prompt {i + 1} ===")
        out = outs[f"cli-{i}"]
        if out.error:   # ended by an error of its own (a custom logits processor's)
            print(f"plinth generate: error: prompt {i + 1}: {out.error}", file=sys.stderr)
            errors += 1
            continue
        print(out.outputs[0].text)
    return 1 if errors else 0


def _logprobs(positions: Any) -> Any:
    """Per position, the chosen token's and the top tokens' logprobs as ``[{token_id, logprob, rank}]``."""
    if positions is None:
        return None
    return [None if pos is None else [{"token_id": t, "logprob": json_logprob(lp.logprob), "rank": lp.rank}
                                   for t, lp in pos.items()]
            for pos in positions]


def _record(out: Any, line: int | None, rid: str, digest: str) -> dict[str, Any]:
    outputs = []
    for c in out.outputs:
        item: dict[str, Any] = {"text": c.text, "token_ids": c.token_ids, "finish_reason": str(c.finish_reason),
                                "stop_reason": c.stop_reason}   # the stop string or token id; null for EOS or length
        if c.logprobs is not None:
            item["logprobs"] = _logprobs(c.logprobs)
            item["cumulative_logprob"] = c.cumulative_logprob
        outputs.append(item)
    rec: dict[str, Any] = {"id": rid, "line": line, "outputs": outputs, "text": out.outputs[0].text,
                           "prompt_tokens": len(out.prompt_token_ids),
                           "completion_tokens": sum(len(c.token_ids) for c in out.outputs), "fingerprint": digest}
    if out.prompt_logprobs is not None:
        rec["prompt_logprobs"] = _logprobs(out.prompt_logprobs)
    return rec


def _report(inp: Path, bad_rows: str, msg: str) -> bool:
    """Report a bad row; whether the run goes on."""
    if bad_rows == "fail":
        print(f"plinth generate: error: {inp}: {msg}", file=sys.stderr)
        return False
    print(f"plinth generate: skipping {inp}: {msg}", file=sys.stderr)
    return True


Row = tuple[int, str, Any, SamplingParams, bool, str]   # line, id, prompt, params, is_chat, fingerprint


def _checked_rows(inp: Path, base: SamplingParams, skip: dict[str, str | None], bad_rows: str,
                  queue: int | None) -> tuple[list[Row], int, list[str]] | None:
    """Every row of ``inp`` validated before the model loads: the rows to run (those not in ``skip``), the number
    skipped as bad, and the rows done in ``skip`` for another request (``id 'x' (row N)``: the row, or the
    command-line defaults, changed since); ``None`` when a bad row stops the run (``fail``)."""
    rows: list[Row] = []
    bad = 0
    seen: set[str] = set()
    changed: list[str] = []
    for line, row in read_rows(inp):
        try:
            if isinstance(row, RowError):
                raise row
            rid, prompt, params, is_chat = parse_row(line, row, base)
            if rid in seen:
                raise RowError(line, f"duplicate id {rid!r}")
            if queue is not None and params.n > queue:
                raise RowError(line, f"n is {params.n}, more than --max-num-seqs plus --max-waiting-requests ({queue})")
            try:
                digest = row_fingerprint(prompt, params, is_chat)
            except RecursionError:   # a value nested about as deeply as the JSON reader allows
                raise RowError(line, "a value is nested too deeply") from None
            seen.add(rid)
        except RowError as exc:
            bad += 1
            if not _report(inp, bad_rows, str(exc)):
                return None
            continue
        if rid not in skip:
            rows.append((line, rid, prompt, params, is_chat, digest))
        elif skip[rid] not in (None, digest):   # (None: a record of a plinth that kept no fingerprint)
            changed.append(f"id {rid!r} (row {line})")
    return rows, bad, changed


def _run_file(engine: Any, inp: Path, output: Path, rows: list[Row], bad_rows: str) -> int:
    """Queue the checked rows as the engine's waiting queue has room, writing each result as it finishes
    (a row the engine refuses, e.g. a chat template that fails on its messages, is a bad row too)."""
    import jinja2
    from tqdm.auto import tqdm

    from plinth.core.scheduler import QueueFullError, RequestRejectedError

    output.parent.mkdir(parents=True, exist_ok=True)
    submitted: dict[str, tuple[int, str, str]] = {}   # engine request id ("row-LINE") -> (line, id, fingerprint)
    failed: list[str] = []   # rows the engine ended with an error (a custom logits processor's): not written
    with output.open("a", encoding="utf-8") as f, tqdm(total=len(rows), unit="row", disable=None) as bar:
        def step() -> None:
            for out in engine.step(final_only=True):
                if out.finished:
                    line, rid, digest = submitted.pop(out.request_id)
                    bar.update(1)
                    if out.error:   # not done: a later run retries it
                        failed.append(f"row {line}: {out.error}")
                        continue
                    f.write(json.dumps(_record(out, line, rid, digest), ensure_ascii=False) + "\n")
                    f.flush()
                    os.fsync(f.fileno())

        def stop() -> bool:
            """Report the rows that failed; whether one of them stops the run (``--bad-rows fail``)."""
            while failed:
                if not _report(inp, bad_rows, failed.pop(0)):
                    engine.abort_request(list(submitted))
                    while engine.has_unfinished_requests():
                        engine.step(final_only=True)
                    return True
            return False

        for line, rid, prompt, params, is_chat, digest in rows:
            try:
                images = None
                if is_chat:
                    prompt, images = chat_prompt(engine, prompt)
                try:
                    add_when_room(engine, f"row-{line}", prompt, params, step, images)   # a row's id may be anything
                except QueueFullError:   # nothing to wait for: it can never fit
                    raise RequestRejectedError("the row's sequences do not fit in the waiting queue "
                                               "(--max-waiting-requests)") from None
            except (RequestRejectedError, RequestFailedError, ValueError, TypeError, jinja2.TemplateError) as exc:
                bar.update(1)
                failed.append(f"row {line}: {exc}")
                if stop():
                    return 2
                continue
            submitted[f"row-{line}"] = (line, rid, digest)
            if stop():
                return 2
        while engine.has_unfinished_requests():
            step()
            if stop():
                return 2
    return 0
