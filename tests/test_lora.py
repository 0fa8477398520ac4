"""LoRA adapters: adapters written by PEFT, run by plinth next to the base model, against PEFT running the same
adapters on transformers (log-probabilities of every generated token), in mixed batches, with fewer slots than
adapters, through the prefix cache, tensor and pipeline parallelism, and with bad adapters refused."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model

from plinth import LLM, LoRARequest, SamplingParams
from plinth.config import ConfigError, EngineConfig
from plinth.core.scheduler import RequestRejectedError

peft = pytest.importorskip("peft")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France, and Berlin is",
    "0123",
    "Large language models generate text one token at a time. Continuous batching keeps",
]
MAX_TOKENS = 10


def make_adapter(model_dir: Path, out: Path, seed: int, r: int = 8, alpha: float = 16, targets=ALL,
                 **lora_kwargs) -> Path:
    """A PEFT LoRA adapter of ``model_dir`` with random A and B (B is zero right after PEFT creates it)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **lora_kwargs)
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    model.save_pretrained(out)
    return out


def peft_logprobs(model_dir: Path, adapter: Path | None, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """log p(output token | everything before it) under transformers (+ PEFT's adapter), float64 softmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    n = len(prompt_ids)
    return [float(logp[n - 1 + i, tok]) for i, tok in enumerate(output_ids)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, **kw)


def assert_matches_peft(model_dir: Path, adapter: Path | None, out, tol: float = 2e-4) -> None:
    completion = out.outputs[0]
    got = [pos[tok].logprob for pos, tok in zip(completion.logprobs, completion.token_ids, strict=True)]
    want = peft_logprobs(model_dir, adapter, out.prompt_token_ids, completion.token_ids)
    assert len(got) == MAX_TOKENS
    for g, w in zip(got, want, strict=True):
        assert math.isclose(g, w, abs_tol=tol), (got, want)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp(f"lora-{request.param}"), arch=request.param)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp(f"adapters-{model_dir.name}")
    return {
        "all": make_adapter(model_dir, root / "all", 1),
        "attn-r4": make_adapter(model_dir, root / "attn", 2, r=4, alpha=8, targets=("q_proj", "v_proj")),
        "rslora": make_adapter(model_dir, root / "rslora", 3, r=8, alpha=4, use_rslora=True,
                               targets=("k_proj", "o_proj", "down_proj")),
        "patterns": make_adapter(model_dir, root / "patterns", 4, r=4, alpha=8, targets=("q_proj", "up_proj"),
                                 rank_pattern={"up_proj": 2}, alpha_pattern={"q_proj": 32}),
        # PEFT's pattern keys are regular expressions: an alternation covers both modules
        "alternation": make_adapter(model_dir, root / "alternation", 5, r=8, alpha=16,
                                    targets=("q_proj", "v_proj", "o_proj"), rank_pattern={"q_proj|v_proj": 4},
                                    alpha_pattern={"q_proj|v_proj": 64}),
    }


def test_adapters_match_peft(model_dir, adapters):
    """Every adapter kind, and the base model, in one call: the log-probability of each generated token equals
    PEFT's on transformers (so the greedy tokens are PEFT's too)."""
    llm = LLM(str(model_dir), dtype="float32", selection="off", enable_lora=True, max_loras=4, max_lora_rank=8)
    names = [None, *adapters]
    loras = [None if n is None else LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(names)]
    prompt = PROMPTS[1]
    outs = llm.generate([prompt] * len(names), greedy(), lora_request=loras, use_tqdm=False)
    tokens = set()
    for name, lora, out in zip(names, loras, outs, strict=True):
        assert out.lora_request == lora
        assert_matches_peft(model_dir, None if name is None else adapters[name], out)
        tokens.add(tuple(out.outputs[0].token_ids))
    assert len(tokens) == len(names)   # the adapters change the outputs
    if torch.cuda.is_available():   # decode steps replayed the graphs captured with the adapters' products
        assert {key[1] for key in llm.engine.runner.graphs.graphs} == {False, True}


def test_fewer_slots_than_adapters(model_dir, adapters):
    """Four adapters and the base model over two slots, prompts chunked into steps of 8 tokens and mixed in
    every order: a request waits for a slot, adapters are swapped in and out, and each output still equals the one
    it gets alone."""
    llm = LLM(str(model_dir), dtype="float32", selection="off", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_num_batched_tokens=8, block_size=4)
    names = list(adapters)
    loras = {n: LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(names)}
    alone = {}
    for n in [None, *names]:
        out = llm.generate(PROMPTS[3], greedy(), lora_request=loras.get(n), use_tqdm=False)[0]
        alone[n] = out.outputs[0].token_ids
    order = [None, *names] * 3
    order = order[1::2] + order[::2]
    outs = llm.generate([PROMPTS[3]] * len(order), greedy(), lora_request=[loras.get(n) for n in order],
                        use_tqdm=False)
    for n, out in zip(order, outs, strict=True):
        assert out.outputs[0].token_ids == alone[n], n


def test_beam_search_takes_one_adapter_per_prompt(model_dir, adapters):
    """``LLM.beam_search`` with a LoRA request per prompt (as vLLM's): each prompt's beams run with its own adapter,
    giving the beams of that prompt searched alone, also when another prompt's beams stop at the context (fewer rows
    in later rounds); a list of the wrong length is refused before any round runs."""
    from plinth.entrypoints.beam_search import BeamSearchParams

    llm = LLM(str(model_dir), dtype="float32", selection="off", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_model_len=32, block_size=4)
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    lora = LoRARequest("all", 1, str(adapters["all"]))
    short, long = [7, 8, 9], [5] * 31   # the long prompt fills the context after one round

    def beams(outs):
        return [[b.token_ids for b in o.sequences] for o in outs]

    alone = beams(llm.beam_search([short], params, lora_request=lora))[0]
    base = beams(llm.beam_search([short], params))[0]
    assert alone != base   # the adapter changes the search
    assert beams(llm.beam_search([long, short], params, lora_request=[None, lora]))[1] == alone
    assert beams(llm.beam_search([short, short], params, lora_request=[lora, None])) == [alone, base]
    with pytest.raises(ValueError, match="2 LoRA requests for 3 prompts"):
        llm.beam_search([short] * 3, params, lora_request=[lora, None])
    assert not llm.engine.has_unfinished_requests()

def test_a_removed_adapter_serves_those_holding_it_and_is_never_read_again(model_dir, adapters, tmp_path):
    """remove_lora (the server's unload): a holder of the adapter (a request accepted before, a beam search between
    rounds) still runs with it, its folder gone; one removed before anything held it is refused, nothing read."""
    import gc
    import shutil

    from plinth.core.scheduler import RequestRejectedError

    folder = shutil.copytree(adapters["attn-r4"], tmp_path / "moving")
    llm = LLM(str(model_dir), dtype="float32", selection="off", enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("moving", 7, str(folder))
    before = llm.generate(PROMPTS[2], greedy(), lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
    held = llm.engine.lora_adapter(7)
    assert held is not None and llm.engine.remove_lora(7) and not llm.engine.has_lora(7)
    shutil.rmtree(folder)
    again = llm.generate(PROMPTS[2], greedy(), lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
    assert again == before and not llm.engine.has_lora(7)   # not put back in the host cache either
    # an adapter removed before anything held it in memory is refused, its folder not read
    other = LoRARequest("gone", 8, str(adapters["all"]))
    llm.engine.add_lora(other)
    llm.engine.remove_lora(8)
    gc.collect()
    with pytest.raises(RequestRejectedError, match="LoRA adapter 'gone' \\(id 8\\) was removed"):
        llm.generate(PROMPTS[2], greedy(), lora_request=other, use_tqdm=False)
    # one whose requests all finished, held by nothing (the last step's sampling batch keeps its requests weakly)
    done = LoRARequest("done", 9, str(adapters["all"]))
    llm.generate(PROMPTS[2], greedy(), lora_request=done, use_tqdm=False)
    assert llm.engine.remove_lora(9)
    gc.collect()
    assert llm.engine.lora_adapter(9) is None
    with pytest.raises(RequestRejectedError, match="LoRA adapter 'done' \\(id 9\\) was removed"):
        llm.generate(PROMPTS[2], greedy(), lora_request=done, use_tqdm=False)


def test_prefix_cache_is_per_adapter(model_dir, adapters):
    """The same prompt under the base model and two adapters: no request reuses another adapter's cached
    keys and values (each output matches PEFT), and a repeat under the same adapter hits its own."""
    llm = LLM(str(model_dir), dtype="float32", selection="off", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4)
    prompt = PROMPTS[3]
    one = LoRARequest("all", 1, str(adapters["all"]))
    two = LoRARequest("attn", 2, str(adapters["attn-r4"]))
    runs = [(None, None), (one, adapters["all"]), (two, adapters["attn-r4"]), (one, adapters["all"])]
    cached = []
    for lora, path in runs:
        out = llm.generate(prompt, greedy(), lora_request=lora, use_tqdm=False)[0]
        assert_matches_peft(model_dir, path, out)
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0]
    assert cached[3] > 0


def test_lora_request_checks(model_dir, adapters, tmp_path):
    llm = LLM(str(model_dir), dtype="float32", selection="off", enable_lora=True, max_loras=1, max_lora_rank=4)
    with pytest.raises(RequestRejectedError, match="rank 8, more than the engine's max_lora_rank 4"):
        llm.generate("hi", greedy(), lora_request=LoRARequest("all", 1, str(adapters["all"])))
    ok = LoRARequest("attn", 2, str(adapters["attn-r4"]))
    llm.generate("hi", greedy(), lora_request=ok, use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="lora_int_id 2 names adapter 'attn'"):
        llm.generate("hi", greedy(), lora_request=LoRARequest("other", 2, str(adapters["patterns"])))
    with pytest.raises(RequestRejectedError, match="no such folder"):
        llm.generate("hi", greedy(), lora_request=LoRARequest("x", 3, str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "p")
    import os
    from pathlib import Path

    # a path object, and a leading ~ (the user's home), as vLLM takes them
    assert LoRARequest("x", 4, "~/adapters/x").lora_path == os.path.join(os.path.expanduser("~"), "adapters", "x")
    assert LoRARequest("x", 4, Path("/a/b")).lora_path == "/a/b"
    # vLLM's other fields: the path with a trailing slash is the same adapter; the deprecated lora_local_path
    llm.generate("hi", greedy(), lora_request=LoRARequest("attn", 2, str(adapters["attn-r4"]) + "/",
                                                          base_model_name="tiny"), use_tqdm=False)
    assert LoRARequest("x", 4, lora_local_path="/a/b").lora_path == "/a/b"
    for field, value in (("long_lora_max_len", 4096), ("tensorizer_config_dict", {}), ("load_inplace", True)):
        with pytest.raises(ValueError, match=field):
            LoRARequest("x", 4, "/a", **{field: value})
    with pytest.raises(ValueError, match="got 1 LoRA requests for 2 prompts"):
        llm.generate(["a", "b"], greedy(), lora_request=[ok])
    # a rejected prompt among several leaves none of them queued, and the engine serves on
    with pytest.raises(RequestRejectedError, match="no such folder"):
        llm.generate(["a", "b"], greedy(), lora_request=[ok, LoRARequest("x", 3, str(tmp_path / "missing"))])
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("hi", greedy(), use_tqdm=False)[0].finished

    plain = LLM(str(model_dir), dtype="float32", selection="off")
    with pytest.raises(RequestRejectedError, match="LoRA adapters are not enabled"):
        plain.generate("hi", greedy(), lora_request=ok)


def _edit(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of adapter ``src`` with config keys replaced and tensors changed (``tensors(dict) -> dict``)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    weights = load_file(src / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "adapter_model.safetensors")
    return dst


@pytest.mark.parametrize("case, message", [
    ("dora", "DoRA adapters are not supported"),
    ("modules_to_save", "modules_to_save"),
    ("bias", "bias='all' is not supported"),
    ("prompt_tuning", "only LORA adapters are supported"),
    ("embedding", "is not a LoRA A/B weight of a decoder layer's projection"),
    ("other_model", "do not fit the model's q_proj"),
    ("missing_b", "has no lora_B weight"),
    ("layer", "names layer 7, but the model has 2 layers"),
    ("rank", "has rank 8, but the config says 3"),
    ("nan", "non-finite weights"),
    ("no_config", "adapter_config.json is missing"),
    ("pickle", "cannot be read as plain tensors"),
    ("alora", "alora_invocation_tokens is set"),
    ("alpha_null", r"alpha_pattern\['q_proj'\] must be a positive number, got None"),
    ("alpha_text", r"alpha_pattern\['q_proj'\] must be a positive number, got 'x'"),
    ("rank_regex", r"rank_pattern key 'q_proj\(' is not a regular expression"),
    ("alpha_huge", "overflows float32"),
    ("fp8", "is torch.float8_e4m3fn; LoRA weights are float32, float16 or bfloat16"),
    ("int", "is torch.int32"),
    ("twice", "has a second lora_A weight"),
    # PiSSA, OLoRA, ... subtract the initial adapter from the base weights (PEFT does it again on loading): the
    # adapter is not a plain one until PEFT converts it
    ("pissa", "init_lora_weights='pissa_niter_4' changes the base model's weights"),
    ("olora", "init_lora_weights='olora' changes the base model's weights"),
])
def test_bad_adapters_are_refused(model_dir, adapters, tmp_path, case, message):
    src = adapters["all"]
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    if case == "dora":
        path = _edit(src, tmp_path / case, {"use_dora": True})
    elif case == "modules_to_save":
        path = _edit(src, tmp_path / case, {"modules_to_save": ["lm_head"]})
    elif case == "bias":
        path = _edit(src, tmp_path / case, {"bias": "all"})
    elif case == "prompt_tuning":
        path = _edit(src, tmp_path / case, {"peft_type": "PROMPT_TUNING"})
    elif case == "embedding":
        path = _edit(src, tmp_path / case, tensors=lambda w: {
            **w, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 10)})
    elif case == "other_model":
        path = _edit(src, tmp_path / case, tensors=lambda w: {
            **w, f"{q}.lora_A.weight": torch.zeros(8, 96), f"{q}.lora_B.weight": torch.zeros(64, 8)})
    elif case == "missing_b":
        path = _edit(src, tmp_path / case, tensors=lambda w: {k: v for k, v in w.items() if k != f"{q}.lora_B.weight"})
    elif case == "layer":
        path = _edit(src, tmp_path / case, tensors=lambda w: {
            **w, f"{q.replace('layers.0', 'layers.7')}.lora_A.weight": w[f"{q}.lora_A.weight"].clone(),
            f"{q.replace('layers.0', 'layers.7')}.lora_B.weight": w[f"{q}.lora_B.weight"].clone()})
    elif case == "rank":
        path = _edit(src, tmp_path / case, {"r": 3})
    elif case == "nan":
        path = _edit(src, tmp_path / case, tensors=lambda w: {
            **w, f"{q}.lora_B.weight": torch.full_like(w[f"{q}.lora_B.weight"], float("nan"))})
    elif case in ("alpha_null", "alpha_text", "rank_regex", "alpha_huge"):
        key, value = {"alpha_null": ("alpha_pattern", {"q_proj": None}), "alpha_text": ("alpha_pattern", {"q_proj": "x"}),
                      "rank_regex": ("rank_pattern", {"q_proj(": 8}), "alpha_huge": ("alpha_pattern", {"q_proj": 1e300}),
                      }[case]
        path = _edit(src, tmp_path / case, {key: value})
    elif case in ("fp8", "int"):
        dtype = torch.float8_e4m3fn if case == "fp8" else torch.int32
        path = _edit(src, tmp_path / case, tensors=lambda w: {**w, f"{q}.lora_A.weight": w[f"{q}.lora_A.weight"].to(dtype)})
    elif case == "twice":   # the same module with and without PEFT's prefix
        path = _edit(src, tmp_path / case, tensors=lambda w: {
            **w, f"{q.removeprefix('base_model.model.')}.lora_A.weight": w[f"{q}.lora_A.weight"].clone()})
    elif case in ("pissa", "olora"):
        path = _edit(src, tmp_path / case, {"init_lora_weights": "pissa_niter_4" if case == "pissa" else "olora"})
    elif case == "alora":   # a LoRA variant that applies the adapter after an invocation sequence only
        path = _edit(src, tmp_path / case, {"alora_invocation_tokens": [5, 6]})
    elif case == "no_config":
        path = _edit(src, tmp_path / case)
        (path / "adapter_config.json").unlink()
    else:   # a pickle that is more than tensors: never unpickled beyond weights_only
        path = tmp_path / case
        path.mkdir()
        (path / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
        torch.save({"x": torch.zeros(1), "code": print}, path / "adapter_model.bin")
    llm = LLM(str(model_dir), dtype="float32", selection="off", enable_lora=True, max_lora_rank=8)
    with pytest.raises(RequestRejectedError, match=message) as info:
        llm.generate("hi", greedy(), lora_request=LoRARequest("bad", 1, str(path)))
    assert info.value.param == "lora_request"
    assert str(path) in str(info.value)


def test_bin_adapter_and_config_checks(model_dir, adapters, tmp_path):
    """``adapter_model.bin`` (plain tensors) reads like the safetensors file; the engine's LoRA options are
    checked; models without plinth's decoder layers cannot take adapters."""
    from safetensors.torch import load_file

    src = adapters["attn-r4"]
    path = tmp_path / "bin"
    path.mkdir()
    (path / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    torch.save(load_file(src / "adapter_model.safetensors"), path / "adapter_model.bin")
    llm = LLM(str(model_dir), dtype="float32", selection="off", enable_lora=True, max_lora_rank=8)
    a = llm.generate(PROMPTS[0], greedy(), lora_request=LoRARequest("bin", 1, str(path)), use_tqdm=False)[0]
    b = llm.generate(PROMPTS[0], greedy(), lora_request=LoRARequest("st", 2, str(src)), use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for kwargs, message in [({"max_loras": 0}, "max_loras must be a positive integer"),
                            ({"max_lora_rank": 2048}, "max_lora_rank must be at most 1024"),
                            ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras .2. must be at least max_loras")]:
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_kwargs(enable_lora=True, **kwargs)


def test_tensor_and_pipeline_parallel_equal_one_process(tmp_path, processes):
    """TP=2 (with one KV head, replicated on both ranks) and PP=2 in worker processes give the same tokens as one
    process, for a batch mixing two adapters and the base model."""
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    model = save_tiny_model(tmp_path / "m", num_key_value_heads=1)
    loras = [None, LoRARequest("a", 1, str(make_adapter(model, tmp_path / "a", 5))),
             LoRARequest("b", 2, str(make_adapter(model, tmp_path / "b", 6, r=4, targets=("v_proj", "gate_proj"))))]
    kw = dict(model=str(model), dtype="float32", selection="off", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_num_batched_tokens=16, block_size=4)
    prompts = PROMPTS * 2
    picks = [loras[i % 3] for i in range(len(prompts))]
    one = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, greedy(), lora_request=picks, use_tqdm=False)]
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        engine = LLMEngine(EngineConfig.from_kwargs(**kw, **layout, distributed_executor="mp"),
                           executor_factory=lambda c: MultiprocExecutor(c, processes))
        try:
            for i, (prompt, lora) in enumerate(zip(prompts, picks, strict=True)):
                engine.add_request(f"r{i}", prompt, greedy(), lora_request=lora)
            done = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
        finally:
            engine.shutdown()
        assert [done[f"r{i}"] for i in range(len(prompts))] == one, layout


def test_model_without_adapter_layers_is_refused(tmp_path):
    """An architecture that runs through the transformers fallback has none of plinth's adaptable layers."""
    import transformers
    from conftest import make_tokenizer

    tokenizer = make_tokenizer()
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="enable_lora: .* declares no layers that take LoRA adapters"):
        LLM(str(tmp_path), dtype="float32", selection="off", enable_lora=True)


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server_parts(tmp_path_factory):
    """An app serving the tiny Llama with one adapter from --lora-modules, runtime updates on."""
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    root = tmp_path_factory.mktemp("lora-server")
    model = save_tiny_model(root / "m")
    paths = {"sql": make_adapter(model, root / "sql", 11), "chat": make_adapter(model, root / "chat", 12, r=4)}
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), dtype="float32", selection="off",
                                                served_model_name="base", enable_lora=True, max_loras=2,
                                                max_lora_rank=8))
    app = build_app(AsyncLLMEngine(engine), lora_modules=[("sql", str(paths["sql"]))], allow_lora_updates=True)
    with TestClient(app) as client:
        yield client, model, paths


