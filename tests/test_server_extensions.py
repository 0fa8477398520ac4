"""vLLM's request extensions and server options: prompt_logprobs, add_special_tokens, truncate_prompt_tokens,
return_tokens_as_token_ids, continuous_usage_stats, documents, stop_reason in chunks, ignored fields, /ping,
X-Request-Id, CORS, HTTPS flags; and LLM.generate's dict prompts."""

from __future__ import annotations

import argparse
import json
import logging
import re

import pytest
import torch
from server_utils import free_port, make_tiny_model

from plinth import LLM, SamplingParams

PROMPT = "Paris is the capital of France; Berlin is"
DOC_TEMPLATE = ("{% for d in documents or [] %}<doc>{{ d['text'] }}</doc>{% endfor %}"
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with a tokenizer that adds a BOS token to plain text (so add_special_tokens matters)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-ext"))
    tok = AutoTokenizer.from_pretrained(path)
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                                 special_tokens=[("<|im_start|>", bos)])
    tok.bos_token = "<|im_start|>"
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def app_parts(model_dir):
    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", selection="off",
                                                served_model_name="tiny", chat_template=DOC_TEMPLATE))
    return engine, AsyncLLMEngine(engine)


@pytest.fixture(scope="module")
def http(app_parts):
    from starlette.testclient import TestClient

    from plinth.entrypoints.openai.api_server import CorsSettings, build_app

    app = build_app(app_parts[1], api_key="sekret", cors=CorsSettings(("http://ui.example",)))
    with TestClient(app, headers={"Authorization": "Bearer sekret"}) as client:
        yield client


def post(http, route: str, body: dict, status: int = 200) -> dict:
    r = http.post(route, json=body)
    assert r.status_code == status, r.text
    return r.json()


