"""The OpenAI-compatible server, through real ``plinth serve`` processes on 127.0.0.1.

References: greedy texts and token counts come from an in-process ``LLMEngine`` on the same
model and the same tokenizer; logprobs from a float64 transformers forward pass.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_utils import make_tiny_model, running_server, scrape_metrics

pytestmark = pytest.mark.server

API_KEY = "test-key-1234"
MAX_MODEL_LEN = 1024
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(model_dir: Path):
    args = [str(model_dir), "--selection", "off", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2",
            "--max-waiting-requests", "4", "--served-model-name", "tiny"]
    with running_server(args, env={"PLINTH_API_KEY": API_KEY}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    """The in-process reference engine, configured like the server."""
    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", max_model_len=MAX_MODEL_LEN))


def offline(engine, prompt, **params):
    """Run one request to completion on the reference engine."""
    from plinth.core.request import SamplingParams

    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(**params))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


def chat_ids(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def headers(key: str | None = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def post(server, path: str, body, key: str | None = API_KEY, timeout: float | httpx.Timeout = 60) -> httpx.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.base_url}{path}", content=data, timeout=timeout,
                      headers={"Content-Type": "application/json", **headers(key)})


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ----------------------------------------------------------------------------------------- basics


def test_health_version_models_and_auth(server, client):
    assert httpx.get(f"{server.base_url}/health").status_code == 200          # open without a key
    version = httpx.get(f"{server.base_url}/version").json()
    import plinth

    assert version["version"] == plinth.__version__
    assert version["selection"]["kind"] == "attention_backend" and version["selection"]["winner"]
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200         # documented as open
    assert_error(httpx.get(f"{server.base_url}/v1/models"), 401, code="invalid_api_key")
    assert_error(httpx.get(f"{server.base_url}/v1/models", headers=headers("wrong")), 401, code="invalid_api_key")
    resp = httpx.get(f"{server.base_url}/v1/models", headers=headers())
    assert resp.status_code == 200
    assert [m["id"] for m in resp.json()["data"]] == ["tiny"]
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0).models.list()
    assert_error(post(server, "/v1/completions", {"prompt": "x"}, key="wrong"), 401)
    assert_error(post(server, "/v1/completions", "{not json", key=None), 401)   # auth before parsing


def test_completion_greedy_matches_reference(client, engine):
    ref = offline(engine, PROMPT, temperature=0.0, max_tokens=12)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == str(ref.outputs[0].finish_reason)
    assert resp.usage.prompt_tokens == len(engine.tokenizer(PROMPT)["input_ids"])
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == resp.usage.model_dump(
        exclude={"prompt_tokens_details"})   # the second run finds the prompt cached


def test_logit_bias_matches_the_reference_engine(client, engine):
    """logit_bias (token-id strings to values in [-100, 100]) changes greedy outputs as the in-process
    engine with the same bias does; -100 bans a token and +100 forces one."""
    plain = offline(engine, PROMPT, temperature=0.0, max_tokens=6, ignore_eos=True)
    banned = plain.outputs[0].token_ids[0]
    bias = {banned: -100.0, 300: 4.0}
    ref = offline(engine, PROMPT, temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias=bias)
    assert banned not in ref.outputs[0].token_ids
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                     logit_bias={str(k): v for k, v in bias.items()}, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == ref.outputs[0].text
    messages = [{"role": "user", "content": "Say something."}]
    forced = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=4, temperature=0.7,
                                            logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].message.content == engine.tokenizer.decode([300] * 4)
    # vLLM's allowed_token_ids: the same as the reference engine with the same restriction
    allowed = [300, 301, 302]
    ref = offline(engine, PROMPT, temperature=0.0, max_tokens=5, ignore_eos=True, allowed_token_ids=allowed)
    assert set(ref.outputs[0].token_ids) <= set(allowed)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert resp.choices[0].text == ref.outputs[0].text


def test_tokenize_and_detokenize_match_the_tokenizer(server, engine):
    """/tokenize gives the ids the completion and chat routes feed the model (a prompt with special tokens,
    messages through the chat template), /detokenize the tokenizer's text; both need the API key."""
    tok = engine.tokenizer
    resp = post(server, "/tokenize", {"prompt": PROMPT})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == tok(PROMPT)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN and "token_strs" not in body
    messages = [{"role": "user", "content": "Hello there"}]
    body = post(server, "/tokenize", {"messages": messages, "return_token_strs": True}).json()
    assert body["tokens"] == chat_ids(engine, messages)
    assert len(body["token_strs"]) == body["count"]
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])   # the vocabulary's strings, as vLLM
    assert tok.convert_tokens_to_string(body["token_strs"]) == tok.decode(body["tokens"])
    ids = body["tokens"]
    resp = post(server, "/detokenize", {"tokens": ids})
    assert resp.status_code == 200 and resp.json() == {"prompt": tok.decode(ids)}
    assert_error(post(server, "/tokenize", {"prompt": "x"}, key=None), 401)
    assert_error(post(server, "/detokenize", {"tokens": [1]}, key="wrong"), 401)
    assert_error(post(server, "/tokenize", {"prompt": "x", "messages": messages}), 400, param="messages")
    assert_error(post(server, "/tokenize", {}), 400, param="prompt")
    assert_error(post(server, "/tokenize", {"prompt": "x", "model": "other"}), 404)
    assert_error(post(server, "/detokenize", {"tokens": [1, 10**6]}), 400, param="tokens")
    assert_error(post(server, "/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}), 400, param="tokens")
    assert_error(post(server, "/detokenize", {"tokens": "abc"}), 400, param="tokens")


def test_structured_outputs_in_both_routes(server, client):
    """response_format json_object / json_schema (OpenAI) and vLLM's guided_* fields constrain the text;
    a malformed or uncompilable constraint is a 400 naming its field."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": "Answer in JSON."}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=40, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "answer", "schema": schema}})
    choice = resp.choices[0]
    if choice.finish_reason == "stop":
        assert set(json.loads(choice.message.content)) == {"ok"}
    else:   # the random model may run out of tokens inside a string or whitespace; what it wrote is a JSON prefix
        assert choice.message.content.lstrip().startswith("{")
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=1,
                                     extra_body={"guided_choice": ["red", "green", "blue"]})
    assert resp.choices[0].text in ("red", "green", "blue") and resp.choices[0].finish_reason == "stop"
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=2,
                                     extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", resp.choices[0].text)
    resp = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=30, temperature=0,
                                          response_format={"type": "json_object"})
    assert resp.choices[0].message.content.lstrip().startswith("{")
    bad = [
        ({"prompt": "x", "guided_regex": "("}, "guided_regex"),
        ({"prompt": "x", "guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"prompt": "x", "guided_choice": []}, "guided_choice"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
        ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
        ({"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ]
    for body, param in bad:
        assert_error(post(server, "/v1/completions", body), 400, param=param)
    assert_error(post(server, "/v1/chat/completions", {"messages": messages, "response_format": {"type": "yaml"}}),
                 400, param="response_format")


def test_completion_prompt_forms_and_n(client, engine):
    ids = engine.tokenizer(PROMPT)["input_ids"]
    by_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    prompts = [PROMPT, "Hello world"]
    ref = [offline(engine, p, temperature=0.0, max_tokens=8) for p in prompts]
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref for _ in range(2)]
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert resp.usage.completion_tokens == 2 * sum(len(r.outputs[0].token_ids) for r in ref)
    batch_ids = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=8, temperature=0)
    assert [c.text for c in batch_ids.choices] == [by_text.choices[0].text] * 2
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, n=2,
                                           stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in resp.choices]


def test_streamed_prompts_beyond_the_batch_start_before_the_last_is_admitted(client, engine):
    """Four prompts on a server running two at a time: the stream starts once the engine has taken
    every prompt, not once every prompt has its first token (the last two wait for the first two to
    finish), so the first prompts' tokens arrive as they are made."""
    prompts = [f"{PROMPT} {i}" for i in range(4)]
    ref = [offline(engine, p, temperature=0.0, max_tokens=48, ignore_eos=True) for p in prompts]
    order: list[tuple[int, str | None]] = []
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=48, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            order.append((c.index, c.finish_reason))
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == [r.outputs[0].text for r in ref]
    first_of_0 = next(k for k, (i, _) in enumerate(order) if i == 0)
    assert order[first_of_0][1] is None, "prompt 0 arrived only once finished"
    assert sum(1 for i, _ in order if i == 0) > 2
    first_of_last = next(k for k, (i, _) in enumerate(order) if i == 3)
    assert first_of_0 < first_of_last


def test_completion_logprobs_match_float64_reference(client, engine, model_dir):
    from transformers import LlamaForCausalLM

    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    n = resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    ref = offline(engine, PROMPT, temperature=0.0, max_tokens=6)
    out_ids = ref.outputs[0].token_ids
    for token, tid in zip(lp.tokens, out_ids, strict=True):
        text = engine.tokenizer.decode([tid])
        # a token holding part of a UTF-8 character is named by its bytes, as OpenAI does
        assert token == text if "\ufffd" not in text else token.startswith("bytes:\\x")
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        all_ids = torch.tensor([ref.prompt_token_ids + out_ids])
        logp = torch.log_softmax(model(all_ids).logits[0], dim=-1)   # [seq, vocab]
    p = len(ref.prompt_token_ids)
    for i, tid in enumerate(out_ids):
        row = logp[p - 1 + i]
        assert lp.token_logprobs[i] == pytest.approx(row[tid].item(), abs=2e-4)
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert len(lp.top_logprobs[i]) <= 3
        assert top[0] == pytest.approx(row.max().item(), abs=2e-4)   # greedy: the chosen one is the best
        assert top == pytest.approx(row.topk(len(top)).values.tolist(), abs=2e-4)
    text = resp.choices[0].text   # each token starts at its offset (a byte token's name is not its text)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for token, start in zip(lp.tokens, lp.text_offset, strict=True):
        assert token.startswith("bytes:") or text[start:start + len(token)] == token


def test_completion_top_logprobs_hold_the_sampled_token(server):
    """OpenAI's completions "always return the logprob of the sampled token, so there may be up to logprobs+1
    elements": sampled at a high temperature, the chosen token is often outside the top k."""
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 3.0, "seed": 7, "logprobs": 1, "ignore_eos": True}
    lp = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    outside = 0
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[token] == chosen and len(top) <= 2
        outside += len(top) == 2
    assert outside > 0   # the case this is about happened


def test_completion_text_offsets_count_characters_of_byte_tokens(server, engine):
    """``text_offset`` is where each token starts in the returned text, in characters: tokens that hold part of a
    UTF-8 character (named ``bytes:\\x..``) advance it only once the character is whole."""
    prompt = "Emoji: \U0001F44B\U0001F600 caf\u00e9 \u4e2d\u6587 ok"
    seen = []
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0, "echo": True, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=headers(),
                              timeout=60) as resp:
                chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                          if line.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                      for t in c["choices"][0]["logprobs"]["tokens"]]
            offsets = [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                       for o in c["choices"][0]["logprobs"]["text_offset"]]
        else:
            choice = post(server, "/v1/completions", body).json()["choices"][0]
            text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
        assert any(t.startswith("bytes:") for t in tokens)   # the prompt's emoji are byte tokens here
        assert offsets == sorted(offsets) and offsets[-1] <= len(text)
        special = set(engine.tokenizer.all_special_tokens)   # left out of the text (skip_special_tokens)
        for token, start in zip(tokens, offsets, strict=True):
            if not token.startswith("bytes:") and token not in special:
                assert text[start:start + len(token)] == token, (token, start, stream)
        seen.append((text, tokens, offsets))
    assert seen[0] == seen[1]   # streamed as returned whole


