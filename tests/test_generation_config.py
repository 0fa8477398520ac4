"""The model's ``generation_config.json`` as default sampling settings and extra end-of-sequence ids
(``--generation-config``, ``--override-generation-config``)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from conftest import save_tiny_model

from plinth import LLM, SamplingParams
from plinth.config import ConfigError, EngineConfig
from plinth.errors import ModelLoadError
from plinth.model_registry.generation_config import read_generation_defaults

PROMPT = "Paris is the capital of France, and Berlin is"


def write(folder, data) -> None:
    (folder / "generation_config.json").write_text(json.dumps(data) if not isinstance(data, str) else data)


def test_reads_the_sampling_keys_and_eos_ids(tmp_path):
    write(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
                     "max_new_tokens": 300, "eos_token_id": [7, 9], "bos_token_id": 1, "max_length": 4096})
    found = read_generation_defaults("auto", None, str(tmp_path), "hf_dir")
    assert found.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
                              "max_tokens": 300}
    assert found.eos_token_ids == (7, 9) and found.origin == str(tmp_path / "generation_config.json")
    # none ignores it; a GGUF model has no folder of its own; the override sets, replaces and removes keys
    assert read_generation_defaults("none", None, str(tmp_path), "hf_dir").sampling == {}
    assert read_generation_defaults("vllm", None, str(tmp_path), "hf_dir").sampling == {}   # vLLM's spelling
    assert read_generation_defaults("auto", None, str(tmp_path / "m.gguf"), "gguf").sampling == {}
    both = read_generation_defaults("auto", {"temperature": 0.2, "top_k": None, "min_p": 0.1}, str(tmp_path), "hf_dir")
    assert both.sampling == {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.05, "max_tokens": 300,
                             "min_p": 0.1}
    # a folder or the file itself, named for another model (a GGUF file)
    other = tmp_path / "elsewhere"
    other.mkdir()
    write(other, {"temperature": 0.3, "eos_token_id": 5})
    for setting in (str(other), str(other / "generation_config.json")):
        found = read_generation_defaults(setting, None, "/models/x.gguf", "gguf")
        assert found.sampling == {"temperature": 0.3} and found.eos_token_ids == (5,)


@pytest.mark.parametrize("data, override, message", [
    ({"temperature": "hot"}, None, "temperature must be a number"),
    ({"top_k": 2.5}, None, "top_k must be an integer"),
    ({"temperature": -1.0}, None, "temperature"),
    ({"top_p": 1.5}, None, "top_p"),
    ({"max_new_tokens": 0}, None, "max_new_tokens must be at least 1"),
    ({"temperature": 10**400}, None, "temperature must be a number"),
    ({}, {"max_new_tokens": 10**400}, "max_new_tokens must be an integer"),
    ({"eos_token_id": "x"}, None, "eos_token_id"),
    ("[1, 2]", None, "not a JSON object"),
    ("{", None, "cannot read"),
    ({}, {"temprature": 0.5}, "unknown key.*'temprature'.*temperature, top_p"),
    ({}, {"top_p": True}, "top_p must be a number"),
])
def test_bad_values_are_load_errors(tmp_path, data, override, message):
    write(tmp_path, data)
    with pytest.raises(ModelLoadError, match=message):
        read_generation_defaults("auto", override, str(tmp_path), "hf_dir")


def test_bad_settings(tmp_path):
    with pytest.raises(ModelLoadError, match="no generation_config.json there"):
        read_generation_defaults(str(tmp_path / "missing"), None, str(tmp_path), "hf_dir")
    with pytest.raises(ConfigError, match="not valid JSON"):
        EngineConfig.from_kwargs(override_generation_config="{temperature: 1}")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        EngineConfig.from_kwargs(override_generation_config="[1]")
    config = EngineConfig.from_kwargs(override_generation_config='{"top_p": 0.5, "temperature": 0.1}')
    assert config.model.override_generation_config == (("temperature", 0.1), ("top_p", 0.5))
    hash(config)   # the configuration stays hashable


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-genconfig"))


def greedy_tokens(model_dir, n: int = 12) -> list[int]:
    llm = LLM(str(model_dir), dtype="float32", selection="off", generation_config="none")
    return llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids


def test_engine_defaults_and_extra_eos(model_dir, tmp_path):
    """The generation config's eos ids end sequences (unless ignore_eos), its sampling keys are the defaults of
    requests without parameters; an explicit SamplingParams is used as it is."""
    reference = greedy_tokens(model_dir)
    stop_at = next(i for i in range(3, len(reference)) if reference[i] not in reference[:i])
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    write(folder, {"temperature": 0.0, "max_new_tokens": 9, "eos_token_id": [reference[stop_at]]})
    llm = LLM(str(folder), dtype="float32", selection="off")
    assert reference[stop_at] in llm.engine.eos_token_ids
    defaults = llm.get_default_sampling_params()
    # max_tokens None: at most max_new_tokens, where the context leaves room for them
    assert (defaults.temperature, defaults.max_tokens, llm.engine.default_max_tokens) == (0.0, None, 9)
    # no parameters: greedy, at most max_new_tokens, ending at the generation config's eos id
    out = llm.generate([PROMPT])[0].outputs[0]
    expected = reference[:min(stop_at + 1, 9)]
    assert out.token_ids == expected
    assert out.finish_reason == ("stop" if stop_at < 9 else "length")
    # ignore_eos keeps going past it
    out = llm.generate([PROMPT], dataclasses.replace(defaults, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == reference
    # the override replaces the file's keys
    llm = LLM(str(folder), dtype="float32", selection="off", override_generation_config={"max_new_tokens": 4})
    assert llm.generate([PROMPT])[0].outputs[0].token_ids == reference[:min(stop_at + 1, 4)]


def test_server_uses_the_defaults_for_unset_fields(model_dir, tmp_path):
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    reference = greedy_tokens(model_dir, n=20)
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    write(folder, {"temperature": 0.0, "max_new_tokens": 20})
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(folder), dtype="float32", selection="off",
                                                served_model_name="tiny"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        def completion(**body):
            r = http.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, "logprobs": 0, **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        # no temperature and no max_tokens: the model's greedy default and its 20 tokens (not OpenAI's 16)
        plain = completion(seed=1)
        assert len(plain["logprobs"]["tokens"]) == 20
        assert plain["text"] == engine.tokenizer.decode(reference)
        # a request's own values win: sampling at temperature 1.5 with different seeds gives different texts
        texts = {completion(temperature=1.5, seed=s, max_tokens=20)["text"] for s in range(4)}
        assert len(texts) > 1
        assert len(completion(max_tokens=5)["logprobs"]["tokens"]) == 5
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20


def test_max_new_tokens_is_a_cap_not_a_demand(model_dir, tmp_path):
    """A max_new_tokens beyond the context is the most a request without max_tokens gets, not a limit it must
    fit: such requests run to the context's end (the model's 512 positions); an eos id outside the vocabulary
    stops the start."""
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    write(folder, {"max_new_tokens": 2048})
    llm = LLM(str(folder), dtype="float32", selection="off", max_model_len=64)
    ids = llm.engine.tokenize(PROMPT)
    out = llm.generate([PROMPT], dataclasses.replace(llm.get_default_sampling_params(), ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 64 - len(ids) and out.outputs[0].finish_reason == "length"
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(folder), dtype="float32", selection="off", max_model_len=64,
                                                override_generation_config={"max_new_tokens": 5}))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        for body in ({"prompt": PROMPT}, {"prompt": PROMPT, "max_tokens": None}, {"prompt": PROMPT, "min_tokens": 7}):
            r = http.post("/v1/completions", json={**body, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == max(5, body.get("min_tokens", 0))
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "use_beam_search": True, "n": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
        assert r.json()["usage"]["completion_tokens"] == 2 * 5
    write(folder, {"eos_token_id": [5, 100000]})
    with pytest.raises(ModelLoadError, match="eos_token_id 100000 is not below the model's vocab_size"):
        LLM(str(folder), dtype="float32", selection="off")
