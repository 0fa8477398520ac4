"""``plinth generate``: one prompt from the command line, or a whole file of prompts.

File mode reads JSONL, CSV or Parquet rows and writes one JSON line per finished row to
``--output``, as soon as each row finishes. Rerunning the same command after an interruption
skips the rows already in the output file: nothing is lost and nothing is done twice.

A row has an ``id`` (default: its 1-based row number), one of ``prompt`` (text),
``messages`` (a chat conversation, list of {role, content}) or ``prompt_token_ids``, and
optionally any sampling parameter (``temperature``, ``max_tokens``, ``stop``, ``seed``, ...)
overriding the command-line defaults for that row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plinth.core.request import SamplingParams, SamplingParamsError
from plinth.entrypoints.engine_args import add_engine_args, engine_config_from_args

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


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
    g.add_argument("--bad-rows", choices=["fail", "skip"], default="fail",
                   help="a malformed row stops the run (fail) or is reported with its line and skipped")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(func=run)


def read_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """Yield (line number, row or RowError) from a JSONL, CSV or Parquet file."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield i, RowError(i, f"invalid JSON: {exc.msg} at column {exc.colno}")
                    continue
                yield i, row if isinstance(row, dict) else RowError(i, "expected a JSON object")
    elif suffix in (".csv", ".parquet"):
        import pandas as pd

        frame = pd.read_csv(path, dtype=str, keep_default_na=False) if suffix == ".csv" else pd.read_parquet(path)
        first = 2 if suffix == ".csv" else 1  # CSV line numbers count the header
        for i, rec in enumerate(frame.to_dict(orient="records")):
            yield i + first, {k: v for k, v in rec.items() if not _is_missing(v)}
    else:
        raise ValueError(f"unsupported input file type {suffix!r}: use .jsonl, .csv or .parquet")


def _is_missing(v: Any) -> bool:
    return v is None or v == "" or (isinstance(v, float) and math.isnan(v))


def _coerce(name: str, value: Any, default: Any) -> Any:
    """CSV cells arrive as strings: convert them to the type of the field's default."""
    if not isinstance(value, str):
        return value.tolist() if hasattr(value, "tolist") else value
    if name in ("stop", "stop_token_ids"):
        return json.loads(value) if value.startswith("[") else [int(value)] if name == "stop_token_ids" else [value]
    if name == "logit_bias":
        return json.loads(value) if value.strip() else None
    if isinstance(default, bool):
        return value.strip().lower() in ("1", "true", "yes")
    if isinstance(default, int) or name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return value


def parse_row(line: int, row: dict[str, Any], base: SamplingParams) -> tuple[str, Any, SamplingParams, bool]:
    """Validate one row: (id, prompt, sampling params, is_chat)."""
    rid = str(row.get("id", line))
    sources = [k for k in ("prompt", "messages", "prompt_token_ids") if k in row]
    if len(sources) != 1:
        raise RowError(line, "needs exactly one of 'prompt', 'messages', 'prompt_token_ids'")
    key = sources[0]
    value = row[key]
    if isinstance(value, str) and key != "prompt":
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(line, f"{key!r} is not valid JSON: {exc.msg}") from None
    if hasattr(value, "tolist"):
        value = value.tolist()
    if key == "prompt" and (not isinstance(value, str) or not value):
        raise RowError(line, "'prompt' must be a non-empty string")
    if key == "messages" and not (isinstance(value, list) and value and all(isinstance(m, dict) for m in value)):
        raise RowError(line, "'messages' must be a non-empty list of {role, content} objects")
    if key == "prompt_token_ids" and not (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
        raise RowError(line, "'prompt_token_ids' must be a non-empty list of integers")
    unknown = set(row) - SAMPLING_FIELDS - {"id", key}
    if unknown:
        raise RowError(line, f"unknown field(s) {', '.join(sorted(unknown))}")
    overrides = {}
    try:
        for k in SAMPLING_FIELDS & set(row):
            overrides[k] = _coerce(k, row[k], getattr(base, k))
        params = base.clone(**overrides)
    except (SamplingParamsError, ValueError, TypeError) as exc:
        raise RowError(line, str(exc)) from None
    return rid, value, params, key == "messages"


def done_ids(output: Path) -> set[str]:
    """Ids already in the output; a torn last line (interrupted write) is cut off."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with output.open("r+b") as f:
            f.truncate(keep)
    ids = set()
    for line in data[:keep].splitlines():
        if line.strip():
            ids.add(str(json.loads(line)["id"]))
    return ids


def run(args: argparse.Namespace) -> int:
    from plinth.errors import CliError

    base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    if args.input is None and not args.prompt:
        raise CliError("give --prompt TEXT or --input FILE")
    if args.input is not None and args.output is None:
        raise CliError("--input needs --output FILE.jsonl")
    if args.input is not None and not Path(args.input).exists():
        raise CliError(f"input file {args.input!r} does not exist")
    config = engine_config_from_args(args)
    from plinth.core.engine import LLMEngine

    engine = LLMEngine(config)
    if args.input is None:
        return _run_prompts(engine, args, base)
    return _run_file(engine, Path(args.input), Path(args.output), base, args.bad_rows)


def _run_prompts(engine: Any, args: argparse.Namespace, base: SamplingParams) -> int:
    for i, text in enumerate(args.prompt):
        prompt = (engine.tokenize(engine.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)
                  if args.chat else text)
        engine.add_request(f"cli-{i}", prompt, base)
    outs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step(final_only=True):
            if out.finished:
                outs[out.request_id] = out
    for i in range(len(args.prompt)):
        print(outs[f"cli-{i}"].outputs[0].text)
    return 0


def _run_file(engine: Any, inp: Path, output: Path, base: SamplingParams, bad_rows: str) -> int:
    from tqdm.auto import tqdm

    skip = done_ids(output)
    submitted: dict[str, int] = {}
    bad = 0
    seen: set[str] = set()
    for line, row in read_rows(inp):
        try:
            if isinstance(row, RowError):
                raise row
            rid, prompt, params, is_chat = parse_row(line, row, base)
            if rid in seen:
                raise RowError(line, f"duplicate id {rid!r}")
            seen.add(rid)
            if rid in skip:
                continue
            if is_chat:
                prompt = engine.tokenize(engine.render_chat(prompt), add_special_tokens=False)
            engine.add_request(rid, prompt, params)
        except ValueError as exc:
            msg = str(exc) if isinstance(exc, RowError) else f"row {line}: {exc}"
            if bad_rows == "fail":
                engine.abort_request(list(submitted))
                print(f"plinth generate: error: {inp}: {msg}", file=sys.stderr)
                return 2
            bad += 1
            print(f"plinth generate: skipping {inp}: {msg}", file=sys.stderr)
            continue
        submitted[rid] = line
    print(f"{len(submitted)} rows to run, {len(skip)} already done, {bad} skipped", file=sys.stderr)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("a", encoding="utf-8") as f, tqdm(total=len(submitted), unit="row", disable=None) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step(final_only=True):
                if not out.finished:
                    continue
                rec = {
                    "id": out.request_id,
                    "line": submitted.get(out.request_id),
                    "outputs": [
                        {"text": c.text, "token_ids": c.token_ids, "finish_reason": str(c.finish_reason)}
                        for c in out.outputs
                    ],
                    "text": out.outputs[0].text,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "completion_tokens": sum(len(c.token_ids) for c in out.outputs),
                }
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
                bar.update(1)
    return 1 if bad and bad_rows == "fail" else 0
