"""``plinth run-batch``: OpenAI batch files through the server's routes, offline and resumable."""

from __future__ import annotations

import json

from conftest import save_tiny_model

from plinth import LLM, SamplingParams
from plinth.entrypoints.cli import main

PROMPT = "Paris is the capital of France, and Berlin is"


def write_lines(path, items) -> None:
    path.write_text("\n".join(i if isinstance(i, str) else json.dumps(i) for i in items) + "\n")


def test_run_batch(tmp_path, capsys):
    model = save_tiny_model(tmp_path / "m")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    write_lines(inp, [
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}},
        {"custom_id": "c2", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}},
        "{not json",
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "again"}},
        {"custom_id": "s", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "stream": True}},
        {"custom_id": "u", "method": "POST", "url": "/v1/files", "body": {}},
    ])
    args = ["run-batch", str(model), "--dtype", "float32", "--selection", "off", "-i", str(inp), "-o", str(out)]
    assert main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in records}
    assert sorted(by_id) == ["<line 4>", "<line 5>", "bad-temp", "c1", "c2", "s", "u"]
    assert len(records) == 7
    # the same text as the engine gives for the same request
    llm = LLM(str(model), dtype="float32", selection="off")
    expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].text
    c1 = by_id["c1"]
    assert c1["error"] is None and c1["response"]["status_code"] == 200
    assert c1["response"]["body"]["choices"][0]["text"] == expected
    assert c1["response"]["request_id"] == c1["response"]["body"]["id"] and c1["id"].startswith("batch_req_")
    assert by_id["c2"]["response"]["body"]["usage"]["completion_tokens"] == 5
    bad = by_id["bad-temp"]
    assert bad["response"]["status_code"] == 400 and bad["error"]["message"].startswith("temperature")
    assert bad["response"]["request_id"].startswith("req_")   # a string, as OpenAI's batch output has
    for key, text in (("<line 4>", "not JSON"), ("s", "stream is not supported"), ("u", "url must be one of")):
        assert by_id[key]["response"] is None and text in by_id[key]["error"]["message"]
    # the repeated c1 line was refused, not run: the first c1's result stands
    assert "custom_id 'c1' appears more than once" in by_id["<line 5>"]["error"]["message"]
    # a rerun keeps the answered requests (200 and 400 are final) and evaluates the other lines again, writing
    # each result once; a new line runs alone
    capsys.readouterr()
    assert main(args) == 0
    assert "0 requests to run, 3 already done, 4 invalid" in capsys.readouterr().err
    assert sorted(json.loads(line)["custom_id"] for line in out.read_text().splitlines()) == sorted(by_id)
    with inp.open("a") as f:
        f.write(json.dumps({"custom_id": "c3", "url": "/v1/chat/completions", "body": chat}) + "\n")
        f.write(json.dumps({"custom_id": "c4\u2028", "url": "/v1/completions",
                            "body": {"prompt": "x\u2028y", "max_tokens": 2}}, ensure_ascii=False) + "\n")
    assert main(args) == 0
    records = [json.loads(line) for line in out.read_text().split("\n") if line]
    assert len(records) == 9 and {"c3", "c4\u2028"} <= {r["custom_id"] for r in records}
    assert all(r["error"] is None for r in records if r["custom_id"].startswith("c"))
    # a results file of something else is never overwritten
    other = tmp_path / "other.jsonl"
    other.write_text('{"something": 1}\n')
    assert main(args[:-1] + [str(other)]) == 2
    assert "is not a result of plinth run-batch" in capsys.readouterr().err
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, one line without a newline")
    assert main(args[:-1] + [str(notes)]) == 2
    assert "is not a result of plinth run-batch" in capsys.readouterr().err
    assert notes.read_text() == "my notes, one line without a newline"


def test_a_full_queue_is_waited_out(tmp_path):
    model = save_tiny_model(tmp_path / "m")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"custom_id": f"r{i}", "url": "/v1/completions",
                       "body": {"prompt": f"prompt {i}", "max_tokens": 4, "ignore_eos": True}} for i in range(12)])
    assert main(["run-batch", str(model), "--dtype", "float32", "--selection", "off", "--max-num-seqs", "2",
                 "--max-waiting-requests", "1", "--max-concurrency", "12", "-i", str(inp), "-o", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 12 and all(r["response"]["status_code"] == 200 for r in records)


def test_engine_death_and_app_errors_leave_requests_for_the_rerun():
    """After the engine dies nothing more is sent and unanswered requests get no record; an exception inside
    the app fails only its own request."""
    import asyncio

    from plinth.entrypoints.run_batch_cmd import run_requests

    state = {"calls": 0, "healthy": True}

    async def app(scope, receive, send):
        await receive()
        state["calls"] += 1
        body = json.dumps({"id": "x", "choices": []}).encode()
        status = 200
        if state["calls"] == 2:
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "boom"}}'})
            raise RuntimeError("boom")
        if state["calls"] >= 4:
            state["healthy"] = False
            status, body = 503, b'{"error": {"message": "dead", "code": "engine_unavailable"}}'
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    written = []
    requests = [{"custom_id": f"r{i}", "url": "/v1/completions", "body": {}} for i in range(8)]
    failed, not_run = asyncio.run(run_requests(app, requests, 1, written.append, lambda: state["healthy"]))
    assert [r["custom_id"] for r in written] == ["r0", "r1", "r2"]
    assert written[1]["response"]["status_code"] == 500 and written[1]["error"]["message"] == "boom"
    assert (failed, not_run) == (1, 5) and state["calls"] == 4


