"""Which quantization method a model runs with: ``--quantization``, the checkpoint's own, or none.

Rules (each refusal is a :class:`~plinth.config.ConfigError` or
:class:`~plinth.errors.ModelLoadError` whose message says what to do instead):

- a checkpoint whose ``config.json`` has ``quantization_config.quant_method = X`` runs with the
  method registered as ``X`` (or one that lists ``X`` in ``checkpoint_aliases``); no installed method
  for ``X`` is an error listing the installed ones;
- ``--quantization NAME`` on such a checkpoint must name that method (a quantized checkpoint is
  not re-quantized);
- ``--quantization NAME`` on a float checkpoint (or random ``dummy`` weights) needs a method that
  quantizes while loading (``quantizes_float_checkpoints``);
- a ``.gguf`` file runs dequantized to floats unless ``--quantization gguf`` is given.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from plinth.config import ConfigError, EngineConfig
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.plugins import PluginError, get_plugin_manager
from plinth.quantization.bitsandbytes import BNB, is_bnb
from plinth.quantization.interface import GemmWorkload, QuantContext, QuantizationMethod


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a plain mapping (``None`` for float checkpoints)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        to_dict = getattr(qc, "to_dict", None)
        qc = to_dict() if callable(to_dict) else dict(vars(qc))
    return dict(qc)


def _read_by_the_model(hf_config: Any, quant_config: dict[str, Any]) -> bool:
    """Whether the checkpoint's architecture reads its ``quant_method`` tensors itself (a model class's
    ``reads_checkpoint_formats``, e.g. gpt-oss's MXFP4 experts), so no quantization plugin is involved."""
    from plinth.model_registry.registry import ModelRegistry

    method = str(quant_config.get("quant_method", "")).lower()
    for arch in getattr(hf_config, "architectures", None) or ():
        if not ModelRegistry.is_native(arch):
            continue
        try:
            cls = ModelRegistry.resolve(arch)
        except UnsupportedModelError:   # reported when the model is built
            continue
        if method in getattr(cls, "reads_checkpoint_formats", ()):
            return True
    return False


