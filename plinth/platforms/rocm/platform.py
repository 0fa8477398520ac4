"""AMD GPUs through a ROCm (HIP) build of torch."""

from __future__ import annotations

import os

import torch

from plinth.attention_backends.interface import Support
from plinth.platforms.cuda_api import CudaApiPlatform


class RocmPlatform(CudaApiPlatform):
    """AMD GPUs: the ``cuda`` device type of a HIP build, RCCL behind the ``nccl`` backend, HIP graphs."""

    name = "rocm"
    priority = 30

    @classmethod
    def is_available(cls) -> Support:
        if torch.version.hip is None:
            return Support.no("this torch is not a ROCm build (torch.version.hip is None)")
        if not torch.cuda.is_available():
            visible = {k: os.environ[k] for k in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES") if k in os.environ}
            hint = "".join(f" ({k}={v!r})" for k, v in visible.items())
            return Support.no(f"torch {torch.__version__} is built for ROCm {torch.version.hip}, "
                              f"but torch.cuda.is_available() is False: no usable AMD GPU or driver{hint}")
        return Support.yes()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """bfloat16 first where torch reports bfloat16 support for the GPU, float16 first otherwise."""
        if torch.cuda.is_bf16_supported():
            return (torch.bfloat16, torch.float16, torch.float32)
        return (torch.float16, torch.float32)
