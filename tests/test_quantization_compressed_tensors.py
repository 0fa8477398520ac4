"""compressed-tensors checkpoints written by the compressed-tensors library itself (on the CPU), against
transformers on the weights the library's own fake quantization gives."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
import transformers
from test_quantization_support import (
    compare,
    is_linear,
    load_plinth,
    one_thread,  # noqa: F401 (an autouse fixture)
    reference_model,
)

from plinth.config import ConfigError

if importlib.util.find_spec("compressed_tensors") is None:
    pytest.skip("compressed-tensors is not installed", allow_module_level=True)


def _lib() -> SimpleNamespace:
    """The library, imported when a test runs: it imports Triton, which must not happen while tests are
    collected (the Triton test modules import it in interpreter mode then)."""
    from compressed_tensors import compressors, quantization
    from compressed_tensors.quantization import utils
    from compressed_tensors.quantization.lifecycle import forward

    return SimpleNamespace(
        ModelCompressor=compressors.ModelCompressor, QuantizationArgs=quantization.QuantizationArgs,
        QuantizationConfig=quantization.QuantizationConfig, QuantizationScheme=quantization.QuantizationScheme,
        apply_quantization_config=quantization.apply_quantization_config, fake_quantize=forward.fake_quantize,
        calculate_qparams=utils.calculate_qparams, is_module_quantized=utils.is_module_quantized,
    )


def _schemes(lib: SimpleNamespace) -> dict[str, dict]:
    args = lib.QuantizationArgs
    int_token = args(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    fp8_token = args(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    return {
        "w4a16-asym": dict(weights=args(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)),
        "w4a16-sym": dict(weights=args(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)),
        "w8a16-channel": dict(weights=args(num_bits=8, type="int", symmetric=True, strategy="channel")),
        "int8-w8a8": dict(weights=args(num_bits=8, type="int", symmetric=True, strategy="channel"),
                          input_activations=int_token),
        "fp8-channel": dict(weights=args(num_bits=8, type="float", symmetric=True, strategy="channel"),
                            input_activations=fp8_token),
        "fp8-tensor": dict(weights=args(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                           input_activations=fp8_token),
        # static per-tensor inputs (input_scale, and input_zero_point when the inputs are asymmetric, whatever the
        # weights are): read, not used
        "int8-w8a8-static-asym-inputs": dict(
            weights=args(num_bits=8, type="int", symmetric=True, strategy="channel"),
            input_activations=args(num_bits=8, type="int", symmetric=False, strategy="tensor", dynamic=False)),
        # llm-compressor's FP8_BLOCK: block weights, FP8 inputs per group (run per token)
        "fp8-block-group-inputs": dict(
            weights=args(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[32, 32]),
            input_activations=args(num_bits=8, type="float", symmetric=True, strategy="group", group_size=32,
                                   dynamic=True)),
        "int8-w8a8-asym-static-inputs": dict(
            weights=args(num_bits=8, type="int", symmetric=False, strategy="channel"),
            input_activations=args(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)),
    }


def _observe(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max per the scheme's strategy (what llm-compressor's observers compute)."""
    if args.strategy == "block":
        bn, bk = args.block_structure
        blocks = weight.reshape(weight.shape[0] // bn, bn, weight.shape[1] // bk, bk)
        return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    if args.strategy == "group":
        grouped = weight.reshape(weight.shape[0], -1, args.group_size)
        return grouped.amin(-1), grouped.amax(-1)
    if args.strategy == "channel":
        return weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    return weight.amin().reshape(1), weight.amax().reshape(1)


def ct_checkpoint(base, out, scheme: str, ignore=("lm_head",)):
    """Quantize the tiny model with the library and save it compressed; also return the dequantized weights."""
    lib = _lib()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    config = lib.QuantizationConfig(
        config_groups={"group_0": lib.QuantizationScheme(targets=["Linear"], **_schemes(lib)[scheme])},
        ignore=list(ignore))
    lib.apply_quantization_config(model, config)
    deq = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not lib.is_module_quantized(module):
                if isinstance(module, torch.nn.Linear) and is_linear(f"{name}.weight"):
                    deq[f"{name}.weight"] = module.weight.detach().clone()
                continue
            args = module.quantization_scheme.weights
            scale, zero = lib.calculate_qparams(*_observe(module.weight, args), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
            deq[f"{name}.weight"] = lib.fake_quantize(module.weight, module.weight_scale,
                                                      getattr(module, "weight_zero_point", None), args).detach()
    compressor = lib.ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    return out, deq


@pytest.mark.parametrize("scheme,kernel", [
    ("w4a16-asym", "dequant"), ("w4a16-asym", "torch_int4pack"), ("w4a16-sym", "torch_int4pack"),
    ("w8a16-channel", "dequant"), ("int8-w8a8", "dequant"), ("fp8-channel", "dequant"), ("fp8-tensor", "dequant"),
    ("int8-w8a8-static-asym-inputs", "dequant"), ("int8-w8a8-asym-static-inputs", "dequant"),
    ("fp8-block-group-inputs", "dequant"),
])
def test_library_checkpoints_match_reference(tiny_llama_dir, tmp_path, scheme, kernel):
    path, deq = ct_checkpoint(tiny_llama_dir, tmp_path / scheme, scheme)
    model, backend, method = load_plinth(path, gemm_kernel=kernel)
    assert method.name == "compressed-tensors" and method.kernel.name == kernel
    # measured: max logit error ~1.5e-6, 48/48 greedy tokens equal
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)


def test_int8_w8a8_on_int_mm(tiny_llama_dir, tmp_path):
    """INT8 activations (per token) as the checkpoint intends: close to the weight-only reference, not equal."""
    path, deq = ct_checkpoint(tiny_llama_dir, tmp_path / "w8a8", "int8-w8a8")
    model, backend, method = load_plinth(path, gemm_kernel="torch_int_mm")
    assert method.activation == "int8_token"
    # measured: max logit error 3.9e-2 (activation rounding; logits up to ~2.5), 42/48 greedy tokens equal
    err, _agree = compare(model, backend, reference_model(tiny_llama_dir, deq), atol=0.1, min_agreement=0.75)
    assert err > 1e-5  # the activations really were quantized


def test_ignored_layer_stays_float(tiny_llama_dir, tmp_path):
    from plinth.model_registry.layers.linear import UnquantizedLinearMethod

    path, deq = ct_checkpoint(tiny_llama_dir, tmp_path / "ign", "w4a16-asym",
                              ignore=("lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"))
    model, backend, method = load_plinth(path, gemm_kernel="dequant")
    assert isinstance(model.model.layers[1].mlp.down_proj.linear_method, UnquantizedLinearMethod)
    assert model.model.layers[0].mlp.down_proj.linear_method is method
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)