def test_prompt_logprobs_match_transformers(http, app_parts, model_dir):
    from transformers import AutoModelForCausalLM

    engine = app_parts[0]
    ids = engine.tokenize(PROMPT)
    body = post(http, "/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 3})
    prompt_lp = body["choices"][0]["prompt_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    assert prompt_lp[0] is None and len(prompt_lp) == len(ids)
    for i in range(1, len(ids)):
        entry = {int(k): v for k, v in prompt_lp[i].items()}
        assert ids[i] in entry and len(entry) in (3, 4)
        assert entry[ids[i]]["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top3 = torch.topk(ref[i - 1], 3).indices.tolist()
        assert {t for t, v in entry.items() if v["rank"] <= 3} == set(top3)
        assert entry[ids[i]]["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert entry[ids[i]]["decoded_token"] == engine.tokenizer.decode([ids[i]])
    # not asked: no key; chat: on the response; streaming: refused
    assert "prompt_logprobs" not in post(http, "/v1/completions", {"prompt": ids, "max_tokens": 1})["choices"][0]
    chat = post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                               "prompt_logprobs": 0})
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])   # k = 0: the prompt's own token only
    err = post(http, "/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}, status=400)
    assert err["error"]["param"] == "prompt_logprobs"


def test_add_special_tokens_and_truncation(http, app_parts):
    engine = app_parts[0]
    plain = engine.tokenize(PROMPT, add_special_tokens=False)
    usage = lambda body: body["usage"]["prompt_tokens"]   # noqa: E731
    assert usage(post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})) == len(plain) + 1
    assert usage(post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                "add_special_tokens": False})) == len(plain)
    messages = [{"role": "user", "content": "hi"}]
    chat = usage(post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}))
    assert usage(post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                     "add_special_tokens": True})) == chat + 1
    # truncation keeps the last N tokens: the same completion as those tokens given directly
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cut = post(http, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 5, "echo": True, **greedy})
    direct = post(http, "/v1/completions", {"prompt": plain[-5:], **greedy})
    assert usage(cut) == 5
    assert cut["choices"][0]["text"] == engine.tokenizer.decode(plain[-5:]) + direct["choices"][0]["text"]
    assert usage(post(http, "/v1/chat/completions", {"messages": messages, "truncate_prompt_tokens": 3,
                                                     "max_tokens": 1})) == 3
    for bad in (0, -2, engine.max_model_len + 1):   # vLLM refuses more than the context; -1 means the context
        assert post(http, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": bad},
                    status=400)["error"]["param"] == "truncate_prompt_tokens"
    whole = post(http, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": -1, **greedy})
    assert usage(whole) == len(plain) + 1
    long = post(http, "/v1/completions", {"prompt": [5] * (engine.max_model_len + 3), "max_tokens": 1,
                                          "truncate_prompt_tokens": -1}, status=400)   # no room left for a token
    assert long["error"]["param"] in ("prompt", "max_tokens"), long


def test_echo_offsets_skip_the_bos_the_tokenizer_added(http):
    """With echo, each token's ``text_offset`` points at its text in the choice (which starts with the caller's
    prompt, without the BOS this tokenizer adds): the BOS takes no characters; streamed or not."""
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 0}
    for stream in (False, True):
        if stream:
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                events = [json.loads(line[6:]) for line in resp.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            choices = [e["choices"][0] for e in events if e["choices"]]
            text = "".join(c["text"] for c in choices)
            tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
            offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        else:
            choice = post(http, "/v1/completions", body)["choices"][0]
            text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
        assert text.startswith(PROMPT) and tokens[0] == "<|im_start|>" and offsets[0] == 0, (stream, tokens, offsets)
        assert offsets == sorted(offsets)
        for token, offset in zip(tokens[1:], offsets[1:], strict=True):
            assert text[offset:].startswith(token), (stream, token, offset, text)


def test_tokens_as_ids_and_continuous_usage(http, app_parts):
    body = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 2, "temperature": 0,
                                          "ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = body["choices"][0]["logprobs"]
    ids = app_parts[0].tokenize(body["choices"][0]["text"], add_special_tokens=False)
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert [int(t.split(":")[1]) for t in lp["tokens"]] == ids
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    chat = post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                               "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True})
    assert all(c["token"].startswith("token_id:") for c in chat["choices"][0]["logprobs"]["content"])
    # each chunk's choice's usage so far (with include_usage only), per choice with n = 2
    for route, body in (("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for include in (True, False):
            counts: dict[int, list[int]] = {0: [], 1: []}
            usage_chunks = 0
            with http.stream("POST", route, json={**body, "max_tokens": 5, "ignore_eos": True, "stream": True,
                                                  "n": 2, "temperature": 1.0, "seed": 3,
                                                  "stream_options": {"include_usage": include,
                                                                     "continuous_usage_stats": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        usage_chunks += chunk.get("usage") is not None
                        for c in chunk["choices"]:
                            if chunk.get("usage") is not None:
                                counts[c["index"]].append(chunk["usage"]["completion_tokens"])
            if not include:
                assert usage_chunks == 0, route
                continue
            for seen in counts.values():
                assert seen and seen == sorted(seen) and seen[-1] == 5, (route, counts)
            if "chat" in route:
                assert counts[0][0] == 0   # the role chunk


def test_documents_stop_reason_and_refusals(http, app_parts, caplog):
    engine = app_parts[0]
    messages = [{"role": "user", "content": "hi"}]
    docs = [{"title": "a", "text": "Berlin is in Germany."}]
    with_docs = post(http, "/v1/chat/completions", {"messages": messages, "documents": docs, "max_tokens": 1})
    rendered = "<doc>Berlin is in Germany.</doc><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert with_docs["usage"]["prompt_tokens"] == len(engine.tokenize(rendered, add_special_tokens=False))
    # the finishing chunk of a stream names the stop string
    stop = post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True})["choices"][0]["message"]["content"][2:4]
    last = None
    with http.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0,
                                                            "ignore_eos": True, "stop": [stop], "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    if c["finish_reason"]:
                        last = c
    assert last is not None and last["finish_reason"] == "stop" and last["stop_reason"] == stop
    # echo: the reply goes on from the assistant's last message and starts with it, streamed or not
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Paris is"}]
    greedy = {"messages": history, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
              "add_generation_prompt": False, "continue_final_message": True}
    plain = post(http, "/v1/chat/completions", greedy)["choices"][0]["message"]["content"]
    echoed = post(http, "/v1/chat/completions", {**greedy, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == "Paris is" + plain
    text = ""
    with http.stream("POST", "/v1/chat/completions", json={**greedy, "echo": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    assert text == echoed
    # a user message last, with a generation prompt: nothing to echo
    asked = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    assert (post(http, "/v1/chat/completions", {**asked, "echo": True})["choices"][0]["message"]["content"]
            == post(http, "/v1/chat/completions", asked)["choices"][0]["message"]["content"])
    for body, param in (({"bad_words": [" "]}, "bad_words"), ({"spaces_between_special_tokens": False},
                                                                 "spaces_between_special_tokens")):
        assert post(http, "/v1/chat/completions", {"messages": messages, **body}, status=400)["error"]["param"] == param
    # bad_words reach the engine (tests/test_engine.py checks what they ban)
    free = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    word = free["choices"][0]["text"].split()[0]
    banned = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                             "bad_words": [word]})
    assert banned["choices"][0]["text"] != free["choices"][0]["text"]
    with caplog.at_level(logging.WARNING):
        post(http, "/v1/completions", {"prompt": "x", "max_tokens": 1, "store": False, "metadata": {"a": 1},
                                       "x\nERROR forged" + "A" * 1000: 1})
    assert "request fields ignored (not supported): 'metadata', 'store', 'x\\nERROR forged" in caplog.text
    assert "A" * 100 not in caplog.text and "\nERROR forged" not in caplog.text
    for body, param in (({"prompt": "x", "echo": True, "logprobs": 2, "prompt_logprobs": -1}, "prompt_logprobs"),
                        ({"prompt": "x", "use_beam_search": True, "n": 2, "prompt_logprobs": 1}, "prompt_logprobs"),
                        ({"prompt": "x", "logprobs": -1}, "logprobs")):   # -1 (the whole vocabulary): offline only
        assert post(http, "/v1/completions", body, status=400)["error"]["param"] == param
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1}
    assert post(http, "/v1/chat/completions", chat, status=400)["error"]["param"] == "top_logprobs"
    for path, body, param in (("/v1/completions", {"prompt": "x", "logprobs": 2 ** 21}, "logprobs"),
                              ("/v1/chat/completions", {**chat, "top_logprobs": 2 ** 21}, "top_logprobs")):
        err = post(http, path, body, status=400)["error"]   # beyond any engine's count: named by this one's limit
        assert err["param"] == param and err["message"] == f"{param}: must be at most 20 (--max-logprobs)", err


def test_ping_request_id_and_cors(http):
    for method in ("GET", "POST"):
        assert http.request(method, "/ping").json() == {"status": "ok"}
    r = http.get("/v1/models", headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    assert "x-request-id" not in http.get("/v1/models").headers
    # a browser's preflight from an allowed origin passes (without the API key); another origin gets no grant
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = http.options("/v1/chat/completions", headers={**preflight, "Authorization": ""})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    r = http.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = http.get("/v1/models", headers={"Origin": "http://ui.example"})
    assert r.headers["access-control-allow-origin"] == "http://ui.example"


def own_front(model_dir):
    """A front of its own (an app's shutdown stops its front)."""
    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine

    return AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", selection="off")))


def test_api_key_under_a_root_path(model_dir):
    """Behind --root-path the server sees paths with the prefix in front: the key is still needed."""
    from starlette.testclient import TestClient

    from plinth.entrypoints.openai.api_server import build_app

    with TestClient(build_app(own_front(model_dir), api_key="sekret"), root_path="/api") as client:
        for path in ("/api/v1/models", "/api/tokenize", "/api/v1/other"):
            assert client.get(path).status_code == 401, path
        assert client.get("/api/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert client.get("/api/health").status_code == 200 and client.get("/api/metrics").status_code == 200


def test_the_api_schema_is_served_unless_disabled(model_dir):
    """``/openapi.json`` is served (``/docs`` and ``/redoc`` never are); ``--disable-fastapi-docs`` (vLLM's flag)
    turns it off; ``--enable-request-id-headers`` is taken (X-Request-Id is always echoed; with it, as in vLLM, a
    response to a request without one gets a new one)."""
    from starlette.testclient import TestClient

    from plinth.entrypoints.cli import build_parser
    from plinth.entrypoints.openai.api_server import build_app

    for openapi, status in ((True, 200), (False, 404)):
        with TestClient(build_app(own_front(model_dir), openapi=openapi)) as client:
            assert client.get("/openapi.json").status_code == status
            assert client.get("/docs").status_code == client.get("/redoc").status_code == 404
            r = client.get("/v1/models", headers={"X-Request-Id": "r-1"})
            assert r.headers["X-Request-Id"] == "r-1"
            assert "X-Request-Id" not in client.get("/v1/models").headers
    argv = ["serve", "--disable-fastapi-docs", "--enable-request-id-headers", "--max-log-len", "100"]
    args = build_parser(argv).parse_args(argv)
    assert args.disable_fastapi_docs and args.enable_request_id_headers and args.max_log_len == 100
    with TestClient(build_app(own_front(model_dir), api_key="k", request_id_headers=True)) as client:
        for path in ("/v1/models", "/health"):   # (a refusal too)
            ids = [client.get(path).headers.get("X-Request-Id") for _ in range(2)]
            assert all(i is not None and re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1], ids
        assert client.get("/health", headers={"X-Request-Id": "r-2"}).headers.get_list("X-Request-Id") == ["r-2"]

def test_reply_role(model_dir):
    """The reply's role, streamed and not (vLLM's rule): ``--response-role`` with ``add_generation_prompt``, the last
    message's own role without it (the reply continues that message, and ``echo`` repeats it)."""
    from starlette.testclient import TestClient

    from plinth.entrypoints.cli import build_parser
    from plinth.entrypoints.openai.api_server import build_app
    from plinth.entrypoints.serve_cmd import ServeError, check_tool_flags

    def roles(client, body):
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            first = next(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
        return whole["role"], first["choices"][0]["delta"]["role"], whole["content"]

    asked = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Paris is"}]
    going_on = {"messages": history, "max_tokens": 2, "temperature": 0, "add_generation_prompt": False,
                "continue_final_message": True, "echo": True}
    with TestClient(build_app(own_front(model_dir), response_role="bot")) as client:
        assert roles(client, asked)[:2] == ("bot", "bot")
        role, streamed, content = roles(client, going_on)
        assert role == streamed == "assistant" and content.startswith("Paris is")
    with TestClient(build_app(own_front(model_dir))) as client:
        assert roles(client, asked)[:2] == ("assistant", "assistant")
    argv = ["serve", "--response-role", "bot"]
    assert build_parser(argv).parse_args(argv).response_role == "bot"
    argv = ["serve", "--response-role", " "]
    with pytest.raises(ServeError, match="--response-role"):
        check_tool_flags(build_parser(argv).parse_args(argv))


def test_no_cors_by_default(model_dir):
    from starlette.testclient import TestClient

    from plinth.entrypoints.openai.api_server import build_app

    with TestClient(build_app(own_front(model_dir))) as client:
        r = client.options("/v1/models", headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in r.headers
        body = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 0}).json()
        assert not body["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_server_flag_checks(tmp_path, capsys):
    from plinth.entrypoints.cli import main
    from plinth.entrypoints.serve_cmd import ServeError, cors_settings

    def args(**kw):
        base = dict(allowed_origins=None, allow_credentials=False, allowed_methods=None, allowed_headers=None)
        return argparse.Namespace(**{**base, **kw})

    assert cors_settings(args()) is None
    got = cors_settings(args(allowed_origins='["http://a"]', allowed_methods='["GET", "POST"]'))
    assert got.allowed_origins == ("http://a",) and got.allowed_methods == ("GET", "POST")
    for bad, message in ((dict(allowed_origins="http://a"), "JSON list"),
                         (dict(allow_credentials=True), "need --allowed-origins"),
                         (dict(allowed_methods='["*"]'), "need --allowed-origins"),
                         (dict(allowed_origins='["*"]', allow_credentials=True), "explicit")):
        with pytest.raises(ServeError, match=message):
            cors_settings(args(**bad))
    key = tmp_path / "key.pem"
    key.write_text("x")
    assert main(["serve", "--ssl-keyfile", str(key)]) == 2
    assert "needs both --ssl-keyfile and --ssl-certfile" in capsys.readouterr().err
    assert main(["serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(tmp_path / "none.pem")]) == 2
    assert "is not a file" in capsys.readouterr().err
    # files that are no key and certificate are refused before anything loads, naming both
    assert main(["serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(key)]) == 2
    err = capsys.readouterr().err
    assert f"--ssl-keyfile {str(key)!r} and --ssl-certfile {str(key)!r} cannot serve HTTPS" in err
    assert "Uvicorn running" not in err and "Traceback" not in err
    # vLLM's --enable-auto-tool-choice needs a parser, as in vLLM (checked before anything loads, run-batch too)
    batch = tmp_path / "in.jsonl"
    batch.write_text("")
    for command in (["serve"], ["run-batch", "-i", str(batch), "-o", str(tmp_path / "out.jsonl")]):
        assert main([*command, "--enable-auto-tool-choice"]) == 2
        assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--uvicorn-log-level", "loud"])
    assert "--uvicorn-log-level: invalid choice" in capsys.readouterr().err
    for timeout in ("inf", "nan", "-1"):   # inf overflowed the join that bounds the shutdown, hiding the real error
        assert main(["serve", "--shutdown-timeout", timeout]) == 2
        assert "--shutdown-timeout must be between 0 and 604800 seconds" in capsys.readouterr().err
    for key in ("", "  "):   # --api-key "$KEY" with KEY unset would serve an open API
        assert main(["serve", "--api-key", key]) == 2
        assert "--api-key is empty" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as mp:   # PLINTH_API_KEY=$KEY with KEY unset: the same
        mp.setenv("PLINTH_API_KEY", " ")
        assert main(["serve"]) == 2
        assert "PLINTH_API_KEY is set but empty" in capsys.readouterr().err
    # a key no client can send (HTTP strips a header's outer whitespace, carries no newline) would make every
    # request a 401: refused before anything loads
    for key in ("sekret\n", " sekret", "sek\tret"):
        assert main(["serve", str(tmp_path / "no-such-model"), "--api-key", key]) == 2
        assert "--api-key has whitespace at an end or a control character" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as mp:   # (a key file read with its newline)
        mp.setenv("PLINTH_API_KEY", "sekret\n")
        assert main(["serve", str(tmp_path / "no-such-model")]) == 2
        assert "PLINTH_API_KEY has whitespace at an end" in capsys.readouterr().err
    # a model path that does not exist fails before the port is bound (and announced as running)
    port = free_port()
    assert main(["serve", str(tmp_path / "no-such-model"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Uvicorn running" not in err


def test_llm_dict_prompts(model_dir):
    llm = LLM(str(model_dir), dtype="float32", selection="off")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = llm.engine.tokenize(PROMPT)
    expected = llm.generate([PROMPT, ids], params)
    got = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids}], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.generate({"prompt_token_ids": torch.tensor(ids)}, params)[0].outputs[0].token_ids == \
        expected[1].outputs[0].token_ids
    for bad, message in (({"text": "x"}, "exactly one"), ({"prompt": "x", "prompt_embeds": [1]}, "exactly one"),
                         ({"prompt": [1, 2]}, "must be text"), ({"prompt_token_ids": "abc"}, "list of token ids"),
                         ({"prompt": "x", "multi_modal_data": {}}, "takes no image inputs"),
                         ({"prompt": "x", "mm_processor_kwargs": {}}, "give them in 'multi_modal_data'"),
                         ({"prompt": "x", "image": 1}, "unknown keys: 'image'")):
        with pytest.raises(ValueError, match=message):
            llm.generate(bad, params)


def test_served_model_aliases_and_vllm_flags(model_dir):
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.cli import build_parser
    from plinth.entrypoints.engine_args import engine_config_from_args
    from plinth.entrypoints.openai.api_server import build_app

    argv = ["serve", str(model_dir), "--served-model-name", "tiny", "alias", "--enable-prefix-caching",
            "--disable-log-requests"]
    config = engine_config_from_args(build_parser(argv).parse_args(argv))
    assert (config.model.served_model_name, config.model.served_model_aliases) == ("tiny", ("alias",))
    assert config.cache.enable_prefix_caching
    from plinth.config import ConfigError

    argv = ["serve", "--served-model-name", "tiny", str(model_dir)]   # the path would be read as a second name
    with pytest.raises(ConfigError, match="put the model before --served-model-name"):
        engine_config_from_args(build_parser(argv).parse_args(argv))
    argv = ["serve", "--no-prefix-caching"]
    assert not engine_config_from_args(build_parser(argv).parse_args(argv)).cache.enable_prefix_caching
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", selection="off",
                                                served_model_name=["tiny", "alias"]))
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "alias"]
        r = client.post("/v1/completions", json={"model": "alias", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        assert client.get("/v1/models/alias").json()["id"] == "alias"
        assert client.post("/v1/completions", json={"model": "other", "prompt": "hi"}).status_code == 404


def test_max_logprobs_flag(model_dir):
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", selection="off",
                                                max_logprobs=30))
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                      "logprobs": True, "top_logprobs": 25})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 11})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "at most 10" in r.json()["error"]["message"]
        # echo reaches beam-search replies too
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Paris is"}]
        r = client.post("/v1/chat/completions", json={"messages": history, "add_generation_prompt": False,
                                                      "continue_final_message": True, "echo": True, "max_tokens": 3,
                                                      "use_beam_search": True, "n": 2})
        assert r.status_code == 200 and all(c["message"]["content"].startswith("Paris is") for c in r.json()["choices"])
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 31})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        assert "--max-logprobs" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "logprobs": True, "top_logprobs": 31})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_sigterm_while_starting_interrupts_like_ctrl_c(capsys, monkeypatch):
    """Until the server runs, SIGTERM interrupts the start as Ctrl-C does (what was started is stopped in the
    finally blocks and the reason is said), and the previous handler comes back."""
    import os
    import signal
    import time

    from plinth.entrypoints import serve_cmd
    from plinth.entrypoints.cli import main

    def starting(args, startup):
        os.kill(os.getpid(), signal.SIGTERM)   # while the model would be loading
        time.sleep(10)   # the handler raises before this ends
        return 0

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(serve_cmd, "_serve", starting)
    t0 = time.monotonic()
    assert main(["serve"]) == 130
    assert time.monotonic() - t0 < 5 and "plinth serve: interrupted" in capsys.readouterr().err
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # the finalizer's interrupt
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_whose_interrupt_a_finalizer_swallows_still_stops_the_start(capsys, monkeypatch, sig):
    """A stop signal landing while the collector runs a finalizer (as when the start's garbage collection ends just
    before the server runs): the interrupt raised there is dropped ("Exception ignored in ..."), but the start
    still stops before the server runs (it used to serve on until a second signal)."""
    import os
    import signal
    import time

    from plinth.entrypoints import serve_cmd
    from plinth.entrypoints.cli import main

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), getattr(signal, sig))
            time.sleep(0.5)   # the handler runs in here; its KeyboardInterrupt cannot leave a finalizer

    went_on = []

    def starting(args, startup):
        Finalized()   # dropped at once: its finalizer runs
        went_on.append(True)   # the interrupt was swallowed
        serve_cmd._stop_if_requested()   # where the real start checks, just before the server runs
        return 0

    monkeypatch.setattr(serve_cmd, "_serve", starting)
    assert main(["serve"]) == 130
    assert went_on and "plinth serve: interrupted" in capsys.readouterr().err


