"""Two versions of a native CPU kernel source, timed in one process, in turns (a before/after on a noisy machine).

    git show <commit>:plinth/attention_backends/csrc/cpu_paged_attention.cpp > /tmp/attn_old.cpp
    python benchmarks/native_ab.py --what decode-attention --sources /tmp/attn_old.cpp,plinth/attention_backends/csrc/cpu_paged_attention.cpp
    git show <commit>:plinth/kernels/csrc/cpu_ops.cpp > /tmp/ops_old.cpp
    python benchmarks/native_ab.py --what gemm-q8 --rows 1,4,32 --sources /tmp/ops_old.cpp,plinth/kernels/csrc/cpu_ops.cpp
    python benchmarks/native_ab.py --what head --rows 16,31,64 --sources /tmp/ops_old.cpp,plinth/kernels/csrc/cpu_ops.cpp

Each source is built like plinth's own (``plinth.kernels.native_build``, this machine's flags; the includes of
``plinth/kernels/csrc``, though a ``cpu_math.h`` beside a source is the one it includes) under its own cache name, and its C entry point is called through ctypes on the same
inputs; the sources take turns for ``--rounds`` rounds and the median (and the least) of each is printed, with
whether the outputs are equal:

- ``decode-attention``: ``plinth_cpu_paged_decode`` per layer at SmolLM2's shapes (9 query heads, 3 KV heads of
  64), ``--seqs`` sequences of about ``--context`` tokens (random block tables), 30 layers' caches cycled (so they
  come from memory, as in a step), float32 queries over a float32 or (``--kv bfloat16``) bfloat16 cache;
- ``gemm-q8``: ``plinth_q4p_gemm_f32q8``, a decoder layer's four GEMMs (q/k/v, o, gate/up, down) at SmolLM2's
  shapes for 30 layers, ``--rows`` float32 rows, random 4-bit codes (their order does not change the time);
- ``head``: ``plinth_q8_0r8_gemm_f32``, the LM head (49,152 x 576, random Q8_0 blocks), weights evicted between
  calls.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import time
from pathlib import Path

import torch

PTR, INT = ctypes.c_void_p, ctypes.c_int64


def _library(source: Path, name: str, abi_symbol: str) -> ctypes.CDLL:
    from plinth.kernels.native_build import build_and_open

    found = re.search(abi_symbol + r"\(\)\s*\{\s*return\s+(\d+);", source.read_text())
    if not found:
        raise SystemExit(f"{source}: no {abi_symbol}()")
    build = build_and_open(source, name, abi_symbol, int(found.group(1)), f"{source.name} ({name})")
    if build.library is None:
        raise SystemExit(f"{source}: {build.reason}")
    return build.library


def decode_attention(sources: list[Path], args: argparse.Namespace) -> list:
    heads, kv_heads, d, bs, layers = 9, 3, 64, 16, 30
    seqs, ctx = args.seqs, args.context
    nb = -(-ctx // bs)
    gen = torch.Generator().manual_seed(0)
    kv_dtype = torch.bfloat16 if args.kv == "bfloat16" else torch.float32
    caches = [torch.randn(2, seqs * nb + 8, bs, kv_heads, d, generator=gen).to(kv_dtype) for _ in range(layers)]
    tables = torch.stack([torch.randperm(seqs * nb + 8, generator=gen)[:nb] for _ in range(seqs)]).int()
    lens = (ctx - torch.randint(0, bs - 1, (seqs,), generator=gen)).int()
    starts = torch.arange(seqs + 1, dtype=torch.int32)
    q = torch.randn(seqs, heads, d, generator=gen)
    code = 3 if kv_dtype == torch.bfloat16 else 0   # float32 queries over a bfloat16 cache / float32 throughout
    calls = []
    for i, source in enumerate(sources):
        fn = _library(source, f"ab_attn{i}", "plinth_cpu_paged_abi").plinth_cpu_paged_decode
        fn.restype, fn.argtypes = None, [PTR] * 6 + [INT] * 10 + [ctypes.c_double] + [INT] * 2
        out = torch.zeros(seqs, heads, d)

        def call(fn=fn, out=out) -> torch.Tensor:
            for cache in caches:
                fn(q.data_ptr(), cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), starts.data_ptr(),
                   out.data_ptr(), code, seqs, heads, kv_heads, d, cache.shape[1], bs, nb, q.stride(0),
                   out.stride(0), d ** -0.5, 0, torch.get_num_threads())
            return out
        calls.append((call, layers, "us per layer"))
    return calls


def gemm_q8(sources: list[Path], rows: int) -> list:
    shapes = [(3072, 576), (576, 1536), (960, 576), (576, 576)] * 30   # gate/up, down, q/k/v, o; 30 layers
    gen = torch.Generator().manual_seed(0)
    weights = []
    for n, k in shapes:
        tiles = -(-n // 16)
        codes = torch.randint(0, 256, (tiles * k * 8,), dtype=torch.uint8, generator=gen)
        d = (torch.rand(tiles * k // 2, generator=gen) * 0.01).half()
        c = (torch.rand(tiles * k // 2, generator=gen) * -0.01).half()
        weights.append((n, k, codes, d, c))
    x = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
    calls = []
    for i, source in enumerate(sources):
        fn = _library(source, f"ab_ops{i}", "plinth_cpu_ops_abi").plinth_q4p_gemm_f32q8
        fn.restype, fn.argtypes = INT, [PTR, INT, PTR, PTR, PTR, PTR, INT, INT, INT]
        outs = {n: torch.empty(rows, n) for n in (3072, 576, 960)}

        def call(fn=fn, outs=outs) -> torch.Tensor:
            for n, k, codes, d, c in weights:
                fn(x[k].data_ptr(), k, codes.data_ptr(), d.data_ptr(), c.data_ptr(), outs[n].data_ptr(), rows, n, k)
            return torch.cat([o.flatten() for o in outs.values()])
        calls.append((call, 1, "us for 30 layers"))
    return calls


def head(sources: list[Path], rows: int) -> list:
    from plinth.kernels import cpu_native

    n, k = 49152, 576
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (n, k // 32 * 34), dtype=torch.uint8, generator=gen)
    view = blocks.view(n, k // 32, 34)
    view[..., :2] = (torch.rand(n, k // 32, generator=gen) * 0.02).half().view(torch.uint8).view(n, k // 32, 2)
    packed = cpu_native.pack_q8_0_rows8(blocks)
    x = torch.randn(rows, k, generator=gen)
    junk = torch.empty(50_000_000)
    calls = []
    for i, source in enumerate(sources):
        fn = _library(source, f"ab_ops{i}", "plinth_cpu_ops_abi").plinth_q8_0r8_gemm_f32
        fn.restype, fn.argtypes = INT, [PTR, INT, PTR, PTR, INT, INT, INT]
        y = torch.empty(rows, n)

        def call(fn=fn, y=y) -> torch.Tensor:
            junk.add_(1)   # the weights come from memory, as after a step's layers
            fn(x.data_ptr(), k, packed.data_ptr(), y.data_ptr(), rows, n, k)
            return y
        calls.append((call, 1, "us"))
    return calls


def race(name: str, sources: list[Path], calls: list, rounds: int) -> None:
    times: list[list[float]] = [[] for _ in calls]
    results = []
    for rnd in range(rounds):
        for i, (call, per, _) in enumerate(calls):
            t = time.perf_counter()
            out = call()
            times[i].append((time.perf_counter() - t) / per * 1e6)
            if rnd == 0:
                results.append(out.clone())
    for i, source in enumerate(sources):
        kept = times[i][1:] or times[i]
        same = "" if i == 0 else ("  (outputs equal the first's)" if torch.equal(results[i], results[0])
                                  else f"  (outputs differ from the first's by up to "
                                       f"{(results[i] - results[0]).abs().max().item():.3g})")
        print(f"{name}  {source}: median {statistics.median(kept):.0f}, least {min(times[i]):.0f} {calls[i][2]}{same}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=["decode-attention", "gemm-q8", "head"], required=True)
    p.add_argument("--sources", required=True, help="comma-separated C++ files (the first is the reference)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--rows", default="32", help="gemm-q8, head: comma-separated row counts")
    p.add_argument("--seqs", type=int, default=32, help="decode-attention: sequences")
    p.add_argument("--context", type=int, default=330, help="decode-attention: tokens per sequence (about)")
    p.add_argument("--kv", choices=["float32", "bfloat16"], default="float32", help="decode-attention: cache dtype")
    args = p.parse_args()
    sources = [Path(s) for s in args.sources.split(",")]
    if len(sources) < 1 or not all(s.is_file() for s in sources):
        raise SystemExit(f"--sources: not files: {args.sources}")
    print(f"{torch.get_num_threads()} threads; {args.what}")
    if args.what == "decode-attention":
        race(f"{args.seqs} x {args.context} {args.kv} cache", sources, decode_attention(sources, args), args.rounds)
        return
    for rows in (int(r) for r in args.rows.split(",")):
        calls = gemm_q8(sources, rows) if args.what == "gemm-q8" else head(sources, rows)
        race(f"{rows} rows", sources, calls, args.rounds)


if __name__ == "__main__":
    main()
