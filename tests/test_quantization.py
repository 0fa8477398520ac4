"""Quantization: packing, quantizers, int4 and fp8 end to end, method resolution and its errors,
kernel selection, and the third-party int8 plugin (CPU, float32, a tiny random Llama)."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_quantization_support import (
    compare,
    dequantized_linears,
    float_state,
    load_plinth,
    one_thread,  # noqa: F401 (an autouse fixture)
    reference_model,
    write_checkpoint,
)

from plinth.config import ConfigError
from plinth.errors import ModelLoadError, SelectionError
from plinth.plugins import get_plugin_manager
from plinth.quantization.formats import FP8_MAX, IntWeights
from plinth.quantization.interface import QuantContext
from plinth.quantization.kernels.dequant import DequantIntKernel
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support
from plinth.quantization.packing import AWQ_ORDER, pack_int32, unpack_int32
from plinth.quantization.quantizers import quantize_fp8_per_channel, quantize_int_rtn, random_int_weights
from plinth.quantization.selection import holder

CPU = torch.device("cpu")

# ------------------------------------------------------------------------------------------ packing


def test_pack_layouts_match_the_published_orders():
    codes = torch.arange(8, dtype=torch.uint8).reshape(1, 8)
    # GPTQ: code i in nibble i; AWQ: code AWQ_ORDER[i] in nibble i -> nibbles 0,2,4,6,1,3,5,7 from the bottom
    assert pack_int32(codes, 4, dim=1).item() == 0x76543210
    assert pack_int32(codes, 4, dim=1, order=AWQ_ORDER).item() == 0x75316420
    assert pack_int32(torch.tensor([[1, 2, 3, 255]], dtype=torch.uint8), 8, dim=1).item() == \
        0xFF030201 - (1 << 32)  # a signed int32 word


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("bits,order", [(4, None), (8, None), (4, "awq")])
def test_pack_unpack_round_trip(bits, dim, order):
    gen = torch.Generator().manual_seed(bits + dim)
    codes = torch.randint(0, 1 << bits, (16, 24), generator=gen).to(torch.uint8)
    order_seq = AWQ_ORDER if order else None
    packed = pack_int32(codes, bits, dim, order_seq)
    assert packed.dtype == torch.int32 and packed.shape[dim] == codes.shape[dim] * bits // 32
    assert torch.equal(unpack_int32(packed, bits, dim, order_seq), codes)


# --------------------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("symmetric", [False, True])
def test_rtn_codes_and_error_bound(symmetric):
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.05
    q = quantize_int_rtn(w, 4, 64, symmetric=symmetric)
    assert q.q.dtype == torch.uint8 and int(q.q.max()) <= 15 and q.scales.shape == (32, 4)
    err = (q.dequantize(torch.float64) - w).abs().view(32, 4, 64)
    # round to nearest: within half a step, plus the clamping a symmetric grid costs at -max
    bound = q.scales.double()[..., None] * (0.5 if not symmetric else 1.0) + 1e-9
    assert bool((err <= bound).all())
    if symmetric:
        assert bool((q.zeros == 8).all())


def test_int_weights_act_order_permutation():
    w = random_int_weights(8, 64, 4, 16, symmetric=False, act_order=True, device=CPU,
                           generator=torch.Generator().manual_seed(1))
    dense = w.dequantize(torch.float64)                                       # unpermuted order
    sorted_cols = ((w.q.double() - w.zeros.double().repeat_interleave(16, 1)) * w.scales.double().repeat_interleave(16, 1))
    assert torch.allclose(dense[:, w.perm], sorted_cols, atol=1e-7)
    x = torch.randn(3, 64, dtype=torch.float64)
    assert torch.allclose(x @ dense.t(), x[:, w.perm] @ sorted_cols.t())


def test_fp8_per_channel_quantizer():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) * 0.1
    q = quantize_fp8_per_channel(w)
    assert q.weight.dtype == torch.float8_e4m3fn
    assert torch.allclose(q.weight.float().abs().amax(1), torch.full((16,), FP8_MAX))
    rel = ((q.dequantize() - w).abs() / w.abs().amax(1, keepdim=True)).max()
    assert rel <= 2.0 ** -4  # E4M3: 3 mantissa bits, relative to the row's largest value


# ------------------------------------------------------------------------------------ int4 and fp8


@pytest.mark.parametrize("kernel", ["dequant", "torch_int4pack"])
def test_int4_matches_transformers_on_dequantized_weights(tiny_llama_dir, kernel):
    model, backend, method = load_plinth(tiny_llama_dir, "int4", gemm_kernel=kernel)
    assert method.kernel.name == kernel and method.group_size == 64  # hidden 64: groups of 64
    deq = dequantized_linears(float_state(tiny_llama_dir),
                              lambda n, w: quantize_int_rtn(w, 4, 64).dequantize(torch.float32))
    # measured: max logit error ~1.3e-6, 48/48 greedy tokens equal
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)
    # the quantization is real: the layers hold 4-bit codes, not the float weights
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not hasattr(qkv, "weight") and "weight" not in dict(qkv.named_parameters())


def test_gate_up_layers_can_apply_silu_and_mul_in_their_kernel(tiny_llama_dir, monkeypatch):
    """A kernel with ``silu_pairs`` is told which layers feed SiLU-and-mul (the MLPs' gate/up, nothing
    else) and computes it for them; the model's outputs stay those of the reference."""
    import torch.nn.functional as F

    from plinth.quantization.kernels import dequant

    calls = []

    class PairingDequant(DequantIntKernel):
        silu_pairs = True

        def prepare(self, weights, *, silu_pairs=False):
            return {**super().prepare(weights), "paired": silu_pairs}

        def apply_silu_mul(self, layer, x, bias):
            calls.append(tuple(x.shape))
            y = self.apply(layer, x, bias)
            d = y.shape[-1] // 2
            return F.silu(y[:, :d]) * y[:, d:]

    monkeypatch.setattr(dequant, "DequantIntKernel", PairingDequant)
    model, backend, method = load_plinth(tiny_llama_dir, "int4", gemm_kernel="dequant")
    assert isinstance(method.kernel, PairingDequant)
    layer0 = model.model.layers[0]
    assert layer0.mlp.gate_up_proj.paired and not layer0.mlp.down_proj.paired
    assert not layer0.self_attn.qkv_proj.paired
    deq = dequantized_linears(float_state(tiny_llama_dir),
                              lambda n, w: quantize_int_rtn(w, 4, 64).dequantize(torch.float32))
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)
    assert len(calls) >= len(model.model.layers)
    # a method that overrides apply keeps its own path for gate/up layers too
    from plinth.quantization.interface import QuantizationMethod

    gate_up = layer0.mlp.gate_up_proj
    x = torch.randn(2, gate_up.input_size_per_partition)
    assert method.apply_silu_mul(gate_up, x, None) is not None
    monkeypatch.setattr(type(method), "apply", lambda self, layer, x, bias: QuantizationMethod.apply(self, layer, x, bias))
    assert method.apply_silu_mul(gate_up, x, None) is None


