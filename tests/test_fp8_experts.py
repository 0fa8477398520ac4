"""FP8 experts: checkpoints whose experts are FP8 (``quant_method: fp8``, per-tensor, per-channel and block scales,
DeepSeek-V3's layout with its widened ``kv_b_proj`` and a 40-row latent projection ending inside a block), float
experts quantized by ``--quantization fp8``, and the refusals (the GEMV kernel reading FP8
experts is in ``test_triton_ops.py``). References:
transformers running the weights the FP8 tensors decode to (float32, CPU)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_models import save_with_tokenizer
from test_quantization_support import compare, load_plinth, one_thread  # noqa: F401 (an autouse fixture)

from plinth.config import ConfigError
from plinth.errors import ModelLoadError
from plinth.model_registry.layers.moe import FusedMoE
from plinth.quantization.formats import FP8_MAX
from plinth.quantization.fp8_experts import FP8ExpertMethod
from plinth.quantization.quantizers import quantize_fp8_per_channel

# DeepSeek's own FP8 layout quantizes every projection of the attention and the MLPs, experts included, and keeps
# the router, norms, embeddings and head in floating point
_DEEPSEEK_PROJ = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                  "up_proj", "down_proj")
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _quantize(w: torch.Tensor, scheme: str, block: tuple[int, int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``({suffix: tensor}, dequantized weight)`` of one float weight in an FP8 checkpoint's layout."""
    if scheme == "block":
        bn, bk = block
        n, k = w.shape
        pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        pad[:n, :k] = w
        s = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).abs().amax(dim=(1, 3)) / FP8_MAX
        full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": s}, q.float() * full
    s = w.abs().amax(1, keepdim=True) / FP8_MAX if scheme == "channel" else w.abs().max() / FP8_MAX
    q = (w / s).to(torch.float8_e4m3fn)
    out = {"weight": q, "weight_scale": s if scheme == "channel" else s.reshape(())}
    if scheme == "static":
        out["input_scale"] = torch.tensor(0.02)
    return out, q.float() * s


def fp8_checkpoint(src, dst, scheme: str, *, block=(32, 32), projections=_PROJ, experts_only: bool = False,
                   float_experts: bool = False):
    """An FP8 copy of the float checkpoint in ``src`` and a float checkpoint of what it decodes to (``dst`` and
    ``dst``-ref); returns both paths."""
    state = load_file(str(src / "model.safetensors"))
    fp8, ref = {}, {}
    for name, w in state.items():
        proj = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if (".layers." in name and proj in projections and (".experts." in name or not experts_only)
                and not (float_experts and ".experts." in name)):
            tensors, deq = _quantize(w.float(), scheme, block)
            fp8.update({f"{name.removesuffix('.weight')}.{suffix}": t for suffix, t in tensors.items()})
            ref[name] = deq
        else:
            fp8[name] = ref[name] = w
    ref_dir = dst.parent / f"{dst.name}-ref"
    for path, tensors in ((dst, fp8), (ref_dir, ref)):
        shutil.copytree(src, path)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if scheme == "static"
                                     else "dynamic", **({"weight_block_size": list(block)} if scheme == "block" else {})}
    (dst / "config.json").write_text(json.dumps(config))
    return dst, ref_dir


