"""Integer experts: AWQ, GPTQ (4 and 8 bits, act order) and compressed-tensors ``pack-quantized`` checkpoints whose
experts are quantized, and float experts under ``--quantization int4``; against transformers running the weights the
packed tensors decode to (a Qwen3-MoE with experts on layers 0 and 2, float32, CPU). The packers are the ones
``test_quantization_awq_gptq.py`` writes from the published layouts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_models import save_with_tokenizer
from test_quantization_awq_gptq import awq_checkpoint, gptq_checkpoint
from test_quantization_support import compare, load_plinth, one_thread, write_checkpoint  # noqa: F401

from plinth.errors import ModelLoadError
from plinth.quantization.quantizers import quantize_int_rtn


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe") / "float"
    save_with_tokenizer("Qwen3MoeForCausalLM", path)
    return path


def _reference(base, deq: dict[str, torch.Tensor], out) -> transformers.PreTrainedModel:
    """transformers on ``base`` with the dequantized weights (per-expert names: transformers stacks them itself)."""
    write_checkpoint(base, out, {**load_file(str(base / "model.safetensors")), **deq}, None)
    return transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


def _check(model, backend, ref) -> None:
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.uint8 and experts.weight_method is not None
    compare(model, backend, ref, atol=1e-3, min_agreement=0.95)


def test_awq_experts(qwen3_moe, tmp_path):
    path, deq = awq_checkpoint(qwen3_moe, tmp_path / "awq", group=32)
    assert "model.layers.0.mlp.experts.3.down_proj.qweight" in load_file(str(path / "model.safetensors"))
    model, backend, method = load_plinth(path)
    assert method.name == "awq"
    # 4-bit codes two per byte: the 32 x 64 gate and up of each of 4 experts take 64 x 32 bytes
    assert model.model.layers[0].mlp.experts.w13_weight.shape == (4, 64, 32)
    _check(model, backend, _reference(qwen3_moe, deq, tmp_path / "ref"))


@pytest.mark.parametrize("bits,desc_act,symmetric,fmt", [(4, True, True, "gptq"), (8, False, False, "gptq_v2"),
                                                          (4, False, False, "gptq")])
def test_gptq_experts(qwen3_moe, tmp_path, bits, desc_act, symmetric, fmt):
    """Act order gives each expert's gate/up and down their own permutation (stacked per expert and projection)."""
    path, deq = gptq_checkpoint(qwen3_moe, tmp_path / "gptq", bits, 32, desc_act, symmetric, fmt)
    model, backend, _ = load_plinth(path)
    experts = model.model.layers[0].mlp.experts
    assert (getattr(experts, "w13_perm", None) is not None) == desc_act
    _check(model, backend, _reference(qwen3_moe, deq, tmp_path / "ref"))