def test_fp8_from_float_checkpoint_matches_reference(tiny_llama_dir):
    model, backend, method = load_plinth(tiny_llama_dir, "fp8")
    assert method.kernel.name == "dequant"  # no FP8 tensor cores on a CPU
    deq = dequantized_linears(float_state(tiny_llama_dir),
                              lambda n, w: quantize_fp8_per_channel(w).dequantize(torch.float32))
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)


@pytest.fixture(scope="module")
def vocab320_dirs(tmp_path_factory):
    """Tiny Llamas with a vocabulary of 320 rows (a multiple of 16, which torch_int4pack needs), untied and
    tied."""
    from conftest import save_tiny_model

    root = tmp_path_factory.mktemp("vocab320")
    return {tied: save_tiny_model(root / str(tied), vocab_size=320, tie_word_embeddings=tied) for tied in (False, True)}


def _int4(w: torch.Tensor) -> torch.Tensor:
    return quantize_int_rtn(w, 4, 64).dequantize(torch.float32)


def test_quantized_lm_head_matches_reference(vocab320_dirs):
    """``--quantize-lm-head`` with int4: the head gets a kernel selected for its shape alone, its logits come
    from the quantized weight (transformers with every linear weight and the head dequantized agrees), and
    the float copy of an untied head is released."""
    path = vocab320_dirs[False]
    model, backend, method = load_plinth(path, "int4", quantize_lm_head=True)
    head = model.lm_head
    assert head.kernel_selection.winner == "torch_int4pack" and (320, 64) not in method.problem.shapes
    assert head.gemm is not None and head.weight.numel() == 0
    assert dict(head.quantized.named_parameters()) and "weight" not in dict(head.quantized.named_parameters())
    state = float_state(path)
    ref = reference_model(path, dequantized_linears(state, lambda n, w: _int4(w)))
    with torch.no_grad():
        ref.lm_head.weight.copy_(_int4(state["lm_head.weight"]))
    compare(model, backend, ref, atol=1e-3, min_agreement=0.95)
    # the head's quantization is visible in the logits: a reference with the float head is further off
    with torch.no_grad():
        ref.lm_head.weight.copy_(state["lm_head.weight"])
    with pytest.raises(AssertionError, match="max logit error"):
        compare(model, backend, ref, atol=1e-3, min_agreement=0.0)