def _load_class(name: str) -> type[QuantizationMethod]:
    regs = get_plugin_manager().registrations("quantization_methods")
    try:
        cls = regs[name].load()
    except PluginError as exc:
        raise ConfigError(f"quantization method {name!r} cannot be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, QuantizationMethod)):
        raise ConfigError(f"quantization method {name!r} ({regs[name].ref}) is not a "
                          f"plinth.quantization.interface.QuantizationMethod subclass")
    return cls


def _method_for_checkpoint(ckpt_method: str, names: list[str], origin: str) -> str:
    if ckpt_method in names:
        return ckpt_method
    regs = get_plugin_manager().registrations("quantization_methods")
    for name in names:
        try:
            cls = regs[name].load()
        except PluginError:
            continue
        if ckpt_method in getattr(cls, "checkpoint_aliases", ()):
            return name
    raise ModelLoadError(
        f"{origin} is quantized with {ckpt_method!r} (quantization_config.quant_method), which no installed "
        f"quantization plugin provides; installed methods: {', '.join(names) or 'none'}"
    )


def choose_method_name(requested: str | None, source_kind: str, quant_config: dict[str, Any] | None,
                       origin: str) -> tuple[str | None, dict[str, Any] | None]:
    """``(method name or None, the quantization_config it is built from)`` (see the module rules)."""
    names = _installed()
    if requested is not None and requested not in names:
        raise ConfigError(f"unknown quantization method {requested!r}; installed: {', '.join(names) or 'none'}")
    if source_kind == "gguf":
        if requested not in (None, "gguf"):
            raise ConfigError(f"--quantization {requested} cannot be used with a .gguf file; GGUF files run "
                              f"dequantized (default) or with --quantization gguf")
        return requested, None
    if requested == "gguf":
        raise ConfigError("--quantization gguf needs a .gguf file")
    ckpt_method = None
    if quant_config is not None:
        ckpt_method = str(quant_config.get("quant_method", "")).lower() or None
        if ckpt_method is None:
            raise ModelLoadError(f"{origin}: quantization_config has no quant_method")
    if ckpt_method is not None:
        name = _method_for_checkpoint(ckpt_method, names, origin)
        if requested is not None and requested != name:
            raise ConfigError(f"{origin} is already quantized with {ckpt_method!r}; --quantization {requested} "
                              f"cannot re-quantize it (leave --quantization out, or pass {name})")
        return name, quant_config
    if requested is None:
        return None, None
    cls = _load_class(requested)
    if not cls.quantizes_float_checkpoints:
        raise ConfigError(f"quantization method {requested!r} reads checkpoints quantized with it "
                          f"(quantization_config.quant_method = {requested!r}); {origin} holds float weights. "
                          f"Methods that quantize float weights while loading: "
                          f"{', '.join(_float_quantizers(names)) or 'none'}")
    return requested, None


def _methods_with(flag: str, names: list[str] | None = None) -> list[str]:
    """The installed methods (of ``names``, default all, sorted) whose class sets ``flag``; a method that
    cannot be imported is left out."""
    regs = get_plugin_manager().registrations("quantization_methods")
    out = []
    for name in names if names is not None else sorted(regs):
        try:
            if getattr(regs[name].load(), flag, False):
                out.append(name)
        except PluginError:
            continue
    return out


def _installed() -> list[str]:
    return sorted(get_plugin_manager().registrations("quantization_methods"))


def _float_quantizers(names: list[str]) -> list[str]:
    return _methods_with("quantizes_float_checkpoints", names)


def _lm_head_quantizers() -> list[str]:
    return _methods_with("quantizes_lm_head")


def resolve_quantization(config: EngineConfig, source: Any, platform: Any, dtype: torch.dtype,
                         device: torch.device, *, tp_size: int | None = None) -> QuantizationMethod | None:
    """The quantization method for ``source`` (``None``: unquantized), ready to be put in the
    :class:`~plinth.model_registry.interface.ModelContext`; its GEMM kernel is chosen when the model
    is built (``QuantizationMethod.prepare_model``).

    Args:
        config: the engine configuration (``model.quantization``, ``device.selection`` and
            ``device.gemm_kernel``, the scheduler limits for the timed workload).
        source: from :func:`plinth.model_registry.loader.resolve_model_source`.
        platform: the selected platform.
        dtype: the compute dtype.
        device: the device of this rank.
        tp_size: the tensor-parallel world size (default: ``config.parallel.tensor_parallel_size``).

    Raises:
        ConfigError: an unknown method, or one that cannot run this checkpoint or setting.
        ModelLoadError: a checkpoint quantized with a method no plugin provides.
    """
    origin = str(source.path or config.model.model or "the model")
    quant_config = checkpoint_quant_config(source.hf_config)
    requested = config.model.quantization
    if is_bnb(quant_config):
        # widened to floats while loading (plinth.quantization.bitsandbytes): a float checkpoint from here on,
        # which a method that quantizes float weights may quantize again
        if requested == BNB:
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, quantization=None))
        quant_config = None
    elif requested == BNB:
        raise ConfigError(f"--quantization {BNB} reads checkpoints saved with bitsandbytes (quantization_config."
                          f"quant_method = 'bitsandbytes'); {origin} is not one. To quantize float weights while "
                          f"loading use one of: {', '.join(_float_quantizers(_installed())) or 'none installed'}")
    if quant_config is not None and _read_by_the_model(source.hf_config, quant_config):
        if config.model.quantization is not None:
            raise ConfigError(f"{origin} stores {quant_config.get('quant_method')!r} weights, which the model reads "
                              f"itself (widened to {str(dtype).removeprefix('torch.')}); leave --quantization out")
        quant_config = None
    name, quant_config = choose_method_name(config.model.quantization, source.kind, quant_config, origin)
    lm_head = getattr(config.model, "quantize_lm_head", False)
    if lm_head and source.kind == "gguf":
        raise ConfigError("--quantize-lm-head quantizes a float LM head; a .gguf file stores its own head type")
    if name is None:
        if lm_head:
            raise ConfigError(f"--quantize-lm-head needs a quantization method that can quantize it: "
                              f"{', '.join(_lm_head_quantizers()) or 'none installed'}")
        if getattr(config.device, "gemm_kernel", None):
            raise ConfigError(f"--gemm-kernel {config.device.gemm_kernel} picks a quantization method's GEMM kernel, "
                              f"and {origin} runs unquantized (add --quantization)")
        return None
    cls = _load_class(name)
    if lm_head and not cls.quantizes_lm_head:
        raise ConfigError(f"quantization method {name!r} cannot quantize the LM head (--quantize-lm-head); "
                          f"methods that can: {', '.join(_lm_head_quantizers()) or 'none installed'}")
    if source.kind not in cls.source_kinds:
        kinds = {"hf_dir": "model directories", "dummy": "random (dummy) weights", "gguf": ".gguf files"}
        raise ConfigError(f"quantization method {name!r} cannot load {kinds.get(source.kind, source.kind)}; it "
                          f"loads {', '.join(kinds.get(k, k) for k in cls.source_kinds)}")
    if tp_size is None:
        tp_size = config.parallel.tensor_parallel_size
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    ctx = QuantContext(
        hf_config=source.hf_config, dtype=dtype, device=device, source_kind=source.kind, capability=capability,
        tp_size=tp_size, platform=platform, selection=config.device.selection,
        gemm_kernel=getattr(config.device, "gemm_kernel", None),
        workload=GemmWorkload.for_engine(*config.scheduler.limits), quantize_lm_head=lm_head,
    )
    method = cls.from_config(quant_config, ctx)
    if lm_head and getattr(method, "block", None) is not None:
        raise ConfigError(f"{origin}: --quantize-lm-head makes per-channel FP8 scales, and this checkpoint's "
                          f"block-scaled layers (weight_block_size) take kernels that read block scales only")
    return method