def test_embedding_lines(tmp_path):
    import numpy as np

    model = save_tiny_model(tmp_path / "m")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"custom_id": "e1", "url": "/v1/embeddings", "body": {"input": [PROMPT, "hello"]}},
                      {"custom_id": "c1", "url": "/v1/completions", "body": {"prompt": PROMPT}}])
    assert main(["run-batch", str(model), "--dtype", "float32", "--selection", "off", "--task", "embed",
                 "-i", str(inp), "-o", str(out)]) == 0
    by_id = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    data = by_id["e1"]["response"]["body"]["data"]
    expected = LLM(str(model), dtype="float32", selection="off", task="embed").embed([PROMPT, "hello"])
    for got, want in zip(data, expected, strict=True):
        np.testing.assert_allclose(got["embedding"], want.outputs.embedding, atol=1e-6)
    assert by_id["c1"]["response"]["status_code"] == 400 and "/v1/embeddings" in by_id["c1"]["error"]["message"]


def test_output_folders_are_made_and_bad_custom_ids_are_invalid_lines(tmp_path, capsys):
    model = save_tiny_model(tmp_path / "m")
    inp, out = tmp_path / "in.jsonl", tmp_path / "new" / "dir" / "out.jsonl"
    body = {"prompt": PROMPT, "max_tokens": 2}
    write_lines(inp, [{"custom_id": "ok", "url": "/v1/completions", "body": body},
                      '{"custom_id": "bad\\ud800", "url": "/v1/completions", "body": {"prompt": "x"}}'])
    assert main(["run-batch", str(model), "--dtype", "float32", "--selection", "off", "-i", str(inp),
                 "-o", str(out)]) == 0
    by_id = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by_id["ok"]["response"]["status_code"] == 200
    assert "custom_id is not valid Unicode text" in by_id["<line 2>"]["error"]["message"]
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert main(["run-batch", str(model), "-i", str(inp), "-o", str(blocked / "out.jsonl")]) == 2
    assert "is not a writable directory" in capsys.readouterr().err


def test_any_stream_value_but_false_is_refused_and_a_reply_that_is_not_json_is_not_final(tmp_path):
    """The server streams for any value it reads as true (``"yes"``, ``1.0``, ...), so a batch line refuses every
    ``stream`` but absent, null and false; a route's reply that is not JSON (a stream) is recorded as a failure a
    rerun tries again (status 502), never as a 200 with the raw text."""
    import asyncio

    from plinth.entrypoints.run_batch_cmd import call_route, read_requests, result_record

    inp = tmp_path / "in.jsonl"
    body = {"prompt": "x"}
    values = {"yes": "yes", "one": 1.0, "t": "t", "false-text": "false", "no": False, "null": None}
    write_lines(inp, [{"custom_id": k, "url": "/v1/completions", "body": {**body, "stream": v}}
                      for k, v in values.items()] + [{"custom_id": "absent", "url": "/v1/completions", "body": body}])
    requests, invalid = read_requests(inp, set())
    assert sorted(r["custom_id"] for r in requests) == ["absent", "no", "null"]
    assert sorted(r["custom_id"] for r in invalid) == ["false-text", "one", "t", "yes"]
    assert all("stream is not supported" in r["error"]["message"] for r in invalid)

    async def streaming_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {\"id\": 1}\n\ndata: [DONE]\n\n"})

    status, reply = asyncio.run(call_route(streaming_app, "/v1/completions", body))
    assert status == 502 and "not JSON" in reply["error"]["message"]
    record = result_record({"custom_id": "x"}, status, reply)
    assert record["error"]["code"] == "http_502" and record["response"]["status_code"] == 502


def test_lines_python_cannot_parse_are_invalid_records_and_the_rest_runs(tmp_path):
    """A line ``json.loads`` refuses with something other than a decode error (an integer of more digits than
    Python converts, nesting deeper than its stack) is an invalid record like any line that is not JSON; the good
    lines still run."""
    from plinth.entrypoints.run_batch_cmd import read_requests

    inp = tmp_path / "in.jsonl"
    good = json.dumps({"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "hi"}})
    big = '{"custom_id": "big", "url": "/v1/completions", "body": {"seed": 1' + "0" * 5000 + "}}"
    deep = '{"custom_id": "deep", "body": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    inp.write_text("\n".join([good, big, deep]) + "\n")
    requests, invalid = read_requests(inp, set())
    assert [r["custom_id"] for r in requests] == ["ok"]
    assert [r["custom_id"] for r in invalid] == ["<line 2>", "<line 3>"]
    assert all("is not JSON" in r["error"]["message"] and r["response"] is None for r in invalid)


def test_a_body_too_deep_to_encode_again_is_its_lines_error_and_reserved_ids(tmp_path):
    """A body nested so deeply (985 levels) that it parses but could not be encoded again deep in the event loop is
    that line's error record, and the other requests run (it killed the whole batch, on every rerun); a custom_id
    of the form
    ``<line N>`` (the name of lines without a usable one) is refused, so names in the results stay unique."""
    model = save_tiny_model(tmp_path / "m")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    deep = '{"custom_id": "deep", "url": "/v1/completions", "body": {"x": ' + "[" * 985 + "]" * 985 + "}}"
    lines = ["{not json", {"custom_id": "<line 1>", "url": "/v1/completions", "body": {"prompt": "x"}},
             {"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": PROMPT, "max_tokens": 3}}]
    write_lines(inp, [*lines, deep])
    assert main(["run-batch", str(model), "--dtype", "float32", "--selection", "off", "-i", str(inp),
                 "-o", str(out)]) == 0
    by_id = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by_id["ok"]["response"]["status_code"] == 200
    assert "reserved" in by_id["<line 2>"]["error"]["message"] and by_id["<line 1>"]["response"] is None
    deep_record = by_id.get("deep") or by_id["<line 4>"]   # (too deep to parse, where the stack is deeper)
    assert deep_record["error"] is not None


def test_one_request_that_cannot_be_sent_fails_alone():
    """A request whose sending raises (here a body json cannot encode) is a 500 record of its own; the other
    requests still run (an exception there cancelled every worker)."""
    import asyncio

    from plinth.entrypoints.run_batch_cmd import run_requests

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"id": "x"}'})

    requests = [{"custom_id": "bad", "url": "/v1/completions", "body": {"x": object()}},
                {"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "hi"}}]
    records = []
    failed, not_run = asyncio.run(run_requests(app, requests, 1, records.append))
    by_id = {r["custom_id"]: r for r in records}
    assert (failed, not_run) == (1, 0) and by_id["ok"]["response"]["status_code"] == 200
    assert by_id["bad"]["response"]["status_code"] == 500 and "TypeError" in by_id["bad"]["error"]["message"]


def test_a_rerun_on_results_of_other_requests_is_refused_and_home_is_expanded(tmp_path, monkeypatch, capsys):
    """Results are matched to lines by custom_id and a fingerprint of the request (method, URL, body): a line whose
    request changed since its final result was written stops the rerun naming it, before the model loads and with
    the results file left as it was (a record without a fingerprint, of an earlier plinth, is taken as before).
    ``~`` in -i and -o is the home folder; flags run-batch has no use for are refused."""
    from plinth.entrypoints.run_batch_cmd import settled_ids

    monkeypatch.setenv("HOME", str(tmp_path))
    model = save_tiny_model(tmp_path / "m")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    a = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": PROMPT, "max_tokens": 2}}
    b = {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}}   # a final 400
    write_lines(inp, [a, b])
    args = ["run-batch", str(model), "--dtype", "float32", "--selection", "off", "-i", "~/in.jsonl", "-o", "~/out.jsonl"]
    assert main(args) == 0
    written = out.read_text()
    assert {r["custom_id"]: r["response"]["status_code"] for r in map(json.loads, written.splitlines())} == \
           {"a": 200, "b": 400}
    capsys.readouterr()
    write_lines(inp, [b, a, {**a, "body": {"prompt": "other"}}])   # the same requests (a repeated line is not a's)
    assert main(args) == 0
    assert "0 requests to run, 2 already done, 1 invalid" in capsys.readouterr().err
    out.write_text(written)
    write_lines(inp, [{**a, "body": {**a["body"], "max_tokens": 3}}, {**b, "url": "/v1/chat/completions"}])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds results of other requests for 2 custom_id(s) of --input '" in err and "'a', 'b'" in err, err
    assert out.read_text() == written
    out.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "fingerprint"}) + "\n"
                           for line in written.splitlines()))
    assert settled_ids(out, inp) == {"a": None, "b": None}
    for flag, needle in ((["--enable-sleep-mode"], "has no use for --enable-sleep-mode"),
                         (["--enable-lora"], "--enable-lora serves the adapters of --lora-modules")):
        assert main([*args, *flag]) == 2 and needle in capsys.readouterr().err