def _reference(path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("scheme,block", [("block", (32, 32)), ("block", (16, 32)), ("channel", None),
                                          ("tensor", None), ("static", None)])
def test_qwen3_moe_fp8_checkpoint_matches_transformers(scheme, block, tmp_path):
    """Qwen3-MoE with every projection FP8, experts included (``moe_intermediate_size`` 32: with 16-row blocks the
    gate and up blocks stack as they are; the (16, 32) case also takes 24-row experts below)."""
    save_with_tokenizer("Qwen3MoeForCausalLM", tmp_path / "float")
    path, ref = fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", scheme, block=block or (32, 32))
    model, backend, method = load_plinth(path)
    experts = model.model.layers[0].mlp.experts
    assert method.name == "fp8" and experts.w13_weight.dtype == torch.uint8 and experts.fp8_scales is not None
    compare(model, backend, _reference(ref), atol=1e-3, min_agreement=0.95)


def test_gate_rows_ending_inside_a_block(tmp_path):
    """24-row experts with 16-row blocks: the gate's second block also covers 8 rows of padding in the checkpoint, so
    its scales are spread per row once loaded (the stacked gate/up scales would otherwise shift the up rows)."""
    import test_models

    arch, cfg, overrides = test_models.ARCHS["Qwen3MoeForCausalLM"]
    test_models.ARCHS["_Qwen3Moe24"] = (arch, cfg, {**overrides, "moe_intermediate_size": 24})
    try:
        save_with_tokenizer("_Qwen3Moe24", tmp_path / "float")
    finally:
        del test_models.ARCHS["_Qwen3Moe24"]
    path, ref = fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "block", block=(16, 32))
    model, backend, _ = load_plinth(path)
    scales = model.model.layers[0].mlp.experts.fp8_scales["w13"]
    assert (scales.rows, scales.cols, scales.scale.shape[1]) == (1, 32, 48)
    compare(model, backend, _reference(ref), atol=1e-3, min_agreement=0.95)


@pytest.mark.parametrize("name", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"])
def test_deepseek_block_fp8_checkpoint_matches_transformers(name, tmp_path):
    """DeepSeek's FP8 layout: every projection FP8 with 32x32 blocks, experts and shared experts included;
    ``kv_b_proj`` is widened once loaded (the attention reads it itself) and ``kv_a_proj_with_mqa``'s 40 rows end
    inside its second block of scales."""
    save_with_tokenizer(name, tmp_path / "float")
    path, ref = fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "block", projections=_DEEPSEEK_PROJ)
    state = load_file(str(path / "model.safetensors"))
    assert state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)   # 40 x 64
    model, backend, method = load_plinth(path)
    attn = model.model.layers[1].self_attn
    assert attn.kv_b_proj.weight.dtype == torch.float32 and not hasattr(attn.kv_b_proj, "weight_scale_inv")
    assert model.model.layers[1].mlp.experts.fp8_scales is not None
    compare(model, backend, _reference(ref), atol=1e-3, min_agreement=0.95)


def test_float_experts_quantized_with_fp8(tmp_path):
    """``--quantization fp8`` on a float Mixtral: the experts are quantized per output channel like the linear
    layers (before, they stayed float)."""
    save_with_tokenizer("MixtralForCausalLM", tmp_path / "float")
    state = load_file(str(tmp_path / "float" / "model.safetensors"))
    ref = {n: (quantize_fp8_per_channel(w.float()).dequantize(torch.float32)
               if ".layers." in n and n.rsplit(".", 2)[-2] in _PROJ else w) for n, w in state.items()}
    shutil.copytree(tmp_path / "float", tmp_path / "ref")
    save_file(ref, str(tmp_path / "ref" / "model.safetensors"))
    model, backend, _ = load_plinth(tmp_path / "float", "fp8")
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.uint8 and experts.w2_weight_scale.shape == (4, 64)
    compare(model, backend, _reference(tmp_path / "ref"), atol=1e-3, min_agreement=0.95)
    # the quantization is in effect: the float model's logits differ
    with pytest.raises(AssertionError, match="max logit error"):
        compare(model, backend, _reference(tmp_path / "float"), atol=1e-4, min_agreement=0.0)


def _moe(num_experts=8, top_k=2, hidden=48, inter=200, tp_rank=0, tp_size=1, bias=False) -> FusedMoE:
    moe = FusedMoE(num_experts, top_k, hidden, inter, renormalize=True, tp_rank=tp_rank, tp_size=tp_size, bias=bias)
    moe.w13_weight.weight_loader = moe.weight_loader
    return moe


