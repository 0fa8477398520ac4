"""One mixture-of-experts layer with its experts in each storage plinth has: the model's dtype, FP8 (per channel and
128x128 blocks) and INT4 (groups of 128, two codes per byte). Reports the experts' bytes and the layer's time for a
decode step (1 and 16 tokens) and a prefill chunk (256 tokens), and the output's relative RMS difference from the
float layer's. Where a step has a second device path, it is timed too (``ms_N_tokens_widened``: quantized experts
widened in runs onto grouped GEMMs instead of the Triton grouped kernel; ``ms_N_tokens_triton_kernel``: float
experts on the Triton grouped kernel instead of torch's grouped GEMMs).

The shape defaults to one layer of Qwen3-30B-A3B (128 experts, top 8, hidden 2048, expert width 768).

``--sweep-tiles`` also times every step that takes the Triton grouped kernel with each candidate of
``--tile-candidates`` (``block_m/BLOCK_N/BLOCK_K/warps/stages``, comma-separated; rows per block of one expert,
the weight tile, Triton's launch settings): ``tiles_N_tokens`` maps each to its ms (or the error it raised), with
the output's relative RMS difference from the default tiles' (``tiles_N_tokens_max_rel_diff``), and
``tiles_N_tokens_best`` names the fastest.

    python benchmarks/moe_experts.py [--device cpu|cuda] [--dtype float32|bfloat16] [--out results.json]
    python benchmarks/moe_experts.py --device cuda --dtype bfloat16 --tokens 32,256,2048 --sweep-tiles
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from plinth.model_registry.layers.moe import FusedMoE
from plinth.quantization.fp8_experts import FP8ExpertMethod
from plinth.quantization.int_experts import IntExpertMethod
from plinth.quantization.quantizers import quantize_int_rtn


class _Int4:
    """The float-weight side of plinth's ``int4`` method (round-to-nearest, asymmetric, groups of 128)."""

    @staticmethod
    def float_weights(weight: torch.Tensor):
        return quantize_int_rtn(weight, 4, 128)