def test_completion_text_offset_after_an_unfinished_character(server, engine):
    """A byte token that starts a UTF-8 character the next token does not finish shows as one replacement
    character in the text; the next token starts after it."""
    tok = engine.tokenizer
    lead = tok.convert_tokens_to_ids("\u00e2")   # byte-level BPE's token for the byte 0xE2 (starts a 3-byte character)
    word = tok.encode("o", add_special_tokens=False)
    assert lead != tok.unk_token_id and len(word) == 1
    body = {"prompt": [lead, word[0], lead, lead], "max_tokens": 1, "temperature": 0, "logprobs": 0, "echo": True}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    assert text.startswith("\ufffdo\ufffd"), text
    assert offsets[:4] == [0, 1, 2, 3], (text, offsets)   # the second 0xE2 is cut short by the third one


def test_null_means_the_default_and_other_request_checks(server):
    """An explicit null for a field with a default is that default (clients send null for unset fields); seeds
    outside 64 bits are 400s; an assistant message's refusal part is its text."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field in ("n", "logprobs", "stream", "echo", "add_generation_prompt", "temperature"):
        resp = post(server, "/v1/chat/completions", {**chat, field: None})
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 1, (field, resp.text)
    for field in ("n", "echo", "stream"):
        resp = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, field: None})
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 1, (field, resp.text)
    from plinth.entrypoints.openai.protocol import CompletionRequest

    # completions' max_tokens: null is a value of its own (up to the context), not the default 16
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens is None
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens == 16
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "seed": 2**64}), 400, "seed")
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "seed": -(2**63) - 1}), 400, "seed")
    assert post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "seed": -(2**63)}).status_code == 200
    refused = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "refusal",
                                                                                    "refusal": "I cannot."}]},
               {"role": "user", "content": "why?"}]
    assert post(server, "/v1/chat/completions", {"messages": refused, "max_tokens": 2}).status_code == 200
    refused[0]["content"] = [{"type": "refusal", "refusal": "no"}]   # only an assistant's reply holds one
    assert_error(post(server, "/v1/chat/completions", {"messages": refused, "max_tokens": 2}), 400, "messages")


def test_truncated_prompts_may_exceed_the_context(server):
    """With ``truncate_prompt_tokens`` the prompt is cut to its last N tokens, however long its text (up to
    MAX_TRUNCATED_CHARS), on both routes; without it such text is refused before tokenizing."""
    long_text = "hello world " * (20 * MAX_MODEL_LEN)
    for path, body in (("/v1/completions", {"prompt": long_text}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]})):
        resp = post(server, path, {**body, "max_tokens": 1, "truncate_prompt_tokens": 20})
        assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == 20, resp.text
        assert_error(post(server, path, {**body, "max_tokens": 1}), 400, code="context_length_exceeded")


def test_requests_refused_on_arrival_are_not_counted_as_errors(server):
    before = scrape_metrics(server.base_url)
    assert_error(post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}), 400, "logit_bias")
    after = scrape_metrics(server.base_url)
    key = "plinth_requests_finished_total{finish_reason=error}"
    assert after.get(key, 0.0) == before.get(key, 0.0)


def test_completion_echo(server, client, engine):
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    choice = resp.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    n_prompt = resp.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == n_prompt + resp.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in choice.logprobs.token_logprobs[1:])
    # max_tokens 0: the prompt and its logprobs only (scoring), the same prompt entries as above, two choices alike
    only = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, n=2)
    assert [c.text for c in only.choices] == [PROMPT, PROMPT] and only.usage.completion_tokens == 0
    assert all(c.finish_reason == "length" for c in only.choices)
    for c in only.choices:
        assert c.logprobs.tokens == choice.logprobs.tokens[:n_prompt]
        assert c.logprobs.token_logprobs == pytest.approx(choice.logprobs.token_logprobs[:n_prompt], abs=1e-5)
        assert c.logprobs.text_offset == choice.logprobs.text_offset[:n_prompt]
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}), 400, "max_tokens")
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                             "stream": True}), 400, "stream")
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                             "min_tokens": 3}), 400, "min_tokens")


def test_stop_string(client, engine):
    full = offline(engine, PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True).outputs[0].text
    k = next(i for i in range(2, len(full) - 2) if full.find(full[i:i + 2]) == i and full[i:i + 2].strip())
    stop = full[k:k + 2]
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == full[:k]
    assert resp.choices[0].finish_reason == "stop"
    chat_stop = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = chat_stop.choices[0].message.content
    j = next(i for i in range(1, len(text) - 1) if text.find(text[i]) == i and text[i].strip())
    cut = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                                         temperature=0, stop=text[j], extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == text[:j] and cut.choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    def sample(seed: int, n: int = 1) -> list[str]:
        resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                         n=n, extra_body={"ignore_eos": True})
        return [c.text for c in resp.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    pair = sample(1234, n=2)
    assert pair == sample(1234, n=2) and pair[0] != pair[1]
    messages = [{"role": "user", "content": "tell me something"}]
    chats = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=1.0, seed=7)
             .choices[0].message.content for _ in range(2)]
    assert chats[0] == chats[1]


# ----------------------------------------------------------------------------------------- chat


def test_chat_matches_reference_stream_and_usage(client, engine):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world"}]
    ids = chat_ids(engine, messages)
    ref = offline(engine, ids, temperature=0.0, max_tokens=10)
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.choices[0].finish_reason == str(ref.outputs[0].finish_reason)

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == msg.content
    assert with_choices[-1].choices[0].finish_reason == resp.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == resp.usage.model_dump(
        exclude={"prompt_tokens_details"})
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_chunks_have_openai_shape(server):
    """Raw chunks as OpenAI sends them: the role only in the first delta, no null ``role``/``content`` keys, an empty
    delta with the finish reason, and ``"usage": null`` only when the usage was asked for; an empty ``model`` is the
    served one."""
    def chunks(path: str, body: dict) -> list[dict]:
        with httpx.stream("POST", f"{server.base_url}{path}", json={"model": "", **body}, headers=headers(),
                          timeout=60) as resp:
            assert resp.status_code == 200, resp.read()
            return [json.loads(line[6:]) for line in resp.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]

    chat = {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 6, "temperature": 0,
            "stream": True}
    got = chunks("/v1/chat/completions", chat)
    deltas = [c["choices"][0]["delta"] for c in got]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert all(v is not None for d in deltas for v in d.values())
    assert deltas[-1] == {} and got[-1]["choices"][0]["finish_reason"] is not None
    assert all("usage" not in c for c in got)
    with_usage = chunks("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in with_usage[:-1]) and with_usage[-1]["usage"]["completion_tokens"] > 0
    completion = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    assert all("usage" not in c for c in chunks("/v1/completions", completion))
    with_usage = chunks("/v1/completions", {**completion, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in with_usage[:-1]) and with_usage[-1]["usage"]["completion_tokens"] > 0


def test_chat_n_logprobs_and_max_completion_tokens(client, engine):
    messages = [{"role": "user", "content": "count to ten"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, n=2, temperature=1.0, seed=3,
                                          max_completion_tokens=5, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 10
    for c in resp.choices:
        assert c.finish_reason == "length"
        content = c.logprobs.content
        assert len(content) == 5
        # the tokens' bytes spell the message
        assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == c.message.content
        for t in content:
            assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
            assert t.logprob <= 0
            assert t.bytes == list(t.token.encode()) or t.token.startswith("bytes:")
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model="tiny", messages=messages, n=2, temperature=1.0, seed=3,
                                                max_completion_tokens=5, stream=True,
                                                extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[0], streamed[1]] == [c.message.content for c in resp.choices]


# ----------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ("/v1/completions", {"prompt": [99999]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),                    # missing field (pydantic)
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "priority": 1}, "priority"),   # the server runs first come, first served
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "priority": -2}, "priority"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}},
     "logit_bias"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                              "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ("/v1/completions", {"prompt": [1, -5], "echo": True, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2**40], "echo": True, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["Hi"] * 20, "n": 128, "max_tokens": 1}, "n"),
    ("/v1/completions", {"prompt": "x", "stream": 5}, "stream"),
    # wrong JSON types are refused, not converted (OpenAI types these fields boolean or integer)
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": [305, True]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 2.0}, "n"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "priority": 0.0}, "priority"),   # a type error, not fcfs refusing 1
    ("/v1/completions", {"prompt": "x", "priority": False}, "priority"),
    ("/v1/completions", {"prompt": "x", "temperature": "0"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "seed": 3.0}, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": "5"}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2.0}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": ["3"]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "skip_special_tokens": "off"},
     "skip_special_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "stream_options": {"include_usage": "true"}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "3"},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": "x"}, "stream_options"),
    ("/v1/completions", '{"prompt": "x", "temperature": Infinity}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "repetition_penalty": Infinity}', "repetition_penalty"),
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\udc00"}]}', "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     "modalities"),
])
def test_invalid_parameters_are_400_naming_the_field(server, path, body, param):
    assert_error(post(server, path, body), 400, param=param)


def test_error_paths_keep_list_indices_and_unreachable_min_tokens_is_refused(server):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"content": "c"}]
    err = assert_error(post(server, "/v1/chat/completions", {"messages": messages}), 400, "messages")
    assert "messages[2].role" in err["message"]
    err = assert_error(post(server, "/v1/completions", {"prompt": [[1, "a"]]}), 400, "prompt")
    assert "prompt[0][1]" in err["message"] and "integer" in err["message"]
    err = assert_error(post(server, "/v1/chat/completions", {"messages": messages[:1], "min_tokens": 10**9}), 400,
                       "min_tokens")
    assert str(MAX_MODEL_LEN) in err["message"]
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": None, "min_tokens": MAX_MODEL_LEN}),
                 400, "min_tokens")
    # a field name that is not valid Unicode: said so (the body is an object)
    err = assert_error(post(server, "/v1/completions", '{"prompt": "x", "max_tokens": 2, "x\\ud800": 1}'), 400)
    assert "field name of the request body is not valid Unicode" in err["message"]


def test_text_that_cannot_fit_is_refused_before_tokenizing(server, client, engine):
    from plinth.entrypoints.openai.serving import MAX_CHARS_PER_TOKEN

    per_token = max(MAX_CHARS_PER_TOKEN, max(len(t) for t in engine.tokenizer.get_vocab()))
    huge = "a" * (per_token * MAX_MODEL_LEN + 1)
    err = assert_error(post(server, "/v1/completions", {"prompt": huge}), 400, "prompt", "context_length_exceeded")
    assert f"{len(huge)} characters" in err["message"]
    err = assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}), 400,
                       "messages", "context_length_exceeded")
    # each prompt of a batch has its own context: many prompts that each fit pass the text check together
    # (this server holds 2 running and 4 waiting: so many prompts at once can never run, a 400 that says so)
    batch = ["hello " * 60] * (2 * per_token * MAX_MODEL_LEN // len("hello " * 60))
    err = assert_error(post(server, "/v1/completions", {"prompt": batch, "max_tokens": 1}), 400, "prompt")
    assert "characters" not in err["message"] and f"{len(batch)} sequences" in err["message"], err
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=2).choices[0].text is not None


def test_malformed_json_unknown_model_and_route(server, client, model_dir):
    assert_error(post(server, "/v1/completions", '{"prompt": "x",'), 400, code="invalid_json")
    # with --served-model-name, the model's path is no name of it
    assert_error(post(server, "/v1/completions", {"model": str(model_dir), "prompt": "x"}), 404, "model",
                 "model_not_found")
    assert_error(post(server, "/v1/chat/completions", b"\xff\xfe"), 400)
    assert_error(post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model", "model_not_found")
    assert_error(post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
                 404, "model", "model_not_found")
    assert_error(httpx.get(f"{server.base_url}/v1/models/gpt-9", headers=headers()), 404)
    assert_error(httpx.get(f"{server.base_url}/v1/models/", headers=headers()), 404, "model", "model_not_found")
    assert_error(httpx.get(f"{server.base_url}/v1/nothing-here", headers=headers()), 404)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", temperature=-3)
    assert info.value.status_code == 400


def test_prompt_too_long_names_both_numbers(server, engine):
    long_prompt = "hello world " * 700
    n = len(engine.tokenizer(long_prompt)["input_ids"])
    assert n > MAX_MODEL_LEN
    err = assert_error(post(server, "/v1/completions", {"prompt": long_prompt}), 400, "prompt", "context_length_exceeded")
    assert str(n) in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    short = "hello world " * 100
    m = len(engine.tokenizer(short)["input_ids"])
    err = assert_error(post(server, "/v1/completions", {"prompt": short, "max_tokens": MAX_MODEL_LEN}), 400,
                       "max_tokens", "context_length_exceeded")
    assert str(m) in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    err = assert_error(post(server, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": long_prompt}]}), 400, "messages")
    assert str(MAX_MODEL_LEN) in err["message"]


def test_queue_full_is_503_with_retry_after(server):
    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers(), timeout=60) as http:
            body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            return list(await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(16))))

    before = scrape_metrics(server.base_url)
    responses = asyncio.run(flood())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 503}, codes
    # the refused requests never ran (or, for the list, were taken back): no finished request, no abort, no error
    after = scrape_metrics(server.base_url)
    served = sum(len(r.json()["choices"]) for r in responses if r.status_code == 200)
    finished = [k for k in after if k.startswith("plinth_requests_finished_total")]
    assert sum(after[k] - before.get(k, 0) for k in finished) == served
    for reason in ("error", "abort"):
        key = f"plinth_requests_finished_total{{finish_reason={reason}}}"
        assert after.get(key, 0) == before.get(key, 0), reason
    for r in responses:
        if r.status_code == 503:
            assert_error(r, 503, code="queue_full")
            assert int(r.headers["Retry-After"]) >= 1
        else:
            assert r.json()["usage"]["completion_tokens"] == 40


def test_a_request_larger_than_the_engine_holds_is_a_400_not_a_503(server):
    """A request whose sequences exceed the running batch and the waiting queue together (2 + 4 here) can never run,
    even on an idle server: a 400 naming the field, not a 503 that clients retry forever. Nothing of it runs."""
    before = scrape_metrics(server.base_url)
    body = {"prompt": [PROMPT] * 7, "max_tokens": 2}
    err = assert_error(post(server, "/v1/completions", body), 400, "prompt")
    assert "7 sequences" in err["message"] and "2 + 4" in err["message"], err
    assert_error(post(server, "/v1/completions", {**body, "prompt": [PROMPT] * 4, "n": 2}), 400, "n")
    assert_error(post(server, "/v1/completions", {**body, "prompt": PROMPT, "n": 7}), 400, "n")
    assert_error(post(server, "/v1/completions", {**body, "prompt": [PROMPT] * 4, "n": 2, "use_beam_search": True}),
                 400, "prompt")
    # six at once fit
    assert len(post(server, "/v1/completions", {**body, "prompt": [PROMPT] * 3, "n": 2}).json()["choices"]) == 6
    after = scrape_metrics(server.base_url)
    key = "plinth_requests_finished_total{finish_reason=length}"
    assert after[key] - before.get(key, 0) == 3   # one per prompt: nothing of the refused ones ran


def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    before = scrape_metrics(server.base_url)
    # 1,000 tokens take far longer than 0.1 s (a step of the tiny model costs ~0.2 ms of host time or more; at 0.5 s
    # a fast CPU finished the request before the client gave up)
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True},
             timeout=httpx.Timeout(60, read=0.1))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = scrape_metrics(server.base_url)
        # the abort is counted when the client goes away; the engine frees the request's blocks at its next step
        if (m["plinth_requests_finished_total{finish_reason=abort}"] > before["plinth_requests_finished_total{finish_reason=abort}"]
                and m["plinth_num_requests_running"] == 0 and m["plinth_kv_cache_usage_ratio"] == 0.0):
            break
        time.sleep(0.1)
    assert m["plinth_requests_finished_total{finish_reason=abort}"] == before["plinth_requests_finished_total{finish_reason=abort}"] + 1
    assert m["plinth_num_requests_running"] == 0 and m["plinth_kv_cache_usage_ratio"] == 0.0
    assert m["plinth_generation_tokens_total"] - before["plinth_generation_tokens_total"] < 1000
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_server_keeps_serving_after_errors_and_never_logs_the_key(server, client):
    for _ in range(3):
        post(server, "/v1/completions", "{{{")
        post(server, "/v1/completions", {"prompt": "x", "temperature": -1})
        post(server, "/v1/completions", {"prompt": "x"}, key="wrong")
    # ignore_eos: the random model may sample its end-of-sequence token (default temperature 1.0)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2 and resp.choices[0].finish_reason == "length"
    assert API_KEY not in server.output()


# ----------------------------------------------------------------------------------------- in-process


def test_kv_cache_refusal_names_max_tokens_without_the_engine_request_id(model_dir):
    """A prompt that fits the KV cache while prompt plus max_tokens does not: a 400 naming max_tokens (what to
    lower), whose message does not show the engine's own request id."""
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", num_blocks=9, block_size=4,
                                                served_model_name="tiny"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        err = assert_error(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 90}), 400, "max_tokens")
        assert "lower max_tokens" in err["message"] and not err["message"].startswith("request "), err
        err = assert_error(http.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 1}), 400, "prompt")
        assert "shorten it" in err["message"] and "cmpl-" not in err["message"], err
        # the model card says how long a sequence may be: what the cache holds, below max_model_len here
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == engine.max_sequence_len < engine.max_model_len