def _config_with(tmp_path, tiny_llama_dir, **changes):
    import json

    path, _ = ct_checkpoint(tiny_llama_dir, tmp_path / "c", "w4a16-asym")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_mixed_schemes_are_refused(tiny_llama_dir, tmp_path):
    second = {"targets": ["re:.*down_proj"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                          "strategy": "channel"}, "format": "pack-quantized"}
    import json

    path = _config_with(tmp_path, tiny_llama_dir)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_1"] = second
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="2 different schemes"):
        load_plinth(path)


def test_kv_cache_scheme_is_refused(tiny_llama_dir, tmp_path):
    kv = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}
    path = _config_with(tmp_path, tiny_llama_dir, kv_cache_scheme=kv)
    with pytest.raises(ConfigError, match="KV-cache quantization"):
        load_plinth(path)


def test_two_bit_weights_are_refused(tiny_llama_dir, tmp_path):
    import json

    path = _config_with(tmp_path, tiny_llama_dir)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="2-bit pack-quantized weights are not supported"):
        load_plinth(path)


@pytest.mark.parametrize("key,value,message", [
    ("group_size", "32", "config_groups.group_0.weights.group_size must be an integer"),
    ("num_bits", None, r"invalid quantization_config[\s\S]*num_bits"),
])
def test_mistyped_weight_settings_are_refused(tiny_llama_dir, tmp_path, key, value, message):
    """Refused naming the setting (the library's own validation; a string group size reached its validator as it was
    and raised a TypeError there)."""
    import json

    path = _config_with(tmp_path, tiny_llama_dir)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"][key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"compressed-tensors: {message}"):
        load_plinth(path)
