"""GGUF files: the Hugging Face config, tokenizer and weights they hold.

A GGUF file (llama.cpp's format) carries the model's hyper-parameters and tokenizer as metadata and its
tensors under llama.cpp's names (``blk.0.attn_q.weight``), with dimensions listed innermost first and,
for llama-family models, the rows of the Q and K projections interleaved for llama.cpp's rotary
convention. This module turns all of that back into what a Hugging Face checkpoint would hold, so the
rest of the model registry loads a GGUF file exactly like a safetensors directory.

Weights are dequantized here with the ``gguf`` package; :func:`iter_gguf_raw` gives the still-quantized
blocks (already in Hugging Face names and row order) for kernels that run quantized.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from plinth.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    import gguf
    import torch
    import transformers

_MAGIC = b"GGUF"


@dataclasses.dataclass(frozen=True)
class _GGUFArchitecture:
    model_type: str  # transformers' model_type, which picks the config class
    hf_architecture: str  # the registry's architecture name
    permuted_qk: bool  # llama.cpp's converter interleaved the Q/K rows (rope type NORM)


# GGUF general.architecture -> how to read it.
_ARCHITECTURES = {
    "llama": _GGUFArchitecture("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": _GGUFArchitecture("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": _GGUFArchitecture("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
}

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)")
# Llama 3 stores its rope scaling as per-frequency divisors; read_gguf_config folds them into the config.
_ROPE_FREQS = "rope_freqs.weight"


# ----------------------------------------------------------------------------------------------- opening


def _open_reader(path: str) -> gguf.GGUFReader:
    """Open a GGUF file (memory-mapped), turning every way it can be unreadable into a ModelLoadError."""
    import gguf

    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise ModelLoadError(f"{path!r} is not a GGUF file: it does not start with the bytes {_MAGIC!r}")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
        raise ModelLoadError(f"GGUF file {path!r} is truncated or corrupt: {e}") from e
    if _meta(reader, "split.count", 1) > 1:
        raise ModelLoadError(
            f"GGUF file {path!r} is one part of a split model; merge the parts into one file first "
            "(llama.cpp's gguf-split --merge)"
        )
    if reader.byte_order != "I":
        raise ModelLoadError(f"GGUF file {path!r} has the other byte order than this machine; convert it first")
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ModelLoadError(f"GGUF file {path!r} is truncated: tensor {tensor.name!r} runs past its end")
    return reader


def _meta(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float32_value(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (``1e-05``, not ``9.99999974e-06``)."""
    return float(str(np.float32(value)))


def _architecture(reader: gguf.GGUFReader, path: str) -> tuple[str, _GGUFArchitecture]:
    name = _meta(reader, "general.architecture")
    if name is None:
        raise ModelLoadError(f"GGUF file {path!r} has no general.architecture metadata")
    arch = _ARCHITECTURES.get(name)
    if arch is None:
        raise UnsupportedModelError(
            f"GGUF file {path!r} has architecture {name!r}; supported GGUF architectures: "
            f"{', '.join(sorted(_ARCHITECTURES))}"
        )
    if _meta(reader, f"{name}.expert_count", 0):
        raise UnsupportedModelError(
            f"GGUF file {path!r} is a mixture-of-experts {name!r} model; GGUF loading supports dense "
            f"{', '.join(sorted(_ARCHITECTURES))} models only"
        )
    return name, arch


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    # GGUF lists dimensions innermost first; Hugging Face (and numpy) outermost first.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


# ------------------------------------------------------------------------------------------------ config


def _head_counts(reader: gguf.GGUFReader, name: str, path: str) -> tuple[int, int]:
    n_heads = _meta(reader, f"{name}.attention.head_count")
    n_kv_heads = _meta(reader, f"{name}.attention.head_count_kv", n_heads)
    if not isinstance(n_heads, int) or not isinstance(n_kv_heads, int):
        raise ModelLoadError(
            f"GGUF file {path!r}: {name}.attention.head_count(_kv) must be one integer each, "
            f"got {n_heads!r} and {n_kv_heads!r}"
        )
    return n_heads, n_kv_heads


