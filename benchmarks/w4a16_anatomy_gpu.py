"""Where a ``cuda_w4a16`` decode GEMV spends its time: the kernel timed whole and with parts cut away.

    python benchmarks/w4a16_anatomy_gpu.py --rows 1 --out anatomy.json

Each variant is the kernel's source with one edit (compiled with NVRTC like the real one), timed like
``skinny_gemm_gpu.py`` (``--copies`` distinct weights per CUDA graph, products back to back, each launched
as a dependent of the one before on Hopper): ``full`` (unchanged), ``launch`` (returns at once: the cost of
a launch in the graph), ``prologue`` (returns after staging and converting the tile's scales, with the first
chunks' copies done), ``no_mma`` (the tensor-core instructions replaced by one add per register: the
streaming and unpacking without the products), and ``read``: the packed codes alone read by a plain
kernel (16-byte loads, ordinary launches), once with the GEMV's grid (a block of 4 warps per 16-row tile)
and once grid-stride (8 blocks per multiprocessor), the bytes' own floor in this harness. Outputs of the
cut variants are wrong by construction; only ``full`` is checked against the float32 product.
``chunk_major`` is not a cut: the codes stored chunk-major (chunk c of every tile side by side) and the kernel's
two address lines changed to match, so that blocks at the same chunk read one contiguous stretch (as the
grid-stride read does) instead of N/16 regions a tile apart; it must give the kernel's own bits
(``chunk_major_equal``).
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


# chunk-major codes: chunk c of every tile side by side ([K/64][N/16][32 lanes][4 words]), so that blocks
# working on the same chunk index read one contiguous stretch instead of N/16 regions a tile apart
_TILE_MAJOR = ("codes + ((size_t)tile * chunks + warp) * 32 + lane", "const size_t code_step = (size_t)warps * 512;")
_CHUNK_MAJOR = ("codes + ((size_t)warp * gridDim.x + tile) * 32 + lane",
                "const size_t code_step = (size_t)warps * gridDim.x * 512;")


def chunk_major(codes: torch.Tensor) -> torch.Tensor:
    """The tile-major packed codes ``[N/16, K/64, 32, 4]`` stored chunk-major (viewed with the same shape,
    so the launcher's checks pass)."""
    return codes.transpose(0, 1).contiguous().view(codes.shape)


def variants(source: str) -> dict[str, str]:
    for anchor in (_MMA, _START, _LOOP, *_TILE_MAJOR):
        assert source.count(anchor) == 1, f"the kernel source changed: {anchor!r}"
    return {
        "full": source,
        "launch": source.replace(_START, _START + "\n  if (K >= 0) return;"),
        "prologue": source.replace(_LOOP, "  wait_copies<0>();\n  if (K >= 0) return;\n" + _LOOP),
        "no_mma": source.replace(_MMA, _NO_MMA),
        "chunk_major": source.replace(_TILE_MAJOR[0], _CHUNK_MAJOR[0]).replace(_TILE_MAJOR[1], _CHUNK_MAJOR[1]),
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
            codes = layers[i].w4m_codes
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
    p.add_argument("--variants", default="full,launch,prologue,no_mma,chunk_major,read")
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
        layers, cm_layers, dense0 = [], [], None
        for c in range(a.copies):
            gen = torch.Generator(device="cuda").manual_seed(c)
            w = random_int_weights(n, k, 4, 128, symmetric=False, act_order=False, device=torch.device("cuda"),
                                   generator=gen)
            state = kern.prepare(w)
            layers.append(holder(state))
            if "chunk_major" in a.variants.split(","):
                cm_layers.append(holder({**state, "w4m_codes": chunk_major(state["w4m_codes"])}))
            if c == 0:
                dense0 = w.dequantize(torch.float32)
        gbytes = (n * k / 2 + n * (k // 128) * 4) / 1e9
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            rec: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "gbytes": gbytes}
            for variant, text in variants(source).items():
                if variant not in a.variants.split(","):
                    continue
                path = tmp / f"{variant}.cu"
                path.write_text(text)
                w4a16_cuda.SOURCE = path
                w4a16_cuda.compiled.cache_clear()
                w4a16_cuda.plan.cache_clear()
                held = cm_layers if variant == "chunk_major" else layers
                t = graph_time(lambda i: kern.apply(held[i], x, None), a.copies, a.replays)  # noqa: B023
                rec[f"{variant}_us"] = t * 1e3
                if variant == "chunk_major":   # the same sums in the same order: the same bits as the kernel's
                    got = kern.apply(held[0], x, None)
                    (tmp / "full.cu").write_text(source)
                    w4a16_cuda.SOURCE = tmp / "full.cu"
                    w4a16_cuda.compiled.cache_clear()
                    w4a16_cuda.plan.cache_clear()
                    rec["chunk_major_equal"] = bool(torch.equal(got, kern.apply(layers[0], x, None)))
                if variant == "full":
                    ref = x.float() @ dense0.T
                    err = (kern.apply(layers[0], x, None).float() - ref).abs().max().item() / ref.abs().max().item()
                    rec["full_rel_err"], rec["full_tbs"] = err, gbytes / t
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