def _post(client, route: str, body: dict, status: int = 200) -> dict:
    r = client.post(route, json=body)
    assert r.status_code == status, r.text
    return r.json()


def test_server_routes_requests_to_adapters(server_parts):
    client, model, paths = server_parts
    ids = LLM(str(model), dtype="float32", selection="off").get_tokenizer()(PROMPTS[1])["input_ids"]
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    want = {}
    for name, path in (("base", None), ("sql", paths["sql"])):
        out = _post(client, "/v1/completions", {**body, "model": name})
        assert out["model"] == name
        lp = out["choices"][0]["logprobs"]["token_logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in _post(client, "/v1/completions", {
            **body, "model": name, "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]["tokens"]]
        ref = peft_logprobs(model, path, ids, tokens)
        assert all(math.isclose(g, w, abs_tol=2e-4) for g, w in zip(lp, ref, strict=True)), (name, lp, ref)
        want[name] = tokens
    assert want["base"] != want["sql"]
    # chat and streaming answer with the adapter too, named in every chunk
    messages = [{"role": "user", "content": "hi"}]
    chat = _post(client, "/v1/chat/completions", {"model": "sql", "messages": messages, "max_tokens": 4})
    assert chat["model"] == "sql"
    with client.stream("POST", "/v1/chat/completions", json={"model": "sql", "messages": messages, "max_tokens": 4,
                                                              "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all(c["model"] == "sql" for c in chunks)
    cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == str(paths["sql"])
    assert cards["base"]["parent"] is None
    err = _post(client, "/v1/completions", {**body, "model": "nope"}, status=404)
    assert "the LoRA adapters 'sql'" in err["error"]["message"]


def test_server_loads_and_unloads_adapters(server_parts):
    client, _, paths = server_parts
    body = {"prompt": "The quick", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "model": "chat"}
    assert _post(client, "/v1/completions", body, status=404)["error"]["code"] == "model_not_found"
    _post(client, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(paths["chat"])})
    first = _post(client, "/v1/completions", body)["choices"][0]["text"]
    err = _post(client, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(paths["chat"])}, status=400)
    assert err["error"]["param"] == "lora_name" and err["error"]["code"] == "model_name_taken"
    err = _post(client, "/v1/load_lora_adapter", {"lora_name": "", "lora_path": str(paths["chat"])}, status=400)
    assert err["error"]["param"] == "lora_name" and "needs a name" in err["error"]["message"]
    err = _post(client, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"}, status=400)
    assert "no such folder" in err["error"]["message"]
    held = client.app.state.ctx.check_model("chat")   # a request that arrived before the unload holds the adapter
    _post(client, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    _post(client, "/v1/completions", body, status=404)
    assert held.adapter is not None and held.adapter.name == "chat"
    del held
    _post(client, "/v1/unload_lora_adapter", {"lora_name": "chat"}, status=404)
    # loaded again (a fresh id): the same answers
    _post(client, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(paths["chat"])})
    assert _post(client, "/v1/completions", body)["choices"][0]["text"] == first
    # load_inplace (vLLM's) replaces the adapter served under the name: another adapter's answers, then the first's
    other = _post(client, "/v1/completions", {**body, "model": "sql"})["choices"][0]["text"]
    ctx = client.app.state.ctx
    before_id = ctx.loras["chat"].lora_int_id
    _post(client, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(paths["sql"]), "load_inplace": True})
    assert ctx.loras["chat"].lora_int_id != before_id and other != first
    assert _post(client, "/v1/completions", body)["choices"][0]["text"] == other
    _post(client, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(paths["chat"]), "load_inplace": True})
    assert _post(client, "/v1/completions", body)["choices"][0]["text"] == first


