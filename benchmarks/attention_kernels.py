"""Micro-benchmark of the Triton paged-attention kernels against torch SDPA (CUDA only).

    python benchmarks/attention_kernels.py --out attention_kernels.json

Cases (32 query heads, 8 KV heads, head size 128, bf16, 16-token blocks, shuffled blocks):
  - prefill 4k causal: TFLOP/s against SDPA on contiguous tensors (lower-right causal mask);
  - extend: 1k new tokens after 3k cached ones;
  - decode batch 64 x context 2k, and batch 16 x context 8k: GB/s of KV read against SDPA on
    a cache gathered into contiguous ``[B, H_kv, L, D]`` tensors beforehand (gather not timed).
Each figure is set against the floor measured on the same device: a device-to-device copy for
bandwidth and a large bf16 matmul for FLOP/s. The table is printed; the JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plinth.attention_backends.interface import AttentionMetadata  # noqa: E402
from plinth.attention_backends.triton import tiles  # noqa: E402
from plinth.attention_backends.triton.backend import TritonAttentionBackend  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bench_ms(fn, warmup_ms: float, rep_ms: float) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def measured_ceilings(dtype: torch.dtype, warmup_ms: float, rep_ms: float) -> dict[str, float]:
    """Device-to-device copy bandwidth (read + write) and the dense matmul rate, measured here."""
    src = torch.randn(1 << 28, device="cuda", dtype=torch.float32)   # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src), warmup_ms, rep_ms)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    mm_ms = bench_ms(lambda: a @ b, warmup_ms, rep_ms)
    return {"copy_gb_s": 2 * (1 << 30) / copy_ms / 1e6, "matmul_tflop_s": 2 * n**3 / mm_ms / 1e9}


def paged_batch(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_size: int, dtype: torch.dtype,
                block_size: int, seed: int = 0):
    """A step over shuffled blocks; returns (query, key, value, kv_cache, metadata, full K, full V)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in seqs]
    nblk = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 1 + sum(nblk)
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros(len(seqs), max(nblk), dtype=torch.int32)
    kv_cache = torch.empty(2, num_blocks, block_size, kv_heads, head_size, dtype=dtype, device="cuda")
    flat = kv_cache.view(2, -1, kv_heads, head_size)
    used, slots, full_k, full_v, new_k, new_v = 0, [], [], [], [], []
    for s, (ctx, _) in enumerate(seqs):
        tables[s, : nblk[s]] = order[used: used + nblk[s]].to(torch.int32)
        used += nblk[s]
        pos = torch.arange(seq_lens[s])
        slot = (tables[s, pos // block_size].long() * block_size + pos % block_size).cuda()
        k = torch.randn(seq_lens[s], kv_heads, head_size, device="cuda", dtype=dtype)
        v = torch.randn(seq_lens[s], kv_heads, head_size, device="cuda", dtype=dtype)
        flat[0, slot] = k
        flat[1, slot] = v
        full_k.append(k)
        full_v.append(v)
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
        slots.append(slot[ctx:])
    qsl = [0]
    for _, q in seqs:
        qsl.append(qsl[-1] + q)
    md = AttentionMetadata(
        num_tokens=qsl[-1], num_seqs=len(seqs), max_query_len=max(q for _, q in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32, device="cuda"),
        slot_mapping=torch.cat(slots), block_tables=tables.cuda(),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    query = torch.randn(qsl[-1], heads, head_size, device="cuda", dtype=dtype)
    return query, torch.cat(new_k), torch.cat(new_v), kv_cache, md, full_k, full_v


def run_case(name: str, seqs: list[tuple[int, int]], args, ceilings: dict[str, float]) -> dict:
    heads, kv_heads, d, dtype = args.heads, args.kv_heads, args.head_size, DTYPES[args.dtype]
    query, key, value, kv_cache, md, full_k, full_v = paged_batch(seqs, heads, kv_heads, d, dtype, args.block_size)
    scale = d**-0.5
    backend = TritonAttentionBackend()
    backend.prepare(md)

    def triton_step():
        backend.forward(query, key, value, kv_cache, md, scale=scale)

    triton_ms = bench_ms(triton_step, args.warmup_ms, args.rep_ms)
    elt = kv_cache.element_size()
    visible = sum(sum(range(c + 1, c + q + 1)) for c, q in seqs)        # (query, key) pairs
    flops = 4 * heads * d * visible
    kv_bytes = sum(c + q for c, q in seqs) * kv_heads * d * 2 * elt
    io_bytes = kv_bytes + 2 * query.numel() * elt
    decode = md.is_decode_only

    # SDPA on contiguous tensors: [B, H, L, D]; every sequence of a case has the same shape
    q_len, n = seqs[0][1], sum(seqs[0])
    q4 = query.view(len(seqs), q_len, heads, d).transpose(1, 2).contiguous()
    k4 = torch.stack(full_k).transpose(1, 2).contiguous()                 # [B, Hkv, n, D]
    v4 = torch.stack(full_v).transpose(1, 2).contiguous()
    if decode:
        def sdpa_step():
            F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=True)
    else:
        from torch.nn.attention.bias import causal_lower_right

        group = heads // kv_heads
        k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
        mask = causal_lower_right(q_len, n)

        def sdpa_step():
            F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
    sdpa_ms = bench_ms(sdpa_step, args.warmup_ms, args.rep_ms)

    floor_ms = max(io_bytes / ceilings["copy_gb_s"] / 1e6, flops / ceilings["matmul_tflop_s"] / 1e9)
    return {
        "case": name, "seqs": len(seqs), "context": seqs[0][0], "new_tokens": q_len, "decode": decode,
        "triton_ms": triton_ms, "sdpa_ms": sdpa_ms, "floor_ms": floor_ms,
        "triton_tflop_s": flops / triton_ms / 1e9, "sdpa_tflop_s": flops / sdpa_ms / 1e9,
        "triton_gb_s": io_bytes / triton_ms / 1e6, "sdpa_gb_s": io_bytes / sdpa_ms / 1e6,
    }


def sweep(args) -> list[dict]:
    """Time the prefill and decode kernels over a grid of tile configurations (for tuning)."""
    heads, kv_heads, d, dtype = args.heads, args.kv_heads, args.head_size, DTYPES[args.dtype]
    group = heads // kv_heads
    rows = []
    default_prefill, default_decode = tiles.prefill_tiles, tiles.decode_tiles
    batch = paged_batch([(0, 4096)], heads, kv_heads, d, dtype, args.block_size)
    flops = 4 * heads * d * 4096 * 4097 // 2
    try:
        for bm in (64, 128):
            for bn in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        cfg = tiles.PrefillTiles(bm, bm // group, bn, warps, stages)
                        tiles.prefill_tiles = lambda *a, cfg=cfg: cfg
                        ms = _time_forward(TritonAttentionBackend(), batch, d, args)
                        rows.append({"kind": "prefill", "config": str(cfg), "ms": ms, "tflop_s": flops / ms / 1e9})
        tiles.prefill_tiles = default_prefill
        batch = paged_batch([(2047, 1)] * 64, heads, kv_heads, d, dtype, args.block_size)
        nbytes = 64 * 2048 * kv_heads * d * 2 * 2
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    for splits in (1, 2, 4):
                        cfg = tiles.DecodeTiles(max(16, group), bn, warps, stages)
                        tiles.decode_tiles = lambda *a, cfg=cfg: cfg
                        ms = _time_forward(TritonAttentionBackend(decode_splits=splits), batch, d, args)
                        rows.append({"kind": "decode", "config": f"{cfg} splits={splits}", "ms": ms,
                                     "gb_s": nbytes / ms / 1e6})
    finally:
        tiles.prefill_tiles, tiles.decode_tiles = default_prefill, default_decode
    for kind, key in (("prefill", "tflop_s"), ("decode", "gb_s")):
        best = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["ms"])[:8]
        for r in best:
            print(f"{kind:<8} {r['ms']:8.3f} ms {r[key]:8.0f} {key}  {r['config']}")
    return rows


def _time_forward(backend: TritonAttentionBackend, batch, head_size: int, args) -> float:
    query, key, value, kv_cache, md, _, _ = batch
    backend.prepare(md)
    try:
        return bench_ms(lambda: backend.forward(query, key, value, kv_cache, md, scale=head_size**-0.5),
                        args.warmup_ms / 5, args.rep_ms / 5)
    except Exception as exc:  # a configuration the compiler cannot fit (shared memory, registers)
        print(f"  skipped: {type(exc).__name__}: {str(exc)[:120]}")
        return float("inf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup-ms", type=float, default=50.0)
    p.add_argument("--rep-ms", type=float, default=300.0)
    p.add_argument("--sweep", action="store_true", help="time a grid of tile configurations instead")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_kernels.py needs a CUDA device")
    if args.sweep:
        rows = sweep(args)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "sweep": rows}, indent=2))
        return

    ceilings = measured_ceilings(DTYPES[args.dtype], args.warmup_ms, args.rep_ms)
    cases = {
        "prefill 4k causal": [(0, 4096)],
        "extend 1k after 3k": [(3072, 1024)],
        "decode 64 x 2k": [(2047, 1)] * 64,
        "decode 16 x 8k": [(8191, 1)] * 16,
    }
    rows = [run_case(name, seqs, args, ceilings) for name, seqs in cases.items()]

    print(f"device: {torch.cuda.get_device_name()}  dtype {args.dtype}  heads {args.heads}/{args.kv_heads}  "
          f"d {args.head_size}  block {args.block_size}")
    print(f"measured ceilings: copy {ceilings['copy_gb_s']:.0f} GB/s, matmul {ceilings['matmul_tflop_s']:.0f} TFLOP/s")
    print(f"{'case':<20} {'triton ms':>10} {'sdpa ms':>9} {'floor ms':>9} {'triton':>16} {'sdpa':>16}")
    for r in rows:
        unit, key = ("GB/s", "gb_s") if r["decode"] else ("TFLOP/s", "tflop_s")
        print(f"{r['case']:<20} {r['triton_ms']:>10.3f} {r['sdpa_ms']:>9.3f} {r['floor_ms']:>9.3f} "
              f"{r['triton_' + key]:>8.0f} {unit:<7} {r['sdpa_' + key]:>8.0f} {unit:<7}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "ceilings": ceilings, "results": rows,
        }, indent=2))


if __name__ == "__main__":
    main()
