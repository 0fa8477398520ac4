"""Skip markers for tests of CPU paths that only some CPUs run."""

from __future__ import annotations

import pytest
import torch

from plinth.worker.cpu_linear import packed_linear_supported

#: the CPU GEMM path (prepacked bfloat16 weights, and with them the GGUF 4-bit copies and the Q8_0 LM head)
#: is installed only where oneDNN's packed bfloat16 linear runs: AVX512 (BW, VL, DQ) or AVX-NE-CONVERT
needs_packed_bf16 = pytest.mark.skipif(
    not packed_linear_supported(torch.bfloat16),
    reason="oneDNN's packed bfloat16 linear does not run on this CPU (needs AVX512 BW/VL/DQ or AVX-NE-CONVERT)")