def test_serve_flags(tmp_path):
    import argparse

    from plinth.entrypoints.serve_cmd import ServeError, lora_modules

    def args(*items, enable=True):
        return argparse.Namespace(lora_modules=list(items), enable_lora=enable)

    assert lora_modules(args("a=/x", '{"name": "b", "path": "/y"}')) == [("a", "/x"), ("b", "/y")]
    for bad, message in [(args("a"), "takes NAME=PATH"), (args("a=/x", "a=/y"), "names 'a' twice"),
                         (args("a=/x", enable=False), "needs --enable-lora"), (args('{"name": 1}'), "takes NAME=PATH")]:
        with pytest.raises(ServeError, match=message):
            lora_modules(bad)


def test_updates_off_by_default(tmp_path):
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    model = save_tiny_model(tmp_path / "m")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), dtype="float32", selection="off", enable_lora=True))
    front = AsyncLLMEngine(engine)
    with pytest.raises(ValueError, match="no such folder"):
        build_app(front, lora_modules=[("a", str(tmp_path / "missing"))])
    with pytest.raises(ValueError, match="the model name 'm' is taken"):
        build_app(front, lora_modules=[(front.served_model_name, str(tmp_path))])
    with TestClient(build_app(front)) as client:
        err = _post(client, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)}, status=404)
        assert "--allow-runtime-lora-updating" in err["error"]["message"]