def test_replies_with_logprobs_are_built_off_the_event_loop(model_dir, monkeypatch):
    """A whole reply with log-probabilities (n x tokens x top_logprobs can make tens of MB) is built and encoded in
    a worker thread, so the event loop keeps serving every other client meanwhile (it stalled for seconds)."""
    import asyncio

    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai import serving_chat, serving_completion
    from plinth.entrypoints.openai.api_server import build_app

    on_loop = []

    def watch(real):
        def watched(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:   # no loop running in this thread: a worker thread
                on_loop.append(False)
            return real(*args, **kwargs)
        return watched

    monkeypatch.setattr(serving_chat, "_logprobs", watch(serving_chat._logprobs))
    monkeypatch.setattr(serving_completion, "_choice", watch(serving_completion._choice))
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", served_model_name="tiny"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "logprobs": True,
                "top_logprobs": 3}
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and len(r.json()["choices"][1]["logprobs"]["content"]) == 4
        r = http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 4, "logprobs": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert on_loop == [False] * 4, on_loop

def test_metrics_count_preemptions_and_first_admissions_only(model_dir):
    """Under a KV cache too small for all requests at once: ``plinth_num_preemptions_total`` counts the
    preemptions, and the prefix cache's counters count each request once (six prompts sharing no token: no
    hits, though the preempted ones resume on their own blocks)."""
    from concurrent.futures import ThreadPoolExecutor

    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", num_blocks=12, block_size=4,
                                                max_num_seqs=4, max_num_batched_tokens=16, served_model_name="tiny"))
    bodies = [{"prompt": [10 + 20 * i + j for j in range(8)], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
              for i in range(6)]
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        with ThreadPoolExecutor(6) as pool:
            usages = [r.json()["usage"] for r in pool.map(lambda b: http.post("/v1/completions", json=b), bodies)]
        metrics = scrape_metrics("", client=http)
    preemptions = engine.stats()["num_preemptions"]
    assert preemptions > 0 and metrics["plinth_num_preemptions_total"] == preemptions
    assert metrics["plinth_prefix_cache_queries_total"] == sum(u["prompt_tokens"] for u in usages) == 48
    assert metrics["plinth_prefix_cache_hits_total"] == metrics["plinth_prefix_cache_hit_rate"] == 0

def test_a_template_that_renders_nothing_is_a_400_naming_messages(model_dir):
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    template = "{% if not quiet %}{{ messages[0]['content'] }}{% endif %}"
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", chat_template=template,
                                                served_model_name="tiny"))
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        err = assert_error(http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"quiet": True}}),
                           400, "messages")
        assert "empty prompt" in err["message"]


