"""``--quantization gguf``: linear layers run on their llama.cpp blocks, against the default path that
dequantizes the same file while loading (itself checked against transformers in tests/test_gguf.py).

Files are written with gguf's writer; Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 tensors with ``gguf.quants.quantize``,
K-type tensors (for which gguf has no quantizer) as random blocks with small scales.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_quantization_support import load_plinth, one_thread, plinth_logits_and_greedy  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM

from plinth.config import ConfigError
from plinth.quantization.formats import GGUFShard, GGUFWeights
from plinth.quantization.kernels.gguf_blocks import BLOCK_TYPES, F32, dequantize_blocks

Q = gguf.GGMLQuantizationType
K_TYPES = (Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# byte offsets of the float16 fields (d, dmin) in each block
HALF_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
               Q.Q2_K: (80, 82), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(rows: int, cols: int, qtype, rng, scale: float) -> np.ndarray:
    """Random block bytes of ``qtype`` with its float16 fields set to small positive values."""
    block_len, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_len, type_size), dtype=np.uint8)
    for pos in HALF_FIELDS[qtype]:
        halves = (rng.random((rows, cols // block_len)) * scale + scale / 4).astype(np.float16)
        blocks[..., pos:pos + 2] = halves.view(np.uint8).reshape(rows, cols // block_len, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES), ids=lambda t: Q(t).name)
def test_block_dequantizers_equal_gguf(qtype):
    rng = np.random.default_rng(qtype)
    data = random_blocks(6, 512, Q(qtype), rng, 0.01)
    ours = dequantize_blocks(torch.from_numpy(data), qtype, 512)
    theirs = gguf.quants.dequantize(data, Q(qtype))
    assert np.array_equal(ours.numpy(), theirs)


def small_llama(**overrides):
    config = AutoConfig.for_model("llama", **{
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "tie_word_embeddings": False, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if name.endswith("norm.weight") else p.normal_(0.0, 0.08)
    return model


def permute_qk(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows go from (half, pair) to (pair, half) order."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_llama(path, model, types: dict[str, Q], seed: int = 0) -> str:
    """A llama GGUF file; ``types`` maps a name fragment (``"q_proj"``) to the type of those tensors."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        data = tensor.numpy()
        if ".q_proj." in hf_name:
            data = permute_qk(data, cfg.num_attention_heads)
        elif ".k_proj." in hf_name:
            data = permute_qk(data, cfg.num_key_value_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        qtype = next((t for frag, t in types.items() if frag in hf_name), Q.F32) if data.ndim == 2 else Q.F32
        if qtype in K_TYPES:
            writer.add_tensor(name, random_blocks(*data.shape, qtype, rng, 2e-4), raw_dtype=qtype)
        elif qtype == Q.F16:
            writer.add_tensor(name, data.astype(np.float16))
        elif qtype != Q.F32:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


MIXED = {"embed_tokens": Q.Q8_0, "q_proj": Q.Q4_1, "k_proj": Q.Q4_0, "v_proj": Q.Q8_0, "layers.0.self_attn.o_proj": Q.Q5_0,
         "layers.1.self_attn.o_proj": Q.F16, "gate_proj": Q.Q5_1, "up_proj": Q.Q4_1, "down_proj": Q.Q8_0,
         "lm_head": Q.Q8_0}
K_MIXED = {"q_proj": Q.Q4_K, "k_proj": Q.Q5_K, "v_proj": Q.Q6_K, "o_proj": Q.Q6_K, "gate_proj": Q.Q4_K,
           "up_proj": Q.Q2_K, "down_proj": Q.Q5_K}


def _compare_with_float_path(path: str) -> tuple[float, float]:
    quant, qbackend, method = load_plinth(path, "gguf")
    assert method.name == "gguf" and method.kernel.name == "gguf_dequant"
    ref, rbackend, none = load_plinth(path)
    assert none is None  # the default for .gguf files: dequantized while loading
    (ql, qtok), (rl, rtok) = plinth_logits_and_greedy(quant, qbackend), plinth_logits_and_greedy(ref, rbackend)
    err = max((a - b).abs().max().item() for a, b in zip(ql, rl, strict=True))
    agree = sum(a == b for x, y in zip(qtok, rtok, strict=True) for a, b in zip(x, y, strict=True)) / 48
    return err, agree


def test_mixed_block_types_match_the_float_path(tmp_path):
    path = write_llama(tmp_path / "mixed.gguf", small_llama(), MIXED)
    err, agree = _compare_with_float_path(path)
    assert err < 1e-4 and agree == 1.0  # measured: 0 (the same float32 values), 48/48 greedy tokens equal
    quant, _backend, _method = load_plinth(path, "gguf")
    qkv = quant.model.layers[0].self_attn.qkv_proj
    assert [t for t, _rows, _cols in qkv.gguf_shards] == [Q.Q4_1, Q.Q4_0, Q.Q8_0]  # one shard per tensor, as stored
    assert quant.model.layers[1].self_attn.o_proj.gguf_shards[0][0] == Q.F16  # float values as stored


def test_k_block_types_match_the_float_path(tmp_path):
    model = small_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    path = write_llama(tmp_path / "k.gguf", model, K_MIXED)
    err, agree = _compare_with_float_path(path)
    assert err < 1e-3 and agree == 1.0  # measured: 0, 48/48
    quant, _backend, _method = load_plinth(path, "gguf")
    types = [t for t, _r, _c in quant.model.layers[0].mlp.gate_up_proj.gguf_shards]
    assert types == [Q.Q4_K, Q.F32]  # Q2_K has no torch dequantizer here: kept as float values


def _layer_weight(layer) -> torch.Tensor:
    shards = [GGUFShard(t, getattr(layer, f"gguf_blocks_{i}"), r, c) for i, (t, r, c) in enumerate(layer.gguf_shards)]
    return GGUFWeights(shards).dequantize()


def test_tensor_parallel_ranks_hold_their_slices(tmp_path):
    path = write_llama(tmp_path / "tp.gguf", small_llama(), MIXED)
    full, _backend, _none = load_plinth(path)
    ref = full.model.layers[0]
    for rank in (0, 1):
        model, _backend, _method = load_plinth(path, "gguf", tp=(rank, 2))
        layer = model.model.layers[0]
        q, k, v = ref.self_attn.qkv_proj.weight.split([64, 32, 32])
        half = lambda t, dim, rank=rank: t.chunk(2, dim)[rank]  # noqa: E731
        expected = {
            "qkv": torch.cat([half(q, 0), half(k, 0), half(v, 0)]),
            "o": half(ref.self_attn.o_proj.weight, 1),
            "gate_up": torch.cat([half(w, 0) for w in ref.mlp.gate_up_proj.weight.split([128, 128])]),
            "down": half(ref.mlp.down_proj.weight, 1),
        }
        got = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
               "down": layer.mlp.down_proj}
        for name, module in got.items():
            assert torch.equal(_layer_weight(module), expected[name]), (rank, name)


