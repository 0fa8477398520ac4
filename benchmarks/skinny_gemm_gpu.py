"""Decode-sized GEMMs on a GPU: cuBLAS against plinth's skinny Triton kernels, bf16 and W4A16.

    python benchmarks/skinny_gemm_gpu.py --out skinny.json            # Llama-3-8B shapes (~2 min on an H200)
    python benchmarks/skinny_gemm_gpu.py --rows 1 --quick             # the default tiles only

For each Llama-3-8B weight shape and row count, the product runs over ``--copies`` distinct weight
matrices (more bytes than the L2 cache) captured back to back in one CUDA graph, as a decode step
runs them; the figure is the time per product and the weight bytes streamed per second. The
candidates: cuBLAS (``F.linear``), the skinny kernel with its default tiles and with each swept tile;
for W4A16 (RTN, group 128): the Triton GEMM's decode path with its default and swept tiles, and cuBLAS
on the dequantized bf16 weight for reference. Every candidate's output is checked against cuBLAS
(bf16) or the dequantized product (W4A16) first. In these graphs ``cuda_w4a16`` (``--parts w4cuda``) is
launched with programmatic dependent launch on Hopper, as in a decode step (each product starts while the
one before finishes), the other kernels are not: ``PLINTH_PDL=0`` compares them launched alike.
"""