def test_engine_crash_fails_requests_and_unexpected_errors_stay_generic(engine):
    """A crash in the engine loop fails in-flight and later requests (no hang); an unexpected
    exception becomes a generic 500 without its details."""
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine, EngineDeadError
    from plinth.core.request import SamplingParams
    from plinth.entrypoints.openai.api_server import build_app

    front = AsyncLLMEngine(engine)
    try:
        def broken_render(*_a, **_k):
            raise RuntimeError("secret internal detail")

        front.render_chat = broken_render   # type: ignore[method-assign]
        with TestClient(build_app(front), raise_server_exceptions=False) as http:
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            err = assert_error(r, 500)
            assert "secret" not in r.text and err["type"] == "server_error"
            assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200

            real_step = engine.step
            calls = {"n": 0}

            def failing_step():
                calls["n"] += 1
                if calls["n"] > 2:   # as the engine itself reports its workers' failure
                    raise EngineDeadError("the engine's workers failed: worker 1 was killed by SIGKILL")
                return real_step()

            engine.step = failing_step   # type: ignore[method-assign]

            async def one() -> None:
                async for _ in front.generate("crash-1", engine.tokenizer(PROMPT)["input_ids"],
                                              SamplingParams(max_tokens=50, ignore_eos=True)):
                    pass

            with pytest.raises(EngineDeadError):
                asyncio.run(asyncio.wait_for(one(), timeout=30))
            assert not front.is_healthy
            with pytest.raises(EngineDeadError):
                asyncio.run(asyncio.wait_for(one(), timeout=5))
            assert_error(http.get("/health"), 503)
            before = scrape_metrics("", http)
            # the refusal names what failed; nothing runs, waits or holds the cache any more; refused requests
            # count nowhere
            for _ in range(3):
                err = assert_error(http.post("/v1/completions", json={"prompt": PROMPT}), 503, code="engine_unavailable")
                assert "worker 1 was killed" in err["message"], err
            after = scrape_metrics("", http)
            assert after["plinth_num_requests_running"] == 0 and after["plinth_num_requests_waiting"] == 0
            assert after["plinth_kv_cache_usage_ratio"] == 0.0
            assert after["plinth_e2e_request_latency_seconds_count"] == before["plinth_e2e_request_latency_seconds_count"]
            assert (after.get("plinth_requests_finished_total{finish_reason=error}")
                    == before.get("plinth_requests_finished_total{finish_reason=error}"))
    finally:
        engine.__dict__.pop("step", None)
        front.shutdown()
    engine.abort_request("crash-1")   # the engine itself is reusable once the patched step is gone
    while engine.has_unfinished_requests():
        engine.step()