def test_gptq_experts_without_g_idx(qwen3_moe, tmp_path):
    """Without act order the experts' (and the linear layers') ``g_idx`` may be left out, as it can only be
    ``k // g``."""
    path, deq = gptq_checkpoint(qwen3_moe, tmp_path / "gptq", 4, 32, False, False)
    state = load_file(str(path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.down_proj.g_idx" in state
    save_file({n: t for n, t in state.items() if not n.endswith(".g_idx")}, str(path / "model.safetensors"))
    model, backend, _ = load_plinth(path)
    _check(model, backend, _reference(qwen3_moe, deq, tmp_path / "ref"))


def test_int4_quantizes_float_experts(qwen3_moe, tmp_path):
    """``--quantization int4`` on a float MoE checkpoint: the experts are quantized like the linear layers (groups of
    32 here: the dense layer's 96 input features rule out 64)."""
    state = load_file(str(qwen3_moe / "model.safetensors"))
    deq = {n: quantize_int_rtn(w.float(), 4, 32).dequantize(torch.float32) for n, w in state.items()
           if ".layers." in n and n.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj")}
    model, backend, method = load_plinth(qwen3_moe, "int4")
    assert method.group_size == 32
    _check(model, backend, _reference(qwen3_moe, deq, tmp_path / "ref"))


@pytest.mark.parametrize("scheme", ["w4a16-sym", "w8a16-channel"])
def test_compressed_tensors_integer_experts(qwen3_moe, tiny_llama_dir, tmp_path, scheme):
    """compressed-tensors integer experts, symmetric: 4-bit groups of 32 (``pack-quantized``, packed with the library's
    own ``pack_to_int32``) and 8-bit per output channel (each projection's own input width as its group: hidden for
    gate/up, the expert width for down); the configuration is the one the library writes."""
    pytest.importorskip("compressed_tensors")
    import json

    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from test_quantization_compressed_tensors import ct_checkpoint

    lib_dir, _ = ct_checkpoint(tiny_llama_dir, tmp_path / "lib", scheme, ignore=("lm_head", "re:.*mlp\\.gate$"))
    quant_config = json.loads((lib_dir / "config.json").read_text())["quantization_config"]
    bits = 4 if scheme.startswith("w4") else 8
    tensors, deq = {}, {}
    for name, w in load_file(str(qwen3_moe / "model.safetensors")).items():
        proj = name.rsplit(".", 2)[-2]
        if ".layers." not in name or proj not in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"):
            tensors[name] = w
            continue
        n, k = w.shape
        group = 32 if bits == 4 else k
        groups = w.float().reshape(n, k // group, group)
        top = (1 << (bits - 1)) - 1
        scale = groups.abs().amax(-1) / top                                           # [N, G]
        q = torch.round(groups / scale[..., None]).clamp(-top - 1, top).to(torch.int8)
        stem = name.removesuffix(".weight")
        if quant_config.get("format") == "pack-quantized":
            tensors[f"{stem}.weight_packed"] = pack_to_int32(q.reshape(n, k), bits)
            tensors[f"{stem}.weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        else:
            tensors[f"{stem}.weight"] = q.reshape(n, k)
        tensors[f"{stem}.weight_scale"] = scale
        deq[name] = (q.float() * scale[..., None]).reshape(n, k)
    path = write_checkpoint(qwen3_moe, tmp_path / "ct", tensors, None)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(config))
    model, backend, method = load_plinth(path)
    assert method.name == "compressed-tensors"
    _check(model, backend, _reference(qwen3_moe, deq, tmp_path / "ref"))


def test_quantized_checkpoints_with_float_experts(qwen3_moe, tmp_path):
    """An AWQ checkpoint that quantizes the attention and the dense MLP and leaves the experts float without listing
    them (quantizers that skip routed modules): the experts load float and run on the float paths."""
    path, deq = awq_checkpoint(qwen3_moe, tmp_path / "awq", group=32, quantize=lambda n: ".layers." in n and
                               n.endswith("_proj.weight") and ".experts." not in n)
    model, backend, _ = load_plinth(path)
    experts = model.model.layers[0].mlp.experts
    assert experts.weight_method is None and experts.w13_weight.dtype == torch.float32
    compare(model, backend, _reference(qwen3_moe, deq, tmp_path / "ref"), atol=1e-3, min_agreement=0.95)
    # the same tensors in two shards, every expert's gate and up before any down projection (the stacked down
    # weights are not allocated yet when the first gate arrives)
    state = load_file(str(path / "model.safetensors"))
    downs = {n: t for n, t in state.items() if ".experts." in n and ".down_proj." in n}
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in state.items() if n not in downs},
              "model-00002-of-00002.safetensors": downs}
    sharded = tmp_path / "sharded"
    shutil.copytree(path, sharded)
    (sharded / "model.safetensors").unlink()
    for file, tensors in shards.items():
        save_file(tensors, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: file for file, tensors in shards.items() for n in tensors}}))
    compare(*load_plinth(sharded)[:2], _reference(qwen3_moe, deq, tmp_path / "ref2"), atol=1e-3, min_agreement=0.95)
    # a layer whose experts are partly float and partly quantized is refused, naming one of each
    w = state.pop("model.layers.0.mlp.experts.1.up_proj.weight")
    packed, _ = awq_checkpoint(qwen3_moe, tmp_path / "all", group=32)
    full = load_file(str(packed / "model.safetensors"))
    for kind in ("qweight", "qzeros", "scales"):
        state[f"model.layers.0.mlp.experts.1.up_proj.{kind}"] = full[f"model.layers.0.mlp.experts.1.up_proj.{kind}"]
    save_file(state, str(path / "model.safetensors"))
    assert w.dtype == torch.float32
    with pytest.raises(ModelLoadError, match=r"experts.0.gate_proj is float and .*experts.1.up_proj quantized"):
        load_plinth(path)


def test_int_experts_under_tensor_parallelism_decode_to_slices(qwen3_moe, tmp_path):
    """Each of two ranks' GPTQ experts widen to its slice of the one-process experts: gate and up rows, down columns."""
    path, _ = gptq_checkpoint(qwen3_moe, tmp_path / "gptq", 4, 16, False, True, "gptq")
    whole = load_plinth(path)[0].model.layers[0].mlp.experts
    for rank in (0, 1):
        half = load_plinth(path, tp=(rank, 2))[0].model.layers[0].mlp.experts
        i = half.intermediate_per_rank
        for e in range(half.num_experts):
            w13, full13 = half.expert_weight("w13", e, torch.float32), whole.expert_weight("w13", e, torch.float32)
            rows = torch.cat([full13[rank * i:(rank + 1) * i], full13[2 * i + rank * i:2 * i + (rank + 1) * i]])
            assert torch.equal(w13, rows)
            assert torch.equal(half.expert_weight("w2", e, torch.float32),
                               whole.expert_weight("w2", e, torch.float32)[:, rank * i:(rank + 1) * i])


def test_a_missing_expert_tensor_is_named(qwen3_moe, tmp_path):
    path, _ = awq_checkpoint(qwen3_moe, tmp_path / "awq", group=32)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.2.mlp.experts.1.up_proj.qzeros"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.2.mlp.experts.1.up_proj.qzeros'"):
        load_plinth(path)
    shutil.rmtree(path)


