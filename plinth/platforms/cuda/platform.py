"""NVIDIA GPUs through a CUDA build of torch."""

from __future__ import annotations

import os

import torch

from plinth.attention_backends.interface import Support
from plinth.platforms.cuda_api import CudaApiPlatform


class CudaPlatform(CudaApiPlatform):
    """NVIDIA GPUs: NCCL for collectives, CUDA graphs for decode."""

    name = "cuda"
    priority = 30

    @classmethod
    def is_available(cls) -> Support:
        if torch.version.cuda is None:
            if torch.version.hip is not None:
                return Support.no(f"this torch is a ROCm build (HIP {torch.version.hip}); the rocm platform applies")
            return Support.no("this torch is not a CUDA build (torch.version.cuda is None)")
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return Support.no(f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, "
                              f"but torch.cuda.is_available() is False: no usable NVIDIA GPU or driver{hint}")
        return Support.yes()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """bfloat16 first from Ampere (compute capability 8.0) on; float16 first before that."""
        major, _minor = torch.cuda.get_device_capability(0)
        if major >= 8:
            return (torch.bfloat16, torch.float16, torch.float32)
        return (torch.float16, torch.float32)