# ----------------------------------------------------------------------------------------- shutdown


def test_sigterm_finishes_in_flight_requests_then_aborts_after_grace(tmp_path):
    # a context long enough that the long request cannot finish within the grace on a fast machine
    model_dir = make_tiny_model(tmp_path / "long", max_position_embeddings=65536)
    args = [str(model_dir), "--selection", "off", "--shutdown-timeout", "2", "--served-model-name", "tiny"]
    with running_server(args) as srv:
        results: dict[str, dict] = {}

        def stream(name: str, max_tokens: int, started: threading.Event) -> None:
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            finish, usage, done = None, None, False
            with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    started.set()
                    if line == "data: [DONE]":
                        done = True
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                        finish = chunk["choices"][0]["finish_reason"]
                    usage = chunk.get("usage") or usage
            results[name] = {"finish": finish, "usage": usage, "done": done}

        long_started, short_started = threading.Event(), threading.Event()
        threads = [threading.Thread(target=stream, args=("long", 60000, long_started)),
                   threading.Thread(target=stream, args=("short", 8, short_started))]
        threads[0].start()
        assert long_started.wait(30)
        threads[1].start()
        assert short_started.wait(30)
        t0 = time.monotonic()
        srv.terminate()
        code = srv.wait(30)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert code == 0, srv.output()
        assert results["short"] == {"finish": "length", "usage": results["short"]["usage"], "done": True}
        assert results["short"]["usage"]["completion_tokens"] == 8
        assert results["long"]["finish"] == "abort" and results["long"]["done"]
        assert results["long"]["usage"]["completion_tokens"] < 60000
        assert 2.0 <= elapsed < 2.0 + 10, elapsed
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{srv.base_url}/health", timeout=2)