def _llama3_freq_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama3 rope scaling applies (what llama.cpp stores as rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim // 2]
    wavelen = 2 * math.pi / inv_freq
    old_len = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = np.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _rope_scaling(
    reader: gguf.GGUFReader, name: str, theta: float, head_dim: int, path: str
) -> dict[str, Any] | None:
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        # llama.cpp writes Llama 3's scaling as divisors only; recover the parameters and check they
        # reproduce every divisor (Llama 3.1/3.2/3.3 all use low 1, high 4, original length 8192).
        factors = np.asarray(freqs.data, dtype=np.float64).reshape(-1)  # [head_dim // 2]
        scaling = {
            "rope_type": "llama3",
            "factor": float(factors.max()),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        if factors.shape != (head_dim // 2,) or not np.allclose(
            _llama3_freq_factors(scaling, theta, head_dim), factors, rtol=1e-4
        ):
            raise UnsupportedModelError(
                f"GGUF file {path!r}: its {_ROPE_FREQS} tensor is not llama3 rope scaling "
                "(low_freq_factor 1, high_freq_factor 4, original length 8192), the only kind supported"
            )
        return scaling
    kind = _meta(reader, f"{name}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = _float32_value(_meta(reader, f"{name}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    original = _meta(reader, f"{name}.rope.scaling.original_context_length")
    if kind == "yarn" and original is not None:
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise UnsupportedModelError(
        f"GGUF file {path!r} uses rope scaling {kind!r}; supported: linear, yarn (with original_context_length)"
    )


def read_gguf_config(path: str) -> tuple[transformers.PretrainedConfig, str]:
    """The Hugging Face config of a GGUF file and the registry's architecture name for it.

    Args:
        path: a ``.gguf`` file.

    Returns:
        ``(config, architecture)``: e.g. a ``LlamaConfig`` (with ``architectures`` set) and
        ``"LlamaForCausalLM"``.

    Raises:
        ModelLoadError: the file is missing, not a GGUF file, truncated, or lacks required metadata.
        UnsupportedModelError: its architecture (or rope scaling) has no implementation.
    """
    from transformers import AutoConfig

    reader = _open_reader(path)
    name, arch = _architecture(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {path!r} has no token_embd.weight tensor")

    def required(key: str) -> Any:
        value = _meta(reader, f"{name}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF file {path!r} lacks the metadata key {name}.{key}")
        return value

    hidden_size = required("embedding_length")
    n_heads, n_kv_heads = _head_counts(reader, name, path)
    head_dim = _meta(reader, f"{name}.attention.key_length", hidden_size // n_heads)
    rotary_dim = _meta(reader, f"{name}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise UnsupportedModelError(
            f"GGUF file {path!r} rotates {rotary_dim} of {head_dim} head dimensions; only full rotary is supported"
        )
    rope_theta = _float32_value(_meta(reader, f"{name}.rope.freq_base", 10000.0))
    options: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "vocab_size": _hf_shape(tensors["token_embd.weight"])[0],
        "hidden_size": hidden_size,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": required("context_length"),
        "rms_norm_eps": _float32_value(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _meta(reader, "tokenizer.ggml.padding_token_id"),
    }
    if arch.model_type in ("llama", "qwen3"):
        options["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch.model_type == "llama":
        options["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    scaling = _rope_scaling(reader, name, rope_theta, head_dim, path)
    if scaling is not None:
        options["rope_scaling"] = scaling
    return AutoConfig.for_model(arch.model_type, **options), arch.hf_architecture


# ----------------------------------------------------------------------------------------------- weights


def _hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for an unknown name."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{kind}"
    match = _BLOCK_TENSOR.fullmatch(stem)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{kind}"


def _unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving, so that rotary pairs are (i, i + head_dim/2) as in HF.

    llama.cpp orders each head's rows as (pair, half); Hugging Face's rotate_half expects (half, pair).
    Works on any row-major layout whose first axis is the output rows: float weights, biases, or
    quantized blocks (each row's blocks move with it).
    """
    head_dim = rows.shape[0] // n_heads
    rest = rows.shape[1:]
    # [n_heads, head_dim // 2, 2, *rest] -> [n_heads, 2, head_dim // 2, *rest]
    return rows.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows.shape)


def iter_gguf_raw(path: str) -> Iterator[tuple[str, np.ndarray, gguf.GGMLQuantizationType, tuple[int, ...]]]:
    """Every tensor of a GGUF file as stored, but under its HF name and in HF row order.

    Yields:
        ``(hf_name, data, ggml_type, hf_shape)``: ``data`` is the memory-mapped array (a copy only for
        Q/K rows that had to be reordered): float tensors as ``[*hf_shape]`` of their numpy type,
        quantized ones as ``uint8`` ``[*hf_shape[:-1], bytes_per_row]``. ``hf_shape`` is the dequantized
        shape. ``rope_freqs.weight`` is not yielded (it is in the config's rope scaling).

    Raises:
        ModelLoadError: an unreadable file, or a tensor with no Hugging Face counterpart.
        UnsupportedModelError: an architecture without an implementation.
    """
    return _iter_raw(_open_reader(path), path)


def _iter_raw(
    reader: gguf.GGUFReader, path: str
) -> Iterator[tuple[str, np.ndarray, gguf.GGMLQuantizationType, tuple[int, ...]]]:
    name, arch = _architecture(reader, path)
    n_heads, n_kv_heads = _head_counts(reader, name, path)
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            raise ModelLoadError(
                f"GGUF file {path!r}: tensor {tensor.name!r} has no counterpart in {arch.hf_architecture}"
            )
        data = tensor.data
        if arch.permuted_qk and (".self_attn.q_proj." in hf_name or ".self_attn.k_proj." in hf_name):
            heads = n_heads if ".q_proj." in hf_name else n_kv_heads
            if data.shape[0] % (2 * heads):
                raise ModelLoadError(
                    f"GGUF file {path!r}: tensor {tensor.name!r} has {data.shape[0]} rows, "
                    f"not a multiple of 2 x {heads} heads"
                )
            data = _unpermute_rows(data, heads)
        yield hf_name, data, tensor.tensor_type, _hf_shape(tensor)


def _dequantizable(ggml_type: gguf.GGMLQuantizationType) -> bool:
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    probe = np.zeros((1, type_size), dtype=np.uint8)  # one zero block
    try:
        gguf.quants.dequantize(probe, ggml_type)
    except NotImplementedError:
        return False
    return True


def iter_gguf_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of a GGUF file, dequantized to ``dtype``, as a Hugging Face checkpoint has it.

    Tensors come one at a time from the memory-mapped file, named (``model.layers.0.mlp.up_proj.weight``)
    and shaped as in transformers; ``lm_head.weight`` only when the file has its own ``output.weight``.

    Raises:
        ModelLoadError: an unreadable file, or a tensor of a type that cannot be dequantized (checked
            before the first tensor is yielded).
        UnsupportedModelError: an architecture without an implementation.
    """
    import gguf
    import torch

    reader = _open_reader(path)
    for ggml_type in sorted({t.tensor_type for t in reader.tensors}):
        if not _dequantizable(ggml_type):
            tensor = next(t.name for t in reader.tensors if t.tensor_type == ggml_type)
            raise ModelLoadError(
                f"GGUF file {path!r}: tensor {tensor!r} has type {ggml_type.name}, which cannot be dequantized"
            )
    for hf_name, data, ggml_type, shape in _iter_raw(reader, path):
        values = gguf.quants.dequantize(data, ggml_type)  # float32 [*shape]
        if not values.flags.writeable:  # a view of the read-only mapping: torch needs its own copy
            values = values.copy()
        yield hf_name, torch.from_numpy(values.reshape(shape)).to(dtype)


# --------------------------------------------------------------------------------------------- tokenizer


def load_gguf_tokenizer(path: str) -> Any:
    """A transformers tokenizer built from a GGUF file's metadata, offline.

    The chat template (``tokenizer.chat_template``) and the BOS/EOS/padding tokens are set from the
    metadata.

    Raises:
        ModelLoadError: an unreadable file, or a tokenizer transformers cannot build.
    """
    from transformers import AutoTokenizer

    path = os.path.abspath(path)
    reader = _open_reader(path)
    if _meta(reader, "tokenizer.ggml.model") is None or "tokenizer.ggml.tokens" not in reader.fields:
        raise ModelLoadError(
            f"GGUF file {path!r} holds no tokenizer (no tokenizer.ggml.model/tokens metadata); "
            "give a tokenizer directory separately"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"could not build a tokenizer from GGUF file {path!r}: {e}") from e
    template = _meta(reader, "tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template
    for attribute, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        token_id = _meta(reader, key)
        if token_id is not None:
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer
