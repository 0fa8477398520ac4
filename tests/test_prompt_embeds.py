"""Prompts given as embeddings (``prompt_embeds``): against transformers' ``inputs_embeds`` on the same weights
(float32, CPU), the prefix cache, sampling options that read the prompt, the server's wire form, worker processes
and the refusals."""

from __future__ import annotations

import base64
import io

import pytest
import torch
import transformers
from conftest import generate_on_tp_workers, save_tiny_model
from test_mamba_models import save_falcon_h1
from test_models import save_with_tokenizer

from plinth import LLM, EmbedsPrompt, SamplingParams
from plinth.config import ConfigError, EngineConfig
from plinth.core.scheduler import RequestRejectedError

STEPS = 6


def _greedy(params_kw: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0, **(params_kw or {}))


@torch.no_grad()
def _transformers_greedy(hf, embeds: torch.Tensor, steps: int = STEPS) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after ``embeds`` fed as ``inputs_embeds``, and their log-probabilities: a whole
    forward pass per token, each chosen token fed as the rows its ids would be (Falcon-H1 multiplies the rows it
    looks up by ``embedding_multiplier``, given rows not; its ``generate`` takes no ``inputs_embeds``)."""
    rows, tokens, logprobs = embeds, [], []
    for _ in range(steps):
        logits = hf(inputs_embeds=rows[None]).logits[0, -1].float()
        t = int(logits.argmax())
        tokens.append(t)
        logprobs.append(float(torch.log_softmax(logits, -1)[t]))
        rows = torch.cat([rows, _rows_of(hf, [t])])
    return tokens, logprobs


@torch.no_grad()
def _rows_of(hf, ids: list[int]) -> torch.Tensor:
    """The rows transformers' forward pass starts from for token ids: the input embedding layer's (Falcon-H1's times
    ``embedding_multiplier``, which it applies to its own lookups only)."""
    lookup_scale = getattr(hf.config, "embedding_multiplier", 1.0) if hf.config.model_type == "falcon_h1" else 1.0
    return hf.get_input_embeddings()(torch.tensor(ids)) * lookup_scale


def _matches(out, hf, embeds: torch.Tensor, tol: float = 2e-4) -> None:
    tokens, logprobs = _transformers_greedy(hf, embeds)
    assert out.outputs[0].token_ids == tokens
    got = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < tol, (got, logprobs)


# each: how transformers treats the given embeddings differs (Gemma's embedding layer scales its own lookups;
# Granite multiplies any inputs_embeds by embedding_multiplier, Falcon-H1 only its own lookups)
ARCHS = ["LlamaForCausalLM", "GemmaForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM", "Qwen3MoeForCausalLM",
         "DeepseekV3ForCausalLM", "FalconH1ForCausalLM"]


@pytest.mark.parametrize("name", ARCHS)
def test_prompt_embeds_match_transformers_inputs_embeds(name, tmp_path):
    """Random embeddings (no token's) give transformers' greedy tokens and log-probabilities for the same
    ``inputs_embeds``; the embeddings of a prompt's tokens give the tokens' own output."""
    if name == "FalconH1ForCausalLM":
        hf = save_falcon_h1(tmp_path)
        prompts = [[5, 9, 14, 3, 40, 41, 7]]
    else:
        hf, prompts = save_with_tokenizer(name, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, block_size=4, enable_prompt_embeds=True)
    scale = hf.get_input_embeddings().weight.std().item()
    embeds = torch.randn(9, hf.config.hidden_size, generator=torch.Generator().manual_seed(3)) * scale
    out, = llm.generate({"prompt_embeds": embeds}, _greedy(), use_tqdm=False)
    assert out.prompt_token_ids == [] and out.num_prompt_positions == 9 and out.prompt is None
    _matches(out, hf, embeds)
    ids = prompts[0]
    looked_up = _rows_of(hf, ids)
    by_ids, by_embeds = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": looked_up}], _greedy(),
                                     use_tqdm=False)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
    for a, b in zip(by_embeds.outputs[0].logprobs, by_ids.outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("llama"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(str(llama[0]), dtype="float32", block_size=4, enable_prompt_embeds=True)


def _rows(hf, seed: int, n: int = 10) -> torch.Tensor:
    return torch.randn(n, hf.config.hidden_size, generator=torch.Generator().manual_seed(seed)) * 0.08


def test_prefix_cache_reuses_blocks_of_the_same_embeddings_only(llm, llama):
    """The same embeddings hit the cache (with the same output); other values of the same length, placeholder
    token ids, or another cache_salt do not."""
    hf = llama[1]
    rows = _rows(hf, 1, 12)
    first, = llm.generate({"prompt_embeds": rows}, _greedy(), use_tqdm=False)
    again, = llm.generate({"prompt_embeds": rows.clone()}, _greedy(), use_tqdm=False)
    assert again.num_cached_tokens == 8 and again.outputs[0].token_ids == first.outputs[0].token_ids
    changed = rows.clone()
    changed[0, 0] += 0.5
    other, = llm.generate({"prompt_embeds": changed}, _greedy(), use_tqdm=False)
    assert other.num_cached_tokens == 0
    _matches(other, hf, changed)
    tokens, = llm.generate({"prompt_token_ids": [0] * 12}, _greedy(), use_tqdm=False)
    assert tokens.num_cached_tokens == 0
    salted, = llm.generate({"prompt_embeds": rows, "cache_salt": "tenant-a"}, _greedy(), use_tqdm=False)
    assert salted.num_cached_tokens == 0 and salted.outputs[0].token_ids == first.outputs[0].token_ids
    # a longer prompt that starts with the same rows shares their whole blocks
    longer, = llm.generate({"prompt_embeds": torch.cat([rows, _rows(hf, 2, 6)])}, _greedy(), use_tqdm=False)
    assert longer.num_cached_tokens == 12
    _matches(longer, hf, torch.cat([rows, _rows(hf, 2, 6)]))


def test_the_prompt_of_embeddings_has_no_tokens_for_penalties(llm, llama):
    """The placeholder ids of a prompt given as embeddings are no tokens: the repetition penalty does not push down
    token 0 (the placeholder), which it does for a token prompt holding 0."""
    hf = llama[1]
    ids = [0, 17, 25, 31, 44, 52]
    with torch.no_grad():
        rows = hf.get_input_embeddings()(torch.tensor(ids))
    params = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={0: 30.0}, repetition_penalty=50.0)
    by_ids, by_embeds = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": rows}], params, use_tqdm=False)
    assert by_embeds.outputs[0].token_ids == [0]
    assert by_ids.outputs[0].token_ids != [0]


def test_truncation_keeps_the_last_rows(llm, llama):
    """``truncate_prompt_tokens`` keeps a prompt's last embeddings, as it keeps a token prompt's last tokens."""
    hf = llama[1]
    ids = [9, 40, 41, 5, 77, 3, 12, 60, 8]
    with torch.no_grad():
        rows = hf.get_input_embeddings()(torch.tensor(ids))
    by_ids, = llm.generate({"prompt_token_ids": ids[-4:]}, _greedy(), use_tqdm=False)
    cut, = llm.generate({"prompt_embeds": rows}, _greedy({"truncate_prompt_tokens": 4}), use_tqdm=False)
    assert cut.num_prompt_positions == 4 and cut.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_a_batch_of_token_and_embedding_prompts_with_n(llm, llama):
    """Embedding and token prompts batched together, several samples each (seeded), and the text of the output."""
    hf = llama[1]
    rows = _rows(hf, 4, 7)
    params = SamplingParams(temperature=1.0, max_tokens=5, n=3, seed=11, ignore_eos=True)
    mixed = llm.generate([{"prompt_token_ids": [5, 6, 7]}, EmbedsPrompt(prompt_embeds=rows)], params, use_tqdm=False)
    alone, = llm.generate({"prompt_embeds": rows}, params, use_tqdm=False)
    assert [c.token_ids for c in mixed[1].outputs] == [c.token_ids for c in alone.outputs]
    tok = llm.get_tokenizer()
    assert [c.text for c in alone.outputs] == [tok.decode(c.token_ids) for c in alone.outputs]


def test_refusals(llm, llama, tmp_path):
    hf = llama[1]
    rows = _rows(hf, 5, 4)
    cases = [
        (torch.randn(4, 63), "this model takes [positions, 64]"),
        (torch.randn(2, 4, 64), "this model takes [positions, 64]"),
        (torch.zeros(0, 64), "the prompt is empty"),
        (torch.ones(4, 64, dtype=torch.int64), "float32, float16, bfloat16 or float64 tensor, got a int64 tensor"),
        ([[0.0] * 64] * 4, "got list"),
        (torch.full((4, 64), float("nan")), "not finite"),
        (torch.full((4, 64), 1e39, dtype=torch.float64), "not finite"),
    ]
    for value, message in cases:
        with pytest.raises(RequestRejectedError, match=message.replace("[", r"\[").replace("]", r"\]")):
            llm.generate({"prompt_embeds": value}, _greedy(), use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="prompt_logprobs needs prompt tokens"):
        llm.generate({"prompt_embeds": rows}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="takes no multi_modal_data"):
        llm.generate({"prompt_embeds": rows, "multi_modal_data": {"image": []}}, _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of 'prompt'"):
        llm.generate({"prompt_embeds": rows, "prompt": "hi"}, _greedy(), use_tqdm=False)
    from plinth.entrypoints.beam_search import BeamSearchParams

    with pytest.raises(RequestRejectedError, match="beam search takes prompts as text or token ids"):
        llm.beam_search([{"prompt_embeds": rows}], BeamSearchParams(beam_width=2, max_tokens=3))
    # nothing was left queued by a refusal: the engine goes on serving
    out, = llm.generate({"prompt_embeds": rows}, _greedy(), use_tqdm=False)
    _matches(out, hf, rows)
    # an engine not started for them
    plain = LLM(str(llama[0]), dtype="float32", block_size=4)
    with pytest.raises(RequestRejectedError, match="enable_prompt_embeds"):
        plain.generate({"prompt_embeds": rows}, _greedy(), use_tqdm=False)
    with pytest.raises(ConfigError, match="speculative decoding does not take prompts given as embeddings"):
        EngineConfig.from_kwargs(model=str(llama[0]), enable_prompt_embeds=True,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_model_without_embedding_inputs_is_refused_at_start(tmp_path):
    """The transformers fallback cannot take embeddings: refused when the engine starts, not per request."""
    from plinth.errors import UnsupportedModelError

    save_with_tokenizer("GPTNeoXForCausalLM", tmp_path)
    with pytest.raises(UnsupportedModelError, match="cannot take embeddings in its forward pass: prompts given as "
                                                    "embeddings"):
        LLM(str(tmp_path), dtype="float32", enable_prompt_embeds=True)


def test_image_model_takes_prompt_embeds(tmp_path):
    """A LLaVA checkpoint (its image encoder beside the prompt embeddings): the embeddings of a text prompt give the
    text's own output."""
    from test_multimodal import _save_llava

    model, _, _ = _save_llava(tmp_path)
    ids = [5, 9, 14, 3, 40, 41, 7]
    with torch.no_grad():
        rows = model.get_input_embeddings()(torch.tensor(ids))
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, enable_prompt_embeds=True)
    by_ids, by_embeds = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": rows}], _greedy(), use_tqdm=False)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_image_models_batch_images_beside_prompt_embeds(tmp_path):
    """Gemma 3 (bidirectional attention within an image), Qwen2-VL (multimodal RoPE) and Qwen3-VL (DeepStack rows):
    the rows of a prompt's tokens give the tokens' own output, and an image prompt batched with them gives its own
    output alone (the prompt's rows are text: attended causally, rotated as text, without DeepStack rows)."""
    from test_gemma3_images import _save as save_gemma3
    from test_multimodal import _picture
    from test_qwen3_vl import IMAGE as QWEN3_IMAGE
    from test_qwen3_vl import _save_with_images as save_qwen3
    from test_qwen_vl import IMAGE as QWEN_IMAGE
    from test_qwen_vl import _save_qwen_vl

    ids = [5, 9, 14, 3, 40, 41, 7, 22, 31, 11]
    for name, save, image_prompt in [
            ("gemma3", save_gemma3, "The quick <start_of_image> brown fox"),
            ("qwen2vl", lambda p: _save_qwen_vl(p, "2"), f"The quick {QWEN_IMAGE} brown fox"),
            ("qwen3vl", lambda p: save_qwen3(p, False), f"A {QWEN3_IMAGE} end")]:
        path = tmp_path / name
        path.mkdir()
        model = save(path)[0]
        with torch.no_grad():
            rows = model.get_input_embeddings()(torch.tensor(ids))
        # (no prefix cache: every step computes both prompts whole)
        llm = LLM(str(path), dtype="float32", block_size=4, max_model_len=256, enable_prompt_embeds=True,
                  enable_prefix_caching=False)
        image = {"prompt": image_prompt, "multi_modal_data": {"image": _picture(1)}}
        by_ids, alone = llm.generate([{"prompt_token_ids": ids}, image], _greedy(), use_tqdm=False)
        for prompts in ([{"prompt_embeds": rows}, image], [image, {"prompt_embeds": rows}]):
            outs = llm.generate(prompts, _greedy(), use_tqdm=False)
            embedded, pictured = outs if "prompt_embeds" in prompts[0] else outs[::-1]
            for got, want in ((embedded, by_ids), (pictured, alone)):
                assert got.outputs[0].token_ids == want.outputs[0].token_ids, name
                for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
                    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a), name
        llm.close()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_on_worker_processes(llama, tp, pp):
    """Tensor-parallel ranks and pipeline stages in worker processes: the same output as transformers, and cached
    blocks for the same embeddings sent again."""
    path, hf = llama
    rows = _rows(hf, 6, 9)
    hits: list[int] = []
    outs = generate_on_tp_workers(path, [{"prompt_embeds": rows}], _greedy(), size=tp, pp=pp, rounds=2, hits=hits,
                                  enable_prompt_embeds=True)
    for out in outs:
        _matches(out, hf, rows)
    assert hits == [8]


