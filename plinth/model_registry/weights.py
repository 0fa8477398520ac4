"""Weight sources and model materialisation: safetensors shards (memory-mapped), random weights,
and building a model on the meta device before allocating it where it runs."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from plinth.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def list_safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint shards of a model directory, from its index file or by glob.

    Raises:
        ModelLoadError: no shard, an unreadable index, or a shard the index names that is missing.
    """
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            values = list(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"cannot read the shard index {index}: {type(exc).__name__}: {exc}") from exc
        bad = [v for v in values if not isinstance(v, str) or not v]
        if bad or not values:
            raise ModelLoadError(f"the shard index {index}: weight_map must map tensor names to shard file names, "
                                 f"got {bad[0]!r}" if bad else f"the shard index {index} names no shard")
        files = []
        for name in sorted(set(values)):
            f = model_dir / name
            # a name like ../other/model.safetensors or /etc/... (checked on the name: shards may be symlinks out of
            # the folder, as in the Hugging Face cache's snapshots)
            if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == "..":
                raise ModelLoadError(f"shard {name!r} listed in {index} is outside the model directory")
            if not f.is_file():
                raise ModelLoadError(f"shard {f.name} listed in {index} does not exist")
            files.append(f)
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors files in {model_dir}; plinth loads safetensors checkpoints "
            f"(pickled .bin/.pt checkpoints are not loaded) or .gguf files"
        )
    return files


class SafetensorsWeights:
    """Iterate ``(name, tensor)`` over safetensors shards, memory-mapped, one shard at a time.

    ``current_file`` names the shard being read (for error messages); ``only``: the tensors whose names start
    with it, the others not read.
    """

    def __init__(self, files: list[Path], only: str = ""):
        self.files = files
        self.only = only
        self.current_file: Path | None = None

    def names(self) -> list[str]:
        """Every tensor name of the shards (read from their headers only)."""
        out: list[str] = []
        for path in self.files:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    out.extend(n for n in handle.keys() if n.startswith(self.only))  # noqa: SIM118
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"cannot read safetensors file {path}: {exc} (corrupt or truncated?)") from exc
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.files:
            self.current_file = path
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"cannot read safetensors file {path}: {exc} (corrupt or truncated?)") from exc
            with handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    if not name.startswith(self.only):
                        continue
                    try:
                        tensor = handle.get_tensor(name)
                    except (SafetensorError, OSError) as exc:
                        raise ModelLoadError(f"cannot read tensor {name!r} from {path}: {exc}") from exc
                    yield name, tensor
        self.current_file = None


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make ``dtype`` torch's default floating-point dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_on_meta(cls: type[nn.Module], *args: object, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Construct ``cls(*args)`` on the meta device (no memory, no init), then allocate it on ``device``."""
    with torch.device("meta"), default_dtype(dtype):
        model = cls(*args)
    materialize(model, device)
    return model


def _empty_as(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor with ``t``'s shape, strides and dtype on ``device``. (``empty_like`` of a
    meta tensor runs torch's Python reference path, whose first call imports sympy: about 0.3 s.)"""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Replace meta parameters and buffers by uninitialised ones on ``device``.

    Unlike ``Module.to_empty`` this keeps tied parameters tied and keeps the attributes set on
    parameters (``weight_loader``, ``expected_shards``). Modules with an ``init_buffers()``
    method recompute their buffers afterwards.
    """
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            new = memo.get(id(param))
            if new is None:
                new = nn.Parameter(_empty_as(param, device), requires_grad=False)
                new.__dict__.update(param.__dict__)
                memo[id(param)] = new
            setattr(module, name, new)
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                module._buffers[name] = _empty_as(buf, device)
    for module in model.modules():
        init = getattr(module, "init_buffers", None)
        if callable(init):
            init()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights: normal(0, std) matrices, ones for norms, zeros for biases; deterministic in ``seed``."""
    params = list(model.named_parameters())  # tied parameters appear once
    if not params:
        return
    gen = torch.Generator(device=params[0][1].device)
    gen.manual_seed(seed)
    for name, param in params:
        if param.dim() == 1 and "norm" in name:
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=gen)
