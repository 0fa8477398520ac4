"""Intel GPUs through torch's ``xpu`` device (with intel_extension_for_pytorch when installed)."""

from __future__ import annotations

import importlib
import logging

import torch

from plinth.attention_backends.interface import Support
from plinth.platforms.interface import Platform

logger = logging.getLogger(__name__)

IPEX_MODULE = "intel_extension_for_pytorch"


def import_ipex() -> str | None:
    """Import intel_extension_for_pytorch if it is installed (it registers extra XPU ops).

    Returns:
        ``None`` when it imported or is not installed; the import error otherwise.
    """
    try:
        importlib.import_module(IPEX_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name == IPEX_MODULE:
            return None
        return f"{IPEX_MODULE} failed to import: {exc}"
    except Exception as exc:  # a broken install is reported in the reason, not fatal
        return f"{IPEX_MODULE} failed to import: {type(exc).__name__}: {exc}"
    return None


class XpuPlatform(Platform):
    """Intel GPUs (Data Center GPU Max, Arc): the ``xpu`` device type, oneCCL behind ``xccl``."""

    name = "xpu"
    priority = 20
    device_type = "xpu"
    dist_backend = "xccl"
    supports_graph_capture = False

    @classmethod
    def is_available(cls) -> Support:
        ipex_error = import_ipex()
        if ipex_error is not None:
            logger.warning("%s", ipex_error)
        suffix = f"; {ipex_error}" if ipex_error else ""
        if not hasattr(torch, "xpu"):
            return Support.no(f"torch {torch.__version__} has no torch.xpu module{suffix}")
        if not torch.xpu.is_available():
            return Support.no(f"torch.xpu.is_available() is False: no usable Intel GPU, driver or "
                              f"XPU build of torch {torch.__version__}{suffix}")
        return Support.yes()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if torch.xpu.is_bf16_supported():
            return (torch.bfloat16, torch.float16, torch.float32)
        return (torch.float16, torch.float32)

    def total_memory(self, index: int = 0) -> int:
        return int(torch.xpu.get_device_properties(index).total_memory)

    def free_memory(self, index: int = 0) -> int:
        if hasattr(torch.xpu, "mem_get_info"):
            free, _total = torch.xpu.mem_get_info(index)
            return int(free)
        # older torch: what this process has not reserved (other processes are not seen)
        return self.total_memory(index) - int(torch.xpu.memory_reserved(index))

    def device_count(self) -> int:
        return torch.xpu.device_count()

    def device_name(self, index: int = 0) -> str:
        return torch.xpu.get_device_name(index)

    def synchronize(self) -> None:
        torch.xpu.synchronize()

    def set_device(self, index: int) -> None:
        torch.xpu.set_device(index)
