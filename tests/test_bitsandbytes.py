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

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # bitsandbytes looks for optional hub kernels when imported
bnb = pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

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


def _dequantized_by_bitsandbytes(path) -> dict[str, torch.Tensor]:
    """The checkpoint's linear weights as bitsandbytes itself dequantizes them (its functional API)."""
    from bitsandbytes.functional import QuantState, dequantize_4bit, int8_vectorwise_dequant

    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if not is_linear(name):
            continue
        stem = name.removesuffix(".weight")
        if f"{stem}.SCB" in tensors:
            out[name] = int8_vectorwise_dequant(t, tensors[f"{stem}.SCB"]).float()
        elif any(k.startswith(f"{name}.quant_state") for k in tensors):
            parts = {k.removeprefix(f"{name}."): v for k, v in tensors.items() if k.startswith(f"{name}.")}
            state = QuantState.from_dict(parts, device=torch.device("cpu"))
            out[name] = dequantize_4bit(t, state).float()
        else:
            out[name] = t.float()
    return out


def _quantized(path) -> set[str]:
    stored = load_file(str(path / "model.safetensors"))
    return {n for n in stored if is_linear(n) and not stored[n].dtype.is_floating_point
            or any(k.startswith(f"{n}.quant_state") for k in stored)}


@pytest.fixture(scope="module")
def bnb_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb")
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
    plinth, logits close (bitsandbytes' CPU kernels round on the way: a 4-bit layer's outputs differ from
    ``x @ dequantized.T`` by ~4e-3 of their size; 8-bit rounds the activations to 8 bits)."""
    hf_model, path = bnb_dirs[kind]
    model, backend, _ = load_plinth(path)
    from test_quantization_support import plinth_logits_and_greedy, reference_logits_and_greedy

    ours, ours_tokens = plinth_logits_and_greedy(model, backend, new_tokens=8)
    theirs, their_tokens = reference_logits_and_greedy(hf_model.eval(), new_tokens=8)
    err = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
    assert err < 5e-2, err
    if kind != "int8":   # 8-bit activations move the random model's near ties
        assert ours_tokens == their_tokens


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
