"""bitsandbytes checkpoints: written by transformers with the real bitsandbytes library (CPU), read by plinth's
loader (widened to floats while loading) and compared with transformers running the same weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quantization_support import (
    PROMPTS,
    compare,
    float_state,
    is_linear,
    load_plinth,
    one_thread,  # noqa: F401 (an autouse fixture)
    reference_model,
)

from plinth.config import ConfigError
from plinth.errors import ModelLoadError

_OFFLINE = os.environ.get("HF_HUB_OFFLINE")
os.environ["HF_HUB_OFFLINE"] = "1"   # bitsandbytes looks for optional hub kernels when imported: never reach out
try:
    bnb = pytest.importorskip("bitsandbytes")
finally:   # the rest of the session's environment as it was
    if _OFFLINE is None:
        del os.environ["HF_HUB_OFFLINE"]
    else:
        os.environ["HF_HUB_OFFLINE"] = _OFFLINE
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """bitsandbytes' layers (through transformers) may look for hub kernels again: offline in these tests."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

CONFIGS = {
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False),
    "nf4-bf16-storage": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16),
    "int8": dict(load_in_8bit=True),
}


def _save_bnb(base, out, kind: str):
    """transformers quantizes the float checkpoint with bitsandbytes and saves it (its own layout)."""
    config = transformers.BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.float32, **CONFIGS[kind])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), quantization_config=config,
                                                              device_map="cpu", dtype=torch.float32)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (base / name).exists() and not (out / name).exists():
            shutil.copy(base / name, out / name)
    return model


def _dequantized_by_bitsandbytes(path, linear_only: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint's linear weights (``linear_only=False``: all its weights, the quantization parts dropped) as
    bitsandbytes itself dequantizes them (its functional API)."""
    from bitsandbytes.functional import QuantState, dequantize_4bit, int8_vectorwise_dequant

    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if linear_only and not is_linear(name):
            continue
        if not name.endswith(".weight"):   # biases, other tensors; not the quantization parts
            if not name.endswith((".SCB", ".weight_format")) and ".weight." not in name:
                out[name] = t
            continue
        stem = name.removesuffix(".weight")
        if f"{stem}.SCB" in tensors:
            out[name] = int8_vectorwise_dequant(t, tensors[f"{stem}.SCB"]).float()
        elif any(k.startswith(f"{name}.quant_state") for k in tensors):
            parts = {k.removeprefix(f"{name}."): v for k, v in tensors.items() if k.startswith(f"{name}.")}
            state = QuantState.from_dict(parts, device=torch.device("cpu"))
            out[name] = dequantize_4bit(t, state).float()
        else:
            out[name] = t.float() if linear_only else t
    return out


def _float_copy(path, out):
    """The checkpoint written again with bitsandbytes' dequantized weights and no quantization_config."""
    shutil.copytree(path, out)
    save_file({k: v.contiguous() for k, v in _dequantized_by_bitsandbytes(path, linear_only=False).items()},
              str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _quantized(path) -> set[str]:
    stored = load_file(str(path / "model.safetensors"))
    return {n for n in stored if is_linear(n) and not stored[n].dtype.is_floating_point
            or any(k.startswith(f"{n}.quant_state") for k in stored)}


@pytest.fixture(scope="module")
def bnb_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        return {kind: (_save_bnb(tiny_llama_dir, root / kind, kind), root / kind) for kind in CONFIGS}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_bitsandbytes_checkpoint_runs_its_dequantized_weights(tiny_llama_dir, bnb_dirs, kind):
    """plinth's logits on the checkpoint equal transformers' on the weights bitsandbytes dequantizes (float32:
    the same numbers, so within float noise), and the greedy tokens agree everywhere."""
    _, path = bnb_dirs[kind]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "bitsandbytes"
    stored = load_file(str(path / "model.safetensors"))
    quantized = [n for n in stored if is_linear(n) and stored[n].dtype != torch.float32]
    assert len(quantized) == 14, quantized   # every decoder linear layer of the two-layer model
    if kind == "nf4-bf16-storage":
        assert all(stored[n].dtype == torch.bfloat16 for n in quantized)
    deq = _dequantized_by_bitsandbytes(path)
    float_weights = float_state(tiny_llama_dir)
    assert all(not torch.equal(deq[n], float_weights[n]) for n in quantized)   # really quantized
    model, backend, method = load_plinth(path)
    assert method is None
    err, agree = compare(model, backend, reference_model(tiny_llama_dir, deq), atol=2e-4, min_agreement=1.0)


@pytest.mark.parametrize("kind", ["nf4-double", "int8"])
def test_plinth_follows_transformers_running_bitsandbytes(bnb_dirs, kind):
    """transformers running the quantized model itself (bitsandbytes' layers, CPU): the same greedy tokens as
    plinth (at least 80% of the positions; all here), logits close (bitsandbytes' CPU kernels round on the way: a 4-bit layer's outputs differ from
    ``x @ dequantized.T`` by ~4e-3 of their size; 8-bit rounds the activations to 8 bits)."""
    hf_model, path = bnb_dirs[kind]
    model, backend, _ = load_plinth(path)
    from test_quantization_support import plinth_logits_and_greedy, reference_logits_and_greedy

    ours, ours_tokens = plinth_logits_and_greedy(model, backend, new_tokens=8)
    theirs, their_tokens = reference_logits_and_greedy(hf_model.eval(), new_tokens=8)
    err = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
    assert err < 5e-2, err
    if kind != "int8":   # 8-bit activations move the random model's near ties (so may bitsandbytes' CPU rounding)
        from test_quantization_support import agreement

        assert agreement(ours_tokens, their_tokens) >= 0.8, (ours_tokens, their_tokens)


def test_quantizing_the_dequantized_weights_again(tiny_llama_dir, bnb_dirs):
    """--quantization fp8 (or int4) on a bitsandbytes checkpoint quantizes the widened weights (memory); the
    name bitsandbytes itself is accepted as "as stored"; on a float checkpoint it is refused with the methods
    that quantize floats."""
    from plinth.quantization.quantizers import quantize_fp8_per_channel

    _, path = bnb_dirs["nf4-double"]
    deq = {n: quantize_fp8_per_channel(w).dequantize(torch.float32) if n in _quantized(path) else w
           for n, w in _dequantized_by_bitsandbytes(path).items()}
    model, backend, method = load_plinth(path, "fp8")
    assert method.name == "fp8"
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)
    _, _, method = load_plinth(path, "bitsandbytes")
    assert method is None
    with pytest.raises(ConfigError, match="reads checkpoints saved with bitsandbytes.*fp8"):
        load_plinth(tiny_llama_dir, "bitsandbytes")
    import argparse

    from plinth.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, "generate")   # the command line takes the name too
    assert engine_config_from_args(parser.parse_args([str(path), "-q", "bitsandbytes"])).model.quantization == \
        "bitsandbytes"