# ruff: noqa: B023  (the timing lambdas run before their loop variables change)
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="default tiles only (no sweep)")
    p.add_argument("--w4cuda-sweep", default="2x3,2x4,2x6,2x8,4x3,4x4,4x6,4x8,8x3,8x4,8x6,8x8",
                   help="the cuda_w4a16 launches swept (--parts w4cuda): WARPSxSTAGES, comma-separated")
    p.add_argument("--parts", default="bf16,w4a16")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def graph_time(fn: Any, copies: int, replays: int) -> float:
    """Milliseconds per product: ``copies`` products in one graph, replayed, median of replays."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / copies)
    return statistics.median(times)


def bf16_part(a: argparse.Namespace, rows: list[int]) -> list[dict[str, Any]]:
    from plinth.kernels import ops

    out = []
    sweep_m1 = [ops.SkinnyTiles(bn, bk, sp, w, st) for bn, bk, sp, w, st in itertools.product(
        (4, 8, 16), (512, 1024), (1, 2), (4,), (2, 3))]
    sweep_mx = [ops.SkinnyTiles(bn, bk, sp, w, st) for bn, bk, sp, w, st in itertools.product(
        (16, 32), (128, 256), (1, 2), (4,), (3,))]
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        copies = a.copies if name != "lm_head" else 2
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
        gbytes = n * k * 2 / 1e9
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x, ws[0]).float()
            rec: dict[str, Any] = {"part": "bf16", "shape": name, "n": n, "k": k, "m": m}
            t = graph_time(lambda i: F.linear(x, ws[i]), copies, a.replays)
            rec["cublas_ms"], rec["cublas_tbs"] = t, gbytes / t
            t = graph_time(lambda i: ops.skinny_linear(x, ws[i]), copies, a.replays)
            err = (ops.skinny_linear(x, ws[0]).float() - ref).abs().max().item()
            rec["default_ms"], rec["default_tbs"], rec["default_err"] = t, gbytes / t, err
            rec["default_tiles"] = str(ops.default_tiles(m, n, k, ops.num_sms(x.device)))
            if not a.quick:
                best = None
                for tiles in (sweep_m1 if m == 1 else sweep_mx):
                    if k % (tiles.block_k * tiles.split_k):
                        continue
                    try:
                        t = graph_time(lambda i, tl=tiles: ops.skinny_linear(x, ws[i], tiles=tl), copies, a.replays)
                    except Exception as exc:  # noqa: BLE001 - a tile that does not compile is skipped
                        print(f"  skip {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, tiles)
                if best is not None:
                    err = (ops.skinny_linear(x, ws[0], tiles=best[1]).float() - ref).abs().max().item()
                    rec["best_ms"], rec["best_tbs"], rec["best_tiles"], rec["best_err"] = (
                        best[0], gbytes / best[0], str(best[1]), err)
            print(json.dumps(rec), flush=True)
            out.append(rec)
        torch.cuda.empty_cache()
    return out


def _int4_shapes(a: argparse.Namespace) -> list[tuple[str, int, int, Any]]:
    """``(name, N, K, GemmProblem)`` of the asked shapes that the int4 parts run (RTN, group 128, bf16)."""
    from plinth.quantization.kernels.interface import GemmProblem

    return [(name, *SHAPES[name], GemmProblem("int", torch.bfloat16, "cuda", capability=torch.cuda.get_device_capability(),
                                              bits=4, group_size=128, shapes=(SHAPES[name],)))
            for name in a.shapes.split(",") if name != "lm_head"]


def w4a16_part(a: argparse.Namespace, rows: list[int]) -> list[dict[str, Any]]:
    from plinth.quantization.kernels.w4a16_triton import TritonW4A16Kernel
    from plinth.quantization.quantizers import random_int_weights
    from plinth.quantization.selection import holder

    out = []
    from plinth.quantization.kernels.int4pack import TorchInt4PackKernel

    sweep = [f"{bn},{sp},{split},{w}" for bn, sp, split, w in itertools.product((8, 16, 32), (2, 4, 8), (1, 2, 4), (2, 4))]
    for name, n, k, problem in _int4_shapes(a):
        kernel = TritonW4A16Kernel(problem)
        tinygemm = TorchInt4PackKernel(problem) if TorchInt4PackKernel.supports(problem) else None
        copies = a.copies
        layers, dense, packed = [], [], []
        for c in range(copies):
            gen = torch.Generator(device="cuda").manual_seed(c)
            w = random_int_weights(n, k, 4, 128, symmetric=False, act_order=False, device=torch.device("cuda"),
                                   generator=gen)
            layers.append(holder(kernel.prepare(w)))
            if tinygemm is not None:
                packed.append(holder(tinygemm.prepare(w)))
            if c == 0:
                dense.append(w.dequantize(torch.bfloat16))
        gbytes = (n * k / 2 + 2 * n * (k // 128) * 4) / 1e9
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x.float(), dense[0].float())
            rec: dict[str, Any] = {"part": "w4a16", "shape": name, "n": n, "k": k, "m": m}
            t = graph_time(lambda i: F.linear(x, dense[0]), 1, a.replays)
            rec["dequant_cublas_ms"] = t
            os.environ.pop("PLINTH_W4A16_GEMV", None)
            t = graph_time(lambda i: kernel.apply(layers[i], x, None), copies, a.replays)
            err = (kernel.apply(layers[0], x, None).float() - ref).abs().max().item() / ref.abs().max().item()
            rec["default_ms"], rec["default_tbs"], rec["default_rel_err"] = t, gbytes / t, err
            if tinygemm is not None:
                rec["int4pack_ms"] = graph_time(lambda i: tinygemm.apply(packed[i], x, None), copies, a.replays)
            if not a.quick and m == 1:
                best = None
                for tiles in sweep:
                    os.environ["PLINTH_W4A16_GEMV"] = tiles
                    try:
                        t = graph_time(lambda i: kernel.apply(layers[i], x, None), copies, a.replays)
                    except Exception as exc:  # noqa: BLE001
                        print(f"  skip {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    if best is None or t < best[0]:
                        err = (kernel.apply(layers[0], x, None).float() - ref).abs().max().item() / ref.abs().max().item()
                        best = (t, tiles, err)
                os.environ.pop("PLINTH_W4A16_GEMV", None)
                if best is not None:
                    rec["best_ms"], rec["best_tbs"], rec["best_tiles"], rec["best_rel_err"] = (
                        best[0], gbytes / best[0], best[1], best[2])
            print(json.dumps(rec), flush=True)
            out.append(rec)
        torch.cuda.empty_cache()
    return out


def w4mma_part(a: argparse.Namespace, rows: list[int]) -> list[dict[str, Any]]:
    """The tensor-core W4A16 kernels for decode rows (group 128, TILE 128), swept over their launch."""
    from plinth.quantization.kernels.int4pack import TorchInt4PackKernel
    from plinth.quantization.kernels.w4a16_triton import interleave_codes, load_jit_module
    from plinth.quantization.packing import pack_int32
    from plinth.quantization.quantizers import random_int_weights
    from plinth.quantization.selection import holder

    jit = load_jit_module()
    out = []
    sweep = list(itertools.product((32, 64, 128), (1, 2, 4), (2,), (3, 4)))
    fold_sweep = list(itertools.product((2, 4, 8, 16), (4, 8, 16, 32), (1, 2, 4), (1, 2, 4)))
    if a.quick:
        sweep, fold_sweep = [(64, 4, 2, 3), (128, 2, 2, 3)], [(16, 4, 1, 4), (16, 4, 2, 4)]
    variants = {"planes": (jit.w4a16_mma_kernel, interleave_codes)}
    for name, n, k, problem in _int4_shapes(a):
        tinygemm = TorchInt4PackKernel(problem)
        ws, packed = [], []
        for c in range(a.copies):
            gen = torch.Generator(device="cuda").manual_seed(c)
            ws.append(random_int_weights(n, k, 4, 128, symmetric=False, act_order=False, device=torch.device("cuda"),
                                         generator=gen))
            packed.append(holder(tinygemm.prepare(ws[-1])))
        dense0 = ws[0].dequantize(torch.float32)
        gbytes = (n * k / 2 + 2 * n * (k // 128) * 4) / 1e9
        layouts = {v: [pack_int32(lay(w.q, 128), 4, dim=1) for w in ws] for v, (_kern, lay) in variants.items()}
        scales = [w.scales.float().contiguous() for w in ws]
        zeros = [w.zeros.float().contiguous() for w in ws]
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = x.float() @ dense0.T
            rec: dict[str, Any] = {"part": "w4mma", "shape": name, "n": n, "k": k, "m": m, "gbytes": gbytes}
            rec["int4pack_ms"] = graph_time(lambda i: tinygemm.apply(packed[i], x, None), a.copies, a.replays)

            def launch(i, kern, v, bn, split, warps, stages, asm):
                y = (torch.zeros(m, n, dtype=torch.float32, device="cuda") if split > 1
                     else torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
                q = layouts[v][i]
                kern[(-(-m // 16), -(-n // bn), split)](
                    x, q, scales[i], zeros[i], y, m, n, k, x.stride(0), q.stride(0), scales[i].stride(0), y.stride(0),
                    GROUP_SIZE=128, TILE=128, BLOCK_N=bn, SPLIT_K=split, MAGIC_BITS=0x4300, MAGIC=128.0, ASM=asm,
                    num_warps=warps, num_stages=stages)
                return y.to(torch.bfloat16) if split > 1 else y

            def fold(i, bn, spans, split, warps):
                y = (torch.zeros(1, n, dtype=torch.float32, device="cuda") if split > 1
                     else torch.empty(1, n, dtype=torch.bfloat16, device="cuda"))
                q = layouts["planes"][i]
                jit.w4a16_gemv_fold_kernel[(-(-n // bn), split)](
                    x, q, scales[i], zeros[i], y, n, k, q.stride(0), scales[i].stride(0),
                    GROUP_SIZE=128, TILE=128, SPANS=spans, BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=1)
                return y.to(torch.bfloat16) if split > 1 else y

            if m == 1:
                best = None
                for cfg in fold_sweep:
                    if k % (128 * cfg[1] * cfg[2]):
                        continue
                    try:
                        err = (fold(0, *cfg).float() - ref).abs().max().item()
                        t = graph_time(lambda i: fold(i, *cfg), a.copies, a.replays)
                    except Exception as exc:  # noqa: BLE001 - a launch that does not compile is skipped
                        print(f"  skip fold {cfg}: {type(exc).__name__}: {str(exc)[-300:]}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg, err / ref.abs().max().item())
                if best is not None:
                    rec["fold_ms"], rec["fold_tbs"], rec["fold_tiles"], rec["fold_rel_err"] = (
                        best[0], gbytes / best[0], best[1], best[2])

            for v, (kern, _lay) in variants.items():
                best = None
                for bn, split, warps, stages in sweep:
                    if (k // 128) % split:
                        continue
                    try:
                        err = (launch(0, kern, v, bn, split, warps, stages, True).float() - ref).abs().max().item()
                        t = graph_time(lambda i: launch(i, kern, v, bn, split, warps, stages, True), a.copies, a.replays)
                    except Exception as exc:  # noqa: BLE001 - a launch that does not compile is skipped
                        print(f"  skip {v} {(bn, split, warps, stages)}: {type(exc).__name__}: {str(exc)[-300:]}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, (bn, split, warps, stages), err / ref.abs().max().item())
                if best is None:
                    continue
                rec[f"{v}_ms"], rec[f"{v}_tbs"], rec[f"{v}_tiles"], rec[f"{v}_rel_err"] = (
                    best[0], gbytes / best[0], best[1], best[2])
            print(json.dumps(rec), flush=True)
            out.append(rec)
        torch.cuda.empty_cache()
    return out


def w4cuda_part(a: argparse.Namespace, rows: list[int]) -> list[dict[str, Any]]:
    """The NVRTC tensor-core decode kernel (``cuda_w4a16``) against torch's int4 kernel and the Triton
    decode kernels (``triton_w4a16``: the GEMV for one row, the tensor-core kernel for 2-16), RTN group 128;
    the CUDA kernel at its default launch and swept over ``PLINTH_W4A16_CUDA="WARPS,STAGES"``."""
    from plinth.kernels import ops
    from plinth.quantization.kernels.int4pack import TorchInt4PackKernel
    from plinth.quantization.kernels.w4a16_cuda import CudaW4A16Kernel, launch_config, registers
    from plinth.quantization.kernels.w4a16_triton import TritonW4A16Kernel
    from plinth.quantization.quantizers import random_int_weights
    from plinth.quantization.selection import holder

    out = []
    sms = ops.num_sms(torch.device("cuda", torch.cuda.current_device()))
    sweep = [tuple(int(v) for v in item.split("x")) for item in a.w4cuda_sweep.split(",")]
    if a.quick:
        sweep = []
    for name, n, k, problem in _int4_shapes(a):
        kernels = {"int4pack": TorchInt4PackKernel(problem), "triton": TritonW4A16Kernel(problem),
                   "cuda": CudaW4A16Kernel(problem)}
        layers: dict[str, list[Any]] = {key: [] for key in kernels}
        for c in range(a.copies):
            gen = torch.Generator(device="cuda").manual_seed(c)
            w = random_int_weights(n, k, 4, 128, symmetric=False, act_order=False, device=torch.device("cuda"),
                                   generator=gen)
            for key, kern in kernels.items():
                layers[key].append(holder(kern.prepare(w)))
            if c == 0:
                dense0 = w.dequantize(torch.float32)
        gbytes = (n * k / 2 + n * (k // 128) * 4) / 1e9
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = x.float() @ dense0.T
            scale = ref.abs().max().item()
            rec: dict[str, Any] = {"part": "w4cuda", "shape": name, "n": n, "k": k, "m": m, "gbytes": gbytes,
                                   "cuda_default": str(launch_config(k, n, m, sms)),
                                   "cuda_registers": registers(True, 1 if m <= 8 else 2, launch_config(k, n, m, sms)[1])}
            for key, kern in kernels.items():
                err = (kern.apply(layers[key][0], x, None).float() - ref).abs().max().item() / scale
                t = graph_time(lambda i: kern.apply(layers[key][i], x, None), a.copies, a.replays)
                rec[f"{key}_us"], rec[f"{key}_tbs"], rec[f"{key}_rel_err"] = t * 1e3, gbytes / t, err
            best = None
            for warps, stages in sweep:
                os.environ["PLINTH_W4A16_CUDA"] = f"{warps},{stages}"
                kern = kernels["cuda"]
                try:
                    t = graph_time(lambda i: kern.apply(layers["cuda"][i], x, None), a.copies, a.replays)
                except Exception as exc:  # noqa: BLE001 - a launch that does not build is skipped
                    print(f"  skip {warps},{stages}: {type(exc).__name__}: {str(exc)[-300:]}")
                    continue
                rec[f"cuda_{warps}x{stages}_us"] = t * 1e3
                if best is None or t < best[0]:
                    best = (t, f"{warps},{stages}")
            os.environ.pop("PLINTH_W4A16_CUDA", None)
            if best is not None:
                rec["cuda_best_us"], rec["cuda_best_tbs"], rec["cuda_best_launch"] = best[0] * 1e3, gbytes / best[0], best[1]
            print(json.dumps(rec), flush=True)
            out.append(rec)
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    rows = [int(r) for r in a.rows.split(",")]
    results: list[dict[str, Any]] = []
    if "bf16" in a.parts:
        results += bf16_part(a, rows)
    if "w4a16" in a.parts.split(","):
        results += w4a16_part(a, rows)
    if "w4mma" in a.parts.split(","):
        results += w4mma_part(a, rows)
    if "w4cuda" in a.parts.split(","):
        results += w4cuda_part(a, rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
