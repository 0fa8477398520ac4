"""The Platform contract: the narrow, device-specific surface the core relies on.

Everything else device-specific (kernels, attention, quantized GEMMs) lives in
attention-backend and quantization plugins, not here.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from plinth.attention_backends.interface import Support


class Platform(abc.ABC):
    """One kind of hardware.

    Subclasses set the class attributes and implement the abstract methods. Importing a
    platform module must not initialise a device runtime; do that in methods.
    """

    #: registry name, e.g. ``"cuda"``
    name: ClassVar[str]
    #: higher wins when several platforms are available; out-of-tree plugins should use >= 100
    priority: ClassVar[int] = 0
    #: the torch device type, e.g. ``"cuda"`` (also on ROCm builds), ``"xpu"``, ``"cpu"``
    device_type: ClassVar[str]
    #: the torch.distributed backend, e.g. ``"nccl"``, ``"gloo"``
    dist_backend: ClassVar[str]
    #: whether decode steps can be captured as graphs (CUDA graphs and equivalents)
    supports_graph_capture: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> Support:
        """Whether this platform can run here; the reason when it cannot. Never raises."""

    @abc.abstractmethod
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Compute dtypes this device runs well, preferred first."""

    @abc.abstractmethod
    def total_memory(self, index: int = 0) -> int:
        """Total memory of device ``index`` in bytes."""

    @abc.abstractmethod
    def free_memory(self, index: int = 0) -> int:
        """Free memory of device ``index`` in bytes."""

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def device_name(self, index: int = 0) -> str:
        return self.name

    def synchronize(self) -> None:  # noqa: B027 (a no-op by default: host platforms have no queue)
        """Wait for all queued work on the current device."""

    def set_device(self, index: int) -> None:  # noqa: B027 (a no-op by default: one host device)
        """Make device ``index`` current for this process."""

    def hand_over_to_thread(self) -> None:  # noqa: B027 (a no-op by default)
        """The thread that built an engine is handing it to a background thread (``AsyncLLMEngine``):
        called on the building thread just before, to release what only that thread would use."""

    def enter_engine_thread(self) -> None:  # noqa: B027 (a no-op by default)
        """Called first on a background thread that will run an engine's steps."""

    def default_dtype(self) -> torch.dtype:
        return self.supported_dtypes()[0]

    def scheduler_defaults(self, index: int = 0) -> tuple[int, int]:
        """``(max_num_seqs, max_num_batched_tokens)`` for an engine that did not set them: how many
        requests run at once and how many tokens one step computes, sized for device ``index``."""
        from plinth.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

        return DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_NUM_BATCHED_TOKENS

    def __repr__(self) -> str:
        return f"<Platform {self.name}>"