def test_quantized_lm_head_keeps_a_tied_embedding(vocab320_dirs):
    """A head tied to the embedding gets its quantized copy; the embedding keeps the float weight."""
    path = vocab320_dirs[True]
    model, _backend, _method = load_plinth(path, "int4", quantize_lm_head=True)
    embed = model.model.embed_tokens.weight
    assert model.lm_head.weight is embed and model.lm_head.gemm is not None
    torch.testing.assert_close(embed, float_state(path)["model.embed_tokens.weight"], atol=0, rtol=0)
    hidden = torch.randn(3, embed.shape[1])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ _int4(embed).T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rank", [0, 1])
def test_quantized_lm_head_of_a_tensor_parallel_rank(vocab320_dirs, rank):
    """Under TP=2 each rank quantizes its own 160 vocabulary rows; its gemm is that shard's product."""
    path = vocab320_dirs[False]
    model, _backend, method = load_plinth(path, "int4", quantize_lm_head=True, tp=(rank, 2))
    head = model.lm_head
    assert head.kernel_selection.winner == "torch_int4pack" and head.weight.numel() == 0
    assert method.group_size == 32   # the attention output's 32 features per rank set the group
    shard = float_state(path)["lm_head.weight"][rank * 160:(rank + 1) * 160]
    hidden = torch.randn(2, 64)
    expected = hidden @ quantize_int_rtn(shard, 4, 32).dequantize(torch.float32).T
    torch.testing.assert_close(head.gemm(hidden), expected, atol=1e-4, rtol=1e-4)


def test_lm_head_only_the_reference_kernel_runs_stays_float(tiny_llama_dir, caplog):
    """Where only dequantize-then-matmul can run the head (fp8 on a CPU; int4 with a vocabulary of 300 rows,
    which torch_int4pack cannot split), the head keeps its float weight, with a warning: expanding the whole
    matrix per call would be slower than the float head. The layers' kernel is chosen without the head."""
    for quantization, layer_kernel in (("fp8", "dequant"), ("int4", "torch_int4pack")):
        caplog.clear()
        with caplog.at_level("WARNING"):
            model, _backend, method = load_plinth(tiny_llama_dir, quantization, quantize_lm_head=True)
        head = model.lm_head
        assert head.kernel_selection.winner == "dequant" and head.gemm is None and head.weight.numel() > 0
        assert method.kernel.name == layer_kernel
        assert "dequant is the only kernel that runs it here; the head stays in torch.float32" in caplog.text


def test_lm_head_on_a_forced_reference_kernel_is_quantized(vocab320_dirs):
    """Forcing the reference kernel (``--gemm-kernel dequant``) quantizes the head through it: the user asked
    for the reference numerics everywhere."""
    model, _backend, method = load_plinth(vocab320_dirs[False], "int4", gemm_kernel="dequant", quantize_lm_head=True)
    head = model.lm_head
    assert method.kernel.name == "dequant" and head.kernel_selection.winner == "dequant"
    assert head.gemm is not None and head.weight.numel() == 0
    hidden = torch.randn(2, 64)
    expected = hidden @ _int4(float_state(vocab320_dirs[False])["lm_head.weight"]).T
    torch.testing.assert_close(head.gemm(hidden), expected, atol=1e-4, rtol=1e-4)