def test_a_second_stop_signal_ends_the_grace_at_once_with_clean_responses(tmp_path):
    """Ctrl-C twice: the second ends the shutdown grace period at once; the engine aborts what is left, so a
    stream still ends with its final chunk and [DONE] and a plain request gets its 200 (not a forced exit's
    cancelled tasks: tracebacks, a plain-text 500 and a cut stream); the server exits with status 0."""
    import signal

    model_dir = make_tiny_model(tmp_path / "long", max_position_embeddings=65536)
    args = [str(model_dir), "--selection", "off", "--shutdown-timeout", "60", "--served-model-name", "tiny"]
    with running_server(args) as srv:
        results: dict[str, object] = {}
        body = {"prompt": PROMPT, "max_tokens": 60000, "temperature": 0, "ignore_eos": True}

        def stream(started: threading.Event) -> None:
            finish, done = None, False
            with httpx.stream("POST", f"{srv.base_url}/v1/completions", json={**body, "stream": True},
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        started.set()
                        done = done or line == "data: [DONE]"
                        if line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["finish_reason"]:
                            finish = json.loads(line[6:])["choices"][0]["finish_reason"]
            results["stream"] = (finish, done)

        def plain() -> None:
            r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60)
            results["plain"] = (r.status_code, r.json()["choices"][0]["finish_reason"])

        started = threading.Event()
        threads = [threading.Thread(target=stream, args=(started,)), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert started.wait(30)
        time.sleep(0.5)   # the plain request is running too
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        code = srv.wait(30)
        for t in threads:
            t.join(30)
        assert code == 0 and time.monotonic() - t0 < 10, srv.output()
        assert results == {"stream": ("abort", True), "plain": (200, "abort")}, results
        assert "Traceback" not in srv.output() and "second stop signal" in srv.output()

# ----------------------------------------------------------------------------------------- default model


@pytest.mark.slow
def test_readme_examples_on_the_default_model():
    """The requests of the serve section of the README, against ``plinth serve`` with no MODEL."""
    with running_server(["--selection", "off"]) as srv:
        # curl example
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "temperature": 0})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        # openai client example
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Name three colors of the rainbow."}],
            max_tokens=48, temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        words = {w.strip(".,:;!*-").lower() for w in text.split()}
        assert len(words & {"red", "orange", "yellow", "green", "blue", "indigo", "violet"}) >= 2, text
        # tool calling example: a forced function's arguments follow its schema
        weather = {"type": "function", "function": {
            "name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                           "additionalProperties": False}}}
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[weather], tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=32, temperature=0)
        call = resp.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and resp.choices[0].finish_reason == "stop"
        assert "paris" in json.loads(call.function.arguments)["city"].lower(), call.function.arguments


def test_taken_port_fails_fast_with_a_clear_error(model_dir):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "plinth.entrypoints.cli", "serve", str(model_dir),
                            "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60   # refused before the model loads


def test_the_server_is_announced_only_once_it_listens(server):
    """The port is bound before the model loads (a taken one fails fast) but listens only after: uvicorn's "Uvicorn
    running on" line at the bind announced a server that refused connections while the model loaded; plinth's own
    "serving ... on" line comes once it is ready."""
    log = server.output()
    assert "engine ready" in log and "serving tiny on http://127.0.0.1:" in log
    assert "Uvicorn running on" not in log, log


def test_usage_reports_prompt_tokens_from_the_prefix_cache(client):
    """usage.prompt_tokens_details.cached_tokens: 0 for a new prompt, whole cached blocks when it comes again."""
    prompt = "A long and unusual prompt about prefix caching, " * 8
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                      stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in again if chunk.usage is not None][0]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = usage.prompt_tokens_details.cached_tokens
    assert usage.prompt_tokens == first.usage.prompt_tokens and 0 < cached < usage.prompt_tokens
    assert cached >= usage.prompt_tokens - 32   # every full block but the last
    messages = [{"role": "user", "content": prompt + "(chat)"}]
    chat = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
            for _ in range(2)]
    assert chat[0].usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < chat[1].usage.prompt_tokens_details.cached_tokens < chat[1].usage.prompt_tokens


def test_a_cache_salt_shares_the_prefix_cache_only_within_the_salt(server, client):
    """vLLM's ``cache_salt`` (completions, chat, responses): a prompt reuses cached tokens only from requests with
    the same salt; an empty or non-string salt is a 400 naming it."""
    prompt = "A tenant's private prompt, long enough to fill several KV blocks of the cache. " * 4

    def cached(salt, stream=False):
        extra = {} if salt is None else {"cache_salt": salt}
        if stream:
            chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                               stream_options={"include_usage": True}, extra_body=extra)
            usage = [c.usage for c in chunks if c.usage is not None][0]
        else:
            usage = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                              extra_body=extra).usage
        return usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached("tenant-a", stream=True) > 0 and cached("tenant-b") > 0 and cached(None) > 0
    messages = [{"role": "user", "content": prompt}]
    chat = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"cache_salt": salt}).usage.prompt_tokens_details.cached_tokens
            for salt in ("tenant-c", "tenant-d", "tenant-c")]
    assert chat[0] == chat[1] == 0 < chat[2]
    responses = [client.responses.create(model="tiny", input=prompt + "(responses)", max_output_tokens=2,
                                         temperature=0, extra_body={"cache_salt": salt}).usage
                 for salt in ("tenant-e", "tenant-f", "tenant-e")]
    assert [u.input_tokens_details.cached_tokens == 0 for u in responses] == [True, True, False]
    for bad in ("", 5):
        assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "cache_salt": bad}), 400,
                     "cache_salt")
        assert_error(post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "cache_salt": bad}),
                     400, "cache_salt")


