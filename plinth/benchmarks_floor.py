"""Physical floors for benchmarks: how fast a workload could possibly run on a known device.

Two floors, both lower bounds on time:

- **decode (memory bound)**: one decode step must read every weight that takes part in a matrix
  product once. The input embedding table is read one row per token, so it is left out (unless it
  is tied to the LM head, which reads it whole). Floor per step = streamed bytes / copy bandwidth.
- **compute bound**: a forward over ``T`` tokens costs ``2 * P * T`` FLOPs, ``P`` being the matmul
  parameters (all parameters except a lookup-only embedding table). Floor = FLOPs / matmul rate.

The ceilings are figures measured on each device (bf16 matmul of 8192^3, device-to-device copy), keyed
by a substring of the device name. Devices not in the table have no floor ("floor unknown ...").
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class DeviceCeilings:
    """Measured ceilings of one device kind.

    Attributes:
        name: the device kind (for reports).
        copy_bytes_per_s: measured device-to-device copy bandwidth, bytes per second.
        matmul_flops_per_s: dense matmul rate per dtype (only measured dtypes are listed).
    """

    name: str
    copy_bytes_per_s: float
    matmul_flops_per_s: dict[torch.dtype, float]


# device-name substring -> ceilings; first match wins (so put more specific names first).
KNOWN_DEVICES: tuple[tuple[str, DeviceCeilings], ...] = (
    ("H200", DeviceCeilings("NVIDIA H200", 4.21e12, {torch.bfloat16: 760e12})),
)

UNKNOWN = "floor unknown for this device"


def ceilings_for(device_name: str) -> DeviceCeilings | None:
    """The ceilings of a device by its name (``torch.cuda.get_device_name``), or ``None``."""
    for key, ceilings in KNOWN_DEVICES:
        if key.lower() in device_name.lower():
            return ceilings
    return None


def device_name(device: torch.device) -> str:
    """A human-readable name of ``device``: the GPU's product name, else the device type."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on the CPU)."""
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None) if device.type != "cpu" else None
    if callable(sync):
        sync(device)


def median_seconds(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """The median wall time of ``iters`` device-synchronised calls of ``fn``, after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class WeightStats:
    """What a model's weights cost to run.

    Attributes:
        params: all parameters (shared ones counted once).
        matmul_params: parameters used in matrix products by one token (``params`` minus a lookup-only embedding;
            of a mixture of experts, the ``top_k`` of ``num_experts`` experts a token runs).
        streamed_bytes: bytes of those matmul parameters, read by every one-sequence decode step (of a quantized
            layer that keeps two layouts, only the one decode steps read: its ``decode_tensors``).
    """

    params: int
    matmul_params: int
    streamed_bytes: int


def _is_lookup(module: nn.Module) -> bool:
    from plinth.model_registry.layers.embedding import LMHead, VocabEmbedding

    if isinstance(module, LMHead):   # a head with a quantized copy reads that copy, not its (tied) float weight
        return hasattr(module, "quantized")
    return isinstance(module, nn.Embedding) or isinstance(module, VocabEmbedding)


def weight_stats(model: nn.Module) -> WeightStats:
    """Count a model's parameters; works for plinth models and for transformers models."""
    lookup: dict[int, torch.Tensor] = {}
    used: dict[int, torch.Tensor] = {}
    for module in model.modules():
        target = lookup if _is_lookup(module) else used
        for p in module.parameters(recurse=False):
            target[id(p)] = p
    lookup_only = {k: p for k, p in lookup.items() if k not in used}
    all_params = {**lookup, **used}
    matmul = [p for k, p in all_params.items() if k not in lookup_only]
    # a quantized layer whose kernel keeps a second layout for long inputs names what decode reads
    unread: set[int] = set()
    for module in model.modules():
        names = getattr(module, "decode_tensors", None)
        if names is not None:
            unread.update(id(p) for n, p in module.named_parameters(recurse=False) if n not in names and n != "bias")
    share = _expert_shares(model)
    return WeightStats(
        params=sum(_numel(p) for p in all_params.values()),
        matmul_params=round(sum(_numel(p) * share.get(id(p), 1.0) for p in matmul)),
        streamed_bytes=round(sum(_numel(p) * p.element_size() * share.get(id(p), 1.0)
                                 for p in matmul if id(p) not in unread)),
    )


def _expert_shares(model: nn.Module) -> dict[int, float]:
    """``id(parameter) -> top_k / num_experts`` for stacked expert weights and biases (``[num_experts, ...]``
    parameters of a module with ``num_experts`` that holds 3-D ones; ``top_k`` from the module or the model's
    ``num_experts_per_tok``): the share of them one token runs."""
    config_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    shares = {}
    for module in model.modules():
        e = getattr(module, "num_experts", None)
        k = getattr(module, "top_k", None) or config_k
        if not isinstance(e, int) or not isinstance(k, int) or not 0 < k < e:
            continue
        stacked = [p for p in module.parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == e]
        if any(p.dim() >= 3 for p in stacked):   # the experts' module (a router's [E, H] weight is read in full)
            shares.update((id(p), k / e) for p in stacked)
    return shares


def _numel(p: torch.Tensor) -> int:
    """A parameter's elements; for a weight the CPU path holds only in its packed form, the weight's own."""
    shape = getattr(p, "released_shape", None)
    return math.prod(shape) if shape is not None else p.numel()


def decode_step_floor_s(stats: WeightStats, ceilings: DeviceCeilings) -> float:
    """The least time one decode step can take: its weights read once at copy bandwidth."""
    return stats.streamed_bytes / ceilings.copy_bytes_per_s


def compute_floor_s(stats: WeightStats, num_tokens: int, dtype: torch.dtype, ceilings: DeviceCeilings) -> float | None:
    """The least time ``num_tokens`` forward tokens can take at the matmul rate (None: dtype not measured)."""
    rate = ceilings.matmul_flops_per_s.get(dtype)
    if rate is None:
        return None
    return 2.0 * stats.matmul_params * num_tokens / rate
