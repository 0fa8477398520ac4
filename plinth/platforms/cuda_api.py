"""What NVIDIA (CUDA) and AMD (ROCm) builds of torch share: the ``torch.cuda`` API.

A ROCm build of torch exposes HIP devices as ``torch.device("cuda")`` and runs RCCL
behind the ``"nccl"`` distributed backend, so both platforms drive the device through
the same calls; they differ in how they are detected and in the dtypes they prefer.
"""

from __future__ import annotations

import torch

from plinth.platforms.interface import Platform

LARGE_DEVICE_BYTES = 70 * 2**30
LARGE_DEVICE_SCHEDULER_DEFAULTS = (512, 2048)   # (max_num_seqs, max_num_batched_tokens)


class CudaApiPlatform(Platform):
    """Device handling through ``torch.cuda``; subclasses implement detection and dtypes."""

    device_type = "cuda"
    dist_backend = "nccl"
    supports_graph_capture = True

    def total_memory(self, index: int = 0) -> int:
        return int(torch.cuda.get_device_properties(index).total_memory)

    def free_memory(self, index: int = 0) -> int:
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_name(self, index: int = 0) -> str:
        return torch.cuda.get_device_name(index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def scheduler_defaults(self, index: int = 0) -> tuple[int, int]:
        """Larger batches on large-memory devices: at 80 GB and above (H100, H200, MI300) a decode
        step of 512 requests still fits the KV cache of typical 7-8B models at a few thousand tokens each,
        and it raises output throughput over 256 (benchmarks/RESULTS.md)."""
        if self.total_memory(index) >= LARGE_DEVICE_BYTES:
            return LARGE_DEVICE_SCHEDULER_DEFAULTS
        return super().scheduler_defaults(index)

    def prepare_runner(self, runner: object, source: object, config: object) -> None:
        """Time the skinny Triton GEMMs against the vendor GEMM per weight shape and install the winners
        for decode-sized inputs (:mod:`plinth.worker.gpu_linear`)."""
        from plinth.worker.gpu_linear import install_skinny_gemms

        install_skinny_gemms(runner.model)  # type: ignore[attr-defined]