def test_quantize_lm_head_errors(tiny_llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="needs a quantization method that can quantize it: .*int4"):
        load_plinth(tiny_llama_dir, None, quantize_lm_head=True)
    with pytest.raises(ConfigError, match="'int8' cannot quantize the LM head.*methods that can: fp8, int4"):
        load_plinth(tiny_llama_dir, "int8", quantize_lm_head=True)
    path, _deq = _fp8_checkpoint(tiny_llama_dir, tmp_path / "block", "block")
    with pytest.raises(ConfigError, match="block-scaled"):
        load_plinth(path, None, quantize_lm_head=True)
    with pytest.raises(SelectionError, match=r"the LM head \(300 x 64, --quantize-lm-head\)"):
        load_plinth(tiny_llama_dir, "int4", gemm_kernel="torch_int4pack", quantize_lm_head=True)


def _fp8_checkpoint(base, out, scheme: str, block=(32, 32), ignored=()):
    """An FP8 checkpoint in the layout of ``quant_method: fp8`` and its dequantized weights."""
    state, deq = float_state(base), {}
    tensors = {}
    for name, w in state.items():
        if not (name.endswith("_proj.weight") and ".layers." in name) or any(i in name for i in ignored):
            tensors[name] = w
            if name.endswith("_proj.weight"):
                deq[name] = w
            continue
        stem = name.removesuffix(".weight")
        if scheme == "block":
            bn, bk = block
            blocks = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
            s = blocks.abs().amax(dim=(1, 3)) / FP8_MAX                         # [N/bn, K/bk]
            full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            q = (w / full).to(torch.float8_e4m3fn)
            tensors[f"{stem}.weight_scale_inv"] = s
            deq[name] = q.float() * full
        else:
            s = w.abs().amax(1, keepdim=True) / FP8_MAX if scheme == "channel" else w.abs().max() / FP8_MAX
            q = (w / s).to(torch.float8_e4m3fn)
            tensors[f"{stem}.weight_scale"] = s.reshape(-1, 1) if scheme == "channel" else s.reshape(())
            deq[name] = q.float() * s
        tensors[name] = q
        if scheme == "static":
            tensors[f"{stem}.input_scale"] = torch.tensor(0.05)
    config = {"quant_method": "fp8", "activation_scheme": "static" if scheme == "static" else "dynamic"}
    if scheme == "block":
        config["weight_block_size"] = list(block)
    if ignored:
        config["ignored_layers"] = list(ignored)
    return write_checkpoint(base, out, tensors, config), deq


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block", "static"])
def test_fp8_checkpoint_matches_reference(tiny_llama_dir, tmp_path, scheme):
    path, deq = _fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", scheme)
    model, backend, method = load_plinth(path)  # detected from config.json
    assert method.name == "fp8" and method.from_checkpoint
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)


def test_fp8_ignored_layers_stay_float(tiny_llama_dir, tmp_path):
    from plinth.model_registry.layers.linear import UnquantizedLinearMethod

    path, deq = _fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", "channel", ignored=("layers.1.mlp.down_proj",))
    model, backend, method = load_plinth(path)
    assert isinstance(model.model.layers[1].mlp.down_proj.linear_method, UnquantizedLinearMethod)
    assert model.model.layers[0].mlp.down_proj.linear_method is method
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)