def test_gguf_method_needs_a_gguf_file(tiny_llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="--quantization gguf needs a .gguf file"):
        load_plinth(tiny_llama_dir, "gguf")
    path = write_llama(tmp_path / "m.gguf", small_llama(), MIXED)
    with pytest.raises(ConfigError, match="--quantization int4 cannot be used with a .gguf file"):
        load_plinth(path, "int4")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_experts_keep_their_blocks_and_split_under_tensor_parallelism(tmp_path, monkeypatch, qtype):
    """``--quantization gguf`` on a Qwen3-MoE file: each expert keeps its blocks and widens to the experts the default
    path loads; each of two ranks holds its gate/up rows and its whole blocks of the down rows. With 256-element
    K-quant blocks a rank's 128 down-projection columns end inside a block: that projection is widened instead."""
    import test_gguf

    qt = getattr(gguf.GGMLQuantizationType, qtype)
    if qtype == "Q4_K":   # gguf's Python quantizer has no K types: random blocks of the type instead
        real = gguf.quants.quantize

        def quantize(data, kind):
            if kind != qt:
                return real(data, kind)
            rows = int(np.prod(data.shape[:-1]))
            blocks = random_blocks(rows, data.shape[-1], kind, np.random.default_rng(data.size), 0.002)
            return blocks.reshape(*data.shape[:-1], -1)

        monkeypatch.setattr(gguf.quants, "quantize", quantize)
        arch, cfg = test_gguf.MOE["qwen3moe"]
        monkeypatch.setitem(test_gguf.MOE, "qwen3moe", (arch, {**cfg, "moe_intermediate_size": 256, "head_dim": 128}))
        model = test_gguf.moe_model("qwen3moe", hidden_size=256)
    else:
        model = test_gguf.moe_model("qwen3moe")
    path = test_gguf.write_moe_gguf(tmp_path / "m.gguf", model, "qwen3moe", qt)
    full = load_plinth(path)[0].model.layers[0].mlp.experts        # dequantized while loading
    kept = load_plinth(path, "gguf")[0].model.layers[0].mlp.experts
    assert kept.gguf_experts["w2"][0].shards[0].ggml_type == qt
    for e in range(full.num_experts):
        for which in ("w13", "w2"):
            assert torch.equal(kept.expert_weight(which, e, torch.float32), full.expert_weight(which, e, torch.float32))
    i = full.intermediate_per_rank // 2
    for rank in (0, 1):
        half = load_plinth(path, "gguf", tp=(rank, 2))[0].model.layers[0].mlp.experts
        assert half.gguf_experts["w13"][0].shards[0].ggml_type == qt
        assert half.gguf_experts["w2"][0].shards[0].ggml_type == (qt if qtype == "Q8_0" else F32)
        for e in range(full.num_experts):
            w13 = full.expert_weight("w13", e, torch.float32)
            rows = torch.cat([w13[rank * i:(rank + 1) * i], w13[2 * i + rank * i:2 * i + (rank + 1) * i]])
            assert torch.equal(half.expert_weight("w13", e, torch.float32), rows)
            assert torch.equal(half.expert_weight("w2", e, torch.float32),
                               full.expert_weight("w2", e, torch.float32)[:, rank * i:(rank + 1) * i])


