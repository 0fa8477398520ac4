"""Where a ``cuda_w4a16`` decode GEMV spends its time: the kernel timed whole and with parts cut away.

    python benchmarks/w4a16_anatomy_gpu.py --rows 1 --out anatomy.json

Each variant is the kernel's source with one edit (compiled with NVRTC like the real one), timed like
``skinny_gemm_gpu.py`` (``--copies`` distinct weights per CUDA graph, products back to back, each launched
as a dependent of the one before on Hopper): ``full`` (unchanged), ``launch`` (returns at once: the cost of
a launch in the graph), ``prologue`` (returns after staging and converting the tile's scales, with the first
chunks' copies done), ``no_mma`` (the tensor-core instructions replaced by one add per register: the
streaming and unpacking without the products), and ``read``: the packed codes alone read by a plain
kernel (16-byte loads, ordinary launches), once with the GEMV's grid at 4 warps (a block of 4 warps per 16-row tile)
and once grid-stride (8 blocks per multiprocessor), the bytes' own floor in this harness. Outputs of the
cut variants are wrong by construction; only ``full`` is checked against the float32 product.
``--dtypes bfloat16,float16`` times each variant with activations of each dtype (the same codes).
``--baseline FILE[,FILE...]`` times other versions of the kernel's source (the one before a change,
experiments) in the same process for an A/B, each as a variant named after its file (``old.cu`` ->
``old``); ``--baseline-slot A,B`` gives their ring slot size, ``A + B * rows`` bytes, where it differs from
the current kernel's. Their results are checked against the float32 product too. They are launched with
the current kernel's shared-memory layout sizes (``SCALE_BYTES`` per scale group): a version that needs
more must be the current one.

    python benchmarks/w4a16_anatomy_gpu.py --rows 1,4 --variants full --baseline old.cu,new_idea.cu
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


# The bytes alone: every 16-byte word of the packed codes read once (kept live by a never-taken store), by
# one block of 4 warps per 16-row tile (the GEMV's grid) or by a grid-stride loop over the whole buffer.
READ_SOURCE = r"""
typedef unsigned int u32;
struct __align__(16) Words4 { u32 x, y, z, w; };
extern "C" __global__ void read_tiles(const Words4* __restrict__ codes, u32* __restrict__ sink, int words) {
  const Words4* p = codes + (size_t)blockIdx.x * words;
  u32 acc = 0;
#pragma unroll 4
  for (int i = threadIdx.x; i < words; i += blockDim.x) {
    const Words4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;
}
extern "C" __global__ void read_flat(const Words4* __restrict__ codes, u32* __restrict__ sink, long long words) {
  u32 acc = 0;
#pragma unroll 4
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < words; i += (long long)gridDim.x * blockDim.x) {
    const Words4 v = codes[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;
}
"""


def read_times(layers: list[Any], copies: int, replays: int) -> dict[str, float]:
    """Microseconds per weight for the two plain-read kernels (ordinary launches in the graph)."""
    import ctypes

    from skinny_gemm_gpu import graph_time

    from plinth.kernels import nvrtc

    index = torch.cuda.current_device()
    tiles_fn = nvrtc.compile_function(READ_SOURCE, "read_tiles", index)
    flat_fn = nvrtc.compile_function(READ_SOURCE, "read_flat", index)
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    sink = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    device = torch.device("cuda", index)
    out = {}
    for name, fn in (("read_tiles", tiles_fn), ("read_flat", flat_fn)):
        def run(i: int, fn: int = fn, name: str = name) -> None:
            codes = layers[i % len(layers)].w4m_codes
            tiles, words = codes.shape[0], codes.numel() // 4
            args = [ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(sink.data_ptr())]
            if name == "read_tiles":
                nvrtc.launch(fn, tiles, 128, 0, device, args + [ctypes.c_int(words // tiles)], name)
            else:
                nvrtc.launch(fn, sms * 8, 256, 0, device, args + [ctypes.c_longlong(words)], name)
        out[f"{name}_us"] = graph_time(run, copies, replays) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--distinct", type=int, default=0,
                   help="distinct weights among the --copies products (default: all distinct; 1: the same weight, "
                        "L2-resident where it fits)")
    p.add_argument("--variants", default="full,launch,prologue,no_mma,read")
    p.add_argument("--baseline", default=None,
                   help="other kernel sources (comma-separated), each timed as a variant named after its file")
    p.add_argument("--baseline-slot", default=None, help="A,B: the baselines' ring slot is A + B * rows bytes")
    p.add_argument("--dtypes", default="bfloat16",
                   help="activation dtypes (bfloat16,float16): each variant is timed with each")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    stems = [Path(f).stem for f in a.baseline.split(",")] if a.baseline else []
    clash = set(stems) & ({"full", "launch", "prologue", "no_mma", "read"} | {s for s in stems if stems.count(s) > 1})
    if clash:
        p.error(f"--baseline files must have distinct names other than the built-in variants: {sorted(clash)}")

    from skinny_gemm_gpu import graph_time

    from plinth.quantization.kernels import w4a16_cuda
    from plinth.quantization.kernels.interface import GemmProblem
    from plinth.quantization.quantizers import random_int_weights
    from plinth.quantization.selection import holder

    source = w4a16_cuda.SOURCE.read_text()
    slot_bytes = w4a16_cuda.slot_bytes
    tmp = Path(tempfile.mkdtemp())
    results: list[dict[str, Any]] = []
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        problem = GemmProblem("int", torch.bfloat16, "cuda", capability=torch.cuda.get_device_capability(),
                              bits=4, group_size=128, shapes=((n, k),))
        kern = w4a16_cuda.CudaW4A16Kernel(problem)
        layers, dense0 = [], None
        for c in range(a.distinct or a.copies):
            gen = torch.Generator(device="cuda").manual_seed(c)
            w = random_int_weights(n, k, 4, 128, symmetric=False, act_order=False, device=torch.device("cuda"),
                                   generator=gen)
            layers.append(holder(kern.prepare(w)))
            if c == 0:
                dense0 = w.dequantize(torch.float32)
        gbytes = (n * k / 2 + n * (k // 128) * 4) / 1e9
        for m, dtype_name in ((int(r), d) for r in a.rows.split(",") for d in a.dtypes.split(",")):
            x = torch.randn(m, k, device="cuda").to(getattr(torch, dtype_name))
            rec: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "dtype": dtype_name, "gbytes": gbytes}
            sources = {v: text for v, text in variants(source).items() if v in a.variants.split(",")}
            baselines = {Path(f).stem: Path(f).read_text() for f in a.baseline.split(",")} if a.baseline else {}
            sources.update(baselines)
            for variant, text in sources.items():
                path = tmp / f"{variant}.cu"
                path.write_text(text)
                w4a16_cuda.SOURCE = path
                w4a16_cuda.compiled.cache_clear()
                w4a16_cuda.plan.cache_clear()
                if variant in baselines and a.baseline_slot:
                    fixed, per_row = (int(v) for v in a.baseline_slot.split(","))
                    w4a16_cuda.slot_bytes = lambda rows, f=fixed, r=per_row: f + r * rows
                else:
                    w4a16_cuda.slot_bytes = slot_bytes
                t = graph_time(lambda i: kern.apply(layers[i % len(layers)], x, None), a.copies, a.replays)  # noqa: B023
                rec[f"{variant}_us"] = t * 1e3
                if variant == "full" or variant in baselines:
                    ref = x.float() @ dense0.T
                    err = (kern.apply(layers[0], x, None).float() - ref).abs().max().item() / ref.abs().max().item()
                    rec[f"{variant}_rel_err"], rec[f"{variant}_tbs"] = err, gbytes / t
            w4a16_cuda.slot_bytes = slot_bytes
            if "read" in a.variants.split(","):
                rec.update(read_times(layers, a.copies, a.replays))
                rec["codes_gbytes"] = n * k / 2 / 1e9
            print(json.dumps(rec), flush=True)
            results.append(rec)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