def test_the_llm_api_generates_from_a_bitsandbytes_checkpoint(bnb_dirs):
    from plinth import LLM, SamplingParams

    _, path = bnb_dirs["nf4-double"]
    with LLM(str(path), dtype="float32", selection="off") as llm:
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def _damaged(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop(f"{Q}.weight.absmax"), f"missing tensor '{Q}.weight.absmax'"),
    (lambda t: t.pop(f"{Q}.weight.nested_absmax"), f"missing tensor '{Q}.weight.nested_absmax'"),
    (lambda t: t.update({f"{Q}.weight.quant_state.bitsandbytes__nf4": torch.tensor(list(b"{not json"),
                                                                                    dtype=torch.uint8)}), "not JSON"),
    (lambda t: t.update({f"{Q}.weight.quant_state.bitsandbytes__nf4": torch.tensor(
        list(json.dumps({"quant_type": "nf8", "blocksize": 64, "shape": [128, 128]}).encode()), dtype=torch.uint8)}),
     "4-bit type 'nf8' is not supported"),
    (lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"][:-2]}), "packed weight has"),
], ids=["no_absmax", "no_nested_absmax", "state_not_json", "unknown_type", "short_weight"])
def test_a_damaged_4bit_layer_is_a_clear_load_error(bnb_dirs, tmp_path, edit, match):
    _, path = bnb_dirs["nf4-double"]
    with pytest.raises(ModelLoadError, match=match):
        load_plinth(_damaged(path, tmp_path / "bad", edit))


def test_a_damaged_8bit_layer_is_a_clear_load_error(bnb_dirs, tmp_path):
    _, path = bnb_dirs["int8"]
    with pytest.raises(ModelLoadError, match=f"missing tensor '{Q}.weight'"):
        load_plinth(_damaged(path, tmp_path / "no_weight", lambda t: t.pop(f"{Q}.weight")))
    with pytest.raises(ModelLoadError, match="SCB"):
        load_plinth(_damaged(path, tmp_path / "short_scb", lambda t: t.update({f"{Q}.SCB": t[f"{Q}.SCB"][:3]})))
    with pytest.raises(ModelLoadError, match="weight_format"):
        load_plinth(_damaged(path, tmp_path / "col", lambda t: t.update(
            {f"{Q}.weight_format": torch.tensor(2, dtype=torch.uint8)})))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("shape,blocksize", [((37, 53), 64), ((300, 129), 128), ((8, 8), 64)])
