"""`plinth generate`: prompts on the command line, and JSONL/CSV/Parquet files with per-row overrides,
bad rows, and resuming an interrupted run without duplicates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from plinth.entrypoints.cli import main

ROWS = [
    {"id": "a", "prompt": "The quick brown fox", "max_tokens": 6},
    {"id": "b", "prompt": "Paris is the capital of", "max_tokens": 9, "temperature": 0},
    {"id": "c", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5},
    {"id": "d", "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 7},
    {"id": "e", "prompt": "0123", "max_tokens": 4, "stop": ["\u00e9"]},
    {"id": "f", "prompt": "Hello", "max_tokens": 3, "logit_bias": {"7": 100}},
]


def engine_args(model_dir: Path) -> list[str]:
    return ["generate", str(model_dir), "--dtype", "float32", "--ignore-eos", "--selection", "off"]


def read_out(path: Path) -> dict[str, dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), f"duplicate rows in output: {ids}"
    return {r["id"]: r for r in recs}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def jsonl_result(tiny_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    out = d / "out.jsonl"
    assert main([*engine_args(tiny_llama_dir), "--input", str(write_jsonl(d / "in.jsonl", ROWS)),
                 "--output", str(out)]) == 0
    return read_out(out)


def test_jsonl_rows_with_overrides(jsonl_result):
    assert set(jsonl_result) == {"a", "b", "c", "d", "e", "f"}
    assert jsonl_result["f"]["outputs"][0]["token_ids"] == [7, 7, 7]   # forced by its logit_bias
    for row in ROWS:
        rec = jsonl_result[row["id"]]
        n = len(rec["outputs"][0]["token_ids"])
        if "stop" not in row:
            assert n == row["max_tokens"], (row, rec)
            assert rec["outputs"][0]["finish_reason"] == "length"
        assert rec["completion_tokens"] == n
    assert jsonl_result["d"]["prompt_tokens"] == 4


def test_csv_and_parquet_give_the_same_results(tiny_llama_dir, tmp_path, jsonl_result):
    flat = [{k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items()} for r in ROWS]
    frame = pd.DataFrame(flat)
    frame.to_csv(tmp_path / "in.csv", index=False)
    frame.to_parquet(tmp_path / "in.parquet")
    for name in ("in.csv", "in.parquet"):
        out = tmp_path / f"{name}.out.jsonl"
        assert main([*engine_args(tiny_llama_dir), "--input", str(tmp_path / name), "--output", str(out)]) == 0
        got = read_out(out)
        assert {k: v["outputs"][0]["token_ids"] for k, v in got.items()} == \
               {k: v["outputs"][0]["token_ids"] for k, v in jsonl_result.items()}


def test_parquet_with_nested_columns_gives_the_jsonl_results(tiny_llama_dir, tmp_path):
    """Parquet columns of lists and structs (not JSON text): a struct holds every key any row used, null where a
    row did not; each row still means what its JSON line means."""
    rows = [*ROWS, {"id": "g", "prompt": "Hello", "max_tokens": 3, "logit_bias": {"9": 100}},
            {"id": "h", "prompt": "Hello", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}]
    write_lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "in.jsonl").write_text(write_lines)
    pd.DataFrame(rows).to_parquet(tmp_path / "in.parquet")
    results = {}
    for name in ("in.jsonl", "in.parquet"):
        out = tmp_path / f"{name}.out.jsonl"
        assert main([*engine_args(tiny_llama_dir), "--input", str(tmp_path / name), "--output", str(out)]) == 0
        results[name] = {k: v["outputs"][0]["token_ids"] for k, v in read_out(out).items()}
    assert set(results["in.parquet"]) == {r["id"] for r in rows}
    assert results["in.parquet"] == results["in.jsonl"]


def test_interrupted_run_resumes_without_duplicates(tiny_llama_dir, tmp_path, jsonl_result):
    rows = ROWS + [{"id": f"x{i}", "prompt": "Large language models", "max_tokens": 3 + i} for i in range(6)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    # Interrupt the first run after three rows were written, as a Ctrl-C would.
    from plinth.core.engine import LLMEngine

    original = LLMEngine.step

    def interrupting_step(self, **kwargs):
        if out.exists() and len(out.read_text().splitlines()) >= 3:
            raise KeyboardInterrupt
        return original(self, **kwargs)

    LLMEngine.step = interrupting_step
    try:
        assert main([*engine_args(tiny_llama_dir), "--input", str(inp), "--output", str(out)]) == 130
    finally:
        LLMEngine.step = original
    partial = read_out(out)
    assert 3 <= len(partial) < len(rows)
    # a torn last line (the process died mid-write) is discarded on resume
    with out.open("a") as f:
        f.write('{"id": "torn", "te')
    assert main([*engine_args(tiny_llama_dir), "--input", str(inp), "--output", str(out)]) == 0
    final = read_out(out)
    assert set(final) == {r["id"] for r in rows}
    for rid, rec in partial.items():
        assert final[rid] == rec
    for rid in "abcde":
        assert final[rid]["outputs"][0]["token_ids"] == jsonl_result[rid]["outputs"][0]["token_ids"]


def test_a_rerun_on_results_of_other_requests_is_refused_naming_them(tiny_llama_dir, tmp_path, capsys):
    """Results are matched to rows by id and by a fingerprint of the request (prompt and sampling parameters,
    command-line defaults included): a row changed since its result was written, or another input file with the
    same ids, stops the run naming the ids, and the results file is left as it was. The same requests from a CSV
    file resume; a record without a fingerprint (written by an earlier plinth) is taken as before."""
    rows = [{"id": "a", "prompt": "The quick brown fox", "max_tokens": 3},
            {"id": "b", "prompt": "Paris is", "stop": ["x"]}]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    args = [*engine_args(tiny_llama_dir), "--max-tokens", "4", "--input", str(inp), "--output", str(out)]
    assert main(args) == 0
    written = out.read_text()
    assert all(len(r["fingerprint"]) == 16 for r in read_out(out).values())
    (tmp_path / "in.csv").write_text('id,prompt,max_tokens,stop\na,The quick brown fox,3,\nb,Paris is,,"[""x""]"\n')
    capsys.readouterr()
    for same in (args, [*args[:-3], str(tmp_path / "in.csv"), *args[-2:]]):
        assert main(same) == 0
        assert "0 rows to run, 2 already done" in capsys.readouterr().err
    changed = write_jsonl(tmp_path / "changed.jsonl", [rows[0], {**rows[1], "prompt": "Berlin is"}])
    for extra, needle in (([*args[:-3], str(changed), *args[-2:]], "id 'b' (row 2)"),
                          ([*args, "--max-tokens", "5"], "id 'b' (row 2)"),        # b's default changed, not a's
                          ([*args, "--temperature", "0.5"], "id 'a' (row 1), id 'b' (row 2)")):
        assert main(extra) == 2
        err = capsys.readouterr().err
        assert f"holds results of other requests for {needle.count('id ')} row(s)" in err and needle in err, err
        assert out.read_text() == written
    legacy = tmp_path / "legacy.jsonl"
    legacy.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "fingerprint"}) + "\n"
                              for r in read_out(out).values()))
    assert main([*args[:-3], str(changed), "--output", str(legacy)]) == 0
    assert "0 rows to run, 2 already done" in capsys.readouterr().err


def test_flags_generate_has_no_use_for_are_refused(tiny_llama_dir, tmp_path, capsys):
    """Engine flags every command takes but ``plinth generate`` could not use stop it before the model loads,
    saying why, rather than changing nothing."""
    inp = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    for flags, needle in ((["--enable-lora"], "--enable-lora: a row cannot name an adapter"),
                          (["--max-lora-rank", "8"], "--max-loras, --max-lora-rank or --max-cpu-loras"),
                          (["--scheduling-policy", "priority"], "--scheduling-policy priority: its rows carry no"),
                          (["--enable-prompt-embeds"], "--enable-prompt-embeds"),
                          (["--enable-sleep-mode"], "--enable-sleep-mode"),
                          (["--served-model-name", "x"], "--served-model-name"),
                          (["--override-generation-config", '{"temperature": 0.5}'], "--override-generation-config")):
        for mode in (["--prompt", "hi"], ["--input", str(inp), "--output", str(tmp_path / "o.jsonl")]):
            assert main([*engine_args(tiny_llama_dir), *mode, *flags]) == 2
            assert f"plinth generate: error: plinth generate has no use for {needle}" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_home_is_expanded_in_path_flags(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """``~`` in --input, --output, --tokenizer, --chat-template and --allowed-local-media-path is the home folder
    (a shell leaves it as it is in quotes or after ``=``)."""
    from plinth.config import ModelConfig
    from plinth.worker.setup import read_chat_template

    monkeypatch.setenv("HOME", str(tmp_path))
    write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    assert main([*engine_args(tiny_llama_dir), "--input", "~/in.jsonl", "--output=~/res/out.jsonl"]) == 0
    assert set(read_out(tmp_path / "res" / "out.jsonl")) == {"a"}
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert read_chat_template("~/t.jinja") == "{{ messages[0]['content'] }}"
    config = ModelConfig(tokenizer="~/tok", allowed_local_media_path="~")
    assert (config.tokenizer, config.allowed_local_media_path) == (str(tmp_path / "tok"), str(tmp_path))

def test_a_path_beginning_with_a_tilde_that_names_no_user_is_that_file(tmp_path, monkeypatch, capsys):
    """``~in.jsonl`` (``~`` and no user of that name) is the file of that name, as a shell leaves it: it was a
    RuntimeError traceback (``Path.expanduser`` raises where ``os.path.expanduser`` leaves the text as it is)."""
    from plinth.worker.setup import read_chat_template

    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "~in.jsonl", ROWS[:1])
    for argv in (["generate", "--input", "~in.jsonl", "--output", "~in.jsonl"],
                 ["run-batch", "-i", "~in.jsonl", "-o", "~in.jsonl"]):
        assert main(argv) == 2
        assert "--output '~in.jsonl' is the input file" in capsys.readouterr().err
    (tmp_path / "~t.jinja").write_text("{{ messages[0]['content'] }}")
    assert read_chat_template("~t.jinja") == "{{ messages[0]['content'] }}"
    # the model argument and --generation-config too: a clear message, not the RuntimeError
    for argv, said in ((["generate", "~nosuchuser-plinth/model", "--prompt", "hi"],
                        "model path '~nosuchuser-plinth/model' does not exist"),
                       (["generate", "tiny-llama", "--load-format", "dummy", "--prompt", "hi",
                         "--generation-config", "~nosuchuser-plinth/cfg"],
                        "--generation-config '~nosuchuser-plinth/cfg': no generation_config.json there")):
        assert main(argv) != 0
        assert said in capsys.readouterr().err


def test_the_fingerprint_of_a_row_is_that_of_its_csv_and_parquet_twins(tmp_path):
    """A real-valued parameter is one number whether it came as a JSON integer (2), a CSV cell or command-line flag
    (2.0), or -0.0: a row converted to CSV, or giving the command-line default itself, resumes its result."""
    from plinth import SamplingParams
    from plinth.entrypoints.generate_cmd import parse_row, read_rows, row_fingerprint

    base = SamplingParams(max_tokens=128, temperature=0.0, top_p=1.0, top_k=0, seed=None, ignore_eos=False)
    row = {"id": "a", "prompt": "hi", "temperature": 2, "presence_penalty": 1, "min_p": -0.0}
    write_jsonl(tmp_path / "in.jsonl", [row, {"id": "b", "prompt": "hi", "temperature": 0}, {"id": "c", "prompt": "hi"}])
    (tmp_path / "in.csv").write_text("id,prompt,temperature,presence_penalty\na,hi,2,1\n")
    pd.DataFrame([{**row, "temperature": 2.0, "presence_penalty": 1.0}]).to_parquet(tmp_path / "in.parquet")
    digests: dict[str, set[str]] = {}
    for name in ("in.jsonl", "in.csv", "in.parquet"):
        for line, r in read_rows(tmp_path / name):
            rid, prompt, params, is_chat = parse_row(line, r, base)
            digests.setdefault(rid, set()).add(row_fingerprint(prompt, params, is_chat))
    assert len(digests["a"]) == 1 and digests["b"] == digests["c"], digests


def test_a_value_nested_about_as_deeply_as_json_reads_is_a_bad_row(tmp_path, capsys):
    """Messages or extra_args nested just within what the JSON reader takes (but deeper than a copy, repr or the
    fingerprint can go) are a bad row, never a RecursionError traceback."""
    from plinth import SamplingParams
    from plinth.entrypoints.generate_cmd import _checked_rows

    inp = tmp_path / "in.jsonl"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)   # (Python's default: a module imported by another test may have raised it)
    try:
        for depth in range(940, 1010):
            nested = '{"a":' * depth + "1" + "}" * depth
            inp.write_text(f'{{"messages": [{{"role": "user", "content": "hi", "x": {nested}}}]}}\n'
                           f'{{"prompt": "hi", "extra_args": {nested}}}\n')
            rows, bad, changed = _checked_rows(inp, SamplingParams(), {}, "skip", None)
            assert len(rows) + bad == 2 and not changed
    finally:
        sys.setrecursionlimit(limit)
    assert "nested too deeply" in capsys.readouterr().err


def test_bad_rows_fail_or_skip_with_line_numbers(tiny_llama_dir, tmp_path):
    inp = tmp_path / "bad.jsonl"
    inp.write_text(
        json.dumps({"id": "ok", "prompt": "Paris", "max_tokens": 2}) + "\n"
        + "{not json\n"
        + json.dumps({"id": "t", "prompt": "x", "temperature": -1}) + "\n"
        + json.dumps({"id": "u", "text": "no prompt"}) + "\n"
    )
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "plinth.entrypoints.cli", *engine_args(tiny_llama_dir), "--input", str(inp),
           "--output", str(out)]
    failed = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2
    assert "row 2: invalid JSON" in failed.stderr
    assert "Traceback" not in failed.stderr
    skipped = subprocess.run([*cmd, "--bad-rows", "skip"], capture_output=True, text=True, timeout=300)
    assert skipped.returncode == 0, skipped.stderr
    for needle in ("row 2: invalid JSON", "row 3: temperature", "row 4: needs exactly one of"):
        assert needle in skipped.stderr
    assert set(read_out(out)) == {"ok"}


def test_prompt_on_command_line(tiny_llama_dir, capsys, jsonl_result):
    assert main([*engine_args(tiny_llama_dir), "--prompt", "The quick brown fox", "--max-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() != "" or jsonl_result["a"]["text"].strip() == ""
    assert jsonl_result["a"]["text"] in printed


def test_missing_input_is_a_clear_error(tiny_llama_dir, tmp_path, capsys):
    assert main([*engine_args(tiny_llama_dir), "--input", str(tmp_path / "nope.jsonl"),
                 "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plinth.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_files_are_checked_before_the_model_loads_and_never_damaged(tiny_llama_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"foo": 1}\n{"id": 3}')                       # not results, no trailing newline
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, one line without a newline")         # not a record cut short either
    cases = [
        (["--input", str(inp), "--output", str(inp)], "is the input file"),
        (["--input", str(inp), "--output", str(foreign)], "is not a result of plinth generate"),
        (["--input", str(inp), "--output", str(notes)], "is not a result of plinth generate"),
        (["--input", str(inp), "--output", str(tmp_path)], "is not a file"),
        (["--input", str(inp), "--output", str(inp / "x.jsonl")], "not a writable directory"),
        (["--input", str(tmp_path), "--output", str(tmp_path / "o.jsonl")], "is not a file"),
        (["--prompt", "hi", "--output", str(tmp_path / "o.jsonl")], "--output applies to --input files"),
        (["--prompt", "hi", "--input", str(inp), "--output", str(tmp_path / "o.jsonl")], "not both"),
        (["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--chat"], "'messages'"),
        (["--input", str(write_jsonl(tmp_path / "n.jsonl", [{"prompt": "hi", "n": 3}])), "--output",
          str(tmp_path / "o.jsonl"), "--max-waiting-requests", "1", "--max-num-seqs", "1"],
         "row 1: n is 3, more than --max-num-seqs plus --max-waiting-requests (2)"),
    ]
    for extra, needle in cases:
        res = run_cli([*engine_args(tiny_llama_dir), *extra])
        assert res.returncode == 2 and needle in res.stderr, (extra, res.stderr)
        assert "Traceback" not in res.stderr
    assert inp.read_text() == "".join(json.dumps(r) + "\n" for r in ROWS[:2])
    assert foreign.read_text() == '{"foo": 1}\n{"id": 3}'
    assert notes.read_text() == "my notes, one line without a newline"
    assert not (tmp_path / "o.jsonl").exists()


def test_rows_of_every_shape_are_run_or_reported(tiny_llama_dir, tmp_path):
    """Parquet lists and integer columns with nulls, chat content parts, bad chat rows, text that is not valid
    Unicode, stop strings that look like JSON, a byte order mark, logprobs in the records, and more rows than
    the waiting queue holds."""
    rows = [
        {"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 3},
        {"id": "nocontent", "messages": [{"role": "user"}], "max_tokens": 3},
        {"id": "surrogate", "prompt": "a\ud800b", "max_tokens": 3},
        {"id": "brackets", "prompt": "Hello", "stop": "[END]", "max_tokens": 4},
        {"id": "lp", "prompt": "Hello", "max_tokens": 3, "logprobs": 2, "prompt_logprobs": 1},
    ] + [{"id": f"q{i}", "prompt": "Paris is", "max_tokens": 2} for i in range(5)]
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode() + b'{"prompt": "caf\xe9"}\n')
    out = tmp_path / "out.jsonl"
    res = run_cli([*engine_args(tiny_llama_dir), "--input", str(inp), "--output", str(out), "--bad-rows", "skip",
                   "--max-waiting-requests", "2"])
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    for needle in ("row 2: messages[0] needs a 'content' string", "row 3: the prompt is not valid Unicode",
                   "row 11: not valid UTF-8"):
        assert needle in res.stderr, res.stderr
    got = read_out(out)
    assert set(got) == {"parts", "brackets", "lp"} | {f"q{i}" for i in range(5)}
    lp = got["lp"]["outputs"][0]
    assert len(lp["logprobs"]) == 3 and all(2 <= len(pos) <= 3 for pos in lp["logprobs"])
    assert lp["cumulative_logprob"] == pytest.approx(sum(
        next(e["logprob"] for e in pos if e["token_id"] == t) for pos, t in zip(lp["logprobs"], lp["token_ids"], strict=True)))
    assert got["lp"]["prompt_logprobs"][0] is None and len(got["lp"]["prompt_logprobs"]) == got["lp"]["prompt_tokens"]
    # Parquet: a list column and an integer column with a null
    frame = pd.DataFrame({"id": ["a", "b"], "prompt_token_ids": [[5, 6, 7], [8, 9]], "max_tokens": [2, None]})
    frame.to_parquet(tmp_path / "in.parquet")
    res = run_cli([*engine_args(tiny_llama_dir), "--input", str(tmp_path / "in.parquet"), "--output",
                   str(tmp_path / "pq.jsonl")])
    assert res.returncode == 0, res.stderr
    got = read_out(tmp_path / "pq.jsonl")
    assert got["a"]["completion_tokens"] == 2 and got["a"]["prompt_tokens"] == 3 and got["b"]["prompt_tokens"] == 2
    assert got["a"]["outputs"][0]["finish_reason"] == "length" and got["a"]["outputs"][0]["stop_reason"] is None


def test_a_second_run_on_the_same_output_stops_at_once(tmp_path, tiny_llama_dir):
    """Two runs appending to one results file would both run the rows neither had done: the second stops, naming
    the file, while the first holds it; an input with nothing left to run does not load the model."""
    from plinth.entrypoints.generate_cmd import output_lock
    from plinth.errors import CliError

    out = tmp_path / "sub" / "out.jsonl"
    with output_lock(out):
        with pytest.raises(CliError, match="is being written by another run"), output_lock(out):
            pass
        (tmp_path / "in.jsonl").write_text('{"prompt": "Hi"}\n')
        res = run_cli([*engine_args(tiny_llama_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(out)])
        assert res.returncode != 0 and "is being written by another run" in res.stderr and "Traceback" not in res.stderr
    with output_lock(out):   # released
        pass
    # the results file replaced while a run holds the lock (a rerun cleaning up a torn record) stays locked
    with output_lock(out):
        out.write_text("")
        tmp = out.with_name("new")
        tmp.write_text("")
        os.replace(tmp, out)
        with pytest.raises(CliError, match="is being written by another run"), output_lock(out):
            pass
    (tmp_path / "empty.jsonl").write_text("")
    res = run_cli(["generate", "/nonexistent-model-dir", "--input", str(tmp_path / "empty.jsonl"), "--output", str(out)])
    assert res.returncode == 0 and "0 rows to run" in res.stderr, res.stderr


def test_row_ids_from_parquet_integer_columns_with_nulls_and_null_ids():
    """A Parquet integer column with a null holds floats (10.0): its ids are the integers; a null id (or an empty cell,
    left out of the row) is the row number, as a null means the default elsewhere."""
    from plinth import SamplingParams
    from plinth.entrypoints.generate_cmd import RowError, parse_row

    base = SamplingParams()
    assert parse_row(1, {"id": 10.0, "prompt": "x", "_cells": True}, base)[0] == "10"
    assert parse_row(2, {"prompt": "x", "_cells": True}, base)[0] == "2"
    assert parse_row(3, {"id": None, "prompt": "x"}, base)[0] == "3"
    with pytest.raises(RowError, match="'id' must be a string or an integer, got 10.5"):
        parse_row(4, {"id": 10.5, "prompt": "x", "_cells": True}, base)
    with pytest.raises(RowError, match="got 10.0"):   # JSON values are taken as they are
        parse_row(5, {"id": 10.0, "prompt": "x"}, base)


def test_a_null_prompt_field_is_absent_as_an_empty_cell_is():
    """pandas' ``to_json(orient="records", lines=True)`` writes every column on every line, null where a row
    does not use it: such a JSONL row means what the same row of a Parquet file means."""
    from plinth import SamplingParams
    from plinth.entrypoints.generate_cmd import RowError, parse_row

    base = SamplingParams()
    chat = [{"role": "user", "content": "Hi"}]
    assert parse_row(1, {"prompt": "x", "messages": None, "prompt_token_ids": None}, base)[1] == "x"
    _, prompt, _, is_chat = parse_row(2, {"prompt": None, "messages": chat, "prompt_token_ids": None}, base)
    assert prompt == chat and is_chat
    with pytest.raises(RowError, match="row 3: needs exactly one of"):
        parse_row(3, {"prompt": None, "messages": None}, base)


def test_an_output_line_python_cannot_parse_is_not_a_result(tmp_path):
    """An ``--output`` line nested too deeply for Python's parser, or holding an integer of too many digits, is
    refused as any other line that is not a result, and the file is left alone."""
    from plinth.entrypoints.generate_cmd import done_ids
    from plinth.errors import CliError

    for name, text in (("deep.jsonl", "[" * 100_000 + "\n"), ("digits.jsonl", '{"id": ' + "1" * 5001 + "}\n"),
                       ("last.jsonl", '{"id": ' + "1" * 5001 + "}")):
        out = tmp_path / name
        out.write_text(text)
        with pytest.raises(CliError, match="line 1 is not a result of plinth generate"):
            done_ids(out)
        assert out.read_text() == text


def test_csv_stop_cells_are_json_lists_or_one_string():
    from plinth.entrypoints.generate_cmd import _coerce

    assert _coerce("stop", '["a", "b"]', [], True) == ["a", "b"]
    assert _coerce("stop", "[/INST]", [], True) == ["[/INST]"]
    assert _coerce("stop", "[1]", [], True) == ["[1]"]
    assert _coerce("stop", "[END]", [], False) == "[END]"        # JSONL values are taken as they are
    with pytest.raises(ValueError, match="JSON list of strings"):
        _coerce("stop", '["a", 1]', [], True)
    with pytest.raises(ValueError, match="true or false"):
        _coerce("ignore_eos", "maybe", False, True)


def test_a_stop_given_as_an_object_is_refused_not_taken_as_its_keys():
    """``{"stop": {"a": 1}}`` (or a Parquet struct) was read as the stop string "a": a row's ``stop`` is a string or a
    list of strings, as in the OpenAI API, and anything else is a bad row naming it."""
    from plinth import SamplingParams
    from plinth.entrypoints.generate_cmd import RowError, parse_row

    base = SamplingParams()
    for row in ({"prompt": "x", "stop": {"a": 1}}, {"prompt": "x", "stop": {"a": "b"}, "_cells": True},
                {"prompt": "x", "stop_token_ids": {"7": 1}}):
        with pytest.raises(RowError, match=r"row 3: stop(_token_ids)?: must be .* or a list of them, got an object"):
            parse_row(3, row, base)
    assert parse_row(1, {"prompt": "x", "stop": "a"}, base)[2].stop == ["a"]


def test_csv_list_cells_of_bad_words_and_allowed_token_ids():
    """``bad_words`` cells are read as ``stop`` cells are, ``allowed_token_ids`` as ``stop_token_ids``: a CSV row
    gives the sampling parameters its JSONL twin gives."""
    from plinth import SamplingParams
    from plinth.entrypoints.generate_cmd import parse_row

    base = SamplingParams()
    jsonl = parse_row(1, {"prompt": "x", "bad_words": ["[", "x"], "allowed_token_ids": [7, 11]}, base)[2]
    csv = parse_row(1, {"prompt": "x", "bad_words": '["[", "x"]', "allowed_token_ids": "[7, 11]", "_cells": True},
                    base)[2]
    assert csv.bad_words == jsonl.bad_words == ["[", "x"]
    assert csv.allowed_token_ids == jsonl.allowed_token_ids == [7, 11]
    one = parse_row(2, {"prompt": "x", "bad_words": "[", "allowed_token_ids": "7", "_cells": True}, base)[2]
    assert one.bad_words == ["["] and one.allowed_token_ids == [7]


def test_csv_rows_keep_their_starting_line_after_quoted_line_breaks(tmp_path):
    from plinth.entrypoints.generate_cmd import read_rows

    path = tmp_path / "in.csv"
    path.write_text('id,prompt\na,"two\nlines"\nb,one line\nc,x,extra\n', encoding="utf-8")
    rows = list(read_rows(path))
    assert [line for line, _ in rows] == [2, 4, 5]
    assert rows[0][1]["prompt"] == "two\nlines" and rows[1][1]["prompt"] == "one line"
    assert "more cells than the header" in str(rows[2][1])


def test_csv_line_numbers_after_blank_lines_long_cells_and_unreadable_json(tmp_path):
    """Blank lines do not shift the reported lines; a cell longer than the csv module's default limit is read;
    JSON nested too deeply or with an integer of too many digits is a bad row, not the end of the run."""
    from plinth import SamplingParams
    from plinth.entrypoints.generate_cmd import RowError, parse_row, read_rows

    long = "word " * 40_000   # 200,000 characters
    path = tmp_path / "in.csv"
    path.write_text(f"prompt,max_tokens\nParis is,2\n\n\nhello,-3\n{long},4\n", encoding="utf-8")
    rows = list(read_rows(path))
    assert [line for line, _ in rows] == [2, 5, 6] and rows[2][1]["prompt"] == long
    deep = "[" * 30_000 + "]" * 30_000
    cells = tmp_path / "deep.csv"
    cells.write_text(f'prompt_token_ids\n"{deep}"\n', encoding="utf-8")
    (line, row), = read_rows(cells)
    with pytest.raises(RowError, match="row 2: 'prompt_token_ids' is not valid JSON: nested too deeply"):
        parse_row(line, row, SamplingParams())
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"prompt": "a", "stop": ' + "[" * 100_000 + "]" * 100_000 + '}\n'
                     + '{"prompt": "b", "max_tokens": ' + "1" * 5001 + '}\n{"prompt": "c"}\n', encoding="utf-8")
    got = list(read_rows(jsonl))
    assert isinstance(got[0][1], RowError) and "nested too deeply" in str(got[0][1])
    assert isinstance(got[1][1], RowError) and "digits" in str(got[1][1])
    assert got[2] == (3, {"prompt": "c"})


def test_row_ids_nulls_and_bad_ids(tiny_llama_dir, tmp_path, capsys):
    """Row ids are the user's own (``a#0`` next to an ``n=2`` row ``a``); a JSON null leaves a field at its
    default, as an empty CSV or Parquet cell does; an id that cannot be written as UTF-8 is a bad row."""
    rows = [
        {"id": "a", "prompt": "The quick", "max_tokens": 4, "n": 2},
        {"id": "a#0", "prompt": "Paris is", "max_tokens": 4},
        {"id": "nulls", "prompt": "Bye", "temperature": None, "max_tokens": None, "stop": None},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": "bad\\ud800", "prompt": "x"}\n')
    out = tmp_path / "out.jsonl"
    assert main([*engine_args(tiny_llama_dir), "--max-tokens", "5", "--input", str(inp), "--output", str(out),
                 "--bad-rows", "skip"]) == 0
    assert "row 4: 'id' is not valid Unicode text" in capsys.readouterr().err
    got = read_out(out)
    assert set(got) == {"a", "a#0", "nulls"}
    assert len(got["a"]["outputs"]) == 2 and len(got["a#0"]["outputs"]) == 1
    assert len(got["nulls"]["outputs"][0]["token_ids"]) == 5   # --max-tokens, not the context's end


def test_prompts_wait_for_queue_room_and_template_errors_are_one_line(tiny_llama_dir, capsys):
    args = [*engine_args(tiny_llama_dir), "--max-tokens", "2"]
    assert main([*args, "--prompt", "a", "--prompt", "b", "--prompt", "c", "--max-waiting-requests", "1"]) == 0
    assert capsys.readouterr().out.count("=== prompt") == 3
    assert main([*args, "--prompt", "hi", "--chat", "--chat-template",
                 "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}"]) == 2
    err = capsys.readouterr().err   # compiled as the renderer compiles it: refused before the model loads
    assert "error: --chat-template is not a valid jinja2 template: No filter named 'no_such_filter'" in err
    # an expression of the template that fails in Python (a division by zero, str + int): one line too
    assert main([*args, "--prompt", "hi", "--chat", "--chat-template", "{{ 1 // 0 }}"]) == 2
    assert "error: the chat template failed: TemplateError: ZeroDivisionError" in capsys.readouterr().err
    assert main([*args, "--prompt", "hi", "--chat", "--chat-template", "{{ messages[0]['content'] + 1 }}"]) == 2
    assert "error: the chat template failed: TemplateError: TypeError" in capsys.readouterr().err


def test_a_template_file_that_is_not_utf8_is_one_line(tiny_llama_dir, tmp_path, capsys):
    latin = tmp_path / "template.jinja"
    latin.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    assert main([*engine_args(tiny_llama_dir), "--prompt", "hi", "--chat", "--chat-template", str(latin)]) == 2
    err = capsys.readouterr().err
    assert f"--chat-template file {str(latin)!r} cannot be read as UTF-8 text" in err and "Traceback" not in err


def test_python_dash_m_plinth_is_the_command(tiny_llama_dir):
    """``python -m plinth`` runs the ``plinth`` command (its exit code and output included)."""
    done = subprocess.run([sys.executable, "-m", "plinth", "generate", "--model", str(tiny_llama_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "give --prompt TEXT or --input FILE" in done.stderr
