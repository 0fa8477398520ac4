"""LoRA adapters in PEFT's format, read and checked on the host.

An adapter folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``,
``alpha_pattern``, ...) and ``adapter_model.safetensors`` (or ``adapter_model.bin``, read with
``torch.load(weights_only=True)``), whose tensors are named
``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight`` (``[out, r]``) for each adapted
linear module of the base model. A layer's output becomes ``x W^T + scale * (x A^T) B^T`` with
``scale = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``).

Everything that could make an adapter unusable is found here, when a request first names it (or when the server
starts), so that the workers that later copy it into a slot never fail: the format and its options, each tensor's
module (the attention and dense-MLP projections of plinth's decoder models), its shapes against the model's and its
rank against the engine's ``max_lora_rank``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import numpy as np
import torch

from plinth.errors import LoRAAdapterError

#: the checkpoint modules adapters name for each of plinth's adaptable layers (a model's ``lora_modules``):
#: projection -> (block, kind of its input features, kind of its output features)
LAYER_TARGETS: dict[str, dict[str, tuple[str, str, str]]] = {
    "qkv_proj": {"q_proj": ("self_attn", "hidden", "q"), "k_proj": ("self_attn", "hidden", "kv"),
                 "v_proj": ("self_attn", "hidden", "kv"),
                 # checkpoints whose projections are fused (Phi-3): split into the parts below as they are read
                 "qkv_proj": ("self_attn", "hidden", "qkv")},
    "o_proj": {"o_proj": ("self_attn", "q", "hidden")},
    "gate_up_proj": {"gate_proj": ("mlp", "hidden", "intermediate"), "up_proj": ("mlp", "hidden", "intermediate"),
                     "gate_up_proj": ("mlp", "hidden", "gate_up")},
    "down_proj": {"down_proj": ("mlp", "intermediate", "hidden")},
}
#: what Llama-style decoders adapt (the attention and the dense MLP)
TARGETS = {proj: kinds for layer in LAYER_TARGETS.values() for proj, kinds in layer.items()}
#: a fused module's parts: (projection, kind of its output rows), in the order of its rows
FUSED = {"qkv_proj": (("q_proj", "q"), ("k_proj", "kv"), ("v_proj", "kv")),
         "gate_up_proj": (("gate_proj", "intermediate"), ("up_proj", "intermediate"))}
# (an image-and-text model's language model under either prefix transformers writes: its decoder layers)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<name>(?:model\.language_model\.|language_model\.model\.|model\.)"
                  r"(?P<rest>layers\.(?P<layer>\d+)\.(?P<block>[A-Za-z_]+)\.(?P<proj>[A-Za-z_0-9]+)))"
                  r"\.lora_(?P<ab>[AB])\.weight$")
#: ``adapter_config.json`` keys that do not change what a plain LoRA adapter computes at inference (training and
#: initialisation settings, bookkeeping, which modules and layers carry weights: read from the tensors' names)
HARMLESS_CONFIG_KEYS = frozenset({
    "peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "bias",
    "use_rslora", "rank_pattern", "alpha_pattern", "base_model_name_or_path", "revision", "inference_mode",
    "init_lora_weights", "layers_to_transform", "layers_pattern", "fan_in_fan_out", "modules_to_save", "use_dora",
    "lora_bias", "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config", "runtime_config",
    "auto_mapping", "peft_version", "ensure_weight_tying", "qalora_group_size",
})
#: ``init_lora_weights`` methods that also change the base model's weights (PEFT subtracts the initial adapter from
#: them, and does so again whenever it loads such an adapter): the adapter alone does not hold what it computes
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"


@dataclasses.dataclass(eq=False)
class LoRAAdapter:
    """An adapter read into host memory.

    Attributes:
        name, lora_id, path: from its :class:`~plinth.lora.request.LoRARequest`.
        rank: the largest rank among its modules.
        modules: the base model's module name (``model.layers.3.self_attn.q_proj``) -> ``(A, B)``: float32
            arrays ``[r, in]`` and ``[out, r]``, the scale folded into ``B``.
    """

    name: str
    lora_id: int
    path: str
    rank: int
    modules: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def model_sizes(hf_config: Any) -> dict[str, int]:
    """The features of each kind of projection input/output (whole model, before tensor parallelism)."""
    from plinth.model_registry.models.decoder import head_dim_of

    heads = hf_config.num_attention_heads
    head_dim = head_dim_of(hf_config)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate = getattr(hf_config, "intermediate_size", 0) or 0
    return {"hidden": hf_config.hidden_size, "q": heads * head_dim, "kv": kv_heads * head_dim,
            "intermediate": intermediate, "qkv": (heads + 2 * kv_heads) * head_dim, "gate_up": 2 * intermediate}


def adapter_targets(model_class: type) -> dict[str, tuple[str, str, str]]:
    """The checkpoint modules an adapter may adapt on ``model_class``: its ``lora_adapter_targets`` where it names
    them itself (Phi's ``dense``, ``fc1``, ``fc2``), else those of its ``lora_modules`` (:data:`LAYER_TARGETS`)."""
    own = getattr(model_class, "lora_adapter_targets", None)
    if own is not None:
        return dict(own)
    return {proj: kinds for layer in getattr(model_class, "lora_modules", ()) for proj, kinds in
            LAYER_TARGETS.get(layer, {}).items()}


def is_moe(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "num_local_experts", 0) or getattr(hf_config, "num_experts", 0))