def test_dequantize_4bit_equals_bitsandbytes(quant_type, nested, shape, blocksize):
    """Odd sizes (a last block shorter than the others, an odd number of codes), both types, both absmax kinds:
    the same numbers as bitsandbytes' own dequantization."""
    from bitsandbytes.functional import dequantize_4bit as theirs
    from bitsandbytes.functional import quantize_4bit

    from plinth.quantization.bitsandbytes import dequantize_4bit

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.1
    packed, state = quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    parts = {("state" if k.startswith("quant_state") else k): v for k, v in state.as_dict(packed=True).items()}
    ours = dequantize_4bit({"weight": packed, **parts}, "layer", torch.float32, torch.device("cpu"))
    assert torch.equal(ours, theirs(packed, state).float())
    assert (ours - w).abs().max() < 0.1   # and it is the weight, roughly


def test_dequantize_8bit_equals_bitsandbytes():
    from bitsandbytes.functional import int8_vectorwise_dequant, int8_vectorwise_quant

    from plinth.quantization.bitsandbytes import dequantize_8bit

    w = torch.randn(33, 70, generator=torch.Generator().manual_seed(0))
    q, scb, _ = int8_vectorwise_quant(w.half())
    ours = dequantize_8bit(q, scb, "layer", torch.float32, torch.device("cpu"))
    assert torch.equal(ours, int8_vectorwise_dequant(q, scb).float())


def _set_state(tensors, **changes):
    key = f"{Q}.weight.quant_state.bitsandbytes__nf4"
    state = json.loads(bytes(tensors[key].tolist()).decode())
    state.update(changes)
    tensors[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


@pytest.mark.parametrize("edit,match", [
    (lambda t: _set_state(t, blocksize=2**40), "blocksize=1099511627776 .*at most 4096"),
    (lambda t: _set_state(t, nested_blocksize=2**28), "nested_blocksize=268435456 .*at most 4096"),
    (lambda t: _set_state(t, nested_offset=10**400), "nested_offset"),
    (lambda t: _set_state(t, shape=[True, 128]), "shape=\\[True, 128\\]"),
    (lambda t: t.update({f"{Q}.weight.quant_state.bitsandbytes__nf4": torch.tensor(list(b"[" * 100000),
                                                                                    dtype=torch.uint8)}), "bytes"),
    (lambda t: t.update({f"{Q}.weight.quant_state.bitsandbytes__nf4": torch.tensor(list(b"[" * 5000),
                                                                                    dtype=torch.uint8)}), "not JSON"),
    (lambda t: t.update({f"{Q}.weight": torch.tensor(1.0, dtype=torch.float16)}), "packed weight has 2 bytes"),
], ids=["huge_blocksize", "huge_nested_blocksize", "offset_too_large", "bool_shape", "huge_state", "deep_json",
        "scalar_weight"])
def test_a_hostile_quantization_state_is_a_clear_load_error(bnb_dirs, tmp_path, edit, match):
    """Whatever the file's JSON says, memory stays bounded by the layer and the error is a ModelLoadError."""
    _, path = bnb_dirs["nf4-double"]
    with pytest.raises(ModelLoadError, match=match):
        load_plinth(_damaged(path, tmp_path / "bad", edit))


def test_dummy_weights_for_a_bitsandbytes_model_directory(bnb_dirs):
    from plinth import LLM, SamplingParams

    _, path = bnb_dirs["nf4-double"]
    with LLM(str(path), load_format="dummy", dtype="float32", selection="off", quantization="int4") as llm:
        out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_the_language_model_of_an_image_and_text_checkpoint(tmp_path):
    """A Llava checkpoint quantized by transformers (its language model's layers; the vision tower's too): the
    language model plinth runs from it computes exactly what it computes from the same checkpoint written with
    bitsandbytes' dequantized weights (the quantization config sits at the top level only)."""
    text = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(text_config=text, vision_config=vision,
                                                                                image_token_index=299))
    model.save_pretrained(str(tmp_path / "float"))
    quantized = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(tmp_path / "float"), device_map="cpu", dtype=torch.float32,
        quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32))
    quantized.save_pretrained(str(tmp_path / "nf4"))
    from test_quantization_support import plinth_logits_and_greedy

    ours, ours_tokens = plinth_logits_and_greedy(*load_plinth(tmp_path / "nf4")[:2], new_tokens=4)
    ref, ref_tokens = plinth_logits_and_greedy(*load_plinth(_float_copy(tmp_path / "nf4", tmp_path / "deq"))[:2],
                                               new_tokens=4)
    assert ours_tokens == ref_tokens and all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))