def test_engine_serves_a_gptq_moe_checkpoint(qwen3_moe, tmp_path):
    """The whole engine (kernel selection for the linear layers, batching) on GPTQ experts with act order: greedy
    tokens equal transformers' on the dequantized weights."""
    from test_models import _prompts, llm_greedy_matches

    import plinth

    path, deq = gptq_checkpoint(qwen3_moe, tmp_path / "gptq", 4, 32, True, True, "gptq")
    ref = _reference(qwen3_moe, deq, tmp_path / "ref")
    llm_greedy_matches(plinth.LLM(str(path), dtype="float32", max_model_len=128), ref, _prompts(ref.config.vocab_size))


_DEEPSEEK_PROJ = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _deepseek_projection(name: str) -> bool:
    return ".layers." in name and name.endswith(".weight") and name.rsplit(".", 2)[-2] in _DEEPSEEK_PROJ


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_deepseek_v2_with_every_projection_quantized(method, tmp_path):
    """DeepSeek-V2 as AWQ/GPTQ checkpoints quantize it: every projection, ``kv_b_proj`` (widened once loaded: the
    latent attention reads it itself) and the experts included (groups of 16: ``o_proj`` reads 48 features)."""
    save_with_tokenizer("DeepseekV2ForCausalLM", tmp_path / "float")
    if method == "awq":
        path, deq = awq_checkpoint(tmp_path / "float", tmp_path / "q", 16, quantize=_deepseek_projection)
    else:
        path, deq = gptq_checkpoint(tmp_path / "float", tmp_path / "q", 4, 16, True, True, quantize=_deepseek_projection)
    assert "model.layers.0.self_attn.kv_b_proj.qweight" in load_file(str(path / "model.safetensors"))
    model, backend, _ = load_plinth(path)
    kv_b = model.model.layers[1].self_attn.kv_b_proj
    assert kv_b.weight.dtype == torch.float32 and not hasattr(kv_b, "qweight")
    ref = _reference(tmp_path / "float", deq, tmp_path / "ref")
    compare(model, backend, ref, atol=1e-3, min_agreement=0.95)
    # a checkpoint with half of kv_b_proj's packed tensors is refused, naming the rest
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.self_attn.kv_b_proj.scales"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="LatentExpansion: the checkpoint has .*qweight.* but not scales"):
        load_plinth(path)


@pytest.mark.parametrize("bits,desc_act", [(4, False), (8, False), (4, True)])
def test_widened_grouped_gemms_equal_the_per_expert_loop(qwen3_moe, tmp_path, bits, desc_act):
    """Integer experts on the grouped GEMMs (the GPU's path for prefill) equal the per-expert loop: runs of experts
    widened in one conversion (one expert at a time with act order's per-expert permutations)."""
    path, _ = gptq_checkpoint(qwen3_moe, tmp_path / "gptq", bits, 32, desc_act, False, "gptq")
    model, _, _ = load_plinth(path)
    moe = model.model.layers[0].mlp.experts
    moe.widen_chunk_elements = 2 * moe.w2_weight.shape[1] * moe.intermediate_per_rank * 2   # runs of two experts
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(6, moe.w2_weight.shape[1], generator=g)
    logits = torch.randn(6, moe.num_experts, generator=g)
    got = moe._forward_widened(x, *moe.route(logits))
    torch.testing.assert_close(got, moe(x, logits), atol=1e-5, rtol=1e-5)
    stacked = moe.weight_method.widen_range(moe, "w2", 1, 3, torch.float32)
    torch.testing.assert_close(stacked, torch.stack([moe.weight_method.widen(moe, "w2", e, torch.float32)
                                                     for e in (1, 2)]), atol=0, rtol=0)


def test_int4_keeps_layers_its_group_does_not_divide_float(tmp_path, caplog):
    """``--quantization int4`` on DeepSeek-V3 whose query latent and value heads are 48 features wide (groups of
    32): q_b_proj and o_proj stay float (their checkpoint weights, with a warning naming them) and the other layers
    and the experts are quantized (before, loading stopped at the first such layer)."""
    from plinth.quantization.int4 import Int4Method

    save_with_tokenizer("DeepseekV3ForCausalLM", tmp_path / "float")
    state = load_file(str(tmp_path / "float" / "model.safetensors"))
    with caplog.at_level("WARNING", logger="plinth.quantization.int4"):
        model, _, method = load_plinth(tmp_path / "float", "int4")
    assert method.group_size == 32 and "model.layers.0.self_attn.q_b_proj (48)" in caplog.text
    attn = model.model.layers[1].self_attn
    for name in ("q_b_proj", "o_proj"):
        layer = getattr(attn, name)
        assert not isinstance(layer.linear_method, Int4Method)
        torch.testing.assert_close(layer.weight, state[f"model.layers.1.self_attn.{name}.weight"], atol=0, rtol=0)
    assert isinstance(attn.q_a_proj.linear_method, Int4Method)
    assert model.model.layers[1].mlp.experts.weight_method is not None
