"""Where a ``cuda_w4a16`` decode GEMV spends its time: the kernel timed whole and with parts cut away.

    python benchmarks/w4a16_anatomy_gpu.py --rows 1 --out anatomy.json

Each variant is the kernel's source with one edit (compiled with NVRTC like the real one), timed like
``skinny_gemm_gpu.py`` (``--copies`` distinct weights per CUDA graph, products back to back, each launched
as a dependent of the one before on Hopper): ``full`` (unchanged), ``launch`` (returns at once: the cost of
a launch in the graph), ``prologue`` (returns after staging and converting the tile's scales, with the first
chunks' copies done), ``no_mma`` (the tensor-core instructions replaced by one add per register: the
streaming and unpacking without the products). Outputs of the cut variants are wrong by construction; only
``full`` is checked against the float32 product.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
_MMA = "mma16816<BF16>(acc[nb], a, b0, b1, s == 0 ? zero4 : acc[nb]);"
_NO_MMA = ("{ const float* c = s == 0 ? zero4 : acc[nb]; acc[nb][0] = c[0] + as_float(a[0] ^ b0); "
           "acc[nb][1] = c[1] + as_float(a[1] ^ b1); acc[nb][2] = c[2] + as_float(a[2]); "
           "acc[nb][3] = c[3] + as_float(a[3]); }")
_START = "extern __shared__ __align__(16) unsigned char shared[];"
_LOOP = "  const u32 magic = BF16 ? 0x43004300u : 0x64006400u;"


def variants(source: str) -> dict[str, str]:
    for anchor in (_MMA, _START, _LOOP):
        assert source.count(anchor) == 1, f"the kernel source changed: {anchor!r}"
    return {
        "full": source,
        "launch": source.replace(_START, _START + "\n  if (K >= 0) return;"),
        "prologue": source.replace(_LOOP, "  wait_copies<0>();\n  if (K >= 0) return;\n" + _LOOP),
        "no_mma": source.replace(_MMA, _NO_MMA),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    from skinny_gemm_gpu import graph_time

    from plinth.quantization.kernels import w4a16_cuda
    from plinth.quantization.kernels.interface import GemmProblem
    from plinth.quantization.quantizers import random_int_weights
    from plinth.quantization.selection import holder

    source = w4a16_cuda.SOURCE.read_text()
    tmp = Path(tempfile.mkdtemp())
    results: list[dict[str, Any]] = []
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        problem = GemmProblem("int", torch.bfloat16, "cuda", capability=torch.cuda.get_device_capability(),
                              bits=4, group_size=128, shapes=((n, k),))
        kern = w4a16_cuda.CudaW4A16Kernel(problem)
        layers, dense0 = [], None
        for c in range(a.copies):
            gen = torch.Generator(device="cuda").manual_seed(c)
            w = random_int_weights(n, k, 4, 128, symmetric=False, act_order=False, device=torch.device("cuda"),
                                   generator=gen)
            layers.append(holder(kern.prepare(w)))
            if c == 0:
                dense0 = w.dequantize(torch.float32)
        gbytes = (n * k / 2 + n * (k // 128) * 4) / 1e9
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            rec: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "gbytes": gbytes}
            for variant, text in variants(source).items():
                path = tmp / f"{variant}.cu"
                path.write_text(text)
                w4a16_cuda.SOURCE = path
                w4a16_cuda.compiled.cache_clear()
                w4a16_cuda.plan.cache_clear()
                t = graph_time(lambda i: kern.apply(layers[i], x, None), a.copies, a.replays)  # noqa: B023
                rec[f"{variant}_us"] = t * 1e3
                if variant == "full":
                    ref = x.float() @ dense0.T
                    err = (kern.apply(layers[0], x, None).float() - ref).abs().max().item() / ref.abs().max().item()
                    rec["full_rel_err"], rec["full_tbs"] = err, gbytes / t
            print(json.dumps(rec), flush=True)
            results.append(rec)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
