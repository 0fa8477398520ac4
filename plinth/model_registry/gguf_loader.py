"""GGUF files: the Hugging Face config, tokenizer and weights they hold.

A GGUF file (llama.cpp's format) carries the model's hyper-parameters and tokenizer as metadata and its
tensors under llama.cpp's names (``blk.0.attn_q.weight``), with dimensions listed innermost first and,
for llama-family models, the rows of the Q and K projections interleaved for llama.cpp's rotary
convention. This module turns all of that back into what a Hugging Face checkpoint would hold, so the
rest of the model registry loads a GGUF file exactly like a safetensors directory.

The header is parsed once per file and process (:mod:`plinth.model_registry.gguf_file`), the tokenizer
is converted once and kept on disk (:mod:`plinth.model_registry.gguf_tokenizer`), and weights are
dequantized in groups (:mod:`plinth.model_registry.gguf_dequant`); :func:`iter_gguf_raw` gives the
still-quantized blocks (already in Hugging Face names and row order) for kernels that run quantized.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.gguf_file import GGUFFile, open_gguf

if TYPE_CHECKING:
    import gguf
    import torch
    import transformers


@dataclasses.dataclass(frozen=True)
class _GGUFArchitecture:
    model_type: str  # transformers' model_type, which picks the config class
    hf_architecture: str  # the registry's architecture name
    permuted_qk: bool  # llama.cpp's converter interleaved the Q/K rows (rope type NORM)
    block_names: tuple[tuple[str, str], ...] = ()  # block tensor names that differ from _BLOCK_NAMES'
    norm_offset: float = 0.0  # llama.cpp's converter added this to every norm weight (Gemma's 1 + w)
    fused: bool = False  # q/k/v in one attn_qkv tensor, gate/up in one ffn_up (Phi-3): split as they are read
    partial_rotary: bool = False  # rope.dimension_count may be less than the head size
    top_names: tuple[tuple[str, str], ...] = ()  # top-level tensor names that differ from _TOP_LEVEL_NAMES'
    layer_norm: bool = False  # LayerNorms (attention.layer_norm_epsilon), not RMSNorms


_GEMMA_NORMS = (("ffn_norm", "pre_feedforward_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                ("post_ffw_norm", "post_feedforward_layernorm"))


@dataclasses.dataclass(frozen=True)
class _GemmaLayout:
    """What llama.cpp's code assumes for a Gemma generation (its GGUF metadata leaves these out)."""

    global_every: int           # every n-th layer attends globally, the others over the sliding window
    big_layers: int             # the model with this many layers scales the softmax by 1/sqrt(hidden / heads)
    default_window: int | None  # the sliding window when the metadata has none (None: required)
    default_caps: tuple[float | None, float | None]   # (attention, final) logit soft caps when the metadata has none


_GEMMA_LAYOUTS = {
    # Gemma 2: even layers slide (window 4096), 27B has 46 layers, caps 50 and 30 unless the file says otherwise
    "gemma2": _GemmaLayout(global_every=2, big_layers=46, default_window=4096, default_caps=(50.0, 30.0)),
    # Gemma 3: every sixth layer global, sliding layers with RoPE base 10,000 (below), 27B has 62 layers
    "gemma3_text": _GemmaLayout(global_every=6, big_layers=62, default_window=None, default_caps=(None, None)),
}


# DeepSeek's block tensors (llama.cpp's names -> the checkpoint's); attn_k_b/attn_v_b (kv_b_proj split per head by
# newer converters, the key half transposed) are joined back into kv_b_proj as they are read
_DEEPSEEK_NAMES = (
    ("attn_q_a", "self_attn.q_a_proj"), ("attn_q_a_norm", "self_attn.q_a_layernorm"),
    ("attn_q_b", "self_attn.q_b_proj"), ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"),
    ("attn_kv_a_norm", "self_attn.kv_a_layernorm"), ("attn_kv_b", "self_attn.kv_b_proj"),
    ("ffn_gate_shexp", "mlp.shared_experts.gate_proj"), ("ffn_up_shexp", "mlp.shared_experts.up_proj"),
    ("ffn_down_shexp", "mlp.shared_experts.down_proj"), ("exp_probs_b", "mlp.gate.e_score_correction_bias"))
_HEAD_NORMS = re.compile(r"blk\.(\d+)\.attn_([qk])_norm\.weight")
_KV_B_PARTS = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight")
# the gating function llama.cpp's converter writes (expert_gating_func)
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2

