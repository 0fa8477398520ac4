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
    for key, text in (("<line 4>", "not JSON"), ("s", "stream is not supported"), ("u", "url must be one of")):
        assert by_id[key]["response"] is None and text in by_id[key]["error"]["message"]
    # the repeated c1 line was refused, not run: the first c1's result stands
    assert "custom_id 'c1' appears more than once" in by_id["<line 5>"]["error"]["message"]
    # a rerun finds everything done; a new line runs alone
    capsys.readouterr()
    assert main(args) == 0
    assert "0 requests to run, 7 already done, 0 invalid" in capsys.readouterr().err
    with inp.open("a") as f:
        f.write(json.dumps({"custom_id": "c3", "url": "/v1/chat/completions", "body": chat}) + "\n")
    assert main(args) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 8 and json.loads(lines[-1])["custom_id"] == "c3"
    # a results file of something else is never overwritten
    other = tmp_path / "other.jsonl"
    other.write_text('{"something": 1}\n')
    assert main(args[:-1] + [str(other)]) == 2
    assert "is not a result of plinth run-batch" in capsys.readouterr().err