def _load_fp8_experts(moe: FusedMoE, block, weights: dict[tuple[int, str], torch.Tensor]) -> None:
    method = FP8ExpertMethod(from_checkpoint=True, block=block)
    method.create_weights(moe)
    moe.weight_method = method
    for (e, role), w in weights.items():
        tensors, _ = _quantize(w, "block" if block else "channel", block or (0, 0))
        param = "w2" if role == "down" else "w13"
        getattr(moe, f"{param}_weight").weight_loader(getattr(moe, f"{param}_weight"), tensors["weight"], (e, role))
        scale_name = f"{param}_weight_scale_inv" if block else f"{param}_weight_scale"
        getattr(moe, scale_name).weight_loader(getattr(moe, scale_name), tensors[next(k for k in tensors if "scale" in k)],
                                               (e, role))
    method.process_weights_after_loading(moe)


def _expert_weights(num_experts, hidden, inter, seed=0) -> dict[tuple[int, str], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(num_experts):
        for role in ("gate", "up", "down"):
            shape = (hidden, inter) if role == "down" else (inter, hidden)
            out[e, role] = torch.randn(shape, generator=g) * 0.1
    return out


def test_fp8_experts_under_tensor_parallelism_equal_one_process():
    """Two ranks' halves of FP8 experts (block scales on the ranks' edges; float experts quantized with the whole
    row's scales) sum to the one-process result."""
    weights = _expert_weights(4, 64, 128, seed=1)
    x = torch.randn(5, 64)
    logits = torch.randn(5, 4)
    for block in ((32, 32), None):
        whole = _moe(4, 2, 64, 128)
        _load_fp8_experts(whole, block, weights)
        halves = []
        for rank in (0, 1):
            moe = _moe(4, 2, 64, 128, tp_rank=rank, tp_size=2)
            _load_fp8_experts(moe, block, weights)
            moe.tp_size = 1          # the sum of the ranks' partial results, without a process group
            halves.append(moe(x, logits))
        torch.testing.assert_close(halves[0] + halves[1], whole(x, logits), atol=1e-5, rtol=1e-5)
    # float experts quantized after loading: rank 1's down-projection halves take the full rows' maxima
    whole, halves = _moe(4, 2, 64, 128), []
    for rank in (0, 1):
        moe = _moe(4, 2, 64, 128, tp_rank=rank, tp_size=2)
        method = moe.weight_method = FP8ExpertMethod(from_checkpoint=False)
        method.create_weights(moe)
        for (e, role), w in weights.items():
            param = moe.w2_weight if role == "down" else moe.w13_weight
            param.weight_loader(param, w, (e, role))
        method.process_weights_after_loading(moe)
        moe.tp_size = 1
        halves.append(moe)
    for (e, role), w in weights.items():
        param = whole.w2_weight if role == "down" else whole.w13_weight
        param.weight_loader(param, w, (e, role))
    whole.weight_method = FP8ExpertMethod(from_checkpoint=False)
    whole.weight_method.process_weights_after_loading(whole)
    assert torch.equal(halves[1].w2_weight_scale, whole.w2_weight_scale)
    torch.testing.assert_close(halves[0](x, logits) + halves[1](x, logits), whole(x, logits), atol=1e-5, rtol=1e-5)


def test_refusals(tmp_path):
    """Block scales a tensor-parallel split would cut, expert tensors of other formats, an FP8 expert in a checkpoint
    that does not say fp8, and an FP8 weight whose scale is missing: one line each."""
    with pytest.raises(ConfigError, match="48 per rank.*32x32 scale blocks"):
        FP8ExpertMethod(from_checkpoint=True, block=(32, 32)).create_weights(_moe(4, 2, 64, 96, tp_size=2))
    from plinth.model_registry.layers.moe import map_expert_weight

    with pytest.raises(ModelLoadError, match=r"experts quantized in this format \(weight_global_scale\)"):
        map_expert_weight("model.layers.0.mlp.experts.3.gate_proj.weight_global_scale", {"gate_proj": "gate"})
    assert map_expert_weight("model.layers.0.mlp.experts.3.down_proj.weight_scale_inv", {"down_proj": "down"}) == \
        ("model.layers.0.mlp.experts.w2_weight_scale_inv", (3, "down"))
    save_with_tokenizer("Qwen3MoeForCausalLM", tmp_path / "float")
    path, _ = fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "channel", experts_only=True)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="experts.0.down_proj.weight' has unsupported dtype float8_e4m3fn"):
        load_plinth(path)
    save_with_tokenizer("DeepseekV3ForCausalLM", tmp_path / "ds")
    path, _ = fp8_checkpoint(tmp_path / "ds", tmp_path / "ds-fp8", "block", projections=_DEEPSEEK_PROJ)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="FP8 weight of LatentExpansion came without its weight_scale_inv"):
        load_plinth(path)