def test_fp8_image_and_text_checkpoint_ignores_its_language_models_layers_by_their_names(tmp_path):
    """An image-and-text checkpoint's ignore list names its language model's layers as the checkpoint does
    (``language_model.model.layers...`` or ``model.language_model.layers...``), not as the causal LM plinth runs
    calls them: those layers load as the float weights they are."""
    import transformers
    from safetensors.torch import load_file, save_file

    from plinth.model_registry.layers.linear import UnquantizedLinearMethod

    text = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    torch.manual_seed(3)
    hf = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=299)).eval()
    hf.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    ignored = [n.removesuffix(".weight") for n in state if n.endswith("layers.1.mlp.down_proj.weight")]
    assert len(ignored) == 1 and not ignored[0].startswith("model.layers.")
    tensors, deq = {}, {}
    for name, w in state.items():
        if ".layers." in name and name.endswith("_proj.weight") and "vision" not in name \
                and name.removesuffix(".weight") not in ignored:
            s = w.abs().amax(1, keepdim=True) / FP8_MAX
            tensors[name], tensors[name.replace(".weight", ".weight_scale")] = (w / s).to(torch.float8_e4m3fn), s
            deq[name] = tensors[name].float() * s
        else:
            tensors[name] = w
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "ignored_layers": ignored + ["lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, backend, method = load_plinth(tmp_path)
    assert isinstance(model.model.layers[1].mlp.down_proj.linear_method, UnquantizedLinearMethod)
    assert model.model.layers[0].mlp.down_proj.linear_method is method
    state = hf.state_dict()   # (named in transformers' own layout, which it may write in another)
    ours = {name.split(".layers.", 1)[1]: name for name in state if ".layers." in name and "vision" not in name}
    with torch.no_grad():
        for name, value in deq.items():
            state[ours[name.split(".layers.", 1)[1]]].copy_(value)
    compare(model, backend, hf, atol=1e-3, min_agreement=0.95)


def test_fp8_partly_ignored_fused_layer_is_refused(tiny_llama_dir, tmp_path):
    path, _ = _fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", "channel", ignored=("layers.0.self_attn.k_proj",))
    with pytest.raises(ConfigError, match="fuses .*q_proj.*k_proj.*only some"):
        load_plinth(path)


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_dummy_preset_runs_quantized(quantization):
    from plinth import LLM, SamplingParams

    llm = LLM("tiny-llama", load_format="dummy", quantization=quantization, dtype="float32", selection="off",
              attention_backend="torch_sdpa")
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# ------------------------------------------------------------------------------------------ errors


def test_unknown_method_name_lists_installed(tiny_llama_dir):
    with pytest.raises(ConfigError, match="unknown quantization method 'int3'; installed: .*fp8.*int4"):
        load_plinth(tiny_llama_dir, "int3")


def test_checkpoint_with_unknown_method(tiny_llama_dir, tmp_path):
    path = tmp_path / "hqq"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized with 'hqq'.*no installed quantization plugin"):
        load_plinth(path)


def test_quantized_checkpoint_is_not_requantized(tiny_llama_dir, tmp_path):
    path, _ = _fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", "channel")
    with pytest.raises(ConfigError, match="already quantized with 'fp8'; --quantization int4 cannot"):
        load_plinth(path, "int4")


def test_fp8_checkpoint_format_and_scheme_checks(tiny_llama_dir):
    ctx = QuantContext(hf_config=None, dtype=torch.float32, device=CPU)
    fp8 = get_plugin_manager().registrations("quantization_methods")["fp8"].load()
    with pytest.raises(ConfigError, match="weight format 'e5m2' unsupported"):
        fp8.from_config({"quant_method": "fp8", "fmt": "e5m2"}, ctx)
    with pytest.raises(ConfigError, match="activation_scheme 'per_group' unsupported"):
        fp8.from_config({"quant_method": "fp8", "activation_scheme": "per_group"}, ctx)


def test_fp8_ignored_layers_must_be_a_list():
    """A single string was read character by character: refused, naming the setting."""
    ctx = QuantContext(hf_config=None, dtype=torch.float32, device=CPU)
    fp8 = get_plugin_manager().registrations("quantization_methods")["fp8"].load()
    with pytest.raises(ConfigError, match="fp8: ignored_layers must be a list of module names, got 'lm_head'"):
        fp8.from_config({"quant_method": "fp8", "ignored_layers": "lm_head"}, ctx)
    assert fp8.from_config({"quant_method": "fp8", "ignored_layers": ["lm_head"]}, ctx).ignored == ("lm_head",)


def test_fp8_tensor_core_kernel_refused_without_fp8_hardware(tiny_llama_dir):
    """Forcing the FP8 tensor-core kernel where there are none fails at load with the reason."""
    with pytest.raises(SelectionError, match="fp8_scaled_mm.*cannot run here: .*need an NVIDIA GPU"):
        load_plinth(tiny_llama_dir, "fp8", gemm_kernel="fp8_scaled_mm")
    with pytest.raises(SelectionError, match="unknown gemm kernel 'cutlass'.*known: dequant, fp8_scaled_mm"):
        load_plinth(tiny_llama_dir, "fp8", gemm_kernel="cutlass")


def test_a_gemm_kernel_without_a_quantization_method_is_refused(tiny_llama_dir):
    import plinth

    with pytest.raises(ConfigError, match="--gemm-kernel bogus picks a quantization method's GEMM kernel.*unquantized"):
        plinth.LLM(str(tiny_llama_dir), gemm_kernel="bogus", selection="off")


def test_fp8_kernel_reports_capability():
    from plinth.quantization.kernels.fp8_scaled_mm import ScaledMMFP8Kernel

    ada = GemmProblem("fp8", torch.bfloat16, "cuda", capability=(8, 0), shapes=((64, 64),))
    assert "8.9" in ScaledMMFP8Kernel.supports(ada).reason
    hopper = GemmProblem("fp8", torch.bfloat16, "cuda", capability=(9, 0), shapes=((64, 64),))
    assert bool(ScaledMMFP8Kernel.supports(hopper)) == (not getattr(torch.version, "hip", None))


def test_int4_group_size_from_environment(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PLINTH_INT4_GROUP_SIZE", "32")
    _model, _backend, method = load_plinth(tiny_llama_dir, "int4", gemm_kernel="dequant")
    assert method.group_size == 32
    monkeypatch.setenv("PLINTH_INT4_GROUP_SIZE", "48")
    with pytest.raises(ConfigError, match="group size 48 does not divide"):
        load_plinth(tiny_llama_dir, "int4")
    monkeypatch.setenv("PLINTH_INT4_GROUP_SIZE", "\u00b2")   # a digit to str.isdigit, not to int()
    with pytest.raises(ConfigError, match="PLINTH_INT4_GROUP_SIZE='\u00b2': expected a multiple of 16"):
        load_plinth(tiny_llama_dir, "int4")


def test_cli_accepts_names_plugins_add():
    from plinth.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, "generate")
    args = parser.parse_args(["m", "--quantization", "int8", "--gemm-kernel", "dequant"])
    config = engine_config_from_args(args)
    assert config.model.quantization == "int8" and config.device.gemm_kernel == "dequant"
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--quantization", "int3"])


# --------------------------------------------------------------------------------------- selection


class OffByOneKernel(GemmKernel):
    """A wrong kernel (adds one to every output): selection must reject it."""

    name = "off_by_one"
    priority = 99

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        return Support.yes()

    def prepare(self, weights: IntWeights):
        return DequantIntKernel(self.problem).prepare(weights)

    def apply(self, layer, x, bias):
        return DequantIntKernel(self.problem).apply(layer, x, bias) + 1.0


class WrongTailKernel(OffByOneKernel):
    """Right for input sizes that are multiples of 128, wrong otherwise (drops the last 64 input features): a
    kernel whose bug only a later layer shape shows."""

    name = "wrong_tail"

    def apply(self, layer, x, bias):
        if x.shape[1] % 128:
            x = x.clone()
            x[:, -64:] = 0
        return DequantIntKernel(self.problem).apply(layer, x, bias)


class WrongSiluKernel(GemmKernel):
    """Right products, wrong fused activation (silu(up) * gate): selection must reject it."""

    name = "wrong_silu"
    priority = 99
    silu_pairs = True

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        return Support.yes()

    def prepare(self, weights: IntWeights, *, silu_pairs=False):
        return {**DequantIntKernel(self.problem).prepare(weights), "paired": silu_pairs}

    def apply(self, layer, x, bias):
        return DequantIntKernel(self.problem).apply(layer, x, bias)

    def apply_silu_mul(self, layer, x, bias):
        assert layer.paired
        y = self.apply(layer, x, bias)
        d = y.shape[1] // 2
        return torch.nn.functional.silu(y[:, d:]) * y[:, :d]


def _int4_with_extra_kernel(name: str, cls_name: str, selection: str, cache_dir) -> Callable[[], Any]:
    """A factory of CPU int4 methods (float32, groups of 64) whose candidates add ``test_quantization:CLS``."""
    from plinth.platforms.selection import select_platform
    from plinth.quantization.int4 import Int4Method

    class WithExtraKernel(Int4Method):
        def kernel_candidates(self):
            return {**super().kernel_candidates(), name: f"test_quantization:{cls_name}"}

    ctx = QuantContext(hf_config=None, dtype=torch.float32, device=CPU, platform=select_platform("cpu"),
                       selection=selection, cache_dir=cache_dir)
    return lambda: WithExtraKernel(ctx, bits=4, group_size=64)


def test_selection_checks_a_kernels_fused_activation(tmp_path):
    result = _int4_with_extra_kernel("wrong_silu", "WrongSiluKernel", "benchmark", tmp_path)().select_kernel([(128, 64)])
    report = {r.name: r for r in result.candidates}["wrong_silu"]
    assert report.status == "rejected" and "exceeds tolerance" in report.reason and report.max_error > 0.1


def test_selection_checks_every_layer_shape_with_its_tails(tmp_path):
    """The correctness check runs each distinct layer shape (cut, keeping the sizes' tails past 128): a kernel wrong
    only for the second layer's input size (1,216 = 9 x 128 + 64) is rejected."""
    method = _int4_with_extra_kernel("wrong_tail", "WrongTailKernel", "benchmark", tmp_path)()
    result = method.select_kernel([(1024, 512), (1000, 1216), (64, 128)])
    kinds = {r.name: r for r in result.candidates}
    assert kinds["wrong_tail"].status == "rejected" and "exceeds tolerance" in kinds["wrong_tail"].reason
    assert kinds["dequant"].max_error == 0.0 and result.winner != "wrong_tail"
    from plinth.quantization.selection import GemmCandidates

    shapes = GemmCandidates(method, method.gemm_problem(((1024, 512), (1000, 1216), (64, 128), (1024, 512))),
                            None).check_shapes()
    assert shapes == [(256, 512), (256 + 1000 % 128, 512 + 64), (64, 128)]


def test_selection_checks_times_and_caches(tmp_path):
    new_method = _int4_with_extra_kernel("off_by_one", "OffByOneKernel", "cached", tmp_path)
    method = new_method()
    first = method.select_kernel([(128, 64), (64, 128)])
    reports = {r.name: r for r in first.candidates}
    assert not first.from_cache and first.how == "benchmark"
    assert reports["off_by_one"].status == "rejected" and "exceeds tolerance" in reports["off_by_one"].reason
    assert reports["dequant"].max_error == 0.0 and set(reports["dequant"].times_ms) == {"decode-1", "decode", "prefill"}
    assert reports["torch_int4pack"].max_error < 1e-5
    assert first.winner in ("dequant", "torch_int4pack")
    assert "PLINTH_TRITON_INTERPRET" in reports["triton_w4a16"].reason or not reports["triton_w4a16"].supported
    second = new_method().select_kernel([(128, 64), (64, 128)])
    assert second.from_cache and second.winner == first.winner
    # another shape is another key
    third = new_method().select_kernel([(256, 64)])
    assert not third.from_cache


def test_kernels_agree_with_float64_reference():
    """Every CPU kernel of integer weights against float64 math on the dequantized weight."""
    from plinth.quantization.kernels.int4pack import TorchInt4PackKernel
    from plinth.quantization.kernels.int8_mm import TorchIntMMKernel

    gen = torch.Generator().manual_seed(3)
    cases = [(TorchInt4PackKernel, 4, 32, False, False, None), (TorchInt4PackKernel, 4, 64, False, True, None),
             (DequantIntKernel, 4, 32, False, True, None), (DequantIntKernel, 8, 128, True, False, None),
             (TorchIntMMKernel, 8, 128, True, False, "int8_token")]
    for cls, bits, group, symmetric, act_order, activation in cases:
        w = random_int_weights(48, 128, bits, group, symmetric=symmetric, act_order=act_order, device=CPU,
                               generator=gen)
        problem = GemmProblem("int", torch.float32, "cpu", bits=bits, group_size=None if group == 128 else group,
                              symmetric=symmetric, act_order=act_order, activation=activation, shapes=((48, 128),))
        assert cls.supports(problem), (cls.name, cls.supports(problem).reason)
        kernel = cls(problem)
        x = torch.randn(5, 128, generator=gen)
        bias = torch.randn(48, generator=gen)
        out = kernel.apply(holder(kernel.prepare(w)), x, bias).double()
        ref = x.double() @ w.dequantize(torch.float64).t() + bias.double()
        tol = 2e-2 if activation else 1e-5  # INT8 activations: a rounding step per element
        assert ((out - ref).abs().max() / ref.abs().max()).item() < tol, cls.name


# --------------------------------------------------------------------------- the int8 plugin package


def test_int8_plugin_is_discovered():
    pm = get_plugin_manager()
    reg = pm.registrations("quantization_methods")["int8"]
    record = pm.records[reg.plugin]
    assert record.distribution == "plinth-int8" and not record.in_tree
    assert record.provides["quantization_methods"] == ["int8"]


def test_int8_plugin_runs_through_llm(tiny_llama_dir):
    from plinth import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), quantization="int8", dtype="float32", selection="benchmark",
              attention_backend="torch_sdpa")
    method = llm.engine.runner.model.ctx.quant_method
    assert method.name == "int8" and type(method).__module__ == "plinth_int8.method"
    reports = {r.name: r for r in method.kernel_selection.candidates}
    assert set(reports) == {"dequant", "int8pack_mm"} and reports["int8pack_mm"].max_error < 1e-5
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = [[5, 17, 42, 9, 100, 23, 7], [250, 3, 3, 61, 88]]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # reference: transformers on the per-channel INT8 weights the plugin makes
    from plinth_int8.method import quantize_per_channel

    deq = dequantized_linears(float_state(tiny_llama_dir), lambda n, w: quantize_per_channel(w).dequantize())
    ref = reference_model(tiny_llama_dir, deq)
    for prompt, got in zip(prompts, outs, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got == ids[len(prompt):]  # measured: 24/24 tokens equal


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_plugin_kernel_refuses_what_torch_computes_wrong(dtype):
    """torch's bfloat16 ``_weight_int8pack_mm`` reads past rows whose input size is not a multiple of 16 (wrong
    values with one row, a crash with several): the kernel declines such layers in bfloat16, so selection runs them
    on the dequantizing kernel; float32 is exact at any size."""
    from plinth_int8.kernels import Int8PackMMKernel
    from plinth_int8.method import quantize_per_channel

    from plinth.quantization.kernels.interface import GemmProblem
    from plinth.quantization.selection import holder

    def problem(*ks):
        return GemmProblem(weight_format="int", dtype=dtype, device_type="cpu", capability=None, bits=8,
                           group_size=None, symmetric=True, shapes=tuple((16, k) for k in ks))

    assert Int8PackMMKernel.supports(problem(64, 128))
    refused = Int8PackMMKernel.supports(problem(64, 136))
    assert bool(refused) == (dtype == torch.float32)
    if dtype == torch.bfloat16:
        assert "multiples of 16, not 136" in refused.reason
        return
    torch.manual_seed(0)
    weights = quantize_per_channel(torch.randn(16, 136))
    kernel = Int8PackMMKernel(problem(136))
    x = torch.randn(1, 136)
    got = kernel.apply(holder(kernel.prepare(weights)), x, None).double()
    want = x.double() @ weights.dequantize().double().T
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_fp8_widening_table_equals_the_conversion():
    """The CPU's 256-entry table gives every float8_e4m3fn byte the value ``.to(float32)`` gives (NaNs where it does),
    in any shape."""
    from plinth.quantization.formats import fp8_to_float32

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3).reshape(3, 16, 16)
    fp8 = codes.view(torch.float8_e4m3fn)
    want, got = fp8.to(torch.float32), fp8_to_float32(fp8)
    assert got.shape == want.shape and torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)) and int(torch.isnan(want).sum()) == 6
    with pytest.raises(TypeError, match="reads float8_e4m3fn, not torch.float8_e5m2"):
        fp8_to_float32(fp8.view(torch.float8_e5m2))