@pytest.mark.server
def test_plinth_serve_with_lora_modules(tmp_path):
    """The flags end to end: a real ``plinth serve`` process answers as the adapter; a bad adapter stops it at
    start with one clear line."""
    import os
    import subprocess
    import sys

    import httpx
    from server_utils import running_server

    model = save_tiny_model(tmp_path / "m")
    adapter = make_adapter(model, tmp_path / "a", 21)
    common = [str(model), "--dtype", "float32", "--selection", "off", "--enable-lora", "--max-lora-rank", "8"]
    with running_server([*common, "--lora-modules", f"mine={adapter}"]) as server:
        models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["m", "mine"]
        body = {"prompt": "The quick", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        base = httpx.post(f"{server.base_url}/v1/completions", json={**body, "model": "m"}).json()
        mine = httpx.post(f"{server.base_url}/v1/completions", json={**body, "model": "mine"}).json()
        assert mine["model"] == "mine" and mine["choices"][0]["text"] != base["choices"][0]["text"]
        assert httpx.post(f"{server.base_url}/v1/load_lora_adapter",
                          json={"lora_name": "x", "lora_path": str(adapter)}).status_code == 404
    bad = subprocess.run([sys.executable, "-m", "plinth.entrypoints.cli", "serve", *common, "--lora-modules",
                          f"mine={tmp_path / 'missing'}", "--port", "0"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PLINTH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert bad.returncode != 0
    assert "no such folder" in bad.stderr and "Traceback" not in bad.stderr


def test_mixture_of_experts_attention_adapter(tmp_path):
    """A Mixtral model: an adapter on the attention projections matches PEFT; one on the experts is refused
    (plinth applies adapters to dense MLPs only)."""
    import transformers
    from conftest import make_tokenizer

    tokenizer = make_tokenizer()
    config = transformers.MixtralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(3)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "m")
    attn = make_adapter(tmp_path / "m", tmp_path / "attn", 31, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    llm = LLM(str(tmp_path / "m"), dtype="float32", selection="off", enable_lora=True, max_lora_rank=8)
    out = llm.generate(PROMPTS[1], greedy(), lora_request=LoRARequest("attn", 1, str(attn)), use_tqdm=False)[0]
    assert_matches_peft(tmp_path / "m", attn, out)
    experts = _edit(attn, tmp_path / "experts", tensors=lambda w: {
        **w, "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": torch.zeros(8, 64)})
    with pytest.raises(RequestRejectedError, match="experts.0.gate_proj.lora_A.weight. is not a LoRA A/B weight"):
        llm.generate("hi", greedy(), lora_request=LoRARequest("experts", 2, str(experts)))


def test_phi3_adapters_on_fused_projections_match_peft(tmp_path):
    """Phi-3's checkpoints fuse q/k/v and gate/up, so PEFT adapts qkv_proj and gate_up_proj: their B rows split
    between the projections (one A for all of them), matching PEFT; an adapter naming a fused module and one
    of its parts is refused."""
    import transformers
    from conftest import make_tokenizer

    tokenizer = make_tokenizer()
    config = transformers.Phi3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=256, pad_token_id=0, eos_token_id=tokenizer.eos_token_id,
                                     bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(5)
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    fused = make_adapter(tmp_path / "m", tmp_path / "fused", 41, targets=("qkv_proj", "o_proj", "gate_up_proj",
                                                                           "down_proj"))
    llm = LLM(str(tmp_path / "m"), dtype="float32", selection="off", enable_lora=True, max_lora_rank=8)
    out = llm.generate(PROMPTS[1], greedy(), lora_request=LoRARequest("fused", 1, str(fused)), use_tqdm=False)[0]
    assert_matches_peft(tmp_path / "m", fused, out)
    base = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)[0]
    assert base.outputs[0].token_ids != out.outputs[0].token_ids   # the adapter changes the output
    both = _edit(fused, tmp_path / "both", tensors=lambda w: {
        **w, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8)})
    with pytest.raises(RequestRejectedError, match="adapted both as qkv_proj and as q_proj"):
        llm.generate("hi", greedy(), lora_request=LoRARequest("both", 2, str(both)))


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_adapter_on_a_quantized_base(tmp_path, method):
    """An adapter over weights quantized on the fly: PEFT on transformers running the dequantized weights is the
    reference (the adapter adds its product to the quantized layer's output)."""
    from test_quantization_support import dequantized_linears, float_state, reference_model

    from plinth.quantization.quantizers import quantize_fp8_per_channel, quantize_int_rtn

    base = save_tiny_model(tmp_path / "m")
    dequant = {"int4": lambda n, w: quantize_int_rtn(w, 4, 64).dequantize(torch.float32),
               "fp8": lambda n, w: quantize_fp8_per_channel(w).dequantize(torch.float32)}[method]
    reference_model(base, dequantized_linears(float_state(base), dequant)).save_pretrained(tmp_path / "ref")
    adapter = make_adapter(base, tmp_path / "a", 41)
    llm = LLM(str(base), dtype="float32", selection="off", quantization=method, enable_lora=True, max_lora_rank=8)
    out = llm.generate(PROMPTS[3], greedy(), lora_request=LoRARequest("a", 1, str(adapter)), use_tqdm=False)[0]
    assert_matches_peft(tmp_path / "ref", adapter, out, tol=1e-3)


@pytest.mark.parametrize("tp", [1, 2])
def test_phi_adapters_on_its_own_module_names(tmp_path, tp):
    """A Phi-2 adapter on every projection under Phi's names (q/k/v, ``dense``, ``fc1``, ``fc2``): the tokens'
    log-probabilities equal PEFT's, also with the layers split over two ranks; an adapter naming a module Phi does
    not have (Llama's ``o_proj``) is refused naming the modules Phi adapts, not silently dropped."""
    from safetensors.torch import load_file, save_file
    from test_models import save_with_tokenizer

    save_with_tokenizer("PhiForCausalLM", tmp_path / "phi")
    adapter = make_adapter(tmp_path / "phi", tmp_path / "adapter", 7,
                           targets=("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"))
    llm = LLM(str(tmp_path / "phi"), dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=256,
              tensor_parallel_size=tp)
    try:
        out = llm.generate([{"prompt_token_ids": [5, 17, 42, 9, 100]}], greedy(),
                           lora_request=LoRARequest("a", 1, str(adapter)), use_tqdm=False)[0]
        assert_matches_peft(tmp_path / "phi", adapter, out)
        if tp > 1:
            return
        foreign = tmp_path / "foreign"
        shutil.copytree(adapter, foreign)
        tensors = load_file(str(foreign / "adapter_model.safetensors"))
        save_file({k.replace(".dense.", ".o_proj."): v for k, v in tensors.items()},
                  str(foreign / "adapter_model.safetensors"))
        with pytest.raises(RequestRejectedError, match=r"adapts self_attn.o_proj; this model applies adapters to "
                                                       r"self_attn.q_proj, .*self_attn.dense, mlp.fc1, mlp.fc2"):
            llm.generate([{"prompt_token_ids": [5, 17]}], greedy(), lora_request=LoRARequest("b", 2, str(foreign)),
                         use_tqdm=False)
    finally:
        llm.close()