def _fail(path: str, message: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {path}: {message}")


def read_adapter_config(path: str) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, checked for options plinth does not apply."""
    if not os.path.isdir(path):
        raise _fail(path, "no such folder")
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise _fail(path, f"{CONFIG_FILE} is missing (a PEFT LoRA adapter folder has it)") from None
    except (OSError, ValueError) as exc:
        raise _fail(path, f"{CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise _fail(path, f"{CONFIG_FILE} must hold a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(path, f"peft_type is {peft_type!r}; only LORA adapters are supported")
    for key, unsupported in (("use_dora", "DoRA adapters"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights"),
                             ("lora_bias", "LoRA biases")):
        if cfg.get(key):
            raise _fail(path, f"{unsupported} are not supported ({key} is set)")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise _fail(path, f"init_lora_weights={init!r} changes the base model's weights as well as the adapter's; "
                          "plinth runs the base model as its checkpoint holds it: serve the adapter converted into a "
                          "plain LoRA adapter (PEFT's save_pretrained(..., path_initial_model_for_weight_conversion="
                          "...)), or the changed base model itself")
    if cfg.get("bias", "none") not in (None, "none"):
        raise _fail(path, f"bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise _fail(path, f"modules_to_save {cfg['modules_to_save']!r} is not supported (fully trained copies of "
                          "base modules)")
    # any other option that is set may change the forward pass (a LoRA variant: aLoRA, QALoRA, ...): refused
    # unless it is one of those known to only describe training or which modules the weights belong to
    changes = sorted(k for k, v in cfg.items() if k not in HARMLESS_CONFIG_KEYS and v not in (None, False, "", [], {}))
    if changes:
        raise _fail(path, f"{', '.join(changes)} {'is' if len(changes) == 1 else 'are'} set: plinth applies plain "
                          "LoRA (x A^T B^T scaled) only, and these options change what an adapter computes")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise _fail(path, f"{key} must be a positive number, got {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = cfg.get(key) or {}
        if not isinstance(patterns, dict):
            raise _fail(path, f"{key} must be an object")
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise _fail(path, f"{key} key {pattern!r} is not a regular expression: {exc}") from None
            if key == "rank_pattern":
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            else:
                ok = (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                      and value > 0)
            if not ok:
                raise _fail(path, f"{key}[{pattern!r}] must be a positive {'integer' if key == 'rank_pattern' else 'number'}"
                                  f", got {value!r}")
    return cfg


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: the first pattern that matches the module name's end."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, SAFETENSORS_FILE)
    if os.path.isfile(st):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(st)
        except (SafetensorError, OSError, ValueError) as exc:
            raise _fail(path, f"{SAFETENSORS_FILE} is not a readable safetensors file: {exc}") from None
    binary = os.path.join(path, BIN_FILE)
    if os.path.isfile(binary):
        try:
            loaded = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
            raise _fail(path, f"{BIN_FILE} cannot be read as plain tensors: {exc}") from None
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise _fail(path, f"{BIN_FILE} must hold a dictionary of tensors")
        return loaded
    raise _fail(path, f"no {SAFETENSORS_FILE} (or {BIN_FILE}) in the folder")


def load_adapter(name: str, lora_id: int, path: str, hf_config: Any, max_rank: int,
                 targets: dict[str, tuple[str, str, str]] | None = None) -> LoRAAdapter:
    """Read and check an adapter against the model ``hf_config`` describes, whose adaptable modules are ``targets``
    (:func:`adapter_targets` of its class; default: a Llama-style decoder's, :data:`TARGETS`).

    Raises:
        LoRAAdapterError: the folder, its config or its tensors cannot be served (the message says why).
    """
    cfg = read_adapter_config(path)
    tensors = _read_tensors(path)
    targets = TARGETS if targets is None else targets
    sizes = model_sizes(hf_config)
    num_layers = hf_config.num_hidden_layers
    moe = is_moe(hf_config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    names: dict[str, str] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _fail(path, f"tensor {key!r} is not a LoRA A/B weight of a decoder layer's projection (plinth "
                              f"applies adapters to {', '.join(TARGETS)}; embeddings and the LM head are not supported)")
        proj, block = m["proj"], m["block"]
        if moe and block == "mlp" and TARGETS.get(proj, ("",))[0] == "mlp":
            raise _fail(path, f"tensor {key!r} adapts the MLP of a mixture-of-experts model; only the attention "
                              "projections of such models take adapters")
        if proj not in targets or targets[proj][0] != block:
            raise _fail(path, f"tensor {key!r} adapts {block}.{proj}; this model applies adapters to "
                              f"{', '.join(f'{b}.{t}' for t, (b, _, _) in targets.items())}")
        if int(m["layer"]) >= num_layers:
            raise _fail(path, f"tensor {key!r} names layer {m['layer']}, but the model has {num_layers} layers")
        if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise _fail(path, f"tensor {key!r} is {tensor.dtype}; LoRA weights are float32, float16 or bfloat16")
        module = "model." + m["rest"]
        names[module] = m["name"]   # (PEFT's rank and alpha patterns match the name in the adapter)
        if m["ab"] in pairs.get(module, {}):
            raise _fail(path, f"tensor {key!r}: module {module} has a second lora_{m['ab']} weight")
        pairs.setdefault(module, {})[m["ab"]] = tensor
    if not pairs:
        raise _fail(path, "the adapter has no LoRA weights")
    alpha_default, rank_default = cfg["lora_alpha"], cfg["r"]
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    top = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise _fail(path, f"module {module} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        proj = module.rsplit(".", 1)[1]
        _, in_kind, out_kind = targets[proj]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _fail(path, f"module {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                              "[r, in] and [out, r]")
        r = int(a.shape[0])
        if (a.shape[1], b.shape[0]) != (sizes[in_kind], sizes[out_kind]):
            raise _fail(path, f"module {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                              f"the model's {proj} ({sizes[in_kind]} inputs, {sizes[out_kind]} outputs): an adapter "
                              "for another base model?")
        if r > max_rank:
            raise _fail(path, f"module {module} has rank {r}, more than the engine's max_lora_rank {max_rank} "
                              "(--max-lora-rank)")
        expected_rank = _pattern_value(rank_pattern, names[module], rank_default)
        if r != expected_rank:
            raise _fail(path, f"module {module} has rank {r}, but the config says {expected_rank}")
        alpha = float(_pattern_value(alpha_pattern, names[module], alpha_default))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _fail(path, f"module {module} has non-finite weights")
        a_np, b_np = a.float().numpy().copy(), (b.double() * scale).float().numpy()
        if not np.isfinite(b_np).all():
            raise _fail(path, f"module {module}: lora_B times its scale ({scale:g}) overflows float32")
        if proj in FUSED:   # one A for every part; B's rows split between them
            base, start = module.rsplit(".", 1)[0], 0
            for part, kind in FUSED[proj]:
                if f"{base}.{part}" in pairs:
                    raise _fail(path, f"module {base} is adapted both as {proj} and as {part}")
                modules[f"{base}.{part}"] = (a_np, b_np[start:start + sizes[kind]].copy())
                start += sizes[kind]
        else:
            modules[module] = (a_np, b_np)
        top = max(top, r)
    return LoRAAdapter(name=name, lora_id=lora_id, path=path, rank=top, modules=modules)