def test_image_inputs_of_a_quantized_llava_checkpoint(tmp_path):
    """A LLaVA checkpoint quantized by transformers, vision tower included: its image encoder is widened as it is read,
    and the tokens with an image equal those of the same checkpoint written with bitsandbytes' dequantized weights."""
    from plinth import LLM, SamplingParams

    pytest.importorskip("PIL")
    from test_multimodal import _picture, _save_llava

    # (rows of 64 features and more: bitsandbytes' own dequantization, the reference, cuts blocks by rows on the CPU)
    _save_llava(tmp_path / "float", vision_hidden=64)
    transformers.LlavaForConditionalGeneration.from_pretrained(
        str(tmp_path / "float"), device_map="cpu", dtype=torch.float32,
        quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
    ).save_pretrained(str(tmp_path / "nf4"))
    for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(tmp_path / "float" / f, tmp_path / "nf4" / f)
    assert any("vision_tower" in n and "quant_state" in n for n in load_file(str(tmp_path / "nf4" / "model.safetensors")))
    prompt = {"prompt": "The <image> quick brown", "multi_modal_data": {"image": _picture(3)}}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = []
    for path in (tmp_path / "nf4", _float_copy(tmp_path / "nf4", tmp_path / "deq")):
        with LLM(str(path), dtype="float32", platform="cpu", selection="off") as llm:
            outs.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0])
    assert outs[0].token_ids == outs[1].token_ids
    assert [{t: lp.logprob for t, lp in step.items()} for step in outs[0].logprobs] == \
        [{t: lp.logprob for t, lp in step.items()} for step in outs[1].logprobs]


def test_a_classifier_whose_score_layer_is_quantized(tiny_llama_dir, tmp_path):
    """transformers quantizes a classifier's ``score`` layer too unless it is skipped: its rows are widened as the
    layers' are (the same probabilities as the checkpoint written with bitsandbytes' dequantized weights)."""
    from plinth import LLM

    cls = transformers.LlamaForSequenceClassification(transformers.LlamaConfig.from_pretrained(
        str(tiny_llama_dir), num_labels=3, pad_token_id=0))
    cls.save_pretrained(str(tmp_path / "float"))
    transformers.AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path / "float"), device_map="cpu", dtype=torch.float32,
        quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["q_proj"],
                                                            bnb_4bit_compute_dtype=torch.float32),
    ).save_pretrained(str(tmp_path / "nf4"))
    assert "score.weight.quant_map" in load_file(str(tmp_path / "nf4" / "model.safetensors"))
    probs = []
    for path in (tmp_path / "nf4", _float_copy(tmp_path / "nf4", tmp_path / "deq")):
        with LLM(str(path), dtype="float32", selection="off", task="classify") as llm:
            probs.append(llm.classify([{"prompt_token_ids": [5, 6, 7, 8]}], use_tqdm=False)[0].outputs.probs)
    assert probs[0] == pytest.approx(probs[1], abs=1e-6)


def test_a_reranker_read_from_a_quantized_lm_head(tmp_path):
    """A causal LM read as a cross-encoder (``classifier_from_token``) takes two rows of its LM head; a head
    quantized by bitsandbytes (quantized unless skipped) is widened first."""
    from conftest import save_tiny_model

    from plinth import LLM

    save_tiny_model(tmp_path / "float", arch="qwen3", tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "float"), device_map="cpu", dtype=torch.float32,
        quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["q_proj"],
                                                            bnb_4bit_compute_dtype=torch.float32),
    ).save_pretrained(str(tmp_path / "nf4"))
    for name in os.listdir(tmp_path / "float"):
        if name.startswith(("tokenizer", "special")):
            shutil.copy(tmp_path / "float" / name, tmp_path / "nf4" / name)
    assert "lm_head.weight.quant_map" in load_file(str(tmp_path / "nf4" / "model.safetensors"))
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a", "b"],
                 "method": "from_2_way_softmax"}
    scores = []
    for path in (tmp_path / "nf4", _float_copy(tmp_path / "nf4", tmp_path / "deq")):
        with LLM(str(path), task="classify", dtype="float32", selection="off", hf_overrides=overrides) as llm:
            scores.append(llm.score([PROMPTS[0]], [PROMPTS[1]], use_tqdm=False)[0].outputs.score)
    assert scores[0] == pytest.approx(scores[1], abs=1e-6)
