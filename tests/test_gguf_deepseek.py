"""DeepSeek-V2/V3 GGUF files (llama.cpp's ``deepseek2`` architecture): config, weights and the engine against the
transformers model the file was written from.

Files are written as llama.cpp's converter writes them: gguf's own HF->GGUF name map, the experts stacked, the
router's correction bias as ``exp_probs_b.bias``, the metadata keys of its DeepSeek converter, and ``kv_b_proj``
either whole (``attn_kv_b``, files before 2025's latent-attention rework, whose ``key_length``/``value_length`` are
the per-head sizes) or split per head into ``attn_k_b`` (key rows transposed) and ``attn_v_b`` (newer files, whose
``key_length``/``value_length`` are the latent's and ``*_mla`` the per-head sizes, ``head_count_kv`` 1).
"""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
import transformers
from test_gguf import (
    _patched,
    assert_logits_match,
    assert_weights_equal,
    engine_matches_dequantized,
    gguf_writer,
)

from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.gguf_loader import iter_gguf_weights, read_gguf_config

Q = gguf.GGMLQuantizationType
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, tie_word_embeddings=False, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=24,
            v_head_dim=16, moe_intermediate_size=32, first_k_dense_replace=1)
CONFIGS = {
    # compressed queries, sigmoid routing over groups with the correction bias, renormalised, scaled
    "v3": ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, q_lora_rank=48,
                               n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    # direct queries, softmax routing within the best group, YaRN with DeepSeek's mscale (equal to mscale_all_dim,
    # as in the released configs: the file stores one of them)
    "v2": ("deepseek_v2", dict(n_routed_experts=4, num_experts_per_tok=2, topk_method="group_limited_greedy",
                               n_group=2, topk_group=1, q_lora_rank=None, n_shared_experts=2,
                               routed_scaling_factor=1.5,
                               rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                                                "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0,
                                                "original_max_position_embeddings": 16, "rope_theta": 10000.0})),
}


def deepseek_model(kind: str, **more) -> transformers.PreTrainedModel:
    model_type, overrides = CONFIGS[kind]
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides, **more})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():   # norms start at one and the correction bias at zero: make every tensor distinct
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            elif name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.05)
    return model


