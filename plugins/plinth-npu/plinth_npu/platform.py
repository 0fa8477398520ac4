"""Huawei Ascend NPUs through the ``torch_npu`` extension.

Importing ``torch_npu`` adds the ``npu`` device type and the ``torch.npu`` module to torch;
collectives run over HCCL.
"""

from __future__ import annotations

import importlib

import torch

from plinth.attention_backends.interface import Support
from plinth.platforms.interface import Platform

TORCH_NPU = "torch_npu"


def _import_torch_npu() -> str | None:
    """Import torch_npu; ``None`` on success, else why it is unusable."""
    try:
        importlib.import_module(TORCH_NPU)
    except ModuleNotFoundError as exc:
        if exc.name == TORCH_NPU:
            return "torch_npu not installed"
        return f"torch_npu failed to import: {exc}"
    except Exception as exc:  # a broken CANN install surfaces here; it is the reason, not a crash
        return f"torch_npu failed to import: {type(exc).__name__}: {exc}"
    return None


class NpuPlatform(Platform):
    """Ascend NPUs (Atlas 300I/800T, 910B): the ``npu`` device type, HCCL for collectives."""

    name = "npu"
    priority = 100  # out-of-tree: ranks above every in-tree platform when its hardware is present
    device_type = "npu"
    dist_backend = "hccl"
    supports_graph_capture = False

    @classmethod
    def is_available(cls) -> Support:
        error = _import_torch_npu()
        if error is not None:
            return Support.no(error)
        if not torch.npu.is_available():
            return Support.no("torch_npu is installed, but torch.npu.is_available() is False: "
                              "no usable Ascend NPU or driver (check ASCEND_RT_VISIBLE_DEVICES and the CANN install)")
        return Support.yes()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if getattr(torch.npu, "is_bf16_supported", lambda: False)():
            return (torch.bfloat16, torch.float16, torch.float32)
        return (torch.float16, torch.float32)

    def total_memory(self, index: int = 0) -> int:
        return int(torch.npu.get_device_properties(index).total_memory)

    def free_memory(self, index: int = 0) -> int:
        free, _total = torch.npu.mem_get_info(index)
        return int(free)

    def device_count(self) -> int:
        return torch.npu.device_count()

    def device_name(self, index: int = 0) -> str:
        return torch.npu.get_device_name(index)

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def set_device(self, index: int) -> None:
        torch.npu.set_device(index)