# GGUF general.architecture -> how to read it.
_ARCHITECTURES = {
    "llama": _GGUFArchitecture("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": _GGUFArchitecture("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": _GGUFArchitecture("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
    "gemma2": _GGUFArchitecture(
        "gemma2", "Gemma2ForCausalLM", permuted_qk=False, norm_offset=1.0, block_names=_GEMMA_NORMS),
    "gemma3": _GGUFArchitecture(
        "gemma3_text", "Gemma3ForCausalLM", permuted_qk=False, norm_offset=1.0, block_names=_GEMMA_NORMS),
    "phi3": _GGUFArchitecture(
        "phi3", "Phi3ForCausalLM", permuted_qk=False, fused=True, partial_rotary=True,
        block_names=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))),
    # llama.cpp converts both as Llama (Q/K rows interleaved)
    "granite": _GGUFArchitecture("granite", "GraniteForCausalLM", permuted_qk=True),
    "smollm3": _GGUFArchitecture("smollm3", "SmolLM3ForCausalLM", permuted_qk=True),
    "olmo2": _GGUFArchitecture("olmo2", "Olmo2ForCausalLM", permuted_qk=False, block_names=(
        ("post_attention_norm", "post_attention_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"))),
    # mixtures of experts: the experts' tensors are stacked ([E, rows, cols]) and read per expert
    "qwen2moe": _GGUFArchitecture("qwen2_moe", "Qwen2MoeForCausalLM", permuted_qk=False),
    "qwen3moe": _GGUFArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", permuted_qk=False),
    "olmoe": _GGUFArchitecture("olmoe", "OlmoeForCausalLM", permuted_qk=False),
    # Granite 3.x mixtures of experts: Granite's multipliers, converted as Llama (Q/K rows interleaved), the
    # checkpoint's fused input_linear split by the converter into ffn_gate_exps (first half) and ffn_up_exps; with a
    # shared MLP (ffn_*_shexp) the file is GraniteMoeShared's
    "granitemoe": _GGUFArchitecture("granitemoe", "GraniteMoeForCausalLM", permuted_qk=True),
    # Command-R / Command-R+ / Aya: the parallel block on one bias-free LayerNorm, interleaved RoPE (as the checkpoint
    # has it: no row reordering), R+'s per-head q/k norms [heads, head_dim] as in the checkpoint, logit_scale
    "command-r": _GGUFArchitecture("cohere", "CohereForCausalLM", permuted_qk=False, layer_norm=True),
    # Command-R7B: Command-R's block (no q/k norms), sliding-window layers with RoPE between full-attention layers
    # without it (the pattern from attention.sliding_window_pattern, else llama.cpp's every fourth layer full)
    "cohere2": _GGUFArchitecture("cohere2", "Cohere2ForCausalLM", permuted_qk=False, layer_norm=True),
    # StableLM 2 / StableLM 3B: LayerNorms with biases, partial RoPE, a parallel block where ffn_norm is absent, the
    # 12B's per-head q/k norms stacked [heads, head_dim] (split back into one tensor per head as they are read)
    "stablelm": _GGUFArchitecture("stablelm", "StableLmForCausalLM", permuted_qk=False, partial_rotary=True,
                                  layer_norm=True),
    # Phi-1/1.5/2: LayerNorms with biases, partial RoPE; q/k/v separate (llama.cpp's converter) or in attn_qkv
    # (early files)
    "phi2": _GGUFArchitecture(
        "phi", "PhiForCausalLM", permuted_qk=False, fused=True, partial_rotary=True, layer_norm=True,
        block_names=(("attn_qkv", "self_attn.qkv_proj"), ("attn_output", "self_attn.dense"), ("ffn_up", "mlp.fc1"),
                     ("ffn_down", "mlp.fc2")),
        top_names=(("output_norm", "model.final_layernorm"),)),
    # DeepSeek-V2/V3 (and the models built on them): multi-head latent attention; V3 when the file has the router's
    # correction bias (exp_probs_b) and sigmoid gating
    "deepseek2": _GGUFArchitecture("deepseek_v2", "DeepseekV2ForCausalLM", permuted_qk=False,
                                   block_names=_DEEPSEEK_NAMES),
}
_DEEPSEEK_V3 = _GGUFArchitecture("deepseek_v3", "DeepseekV3ForCausalLM", permuted_qk=False,
                                 block_names=_DEEPSEEK_NAMES)
_DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
# llama.cpp writes Mixtral as a "llama" file with experts (llama.expert_count)
_MIXTRAL = _GGUFArchitecture("mixtral", "MixtralForCausalLM", permuted_qk=True)
_GRANITE_MOE_SHARED = _GGUFArchitecture("granitemoeshared", "GraniteMoeSharedForCausalLM", permuted_qk=True)
_GRANITE_TYPES = ("granite", "granitemoe", "granitemoeshared")
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared")
# the stacked expert tensors, and what each architecture calls an expert's projections
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_EXPERT_PROJ_NAMES = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}
_DEFAULT_PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# whether the top-k weights are renormalised when the file does not say (llama.cpp's own choice per architecture)
_MOE_RENORMALIZE = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False, "granitemoe": True,
                    "granitemoeshared": True}