def write_deepseek_gguf(path, model, *, split_kv_b: bool = True, qtype=Q.F32, gating: bool = True,
                        tokenizer: bool = False, shared_count: int | str | None = "config",
                        ) -> tuple[str, dict[str, torch.Tensor]]:
    """``model`` as llama.cpp's converter writes it; returns the path and the state dict the file decodes to (each
    quantized tensor through gguf's own quantize/dequantize)."""
    cfg = model.config
    v3 = cfg.model_type == "deepseek_v3"
    header = copy.copy(cfg)   # the converter writes MLA as one KV head once kv_b_proj is split
    header.num_key_value_heads = 1 if split_kv_b else cfg.num_attention_heads
    writer = gguf_writer(path, header, "deepseek2")
    rope = cfg.rope_parameters
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    per_head_key = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if split_kv_b:
        writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(per_head_key)
        writer.add_value_length_mla(cfg.v_head_dim)
    else:
        writer.add_key_length(per_head_key)
        writer.add_value_length(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if shared_count is not None:
        writer.add_expert_shared_count(cfg.n_shared_experts if shared_count == "config" else shared_count)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob and v3:
        writer.add_expert_weights_norm(True)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    if gating:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    if tokenizer:   # the tests' byte-level BPE tokenizer, as DeepSeek-V3's converter writes its own ("gpt2")
        from test_startup_cache import bpe_tokenizer_metadata

        meta = bpe_tokenizer_metadata()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("deepseek-v3")
        writer.add_token_list(meta["tokens"])
        writer.add_token_merges(meta["merges"])
        writer.add_token_types([3 if t in meta["special"] else 1 for t in meta["tokens"]])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    decoded: dict[str, torch.Tensor] = {}

    def add(name: str, data: np.ndarray) -> np.ndarray:
        """Write one tensor (quantized where its rows are whole blocks); returns what it decodes to."""
        if data.ndim >= 2 and qtype != Q.F32 and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            blocks = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
            return gguf.quants.dequantize(blocks, qtype).reshape(data.shape)
        writer.add_tensor(name, data.astype(np.float32))
        return data.astype(np.float32)

    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for hf_name, tensor in model.state_dict().items():
        data = tensor.numpy()
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if hf_name.endswith(".mlp.experts.gate_up_proj"):          # [E, 2I, H]: gate rows, then up rows
            rows = data.shape[1] // 2
            gate = add(f"blk.{layer}.ffn_gate_exps.weight", data[:, :rows])
            up = add(f"blk.{layer}.ffn_up_exps.weight", data[:, rows:])
            decoded[hf_name] = torch.from_numpy(np.concatenate([gate, up], axis=1))
        elif hf_name.endswith(".mlp.experts.down_proj"):
            decoded[hf_name] = torch.from_numpy(add(f"blk.{layer}.ffn_down_exps.weight", data))
        elif hf_name.endswith(".kv_b_proj.weight") and split_kv_b:
            per_head = data.reshape(heads, nope + v, -1)
            k_b = add(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)))
            v_b = add(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(per_head[:, nope:]))
            decoded[hf_name] = torch.from_numpy(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(
                data.shape))
        else:
            mapped = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
            decoded[hf_name] = torch.from_numpy(add(names.get_name(mapped, try_suffixes=(".weight", ".bias")), data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path), decoded


@pytest.mark.parametrize("kind,split_kv_b", [("v3", True), ("v3", False), ("v2", True), ("v2", False)])
def test_deepseek_gguf_gives_the_original_logits(tmp_path, kind, split_kv_b):
    """The config (latent ranks and head sizes, dense first block, routing, YaRN) and F32 weights of a DeepSeek GGUF
    file rebuild the original model on plinth's DeepSeek classes: logits equal transformers' on the original."""
    model = deepseek_model(kind)
    path, _ = write_deepseek_gguf(tmp_path / "m.gguf", model, split_kv_b=split_kv_b, gating=split_kv_b)
    config, architecture = read_gguf_config(path)
    assert architecture == {"v3": "DeepseekV3ForCausalLM", "v2": "DeepseekV2ForCausalLM"}[kind]
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace", "n_group",
                "topk_group", "moe_intermediate_size", "intermediate_size"):
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.routed_scaling_factor == pytest.approx(model.config.routed_scaling_factor)
    if kind == "v2":
        assert config.topk_method == "group_limited_greedy"
        assert config.rope_parameters["mscale_all_dim"] == pytest.approx(0.707)
    assert_logits_match(path, model)