def test_stop_signals_graceful_then_cut_short_then_forced():
    """SIGTERM once: the graceful stop; twice: the grace ends at once (the engine aborts what is left); a third:
    the exit is forced (uvicorn alone forces only on a second SIGINT, never on SIGTERM)."""
    import signal

    import uvicorn

    from plinth.entrypoints.serve_cmd import _server_class

    aborted = []
    server = _server_class()(uvicorn.Config(app=None), 60.0, lambda: aborted.append(True))
    server.handle_exit(signal.SIGTERM, None)
    assert (server.should_exit, server.force_exit, aborted) == (True, False, [])
    server.handle_exit(signal.SIGTERM, None)
    assert (server.force_exit, aborted) == (False, [True])
    server.handle_exit(signal.SIGTERM, None)
    assert server.force_exit


def test_force_include_usage_ends_every_stream_with_its_usage(model_dir):
    """``--enable-force-include-usage`` (vLLM's): a stream that did not ask for its usage ends with it anyway; vLLM's
    logging flags are accepted."""
    from starlette.testclient import TestClient

    from plinth.entrypoints.cli import build_parser
    from plinth.entrypoints.openai.api_server import build_app

    def chunks(client, path, body):
        with client.stream("POST", path, json={**body, "max_tokens": 3, "temperature": 0, "stream": True,
                                                    "ignore_eos": True}) as r:
            assert r.status_code == 200
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for force in (True, False):
        with TestClient(build_app(own_front(model_dir), force_include_usage=force)) as client:
            for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi"})):
                got = chunks(client, path, body)
                if force:
                    assert got[-1]["usage"]["completion_tokens"] == 3 and got[-1]["choices"] == []
                    assert all(c["usage"] is None for c in got[:-1])
                else:
                    assert all("usage" not in c for c in got)
    argv = ["serve", "--enable-force-include-usage", "--enable-log-requests", "--disable-uvicorn-access-log",
            "--enable-prompt-tokens-details"]
    args = build_parser(argv).parse_args(argv)
    assert args.enable_force_include_usage and args.access_log is False