# Granite's multipliers: GGUF key (after the architecture name) -> config field; llama.cpp's converter writes the
# config's values as they are; when one is absent llama.cpp scales by 1, and the softmax by 1/sqrt(head size)
_GRANITE_SCALES = {"embedding_scale": "embedding_multiplier", "attention.scale": "attention_multiplier",
                   "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
# SmolLM3 in llama.cpp: every fourth layer (3, 7, ...) has no RoPE; its GGUF metadata has no key for it
_SMOLLM3_NO_ROPE_STEP = 4
# Phi-3's longrope: llama.cpp writes the per-frequency divisors as these tensors
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Gemma 3 in llama.cpp: the sliding layers' RoPE base
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Cohere2 in llama.cpp: without attention.sliding_window_pattern, every fourth layer (3, 7, ...) attends fully
_COHERE2_SLIDING_PERIOD = 4

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
    # mixtures of experts: the router, and Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)")
# Llama 3 stores its rope scaling as per-frequency divisors; read_gguf_config folds them into the config.
_ROPE_FREQS = "rope_freqs.weight"


# ----------------------------------------------------------------------------------------------- opening


def _float32_value(value: float, key: str = "a metadata value") -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (``1e-05``, not ``9.99999974e-06``);
    beyond float32's range, infinity.

    Raises:
        ModelLoadError: ``value`` (of metadata ``key``) is not a number.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ModelLoadError(f"GGUF: {key} must be a number, got {value!r}")
    with np.errstate(over="ignore"):
        return float(str(np.float32(value)))


def _architecture(reader: GGUFFile, path: str) -> tuple[str, _GGUFArchitecture]:
    name = reader.get("general.architecture")
    if name is None:
        raise ModelLoadError(f"GGUF file {path!r} has no general.architecture metadata")
    if not isinstance(name, str):
        raise ModelLoadError(f"GGUF file {path!r}: general.architecture must be a string, got {name!r}")
    arch = _ARCHITECTURES.get(name)
    if arch is None:
        raise UnsupportedModelError(
            f"GGUF file {path!r} has architecture {name!r}; supported GGUF architectures: "
            f"{', '.join(sorted(_ARCHITECTURES))}"
        )
    if name == "deepseek2" and any(t.name.endswith(".exp_probs_b.bias") for t in reader.tensors):
        arch = _DEEPSEEK_V3
    if name == "granitemoe" and any(t.name.endswith(".ffn_gate_shexp.weight") for t in reader.tensors):
        arch = _GRANITE_MOE_SHARED
    if reader.get(f"{name}.expert_count", 0):
        if name == "llama":
            return name, _MIXTRAL
        if arch.model_type not in _MOE_TYPES + _DEEPSEEK_TYPES:
            raise UnsupportedModelError(
                f"GGUF file {path!r} is a mixture-of-experts {name!r} model; GGUF mixtures of experts supported: "
                f"deepseek2, granitemoe, llama (Mixtral), olmoe, qwen2moe, qwen3moe"
            )
    elif arch.model_type in _MOE_TYPES:
        raise ModelLoadError(f"GGUF file {path!r}: a {name!r} file needs {name}.expert_count")
    return name, arch


# ------------------------------------------------------------------------------------------------ config


def _head_counts(reader: GGUFFile, name: str, path: str) -> tuple[int, int]:
    n_heads = reader.get(f"{name}.attention.head_count")
    n_kv_heads = reader.get(f"{name}.attention.head_count_kv", n_heads)
    if (not isinstance(n_heads, int) or not isinstance(n_kv_heads, int) or isinstance(n_heads, bool)
            or n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads):
        raise ModelLoadError(
            f"GGUF file {path!r}: {name}.attention.head_count(_kv) must be one positive integer each, the first a "
            f"multiple of the second, got {n_heads!r} and {n_kv_heads!r}"
        )
    return n_heads, n_kv_heads


def _check_sizes(options: dict[str, Any], tensors: dict[str, Any], name: str, path: str, up_parts: int = 1) -> None:
    """The size metadata agrees with the tensor table (checked before a model of that size is built;
    ``up_parts``: 2 where ffn_up holds gate and up)."""
    for key, what in (("hidden_size", "embedding_length"), ("intermediate_size", "feed_forward_length"),
                      ("num_hidden_layers", "block_count"), ("max_position_embeddings", "context_length"),
                      ("head_dim", "attention.key_length")):
        value = options[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelLoadError(f"GGUF file {path!r}: {name}.{what} must be a positive integer, got {value!r}")
    blocks = {int(m[1]) for m in map(_BLOCK_TENSOR.match, tensors) if m is not None}
    count = options["num_hidden_layers"]
    if len(blocks) != count or (blocks and (min(blocks) != 0 or max(blocks) != count - 1)):   # 0..count-1, no range
        raise ModelLoadError(f"GGUF file {path!r}: {name}.block_count is {options['num_hidden_layers']}, but the "
                             f"file has tensors of {len(blocks)} blocks (blk.0 to blk.{max(blocks, default=-1)})")
    up = tensors.get("blk.0.ffn_up.weight")
    if up is not None and up.shape[0] != up_parts * options["intermediate_size"]:
        raise ModelLoadError(f"GGUF file {path!r}: blk.0.ffn_up.weight has {up.shape[0]} rows, but "
                             f"{name}.feed_forward_length is {options['intermediate_size']}")


def _llama3_freq_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama3 rope scaling applies (what llama.cpp stores as rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim // 2]
    wavelen = 2 * math.pi / inv_freq
    old_len = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = np.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _longrope(reader: GGUFFile, name: str, rotary_dim: int, path: str) -> dict[str, Any]:
    """Phi-3's longrope from llama.cpp's ``rope_factors_long``/``_short`` tensors and its metadata."""
    factors = {}
    for key, tensor_name in zip(("long_factor", "short_factor"), _ROPE_FACTORS, strict=True):
        tensor = next((t for t in reader.tensors if t.name == tensor_name), None)
        if tensor is None:
            raise ModelLoadError(f"GGUF file {path!r} has {_ROPE_FACTORS[0]} or {_ROPE_FACTORS[1]}, not both")
        values = np.asarray(reader.tensor_data(tensor), dtype=np.float64).reshape(-1)
        if values.shape != (rotary_dim // 2,):
            raise ModelLoadError(f"GGUF file {path!r}: {tensor_name} has {values.size} factors for "
                                 f"{rotary_dim // 2} rotary frequencies")
        factors[key] = [_float32_value(v) for v in values]
    original = reader.get(f"{name}.rope.scaling.original_context_length")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise ModelLoadError(f"GGUF file {path!r}: longrope factors need {name}.rope.scaling.original_context_length")
    out = {"rope_type": "longrope", **factors, "original_max_position_embeddings": original}
    attn_factor = reader.get(f"{name}.rope.scaling.attn_factor")
    if attn_factor is not None:
        out["attention_factor"] = _float32_value(attn_factor)
    return out


def _rope_scaling(
    reader: GGUFFile, name: str, theta: float, head_dim: int, path: str
) -> dict[str, Any] | None:
    if any(t.name in _ROPE_FACTORS for t in reader.tensors):
        return _longrope(reader, name, head_dim, path)
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        # llama.cpp writes Llama 3's scaling as divisors only; recover the parameters and check they
        # reproduce every divisor (Llama 3.1/3.2/3.3 all use low 1, high 4, original length 8192).
        factors = np.asarray(reader.tensor_data(freqs), dtype=np.float64).reshape(-1)  # [head_dim // 2]
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
    kind = reader.get(f"{name}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = reader.get(f"{name}.rope.scaling.factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or (
            factor != 0 and factor < 1):
        raise ModelLoadError(f"GGUF file {path!r}: {name}.rope.scaling.factor must be a number of at least 1 "
                             f"(0: no scaling, as llama.cpp reads it), got {factor!r}")
    if factor == 0:
        return None
    factor = _float32_value(factor)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    original = reader.get(f"{name}.rope.scaling.original_context_length")
    if kind == "yarn" and original is not None:
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ModelLoadError(f"GGUF file {path!r}: {name}.rope.scaling.original_context_length must be a "
                                 f"positive integer, got {original!r}")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise UnsupportedModelError(
        f"GGUF file {path!r} uses rope scaling {kind!r}; supported: linear, yarn (with original_context_length)"
    )


def _end_token_ids(reader: GGUFFile, vocab_size: int) -> int | list[int] | None:
    """The tokens that end a reply: the EOS and, where the converter wrote them, the end-of-turn and end-of-message
    tokens (llama.cpp stops on each; CodeLlama, Gemma and Llama 3 files carry them). One id stays an int."""
    eos = reader.get("tokenizer.ggml.eos_token_id")
    ids = [eos] if eos is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = reader.get(key)
        if isinstance(extra, int) and not isinstance(extra, bool) and 0 <= extra < vocab_size and extra not in ids:
            ids.append(extra)
    return ids[0] if len(ids) == 1 else (ids or None)


def read_gguf_config(path: str, plain: bool = False) -> tuple[transformers.PretrainedConfig, str]:
    """The Hugging Face config of a GGUF file and the registry's architecture name for it.

    Args:
        path: a ``.gguf`` file.
        plain: return a generic ``PretrainedConfig`` holding the same fields (``model_type`` set,
            RoPE already in ``rope_parameters``) instead of the architecture's own class. Importing a
            model's config class pulls in much of transformers and ``torch.distributed`` (about 1 s),
            which plinth's own models do not need; :func:`transformers_config` turns a plain config
            into the class when transformers' modelling code needs one.

    Returns:
        ``(config, architecture)``: e.g. a ``LlamaConfig`` (with ``architectures`` set) and
        ``"LlamaForCausalLM"``.

    Raises:
        ModelLoadError: the file is missing, not a GGUF file, truncated, or lacks required metadata.
        UnsupportedModelError: its architecture (or rope scaling) has no implementation.
    """
    reader = open_gguf(path)
    name, arch = _architecture(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {path!r} has no token_embd.weight tensor")

    def required(key: str) -> Any:
        value = reader.get(f"{name}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF file {path!r} lacks the metadata key {name}.{key}")
        return value

    hidden_size = required("embedding_length")
    embd = tensors["token_embd.weight"].shape
    if len(embd) != 2 or embd[1] != hidden_size or isinstance(hidden_size, bool):
        raise ModelLoadError(f"GGUF file {path!r}: token_embd.weight has shape {list(embd)}, but "
                             f"{name}.embedding_length is {hidden_size!r}")
    n_heads, n_kv_heads = _head_counts(reader, name, path)
    head_dim = reader.get(f"{name}.attention.key_length", hidden_size // n_heads)
    rotary_dim = reader.get(f"{name}.rope.dimension_count", head_dim)
    if arch.model_type in _DEEPSEEK_TYPES:   # the config's head_dim is the rotary part (key_length: the latent's)
        head_dim = rotary_dim
    if rotary_dim != head_dim and not (arch.partial_rotary and isinstance(rotary_dim, int)
                                       and 0 < rotary_dim < head_dim and rotary_dim % 2 == 0):
        raise UnsupportedModelError(
            f"GGUF file {path!r} rotates {rotary_dim} of {head_dim} head dimensions; only full rotary is supported"
        )
    rope_theta = _float32_value(reader.get(f"{name}.rope.freq_base", 10000.0), f"{name}.rope.freq_base")
    options: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden_size,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": required("context_length"),
        **({"layer_norm_eps": _float32_value(required("attention.layer_norm_epsilon"),
                                             f"{name}.attention.layer_norm_epsilon")} if arch.layer_norm else
           {"rms_norm_eps": _float32_value(required("attention.layer_norm_rms_epsilon"),
                                           f"{name}.attention.layer_norm_rms_epsilon")}),
        "rope_theta": rope_theta,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": reader.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _end_token_ids(reader, tensors["token_embd.weight"].shape[0]),
        "pad_token_id": reader.get("tokenizer.ggml.padding_token_id"),
    }
    if arch.model_type in ("cohere", "cohere2"):
        scale = reader.get(f"{name}.logit_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            raise ModelLoadError(f"GGUF file {path!r}: {name}.logit_scale must be a positive number, got {scale!r}")
        options.update(logit_scale=_float32_value(scale), attention_bias="blk.0.attn_q.bias" in tensors)
        if arch.model_type == "cohere":
            options["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    if arch.model_type == "stablelm":
        parallel = reader.get(f"{name}.use_parallel_residual", "blk.0.ffn_norm.weight" not in tensors)
        options.update(use_qkv_bias="blk.0.attn_q.bias" in tensors, use_parallel_residual=bool(parallel),
                       qk_layernorm="blk.0.attn_q_norm.weight" in tensors)
    if arch.model_type == "phi" and "blk.0.ffn_up.weight" in tensors:   # the converter writes 4 x hidden
        options["intermediate_size"] = int(tensors["blk.0.ffn_up.weight"].shape[0])
    _check_sizes(options, tensors, name, path, 2 if dict(arch.block_names).get("ffn_up") == "mlp.gate_up_proj" else 1)
    if arch.model_type == "cohere2":
        options.update(_cohere2_options(reader, name, tensors, options, path))
    if arch.model_type in ("llama", "qwen3", "gemma2", "gemma3_text", *_GRANITE_TYPES, "smollm3", "olmo2"):
        options["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch.model_type in ("llama", "granite", "smollm3"):
        options["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if arch.model_type in _GRANITE_TYPES:
        for key, field in _GRANITE_SCALES.items():
            value = reader.get(f"{name}.{key}", head_dim ** -0.5 if key == "attention.scale" else 1.0)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ModelLoadError(f"GGUF file {path!r}: {name}.{key} must be a number, got {value!r}")
            options[field] = _float32_value(value)
    if arch.model_type == "olmo2" and reader.get(f"{name}.attention.sliding_window"):
        raise UnsupportedModelError(f"GGUF file {path!r} is an OLMo 3 file (olmo2 with sliding-window layers); "
                                    "plinth reads OLMo 3 from its safetensors checkpoint only")
    if arch.model_type in _MOE_TYPES:
        options.update(_moe_options(reader, name, arch, tensors, options, path))
    if arch.model_type in _DEEPSEEK_TYPES:
        options.update(_deepseek_options(reader, name, arch, tensors, options, path))
    if arch.model_type == "smollm3":
        options["no_rope_layers"] = [int((i + 1) % _SMOLLM3_NO_ROPE_STEP != 0)
                                     for i in range(options["num_hidden_layers"])]
    scaling = _rope_scaling(reader, name, rope_theta, rotary_dim, path)
    if scaling is not None and arch.model_type in _DEEPSEEK_TYPES:
        scaling.update(_deepseek_yarn(reader, name, scaling, path))
    rope = {**(scaling or {"rope_type": "default"}), "rope_theta": rope_theta}
    if rotary_dim != head_dim:
        rope["partial_rotary_factor"] = rotary_dim / head_dim
    if arch.model_type == "phi3":
        options["sliding_window"] = reader.get(f"{name}.attention.sliding_window")
    if arch.model_type in _GEMMA_LAYOUTS:
        options.update(_gemma_options(reader, name, options, path, _GEMMA_LAYOUTS[arch.model_type]))
    if arch.model_type == "gemma3_text":
        rope = {"full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE}}
    options.pop("rope_theta")
    if plain:
        from transformers import PretrainedConfig

        options["rope_parameters"] = rope
        config = PretrainedConfig(**options)
        config.model_type = arch.model_type
        return config, arch.hf_architecture
    from transformers import AutoConfig

    if arch.model_type == "gemma3_text":
        options["rope_parameters"] = rope
    else:
        options["rope_theta"] = rope_theta
        if scaling is not None:
            options["rope_scaling"] = scaling
    return AutoConfig.for_model(arch.model_type, **_rope_fields(arch.model_type, options, rope)), \
        arch.hf_architecture


def _rope_fields(model_type: str, options: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the RoPE values that config classes keep as fields of their own, which replace the RoPE
    parameters' (with their defaults where not given): ``partial_rotary_factor``, and Phi-3's
    ``original_max_position_embeddings`` (``Phi3Config``'s default 4096)."""
    out = dict(options)
    if model_type != "gemma3_text" and "partial_rotary_factor" in rope:
        out.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
    if model_type == "phi3" and "original_max_position_embeddings" in rope:
        out.setdefault("original_max_position_embeddings", rope["original_max_position_embeddings"])
    return out


def _moe_options(reader: GGUFFile, name: str, arch: _GGUFArchitecture, tensors: dict[str, Any],
                 options: dict[str, Any], path: str) -> dict[str, Any]:
    """The config fields of a mixture of experts: counts from the metadata, sizes from the stacked tensors."""
    count, used = reader.get(f"{name}.expert_count"), reader.get(f"{name}.expert_used_count")
    sparse = [i for i in range(options["num_hidden_layers"]) if f"blk.{i}.ffn_gate_exps.weight" in tensors]
    gate = tensors.get(f"blk.{sparse[0]}.ffn_gate_exps.weight") if sparse else None
    if gate is None or len(gate.shape) != 3:
        raise ModelLoadError(f"GGUF file {path!r}: a mixture of experts needs stacked expert tensors "
                             f"(blk.N.ffn_gate_exps.weight [experts, rows, hidden]); per-expert tensors (older "
                             f"llama.cpp files) are not read")
    if (not isinstance(count, int) or not isinstance(used, int) or isinstance(used, bool)
            or not 0 < used <= count or gate.shape[0] != count):
        raise ModelLoadError(f"GGUF file {path!r}: {name}.expert_count {count!r} and expert_used_count {used!r} "
                             f"must be positive integers, the second at most the first, and the experts' "
                             f"tensors have {gate.shape[0]}")
    size = int(gate.shape[1])
    renormalize = reader.get(f"{name}.expert_weights_norm", _MOE_RENORMALIZE[arch.model_type])
    dense = [i for i in range(options["num_hidden_layers"]) if i not in sparse]
    if dense:   # llama.cpp's mixtures of experts have experts on every block
        raise ModelLoadError(f"GGUF file {path!r}: blocks {dense} have no experts (ffn_gate_exps); a {name!r} "
                             f"file has them on every block")
    if arch.model_type == "mixtral":
        return {"num_local_experts": count, "num_experts_per_tok": used, "intermediate_size": size}
    if arch.model_type in _GRANITE_TYPES:   # (the model renormalises its top-k weights, as llama.cpp does)
        if not renormalize:
            raise UnsupportedModelError(f"GGUF file {path!r}: {name}.expert_weights_norm is false; Granite's "
                                        f"mixtures of experts renormalise their top-k weights")
        out = {"num_local_experts": count, "num_experts_per_tok": used, "intermediate_size": size}
        if arch.model_type == "granitemoeshared":   # one shared MLP (gate/up/down) every token runs
            shared = tensors.get(f"blk.{sparse[0]}.ffn_gate_shexp.weight")
            rows = int(shared.shape[0]) if shared is not None and len(shared.shape) == 2 else None
            length = reader.get(f"{name}.expert_shared_feed_forward_length", rows)
            if rows is None or length != rows:
                raise ModelLoadError(f"GGUF file {path!r}: {name}.expert_shared_feed_forward_length is {length!r}, "
                                     f"but blk.{sparse[0]}.ffn_gate_shexp.weight has {rows} rows")
            out["shared_intermediate_size"] = rows
        return out
    if arch.model_type == "olmoe":
        clamp = reader.get(f"{name}.attention.clamp_kqv")
        if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, int | float) or clamp <= 0):
            raise ModelLoadError(f"GGUF file {path!r}: {name}.attention.clamp_kqv must be a positive number, "
                                 f"got {clamp!r}")
        return {"num_experts": count, "num_experts_per_tok": used, "intermediate_size": size,
                "norm_topk_prob": bool(renormalize), "clip_qkv": _float32_value(clamp) if clamp else None,
                "attention_bias": "blk.0.attn_q.bias" in tensors}
    out: dict[str, Any] = {"num_experts": count, "num_experts_per_tok": used, "moe_intermediate_size": size,
                           "norm_topk_prob": bool(renormalize), "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch.model_type == "qwen2_moe":
        shared = tensors.get(f"blk.{sparse[0]}.ffn_gate_shexp.weight")
        if shared is None:
            raise ModelLoadError(f"GGUF file {path!r}: a qwen2moe file needs the shared expert "
                                 f"(blk.N.ffn_gate_shexp.weight)")
        out["shared_expert_intermediate_size"] = int(shared.shape[0])
        out["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    return out


def _cohere2_options(reader: GGUFFile, name: str, tensors: dict[str, Any], options: dict[str, Any],
                     path: str) -> dict[str, Any]:
    """Command-R7B's sliding window and which layers use it: ``attention.sliding_window`` (required, as in
    llama.cpp) and ``attention.sliding_window_pattern``, either a period n (each run of n layers: n - 1 sliding, then
    one full) or one flag per layer (true: sliding); llama.cpp's period 4 when absent. RoPE only on the sliding
    layers is the model's own (``Cohere2ForCausalLM``)."""
    if "blk.0.attn_q_norm.weight" in tensors or "blk.0.attn_k_norm.weight" in tensors:
        raise UnsupportedModelError(f"GGUF file {path!r}: a cohere2 file with per-head q/k norms (attn_q_norm); "
                                    f"Command-R7B has none, and plinth reads them for command-r files only")
    window = _positive(reader, f"{name}.attention.sliding_window", path)
    if window is None:
        raise ModelLoadError(f"GGUF file {path!r} lacks the metadata key {name}.attention.sliding_window")
    layers = options["num_hidden_layers"]
    pattern = reader.get(f"{name}.attention.sliding_window_pattern", _COHERE2_SLIDING_PERIOD)
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        sliding = [i % pattern < pattern - 1 for i in range(layers)]
    elif isinstance(pattern, list | tuple) and len(pattern) == layers and all(isinstance(f, bool) for f in pattern):
        sliding = list(pattern)
    else:
        raise ModelLoadError(f"GGUF file {path!r}: {name}.attention.sliding_window_pattern must be a positive "
                             f"integer or one boolean per layer ({layers}), got {pattern!r}")
    return {"sliding_window": window,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


def _positive(reader: GGUFFile, key: str, path: str, default: Any = None) -> Any:
    """An integer metadata value that must be positive (``default`` when absent)."""
    value = reader.get(key, default)
    if value is not default and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ModelLoadError(f"GGUF file {path!r}: {key} must be a positive integer, got {value!r}")
    return value


def _deepseek_options(reader: GGUFFile, name: str, arch: _GGUFArchitecture, tensors: dict[str, Any],
                      options: dict[str, Any], path: str) -> dict[str, Any]:
    """DeepSeek-V2/V3's config fields as llama.cpp's converter writes them: the latent attention's ranks and head
    sizes (files from 2025 on give the per-head key/value sizes as ``key_length_mla``/``value_length_mla``, their
    ``key_length``/``value_length`` being the latent's; older files give them as ``key_length``/``value_length``),
    the leading dense blocks and the experts' routing."""
    rope = options["head_dim"]
    kv_lora = _positive(reader, f"{name}.attention.kv_lora_rank", path)
    if kv_lora is None:
        raise ModelLoadError(f"GGUF file {path!r} lacks the metadata key {name}.attention.kv_lora_rank")
    key = _positive(reader, f"{name}.attention.key_length_mla", path)
    value = _positive(reader, f"{name}.attention.value_length_mla", path)
    if key is None or value is None:
        key = _positive(reader, f"{name}.attention.key_length", path)
        value = _positive(reader, f"{name}.attention.value_length", path)
    if key is None or value is None or key <= rope:
        raise ModelLoadError(f"GGUF file {path!r}: {name}.attention.key_length(_mla) {key!r} and "
                             f"value_length(_mla) {value!r} must be positive, the key longer than its "
                             f"{rope} rotary features")
    out: dict[str, Any] = {
        "num_key_value_heads": options["num_attention_heads"], "kv_lora_rank": kv_lora,
        "q_lora_rank": _positive(reader, f"{name}.attention.q_lora_rank", path), "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key - rope, "v_head_dim": value,
        "attention_bias": "blk.0.attn_q.bias" in tensors or "blk.0.attn_q_a.bias" in tensors,
    }
    layers = options["num_hidden_layers"]
    count = reader.get(f"{name}.expert_count", 0)
    dense = reader.get(f"{name}.leading_dense_block_count", 0)
    if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense <= layers:
        raise ModelLoadError(f"GGUF file {path!r}: {name}.leading_dense_block_count must be an integer from 0 to "
                             f"{layers}, got {dense!r}")
    if not count or dense == layers:   # every block dense
        return {**out, "n_routed_experts": 0, "n_shared_experts": 0, "first_k_dense_replace": layers}
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in tensors]
    if sparse != list(range(dense, layers)):
        raise ModelLoadError(f"GGUF file {path!r}: {name}.leading_dense_block_count is {dense}, so blocks {dense} to "
                             f"{layers - 1} need stacked experts (blk.N.ffn_gate_exps.weight); the file has them on "
                             f"blocks {sparse}")
    gate = tensors[f"blk.{dense}.ffn_gate_exps.weight"]
    used = reader.get(f"{name}.expert_used_count")
    if (len(gate.shape) != 3 or not isinstance(count, int) or not isinstance(used, int) or isinstance(used, bool)
            or not 0 < used <= count or gate.shape[0] != count):
        raise ModelLoadError(f"GGUF file {path!r}: {name}.expert_count {count!r} and expert_used_count {used!r} "
                             f"must be positive integers, the second at most the first, and the experts' "
                             f"tensors [experts, rows, hidden] have shape {list(gate.shape)}")
    v3 = arch.model_type == "deepseek_v3"
    gating = reader.get(f"{name}.expert_gating_func", _GATING_SIGMOID if v3 else _GATING_SOFTMAX)
    if gating != (_GATING_SIGMOID if v3 else _GATING_SOFTMAX):
        raise UnsupportedModelError(
            f"GGUF file {path!r}: {name}.expert_gating_func is {gating!r}; plinth reads DeepSeek-V2 files (softmax "
            f"gating, {_GATING_SOFTMAX}) and DeepSeek-V3 files (sigmoid gating, {_GATING_SIGMOID}, with the router's "
            f"correction bias blk.N.exp_probs_b)")
    groups = _positive(reader, f"{name}.expert_group_count", path, 1)
    groups_used = _positive(reader, f"{name}.expert_group_used_count", path, groups)
    size = int(gate.shape[1])
    shexp = tensors.get(f"blk.{dense}.ffn_gate_shexp.weight")
    shared_rows = int(shexp.shape[0]) if shexp is not None else 0
    shared = reader.get(f"{name}.expert_shared_count")
    if shared is None and shared_rows % size == 0:   # the shared experts are one MLP of shared x the experts' width
        shared = shared_rows // size
    if isinstance(shared, bool) or not isinstance(shared, int) or shared * size != shared_rows:
        raise ModelLoadError(f"GGUF file {path!r}: {name}.expert_shared_count is {shared!r}, but "
                             f"blk.{dense}.ffn_gate_shexp.weight has {shared_rows} rows (the shared experts' "
                             f"count times the experts' {size})")
    scale = reader.get(f"{name}.expert_weights_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ModelLoadError(f"GGUF file {path!r}: {name}.expert_weights_scale must be a positive number, "
                             f"got {scale!r}")
    out.update({
        "n_routed_experts": count, "num_experts_per_tok": used, "moe_intermediate_size": size,
        "n_shared_experts": shared, "first_k_dense_replace": dense,
        "routed_scaling_factor": _float32_value(scale), "norm_topk_prob": bool(reader.get(
            f"{name}.expert_weights_norm", False)), "n_group": groups, "topk_group": groups_used})
    if not v3:
        out["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return out


def _deepseek_yarn(reader: GGUFFile, name: str, scaling: dict[str, Any], path: str) -> dict[str, Any]:
    """DeepSeek's YaRN fields: the converter writes ``yarn_log_multiplier`` = 0.1 x ``mscale_all_dim`` (the
    released configs have ``mscale`` equal to it, the only case the file can describe) and llama.cpp's betas."""
    if scaling.get("rope_type") != "yarn":
        return {}
    out: dict[str, Any] = {}
    log_mul = reader.get(f"{name}.rope.scaling.yarn_log_multiplier")
    if log_mul is not None:
        if isinstance(log_mul, bool) or not isinstance(log_mul, int | float) or log_mul < 0:
            raise ModelLoadError(f"GGUF file {path!r}: {name}.rope.scaling.yarn_log_multiplier must be a "
                                 f"non-negative number, got {log_mul!r}")
        out["mscale"] = out["mscale_all_dim"] = _float32_value(log_mul) * 10
    for key in ("beta_fast", "beta_slow"):
        beta = reader.get(f"{name}.rope.scaling.yarn_{key}")
        if beta is not None:
            out[key] = _float32_value(beta)
    return out


def _gemma_options(reader: GGUFFile, name: str, options: dict[str, Any], path: str,
                   layout: _GemmaLayout) -> dict[str, Any]:
    """Gemma 2's and 3's fields that their GGUF metadata leaves to llama.cpp's code (see ``_GEMMA_LAYOUTS``)."""
    from plinth.model_registry.layers.attention import MAX_SOFT_CAP, usable_soft_cap

    window = reader.get(f"{name}.attention.sliding_window")
    if window is None:
        window = layout.default_window
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"GGUF file {path!r}: {name}.attention.sliding_window must be a positive integer, "
                             f"got {window!r}")
    caps = []
    for key, default in zip(("attn_logit_softcapping", "final_logit_softcapping"), layout.default_caps, strict=True):
        cap = reader.get(f"{name}.{key}")
        cap = default if cap is None else cap
        if cap is not None:   # checked as float32 (a huge float64 would round to inf, a tiny one to 0)
            value = _float32_value(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) else cap
            if not usable_soft_cap(value):
                raise ModelLoadError(f"GGUF file {path!r}: {name}.{key} must be a positive number up to "
                                     f"{MAX_SOFT_CAP:g}, got {cap!r}")
            cap = value
        caps.append(cap)
    layers = options["num_hidden_layers"]
    scalar = (options["hidden_size"] // options["num_attention_heads"] if layers == layout.big_layers
              else options["head_dim"])
    return {
        "sliding_window": window,
        "layer_types": ["full_attention" if (i + 1) % layout.global_every == 0 else "sliding_attention"
                        for i in range(layers)],
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": caps[0],
        "final_logit_softcapping": caps[1],
    }


def transformers_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """``config`` as its model type's own transformers class (a plain one from
    ``read_gguf_config(..., plain=True)`` is rebuilt; any other is returned as it is)."""
    from transformers import AutoConfig, PretrainedConfig

    if type(config) is not PretrainedConfig or not getattr(config, "model_type", ""):
        return config
    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "transformers_version")}
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    return AutoConfig.for_model(config.model_type, **_rope_fields(config.model_type, fields, rope))


# ----------------------------------------------------------------------------------------------- weights


def _hf_name(gguf_name: str, arch: _GGUFArchitecture | None = None) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for an unknown name."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    top = {**_TOP_LEVEL_NAMES, **dict(arch.top_names)} if arch is not None else _TOP_LEVEL_NAMES
    if stem in top:
        return f"{top[stem]}.{kind}"
    match = _BLOCK_TENSOR.fullmatch(stem)
    names = {**_BLOCK_NAMES, **dict(arch.block_names)} if arch is not None and arch.block_names else _BLOCK_NAMES
    if match is None or match.group(2) not in names:
        return None
    target = names[match.group(2)]
    if target.endswith("_bias"):   # a bias that is a parameter of its own (DeepSeek-V3's router correction)
        return f"model.layers.{match.group(1)}.{target}" if kind == "bias" else None
    return f"model.layers.{match.group(1)}.{target}.{kind}"


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
    return _iter_raw(open_gguf(path), path)


def _iter_raw(
    reader: GGUFFile, path: str
) -> Iterator[tuple[str, np.ndarray, gguf.GGMLQuantizationType, tuple[int, ...]]]:
    name, arch = _architecture(reader, path)
    n_heads, n_kv_heads = _head_counts(reader, name, path)
    q_rows = kv_rows = 0
    if arch.fused:
        hidden = reader.get(f"{name}.embedding_length")
        head_dim = reader.get(f"{name}.attention.key_length", hidden // n_heads)
        q_rows, kv_rows = n_heads * head_dim, n_kv_heads * head_dim
    kv_b_parts: dict[str, dict[str, Any]] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS or tensor.name in _ROPE_FACTORS:
            continue
        part = _KV_B_PARTS.fullmatch(tensor.name) if arch.model_type in _DEEPSEEK_TYPES else None
        if part is not None:
            parts = kv_b_parts.setdefault(part.group(1), {})
            parts[part.group(2)] = tensor
            if len(parts) == 2:
                yield _joined_kv_b(reader, part.group(1), parts, path)
            continue
        expert = (_EXPERT_TENSOR.fullmatch(tensor.name) if arch.model_type in _MOE_TYPES + _DEEPSEEK_TYPES
                  else None)
        norm = _HEAD_NORMS.fullmatch(tensor.name) if arch.model_type == "stablelm" else None
        if norm is not None:   # [heads, head_dim]: one LayerNorm per head in the checkpoint
            data = reader.tensor_data(tensor)
            for h in range(data.shape[0]):
                yield (f"model.layers.{norm.group(1)}.self_attn.{norm.group(2)}_layernorm.norms.{h}.weight", data[h],
                       tensor.ggml_type, tuple(tensor.shape)[1:])
            continue
        if expert is not None:
            yield from _split_experts(expert, reader.tensor_data(tensor), tensor, arch, path)
            continue
        hf_name = _hf_name(tensor.name, arch)
        if hf_name is None:
            raise ModelLoadError(
                f"GGUF file {path!r}: tensor {tensor.name!r} has no counterpart in {arch.hf_architecture}"
            )
        data = reader.tensor_data(tensor)
        if arch.permuted_qk and (".self_attn.q_proj." in hf_name or ".self_attn.k_proj." in hf_name):
            heads = n_heads if ".q_proj." in hf_name else n_kv_heads
            if data.shape[0] % (2 * heads):
                raise ModelLoadError(
                    f"GGUF file {path!r}: tensor {tensor.name!r} has {data.shape[0]} rows, "
                    f"not a multiple of 2 x {heads} heads"
                )
            data = _unpermute_rows(data, heads)
        ggml_type = tensor.ggml_type
        if arch.norm_offset and hf_name.endswith("norm.weight"):
            data, ggml_type = _offset_norm(data, tensor, arch.norm_offset, path)
        if arch.fused and hf_name.rsplit(".", 2)[-2] in ("qkv_proj", "gate_up_proj"):
            yield from _split_fused(hf_name, data, tensor, q_rows, kv_rows, path)
            continue
        if hf_name.endswith(".shared_expert_gate.weight") and len(tensor.shape) == 1:   # llama.cpp keeps [hidden]
            yield hf_name, data.reshape(1, *data.shape), ggml_type, (1, *tuple(tensor.shape))
            continue
        yield hf_name, data, ggml_type, tensor.shape
    unpaired = sorted(f"blk.{layer}.attn_{next(iter(parts))}_b" for layer, parts in kv_b_parts.items()
                      if len(parts) < 2)
    if unpaired:
        raise ModelLoadError(f"GGUF file {path!r}: {', '.join(unpaired)} without its other half (attn_k_b and "
                             f"attn_v_b together hold kv_b_proj)")


def _offset_norm(data: np.ndarray, tensor: Any, offset: float, path: str) -> tuple[np.ndarray, Any]:
    """A norm weight llama.cpp stored as ``w + offset`` (Gemma's ``1 + w``), back to the checkpoint's ``w``: float32
    values, whatever float or block type the file used, so they are F32 from here on."""
    import gguf
    import torch

    from plinth.model_registry.gguf_dequant import dequantize_tensor

    try:
        values = dequantize_tensor(data, tensor.ggml_type, tuple(tensor.shape), torch.float32).numpy()
    except NotImplementedError:
        raise ModelLoadError(f"GGUF file {path!r}: norm tensor {tensor.name!r} is stored as "
                             f"{tensor.ggml_type.name}, which cannot be dequantized") from None
    return values - np.float32(offset), gguf.GGMLQuantizationType.F32


def _joined_kv_b(reader: GGUFFile, layer: str, parts: dict[str, Any],
                 path: str) -> tuple[str, np.ndarray, Any, tuple[int, ...]]:
    """``kv_b_proj`` ``[heads x (qk_nope + v), kv_lora_rank]`` from llama.cpp's split of it: ``attn_k_b``
    ``[heads, kv_lora_rank, qk_nope]`` (each head's key rows transposed) and ``attn_v_b`` ``[heads, v, kv_lora_rank]``;
    dequantized to float32 (the transposed half has no blocks along the checkpoint's rows)."""
    import gguf

    from plinth.model_registry.gguf_dequant import dequantize_tensor

    k_t, v_t = parts["k"], parts["v"]
    k_shape, v_shape = tuple(k_t.shape), tuple(v_t.shape)
    if (len(k_shape) != 3 or len(v_shape) != 3 or k_shape[0] != v_shape[0] or k_shape[1] != v_shape[2]):
        raise ModelLoadError(f"GGUF file {path!r}: blk.{layer}.attn_k_b {list(k_shape)} and attn_v_b "
                             f"{list(v_shape)} are not [heads, kv_lora_rank, qk_nope] and [heads, v, kv_lora_rank]")
    import torch

    k = dequantize_tensor(reader.tensor_data(k_t), k_t.ggml_type, k_shape, torch.float32)
    v = dequantize_tensor(reader.tensor_data(v_t), v_t.ggml_type, v_shape, torch.float32)
    joined = torch.cat([k.transpose(1, 2), v], dim=1).reshape(-1, k_shape[1])
    return (f"model.layers.{layer}.self_attn.kv_b_proj.weight", joined.numpy(), gguf.GGMLQuantizationType.F32,
            tuple(joined.shape))


def _split_experts(match: re.Match, data: np.ndarray, tensor: Any, arch: _GGUFArchitecture,
                   path: str) -> Iterator[tuple[str, np.ndarray, Any, tuple[int, ...]]]:
    """A stacked ``[experts, rows, cols]`` expert tensor as one tensor per expert (float rows or their quantized
    blocks), named as the architecture's checkpoints name them."""
    shape = tuple(tensor.shape)
    if len(shape) != 3 or data.shape[0] != shape[0]:
        raise ModelLoadError(f"GGUF file {path!r}: tensor {tensor.name!r} has shape {list(shape)}, not "
                             f"[experts, rows, cols]")
    layer, role = match.group(1), match.group(2)
    proj = _EXPERT_PROJ_NAMES.get(arch.model_type, _DEFAULT_PROJ_NAMES)[role]
    for e in range(shape[0]):
        yield f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", data[e], tensor.ggml_type, shape[1:]


def _split_fused(hf_name: str, data: np.ndarray, tensor: Any, q_rows: int, kv_rows: int,
                 path: str) -> Iterator[tuple[str, np.ndarray, Any, tuple[int, ...]]]:
    """A fused ``qkv_proj`` / ``gate_up_proj`` tensor as its projections (row slices: float rows or the rows'
    quantized blocks), so that every consumer sees Llama's tensors."""
    rows = data.shape[0]
    if ".qkv_proj." in hf_name:
        parts = (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows))
        fused = "qkv_proj"
    else:
        parts = (("gate_proj", rows // 2), ("up_proj", rows // 2))
        fused = "gate_up_proj"
    if sum(n for _, n in parts) != rows:
        raise ModelLoadError(f"GGUF file {path!r}: tensor {tensor.name!r} has {rows} rows, not "
                             f"{' + '.join(str(n) for _, n in parts)}")
    start = 0
    for part, n in parts:
        yield (hf_name.replace(fused, part), data[start:start + n], tensor.ggml_type,
               (n, *tuple(tensor.shape)[1:]))
        start += n


def iter_gguf_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of a GGUF file, dequantized to ``dtype``, as a Hugging Face checkpoint has it.

    Tensors come one at a time from the memory-mapped file, named (``model.layers.0.mlp.up_proj.weight``)
    and shaped as in transformers; ``lm_head.weight`` only when the file has its own ``output.weight``.

    Raises:
        ModelLoadError: an unreadable file, or a tensor of a type that cannot be dequantized (checked
            before the first tensor is yielded).
        UnsupportedModelError: an architecture without an implementation.
    """
    from plinth.model_registry.gguf_dequant import Scratch, can_dequantize, dequantize_group, native_expansion

    reader = open_gguf(path)
    for ggml_type in sorted({t.ggml_type for t in reader.tensors}):
        if not can_dequantize(ggml_type):
            tensor = next(t.name for t in reader.tensors if t.ggml_type == ggml_type)
            raise ModelLoadError(
                f"GGUF file {path!r}: tensor {tensor!r} has type {ggml_type.name}, which cannot be dequantized"
            )
    group: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType, tuple[int, ...]]] = []
    size = 0
    group_elements = _NATIVE_GROUP_ELEMENTS if native_expansion() else _GROUP_ELEMENTS
    scratch = Scratch()
    expand = functools.partial(dequantize_group, scratch=scratch)
    for item in _iter_raw(reader, path):
        group.append(item)
        size += math.prod(item[3])
        if size >= group_elements:
            yield from _dequantized(group, dtype, expand)
            group, size = [], 0
    yield from _dequantized(group, dtype, expand)


# Tensors are dequantized in groups of about this many elements (128 MB of float32 temporaries): few large torch
# ops. The native kernel's cost does not grow with the number of calls, so it takes smaller groups, whose scratch
# buffers (two, reused) fault in fewer pages: the default model's weights 230 -> 125 ms (2-core AMD EPYC, AVX2).
_GROUP_ELEMENTS = 1 << 25
_NATIVE_GROUP_ELEMENTS = 1 << 22


def _dequantized(group: list, dtype: torch.dtype, dequantize_group: Any) -> Iterator[tuple[str, torch.Tensor]]:
    values = dequantize_group([(data, ggml_type, shape) for _, data, ggml_type, shape in group], dtype)
    for (hf_name, *_), tensor in zip(group, values, strict=True):
        yield hf_name, tensor


# --------------------------------------------------------------------------------------------- tokenizer


def load_gguf_tokenizer(path: str, use_cache: bool = True) -> Any:
    """A transformers tokenizer built from a GGUF file's metadata, offline; see
    :func:`plinth.model_registry.gguf_tokenizer.load_gguf_tokenizer` (cached on disk)."""
    from plinth.model_registry.gguf_tokenizer import load_gguf_tokenizer as load

    return load(path, use_cache=use_cache)