def test_request_bodies_over_the_limit_are_413s(model_dir):
    """A body larger than ``max_request_bytes`` is refused with a 413 naming the flag: by its Content-Length before
    it is read, and a chunked body (no length) as it arrives; bodies within the limit, streamed replies (which watch
    for the client leaving) and an API key check before the body is read all work as before."""
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app
    from plinth.entrypoints.serve_cmd import ServeError, request_limit

    assert request_limit(None) == 256 << 20 and request_limit(0) is None
    with pytest.raises(ServeError, match="--max-request-bytes must be 0"):
        request_limit(-1)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", block_size=4,
                                                served_model_name="tiny"))
    app = build_app(AsyncLLMEngine(engine), max_request_bytes=4000, api_key="k")
    key = {"Authorization": "Bearer k"}
    big = {"model": "tiny", "prompt": "x" * 5000, "max_tokens": 2}
    with TestClient(app) as http:
        err = assert_error(http.post("/v1/completions", json=big, headers=key), 413, None)
        assert "--max-request-bytes" in err["message"] and err["code"] == "request_too_large", err
        assert http.post("/v1/completions", json=big).status_code == 401   # the key first, the body unread
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, headers=key)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        with http.stream("POST", "/v1/completions", headers=key,
                         json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert r.status_code == 200 and len(lines) >= 2 and lines[-1] == "data: [DONE]"

    async def chunked() -> tuple[int, dict]:
        async def parts():
            for _ in range(5):
                yield b" " * 1000
            yield json.dumps(big).encode()

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/v1/completions", content=parts(),
                                  headers={**key, "content-type": "application/json"})
            return r.status_code, r.json()

    status, body = asyncio.run(chunked())
    assert status == 413 and "--max-request-bytes" in body["error"]["message"]