def test_quantized_deepseek_gguf_weights_and_engine(tmp_path):
    """A Q8_0 DeepSeek-V3 file with kv_b_proj split: every tensor plinth reads equals gguf's own dequantization of
    the file (kv_b_proj joined back from its transposed halves); through ``LLM`` with the blocks kept
    (``quantization="gguf"``) greedy tokens equal transformers' on those weights."""
    from conftest import save_tiny_model

    model = deepseek_model("v3")
    path, decoded = write_deepseek_gguf(tmp_path / "m.gguf", model, qtype=Q.Q8_0)
    cfg = model.config
    assert_weights_equal(path, decoded, cfg.n_routed_experts, range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    reference = deepseek_model("v3")
    reference.load_state_dict({**reference.state_dict(), **decoded})
    tokenizer = save_tiny_model(tmp_path / "tok")
    engine_matches_dequantized(path, reference, tokenizer)
    import plinth

    llm = plinth.LLM(path, tokenizer=str(tokenizer), dtype="float32", max_model_len=128, quantization="gguf")
    layer = llm.engine.runner.model.model.layers[1]
    assert layer.mlp.experts.gguf_experts is not None and layer.mlp.experts.w13_weight.numel() == 0
    assert layer.self_attn.o_proj.gguf_blocks_0.dtype == torch.uint8   # Q8_0 blocks kept
    llm.close()


def test_dense_deepseek_files_and_the_shared_experts_count(tmp_path):
    """A DeepSeek file whose blocks are all dense (``leading_dense_block_count`` = the block count; the converter
    still writes the config's expert count) loads with dense MLPs; a file without ``expert_shared_count`` takes the
    count from the shared experts' tensor, and one whose count disagrees with that tensor is refused."""
    dense = deepseek_model("v2", first_k_dense_replace=BASE["num_hidden_layers"])
    path, _ = write_deepseek_gguf(tmp_path / "dense.gguf", dense)
    config, _ = read_gguf_config(path)
    assert config.first_k_dense_replace == config.num_hidden_layers and config.n_routed_experts == 0
    inferred, _ = write_deepseek_gguf(tmp_path / "inferred.gguf", deepseek_model("v2"), shared_count=None)
    assert read_gguf_config(inferred)[0].n_shared_experts == CONFIGS["v2"][1]["n_shared_experts"]
    assert_logits_match(path, dense)
    assert_logits_match(inferred, deepseek_model("v2"))
    wrong, _ = write_deepseek_gguf(tmp_path / "wrong.gguf", deepseek_model("v2"), shared_count=1)
    with pytest.raises(ModelLoadError, match=r"expert_shared_count is 1, but blk.1.ffn_gate_shexp.weight has 64 rows"):
        read_gguf_config(wrong)


def test_deepseek_files_that_cannot_be_read_are_refused(tmp_path):
    """Half of a split kv_b_proj, gating that disagrees with the file's router, and experts missing from a block
    after the leading dense ones: each a clear error naming what is wrong."""
    v2, _ = write_deepseek_gguf(tmp_path / "v2.gguf", deepseek_model("v2"))
    lone = tmp_path / "lone.gguf"   # V2 has no attn_q_a: the value half renamed to it (same length)
    lone.write_bytes(open(v2, "rb").read().replace(b"blk.1.attn_v_b.weight", b"blk.1.attn_q_a.weight"))
    with pytest.raises(ModelLoadError, match=r"blk.1.attn_k_b without its other half"):
        dict(iter_gguf_weights(str(lone), torch.float32))
    path, _ = write_deepseek_gguf(tmp_path / "m.gguf", deepseek_model("v3"))
    data = open(path, "rb").read()
    softmax = tmp_path / "softmax.gguf"
    softmax.write_bytes(_patched(data, "deepseek2.expert_gating_func", 1))
    with pytest.raises(UnsupportedModelError, match=r"expert_gating_func is 1"):
        read_gguf_config(str(softmax))
    dense = tmp_path / "dense.gguf"
    dense.write_bytes(_patched(data, "deepseek2.leading_dense_block_count", 2))
    with pytest.raises(ModelLoadError, match=r"leading_dense_block_count is 2.*blocks \[1, 2\]"):
        read_gguf_config(str(dense))


def test_the_tokenizer_of_a_deepseek_file(tmp_path):
    """transformers loads no deepseek2 model from GGUF, so its AutoTokenizer refuses the file; the tokenizer comes
    from the file's tokenizer metadata alone: it encodes as the tokenizer the metadata was written from."""
    from conftest import make_tokenizer

    from plinth.model_registry.gguf_loader import load_gguf_tokenizer

    path, _ = write_deepseek_gguf(tmp_path / "m.gguf", deepseek_model("v2"), tokenizer=True)
    ours, reference = load_gguf_tokenizer(path, use_cache=False), make_tokenizer()
    for text in ("hello world", "The quick brown fox, 123 times!", "caf\u00e9 na\u00efve\n\ttabs"):
        assert ours(text).input_ids == reference(text).input_ids, text


@pytest.mark.parametrize("arch", ["granite", "llama"])
@pytest.mark.parametrize("merges,match", [(["zzzzz yyyy"], "out of vocabulary"), (["abc"], "Merges"),
                                          (None, "has no tokenizer.ggml.merges")])
def test_broken_tokenizer_metadata_is_a_load_error(tmp_path, arch, merges, match):
    """Tokenizer metadata the tokenizers library cannot build (merges of unknown tokens, malformed or missing merges)
    is a ModelLoadError naming the file and the reason, for architectures transformers loads from GGUF (llama) and
    for those it does not (granite), whose refusal of the architecture is not the reason given."""
    from test_gguf import small_model, write_gguf
    from test_startup_cache import bpe_tokenizer_metadata

    from plinth.model_registry.gguf_loader import load_gguf_tokenizer

    meta = bpe_tokenizer_metadata()

    def tokenizer(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(meta["tokens"])
        if merges is not None:
            writer.add_token_merges(merges)

    path = write_gguf(tmp_path / "m.gguf", small_model(arch, False, vocab_size=len(meta["tokens"])), arch,
                      metadata={"tokenizer": tokenizer})
    with pytest.raises(ModelLoadError, match=rf"GGUF file .*{match}") as error:
        load_gguf_tokenizer(path, use_cache=False)
    assert "not supported yet" not in str(error.value)