def test_compressed_tensors_fp8_experts(tmp_path, tiny_llama_dir):
    """A compressed-tensors ``float-quantized`` checkpoint (the layout of the FP8-dynamic MoE releases: per-channel
    ``weight_scale`` ``[N, 1]`` on every projection, experts included, the routers ignored), its configuration
    written by the library itself."""
    pytest.importorskip("compressed_tensors")
    from test_quantization_compressed_tensors import ct_checkpoint

    lib_dir, _ = ct_checkpoint(tiny_llama_dir, tmp_path / "lib", "fp8-channel", ignore=("lm_head", "re:.*mlp\\.gate$"))
    quant_config = json.loads((lib_dir / "config.json").read_text())["quantization_config"]
    assert quant_config["quant_method"] == "compressed-tensors"
    save_with_tokenizer("Qwen3MoeForCausalLM", tmp_path / "float")
    path, ref = fp8_checkpoint(tmp_path / "float", tmp_path / "ct", "channel")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(config))
    model, backend, method = load_plinth(path)
    assert method.name == "compressed-tensors" and model.model.layers[0].mlp.experts.fp8_scales is not None
    compare(model, backend, _reference(ref), atol=1e-3, min_agreement=0.95)


def test_engine_serves_an_fp8_moe_checkpoint(tmp_path):
    """The whole engine (CPU platform, kernel selection, batching) on a DeepSeek-V3 block-FP8 checkpoint: greedy
    tokens equal transformers' ``generate`` on the weights the checkpoint decodes to."""
    from test_models import llm_greedy_matches

    import plinth

    _, prompts = save_with_tokenizer("DeepseekV3ForCausalLM", tmp_path / "float")
    path, ref = fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "block", projections=_DEEPSEEK_PROJ)
    llm_greedy_matches(plinth.LLM(str(path), dtype="float32", max_model_len=128), _reference(ref), prompts)


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("name", ["GraniteMoeForCausalLM", "GptOssForCausalLM", "Qwen3MoeForCausalLM"])
def test_fp8_checkpoints_keep_stacked_experts_float(name, tmp_path):
    """Experts a checkpoint stacks (Granite's ``input_linear``, gpt-oss's ``gate_up_proj``) are not linear layers, so FP8
    tools leave them float; so do tools that skip routed experts without listing them (Qwen3-MoE here): the FP8
    attention loads and the experts stay float, on the float paths."""
    save_with_tokenizer(name, tmp_path / "float")
    path, ref = fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "channel", float_experts=True)
    model, backend, method = load_plinth(path)
    mlp = model.model.layers[0].mlp
    experts = mlp.routed.experts if hasattr(mlp, "routed") else mlp.experts
    assert method.name == "fp8" and experts.weight_method is None and experts.w13_weight.dtype == torch.float32
    assert not hasattr(experts, "w13_weight_scale")
    compare(model, backend, _reference(ref), atol=1e-3, min_agreement=0.95)
    if name == "Qwen3MoeForCausalLM":   # one expert FP8 among float ones: refused, naming one of each
        fp8, _ = fp8_checkpoint(tmp_path / "float", tmp_path / "all", "channel")
        state = load_file(str(path / "model.safetensors"))
        donor = load_file(str(fp8 / "model.safetensors"))
        for kind in ("weight", "weight_scale"):
            state[f"model.layers.0.mlp.experts.2.up_proj.{kind}"] = donor[f"model.layers.0.mlp.experts.2.up_proj.{kind}"]
        save_file(state, str(path / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=r"experts.0.down_proj is float and .*experts.2.up_proj FP8"):
            load_plinth(path)
        del state["model.layers.0.mlp.experts.2.up_proj.weight_scale"]   # ... and an FP8 expert without its scale
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for kind in ("weight", "weight_scale"):
                    key = f"model.layers.0.mlp.experts.{e}.{proj}.{kind}"
                    if (e, proj) != (2, "up_proj") or kind == "weight":
                        state[key] = donor[key]
        save_file(state, str(path / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.0.mlp.experts.2.up_proj.weight_scale'"):
            load_plinth(path)


@pytest.mark.parametrize("ignored", [["model.layers.0.block_sparse_moe.experts", "model.layers.1.block_sparse_moe"],
                                     [f"model.layers.{i}.block_sparse_moe.experts.{e}" for i in (0, 1)
                                      for e in range(4)]],
                         ids=["modules", "each-expert"])
def test_ignore_lists_name_experts_by_their_checkpoint_names(ignored, tmp_path):
    """Mixtral's experts live under ``block_sparse_moe`` in the checkpoint (``mlp`` in plinth): an ignore list naming
    the experts module, a parent, or each expert keeps them float; one that leaves some experts of a layer quantized
    is refused."""
    save_with_tokenizer("MixtralForCausalLM", tmp_path / "float")
    path, ref = fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "channel", projections=_ATTENTION)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ignored
    (path / "config.json").write_text(json.dumps(config))
    model, backend, _ = load_plinth(path)
    assert model.model.layers[1].mlp.experts.weight_method is None
    compare(model, backend, _reference(ref), atol=1e-3, min_agreement=0.95)
    config["quantization_config"]["ignored_layers"] = ["model.layers.0.block_sparse_moe.experts.2"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"keeps model.layers.0.block_sparse_moe.experts.2.w1, .* in floating point "
                                          r"and quantizes the other experts of model.layers.0.mlp.experts"):
        load_plinth(path)


@pytest.mark.parametrize("block", [None, (16, 32), (32, 32)])
def test_widened_grouped_gemms_equal_the_per_expert_loop(block):
    """FP8 experts on the grouped GEMMs (the GPU's path for prefill: runs of experts widened together) equal the
    per-expert loop: per-channel and block scales widened in one conversion per run, 200-row experts whose gate
    ends inside a 16- or 32-row block (per-row scales), 48-row ``w2`` under 32-row blocks (a block would span two
    experts: widened one at a time); runs of three experts, the first run chosen by no token and skipped."""
    moe = _moe(8, 2, 48, 200)
    _load_fp8_experts(moe, block, _expert_weights(8, 48, 200, seed=2))
    moe.widen_chunk_elements = 3 * 48 * 200 * 2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 48, generator=g)
    logits = torch.randn(9, 8, generator=g)
    logits[:, :3] = -30.0    # experts 0-2: no token
    assert not moe.uses_widened_grouped_gemm(x)   # the device conditions (a CUDA GPU of 9.0+, bfloat16)
    calls = []
    widen_range = moe.weight_method.widen_range
    moe.weight_method.widen_range = lambda *a: calls.append(a[1:4]) or widen_range(*a)
    got = moe._forward_widened(x, *moe.route(logits))
    assert [c for c in calls if c[0] == "w13"] == [("w13", 3, 6), ("w13", 6, 8)]
    torch.testing.assert_close(got, moe(x, logits), atol=1e-5, rtol=1e-5)