def test_gguf_experts_on_widened_grouped_gemms(tmp_path, monkeypatch):
    """GGUF experts (their weights in ``gguf_experts``, the stacked parameters empty) on the grouped-GEMM path: the
    device check reads the layer's sizes, not the empty parameters, and runs of experts widened one expert at a
    time equal the per-expert loop."""
    import test_gguf

    from plinth.model_registry.layers import moe as moe_module

    path = test_gguf.write_moe_gguf(tmp_path / "m.gguf", test_gguf.moe_model("qwen3moe"), "qwen3moe",
                                    gguf.GGMLQuantizationType.Q8_0)
    experts = load_plinth(path, "gguf")[0].model.layers[0].mlp.experts
    assert experts.w2_weight.numel() == 0
    monkeypatch.setattr(moe_module, "_capability", lambda _device: (9, 0))
    assert experts._grouped_gemm_runs(torch.device("cuda"), torch.bfloat16, True)
    experts.widen_chunk_elements = 3 * experts.hidden_size * experts.intermediate_per_rank * 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, experts.hidden_size, generator=g)
    logits = torch.randn(7, experts.num_experts, generator=g)
    torch.testing.assert_close(experts._forward_widened(x, *experts.route(logits)), experts(x, logits),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_type", [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_gemma_norms_stored_as_half_floats(tmp_path, monkeypatch, norm_type):
    """Gemma's norm weights (stored as 1 + w) in F16 or BF16 rather than llama.cpp's usual F32: both paths load
    them as w, equal to the original's within the storage type's rounding (they were a reshape error under
    ``--quantization gguf``, and BF16 was refused on both paths)."""
    import test_gguf

    plain_add = test_gguf.add_tensor

    def add_tensor(writer, name, data, qtype=Q.F32):
        if data.ndim == 1 and name.endswith("norm.weight"):
            if norm_type == Q.F16:
                writer.add_tensor(name, data.astype(np.float16))
            else:
                halves = torch.from_numpy(data.astype(np.float32)).to(torch.bfloat16)
                writer.add_tensor(name, halves.view(torch.int16).numpy().view(np.uint8), raw_dtype=Q.BF16)
        else:
            plain_add(writer, name, data, qtype)

    monkeypatch.setattr(test_gguf, "add_tensor", add_tensor)
    model = test_gguf.gemma_model("gemma3")
    path = test_gguf.write_gemma_gguf(tmp_path / "g.gguf", model, Q.Q8_0)
    scale = model.model.layers[0].input_layernorm.weight.detach() + 1  # what the norm multiplies by
    stored = scale.to(torch.float16 if norm_type == Q.F16 else torch.bfloat16).float()
    assert (stored - scale).abs().max() > 1e-4  # the storage rounds, so the check below tells the two apart
    for quantization in (None, "gguf"):
        loaded = load_plinth(path, quantization)[0]
        norm = loaded.model.layers[0].input_layernorm  # plinth's Gemma norm keeps 1 + w
        torch.testing.assert_close(norm.weight.detach(), stored, rtol=0, atol=1e-6, msg=str(quantization))
