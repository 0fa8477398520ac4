"""New values for a loaded model's weights, in place (reinforcement-learning loops that train a copy of the model
and hand its weights to the engine between rounds of generation).

Tensors arrive with their checkpoint (Hugging Face) names, as at load time, and go through the same per-parameter
loaders (fused projections, tensor-parallel shards, tied embeddings, norms stored as ``1 + w``), so a rank takes
its own shard of a whole tensor. Values are copied into the existing parameters: CUDA graphs, compiled decode
steps and kernels that read the parameters see them at once. What kept a transformed copy of the weights at start-up
cannot take new values this way and is refused by :func:`update_problem` before anything is written: quantized
models (an FP8/INT4/GGUF... method turned the weights into another format) and the CPU path's repacked GEMM
weights (``PLINTH_CPU_PACKED=0`` keeps the plain ones).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from plinth.errors import ModelLoadError


def _plain_method(method: Any) -> bool:
    """A linear layer's method multiplies the layer's own ``weight`` parameter as it is at each call."""
    from plinth.model_registry.layers.linear import UnquantizedLinearMethod

    while getattr(method, "inner", None) is not None and getattr(method, "reads_weight", False):
        method = method.inner   # a wrapper that picks a kernel for the same weight (the GPU's skinny GEMMs)
    return type(method) is UnquantizedLinearMethod


def update_problem(model: torch.nn.Module) -> str | None:
    """Why new weight values cannot be loaded into ``model`` in place (``None``: they can)."""
    quant = getattr(getattr(model, "ctx", None), "quant_method", None)
    if quant is not None:
        name = getattr(quant, "name", None) or type(quant).__name__
        return (f"the model runs quantized ({name}): its weights were converted at load time; load the new "
                f"weights with a new engine")
    for name, module in model.named_modules():
        method = getattr(module, "linear_method", None)
        if method is not None and not _plain_method(method):
            if type(method).__name__ == "CpuLinearMethod":
                return _cpu_copy(method, name)
            return f"layer {name} multiplies a converted copy of its weight ({type(method).__name__})"
        if getattr(module, "weight_method", None) is not None:
            return f"the experts of {name} are stored converted ({type(module.weight_method).__name__})"
        gemm = getattr(module, "gemm", None)
        if gemm is not None and not getattr(gemm, "reads_weight", False):
            owner = getattr(gemm, "__self__", None)
            if type(owner).__name__ == "CpuLinearMethod":
                return _cpu_copy(owner, name)
            return f"the LM head ({name}) multiplies a converted copy of its weight"
    return None


def _cpu_copy(method: Any, name: str) -> str:
    """Why a layer with the CPU path's GEMM method cannot take new values."""
    if getattr(method, "int4", None) is not None or getattr(method, "q8_0", None) is not None:
        return (f"the CPU path multiplies the GGUF file's quantized blocks ({name}); load the new weights with a "
                "new engine")
    from plinth.worker.cpu_path import PACKED_ENV

    return (f"the CPU path multiplies repacked copies of the weights ({name}); start the engine with "
            f"{PACKED_ENV}=0 to keep the plain weights, which take new values")


@contextlib.contextmanager
def _mode(model: Any, mode: str) -> Iterator[None]:
    model.weight_update = mode
    try:
        yield
    finally:
        model.weight_update = None


def update_weights(model: torch.nn.Module, pairs: list[tuple[str, torch.Tensor]], phase: str | None = None,
                   images: Any = None, encoder_elsewhere: bool = False) -> int:
    """Copy ``pairs`` (checkpoint names and tensors, any subset of the model's, as :func:`weight_pairs` gives them)
    into ``model``'s parameters; the number of tensors given. ``images``: the runner's image encoder
    (:class:`~plinth.multimodal.runner.ImageFeatures`), which takes the vision tower's and projector's tensors (and
    forgets the images it encoded with the old ones); ``encoder_elsewhere``: this process has no image encoder of the
    model's (a later pipeline stage), so such tensors are not its to check or write.

    Every name is mapped and every dtype and shape checked before anything is written (``phase``: ``"check"`` or
    ``"write"`` alone, for ranks that must all pass the check before any writes; ``None``: both). A model's own
    loader (not a shared layer's) checks its shapes as it writes, so such a mismatch leaves the tensors before it
    written (the error says so).

    Raises:
        ModelLoadError: the model cannot take new values in place (:func:`update_problem`), a name with no
            parameter, a tensor that is not floating point, or a shape that does not fit.
    """
    problem = update_problem(model)
    if problem is not None:
        raise ModelLoadError(f"cannot update the weights in place: {problem}")
    if not pairs:
        return 0
    encoder_pairs: list[tuple[str, torch.Tensor]] = []
    given = len(pairs)
    if images is not None and images.encoder is None:   # (a text model's prompt embeddings: no encoder)
        images = None
    if images is not None or encoder_elsewhere:   # the vision tower's and projector's tensors go to the image encoder
        from plinth.multimodal.vision import ENCODER_PREFIXES

        encoder_pairs = [(n, t) for n, t in pairs if n.startswith(ENCODER_PREFIXES)] if images is not None else []
        pairs = [(n, t) for n, t in pairs if not n.startswith(ENCODER_PREFIXES)]
    with torch.no_grad():
        if phase in (None, "check"):   # everything checked before anything is written
            if encoder_pairs:
                images.encoder.load_weights(iter(encoder_pairs), partial=True, write=False)
            if pairs:
                with _mode(model, "check"):
                    model.load_weights(iter(pairs))   # type: ignore[operator]
        if phase in (None, "write") and encoder_pairs:
            images.encoder.load_weights(iter(encoder_pairs), partial=True)
            images.clear()   # images encoded with the old weights
        if phase in (None, "write") and pairs:
            with _mode(model, "write"):
                try:
                    model.load_weights(iter(pairs))   # type: ignore[operator]
                except ModelLoadError as exc:
                    raise ModelLoadError(f"{exc} (the tensors before it were written: update again with tensors "
                                         "that fit)") from exc
    return given


def weight_pairs(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """What ``update_weights`` takes, as ``(name, tensor)`` pairs: a mapping of names to tensors (a
    ``state_dict()``), an iterable of pairs (``model.named_parameters()``), or the path of a safetensors file or of
    a directory of them (a saved checkpoint of the same architecture).

    Raises:
        ModelLoadError: anything else, or an unreadable checkpoint.
    """
    import os
    from collections.abc import Mapping
    from pathlib import Path

    from plinth.model_registry.weights import SafetensorsWeights, list_safetensors_files

    if isinstance(weights, str | os.PathLike):
        path = Path(weights)
        if path.is_dir():
            return list(SafetensorsWeights(list_safetensors_files(path)))
        if path.is_file() and path.suffix == ".safetensors":
            return list(SafetensorsWeights([path]))
        raise ModelLoadError(f"{path}: not a safetensors file or a directory of them")
    if isinstance(weights, Mapping):
        weights = weights.items()
    if isinstance(weights, torch.Tensor) or not isinstance(weights, Iterable):
        raise ModelLoadError(f"weights must be a mapping of names to tensors, (name, tensor) pairs, or a "
                             f"safetensors checkpoint's path, got {type(weights).__name__}")
    pairs = []
    for item in weights:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ModelLoadError(f"weights must be (name, tensor) pairs, got {type(item).__name__}: {item!r:.80}")
        pairs.append((item[0], item[1].detach()))
    return pairs