def build(fmt: str, args, float_state: dict[str, torch.Tensor]) -> FusedMoE:
    with torch.device(args.device):
        moe = FusedMoE(args.experts, args.top_k, args.hidden, args.inter, renormalize=True)
    moe.load_state_dict(float_state)
    if fmt == "float":
        return moe.to(args.dtype)
    if fmt == "fp8-block":   # quantized per 128x128 block, as DeepSeek's and Qwen3's FP8 releases store them
        method = FP8ExpertMethod(from_checkpoint=True, block=(128, 128))
        method.create_weights(moe)
        for which, w in (("w13", float_state["w13_weight"]), ("w2", float_state["w2_weight"])):
            e, n, k = w.shape
            blocks = w.float().reshape(e, n // 128, 128, k // 128, 128)
            s = blocks.abs().amax(dim=(2, 4)) / 448.0
            q = (blocks / s[:, :, None, :, None]).reshape(e, n, k).to(torch.float8_e4m3fn)
            getattr(moe, f"{which}_weight").data.copy_(q.view(torch.uint8))
            getattr(moe, f"{which}_weight_scale_inv").data.copy_(s)
    else:                    # float experts quantized once loaded, as --quantization fp8 / int4 do
        method = FP8ExpertMethod(from_checkpoint=False) if fmt == "fp8-channel" else \
            IntExpertMethod(_Int4(), from_checkpoint=False)
        method.create_weights(moe)
    moe.weight_method = method
    method.process_weights_after_loading(moe)
    return moe


def expert_bytes(moe: FusedMoE) -> int:
    return sum(p.numel() * p.element_size() for n, p in moe.named_parameters() if n.startswith(("w13", "w2")))


def time_it(fn, iters: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: ``block_m/BLOCK_N/BLOCK_K/warps/stages`` tried by ``--sweep-tiles`` (the first: the kernel's former fixed tiles; the default
#: now depends on the step, :func:`plinth.kernels.ops.moe_grouped_tiles`)
DEFAULT_TILE_CANDIDATES = ",".join(f"{m}/{t}" for m in (32, 16, 64) for t in ("64/64/4/2", "128/64/4/3",
                                                                             "64/128/4/3", "128/128/8/3"))


def parse_tiles(text: str) -> tuple[int, tuple[int, int, int, int]]:
    """``"32/64/64/4/2"`` -> ``(32, (64, 64, 4, 2))``; powers of two for the block sizes and warps."""
    parts = text.strip().split("/")
    if len(parts) != 5 or not all(v.isdigit() and int(v) > 0 for v in parts):
        raise ValueError(f"tile candidate {text!r}: expected block_m/BLOCK_N/BLOCK_K/warps/stages, positive integers")
    block_m, block_n, block_k, warps, stages = (int(v) for v in parts)
    if any(v & (v - 1) for v in (block_m, block_n, block_k, warps)):
        raise ValueError(f"tile candidate {text!r}: block sizes and warps must be powers of two")
    return block_m, (block_n, block_k, warps, stages)


def sweep_tiles(moe: FusedMoE, x: torch.Tensor, logits: torch.Tensor, default_out: torch.Tensor,
                candidates: list[tuple[int, tuple[int, int, int, int]]], iters: int, sync, tokens: int) -> dict:
    """The layer's time with each grouped-kernel tile candidate (the same routing and inputs)."""
    times: dict[str, float | str] = {}
    worst = 0.0
    for block_m, tiles in candidates:
        key = "/".join(str(v) for v in (block_m, *tiles))
        moe.grouped_kernel_tiles = (block_m, tiles)
        try:
            out = moe(x, logits).float()
            worst = max(worst, float((out - default_out).norm() / default_out.norm()))
            times[key] = round(1000 * time_it(lambda: moe(x, logits), iters, sync), 3)
        except Exception as e:   # a candidate the device cannot run (shared memory, registers): recorded, skipped
            times[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    moe.grouped_kernel_tiles = None
    timed = {k: v for k, v in times.items() if isinstance(v, float)}
    return {f"tiles_{tokens}_tokens": times, f"tiles_{tokens}_tokens_max_rel_diff": round(worst, 5),
            f"tiles_{tokens}_tokens_best": min(timed, key=timed.get) if timed else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--tokens", default="1,16,256")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    p.add_argument("--out", default=None)
    p.add_argument("--sweep-tiles", action="store_true", help="time the grouped kernel's tile candidates")
    p.add_argument("--tile-candidates", default=DEFAULT_TILE_CANDIDATES,
                   help="block_m/BLOCK_N/BLOCK_K/warps/stages, comma-separated")
    args = p.parse_args()
    try:
        candidates = [parse_tiles(c) for c in args.tile_candidates.split(",")] if args.sweep_tiles else []
    except ValueError as e:
        p.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    float_state = {"w13_weight": torch.randn(args.experts, 2 * args.inter, args.hidden, generator=g) * 0.02,
                   "w2_weight": torch.randn(args.experts, args.hidden, args.inter, generator=g) * 0.02}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows = []
    reference = {}
    for fmt in ("float", "fp8-channel", "fp8-block", "int4-g128"):
        moe = build(fmt, args, float_state)
        row = {"format": fmt, "expert_bytes": expert_bytes(moe)}
        for t in (int(v) for v in args.tokens.split(",")):
            gen = torch.Generator().manual_seed(t)
            x = torch.randn(t, args.hidden, generator=gen).to(args.device, args.dtype)
            logits = torch.randn(t, args.experts, generator=gen).to(args.device)
            with torch.no_grad():
                out = moe(x, logits).float()
                row[f"ms_{t}_tokens"] = round(1000 * time_it(lambda m=moe, x=x, lg=logits: m(x, lg), args.iters,
                                                             sync), 3)
                # the other device path of the same step, side by side: the widened runs for quantized experts
                # that take the Triton grouped kernel; that kernel for float experts on the grouped GEMMs
                other = None
                if moe.uses_grouped_kernel(x) and moe.uses_widened_grouped_gemm(x):
                    other, off = "widened", "uses_grouped_kernel"
                elif moe.uses_grouped_gemm(x) and not moe.uses_gemv(x) and moe._kernels_read(x.device):
                    other, off = "triton_kernel", "uses_grouped_gemm"
                if other is not None:
                    setattr(moe, off, lambda _x: False)
                    row[f"ms_{t}_tokens_{other}"] = round(1000 * time_it(lambda m=moe, x=x, lg=logits: m(x, lg),
                                                                         args.iters, sync), 3)
                    delattr(moe, off)
                if candidates and moe.uses_grouped_kernel(x):
                    row.update(sweep_tiles(moe, x, logits, out, candidates, args.iters, sync, t))
            if fmt == "float":
                reference[t] = out
            else:
                ref = reference[t]
                row[f"rel_err_{t}_tokens"] = round(float((out - ref).norm() / ref.norm()), 4)   # relative RMS
        rows.append(row)
        print(json.dumps(row))
        del moe
        result = {"device": args.device, "dtype": str(args.dtype).removeprefix("torch."),
                  "threads": torch.get_num_threads(),
                  "shape": {"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden, "inter": args.inter},
                  "rows": rows}
        if args.out:   # after every format: a run cut short keeps the rows it finished
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