# ----------------------------------------------------------------------------------------------- the server


def _b64(value) -> str:
    buf = io.BytesIO()
    torch.save(value, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _compressed(value) -> str:
    """``torch.save``'s archive with its entries deflated: a small request that would unpack to much more memory."""
    import zipfile

    buf = io.BytesIO()
    torch.save(value, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return base64.b64encode(out.getvalue()).decode()


class _NotATensor:
    """An object whose pickle names a class: ``torch.load(weights_only=True)`` refuses to build it."""

    def __reduce__(self):
        return (print, ("this must never run",))


def test_server_completions_take_prompt_embeds(llama):
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    path, hf = llama
    rows = _rows(hf, 7, 6)
    tokens, _ = _transformers_greedy(hf, rows)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", selection="off", block_size=4,
                                                served_model_name="tiny", enable_prompt_embeds=True))
    tok = engine.tokenizer
    body = {"model": "tiny", "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        # the embeddings' choices come first, then the prompt's; usage counts every position
        r = http.post("/v1/completions", json={**body, "prompt_embeds": [_b64(rows), _b64(rows[None].half())],
                                               "prompt": [3, 4, 5]})
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["choices"][0]["text"] == tok.decode(tokens)
        assert reply["choices"][1]["text"] != ""   # (the same rows in float16: rounded, maybe other tokens)
        assert reply["usage"]["prompt_tokens"] == 6 + 6 + 3 and reply["usage"]["completion_tokens"] == 3 * STEPS
        # streamed, with the usage at the end
        r = http.post("/v1/completions", json={**body, "prompt_embeds": _b64(rows), "stream": True,
                                               "stream_options": {"include_usage": True}})
        chunks = [line[6:] for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        import json

        parsed = [json.loads(c) for c in chunks]
        assert "".join(c["choices"][0]["text"] for c in parsed if c["choices"]) == tok.decode(tokens)
        assert parsed[-1]["usage"]["prompt_tokens"] == 6 and parsed[-1]["usage"]["prompt_tokens_details"][
            "cached_tokens"] == 4
        refused = [
            ({"prompt_embeds": "not base64!"}, "prompt_embeds", "not valid base64"),
            ({"prompt_embeds": _b64({"rows": rows})}, "prompt_embeds", "holds a dict, not a tensor"),
            ({"prompt_embeds": _b64(_NotATensor())}, "prompt_embeds", "could not be read as a tensor"),
            ({"prompt_embeds": _compressed(rows)}, "prompt_embeds", "compressed entries"),
            ({"prompt_embeds": _b64(rows.to_sparse()), "truncate_prompt_tokens": 3}, "prompt_embeds",
             "must be a dense tensor, got a sparse_coo one"),
            ({"prompt_embeds": _b64(torch.randn(5, 32))}, "prompt_embeds", "this model takes [positions, 64]"),
            ({"prompt_embeds": _b64(torch.randn(5))}, "prompt_embeds", "give [positions, hidden_size]"),
            ({"prompt_embeds": []}, "prompt_embeds", "must not be empty"),
            ({"prompt_embeds": _b64(rows), "echo": True}, "echo", "needs prompt tokens"),
            ({"prompt_embeds": _b64(rows), "use_beam_search": True, "n": 2}, "use_beam_search", "needs prompt tokens"),
            ({"prompt_embeds": _b64(rows), "prompt_logprobs": 1}, "prompt_logprobs", "needs prompt tokens"),
            ({"prompt_embeds": _b64(rows), "max_tokens": 600}, "max_tokens", "maximum context length"),
            ({}, "prompt", "give a prompt (text or token ids) or prompt_embeds"),
        ]
        for extra, param, message in refused:
            r = http.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and message in err["message"], (extra, err)
    plain = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", selection="off", block_size=4,
                                               served_model_name="tiny"))
    with TestClient(build_app(AsyncLLMEngine(plain))) as http:
        r = http.post("/v1/completions", json={**body, "prompt_embeds": _b64(rows)})
        assert r.status_code == 400 and "--enable-prompt-embeds" in r.json()["error"]["message"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_prompt_embeds_equal_transformers(llama):
    """On a GPU (CUDA graphs for the decode steps, asynchronous scheduling): float32 tokens after embeddings, beside a
    token prompt, equal transformers' on the CPU; the same rows sent again hit the prefix cache; bfloat16 rows of a
    prompt's tokens give the tokens' own output in a bfloat16 engine."""
    path, hf = llama
    rows = _rows(hf, 8, 11)
    llm = LLM(str(path), dtype="float32", platform="cuda", block_size=8, gpu_memory_utilization=0.3,
              enable_prompt_embeds=True)
    outs = llm.generate([{"prompt_embeds": rows.cuda()}, {"prompt_token_ids": [5, 6, 7]}], _greedy(), use_tqdm=False)
    _matches(outs[0], hf, rows, tol=1e-3)
    again, = llm.generate({"prompt_embeds": rows}, _greedy(), use_tqdm=False)
    assert again.num_cached_tokens == 8 and again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    llm.close()
    ids = [9, 40, 41, 5, 77, 3, 12, 60, 8]
    llm = LLM(str(path), dtype="bfloat16", platform="cuda", block_size=8, gpu_memory_utilization=0.3,
              enable_prompt_embeds=True)
    with torch.no_grad():
        looked_up = hf.get_input_embeddings()(torch.tensor(ids)).bfloat16()
    by_ids, by_embeds = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": looked_up}], _greedy(),
                                     use_tqdm=False)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
    llm.close()
