"""Parts of a CPU step on the default model, timed one at a time (two threads).

* ``sampler``: sampling 32 rows of the 49k vocabulary at temperature 1 (the native draw where it runs, and torch's)
  and greedily;
* ``prefill-kernel``: prefill attention per layer (SmolLM2 shapes, the default model's dtype here): one
  500-token prompt, and a 224-token chunk after 100 cached tokens, through ``cpu_paged`` (its native kernel
  where the CPU has one) and through the ``torch_batched`` path it falls back to; in bfloat16 also one 500-token
  prompt through the AMX prefill kernel (where it runs) and torch's fused attention;
* ``decode-kernel``: ``paged_decode`` per layer for 32 sequences of 330 tokens and for one sequence of 128 and
  of 2,000 tokens, in a cache of 30 layers in the default model's dtype here (and in FP8 E4M3, ``fp8_`` keys, where
  the kernel reads it; for a float32 model also a bfloat16 cache, ``bf16kv_`` keys, where it reads one), cold (a
  64 MiB write between calls, as the GEMMs between layers evict the caches), cycled (the 30 layers in turn, nothing between) and warm; a
  bfloat16 cache on AMX tiles where the kernel takes them and on AVX512-BF16 vectors (``vec_`` keys);
* ``decode-gemv``: a decode step's int4 GEMMs per layer (qkv / o / gate_up / down at SmolLM2 shapes, random
  4-bit codes) for 1 and 4 input rows, 30 layers cycled so the weights come from memory as in a step: torch's
  ``_weight_int4pack_mm_for_cpu`` against plinth's native panel GEMV (``Q4Gemv``), with the GB/s of the 4-bit
  codes, scales and offsets streamed;
* ``gate-up``: the MLP's gate/up GEMM and SiLU-and-mul for 32, 128 and 500 rows, 30 layers cycled: the AMX panel
  GEMM then the activation against the GEMM with the activation in its epilogue (CPUs with AMX-BF16);
* ``amx-gemms``: a step's four 4-bit GEMMs (q/k/v, o, gate/up, down), 30 layers cycled, on AMX tiles at 8, 32, 128
  and 500 rows (CPUs with AMX-BF16);
* ``f32-gemm``: the float32 GEMMs of a float32 GGUF model on a CPU without native bfloat16, per layer (SmolLM2
  shapes, 30 layers cycled as in a step; 6 at 128 and 512 rows, where the GEMMs are compute-bound) for 1-512 rows: the float32 panel GEMV (``Q4GemvF32``, at most 16
  rows), the 8-bit-input panel GEMM (``Q4GemmF32Q8``), oneDNN's packed float32 GEMM and ``F.linear`` (MKL);
  and the Q8_0 LM head at 1-4 and 8 rows with float32 and with 8-bit inputs, and at 8-256 rows over its regrouped
  blocks in float32 against oneDNN's packed float32 GEMM (weights cold);
* ``lm-head``: a GGUF Q8_0 LM head (49,152 x 576, random codes and scales) at 1-64 rows, warm and cold (a 400 MiB write
  between calls): the AMX GEMM over the regrouped blocks (``q8_panel_matmul``, CPUs with AMX-BF16), the Q8_0 GEMV
  with float32 logits (``q8_0_matmul``) and oneDNN's packed bfloat16 GEMM followed by the float32 copy of its logits;
* ``gguf-load``: the default model's GGUF weights read and expanded to float32 (``iter_gguf_weights``, as a
  load does, without the model), through the native kernel and through the torch code it replaces, alternating;
* ``steps``: engine steps: a 500-token prefill, a step of 31 decodes plus a 224-token chunk, a
  decode-only step of 31, and a batch-1 decode at a ~280-token context (medians).

    python benchmarks/cpu_parts.py --parts sampler,prefill-kernel,decode-kernel,decode-gemv,gate-up,amx-gemms,f32-gemm,lm-head,steps,gguf-load
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import numpy as np
import torch

H, HKV, D, BS, VOCAB = 9, 3, 64, 16, 49152


def cold_median_ms(fn: Callable[[], object], junk: torch.Tensor, reps: int) -> float:
    """``fn``'s median time with ``junk`` written before each call (its operands out of the caches), the write untimed."""
    times = []
    for _ in range(reps):
        junk.add_(1)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def sampler_part() -> dict:
    from plinth.core import sampler as sampler_module
    from plinth.core.request import Request, SamplingParams
    from plinth.core.sampler import Sampler
    from plinth.core.sampling_batch import SamplingBatch

    logits = torch.randn(32, VOCAB)
    out = {}
    for name, temp in (("temperature_1", 1.0), ("greedy", 0.0)):
        reqs = [Request(str(i), [1], SamplingParams(temperature=temp)) for i in range(32)]
        batch = SamplingBatch.from_requests(reqs, VOCAB, "cpu")
        sampler = Sampler()
        out[f"sample_32_rows_{name}_ms"] = median_ms(lambda s=sampler, b=batch: s.sample(logits, b), 20)
    # the temperature draw without the native kernel (torch's softmax, cumsum and search)
    enabled = sampler_module.cpu_native.sampling_enabled
    sampler_module.cpu_native.sampling_enabled = lambda x: False
    try:
        reqs = [Request(str(i), [1], SamplingParams(temperature=1.0)) for i in range(32)]
        batch = SamplingBatch.from_requests(reqs, VOCAB, "cpu")
        out["sample_32_rows_temperature_1_torch_ms"] = median_ms(lambda b=batch: Sampler().sample(logits, b), 20)
    finally:
        sampler_module.cpu_native.sampling_enabled = enabled
    return out


def prefill_kernel_part() -> dict:
    from plinth.attention_backends import cpu_paged
    from plinth.attention_backends.cpu_paged import CpuPagedBackend
    from plinth.attention_backends.interface import AttentionSpec
    from plinth.attention_backends.probe import make_paged_batch
    from plinth.attention_backends.torch_batched import TorchBatchedBackend
    from plinth.platforms.cpu import platform as cpu_platform

    dtype = torch.bfloat16 if cpu_platform.has_fast_bf16() else torch.float32   # the default model's dtype here
    out: dict = {"dtype": str(dtype).removeprefix("torch."), "native_kernel": cpu_paged._prefill_kernel_ok()}
    spec = AttentionSpec(num_heads=H, num_kv_heads=HKV, head_size=D, dtype=dtype, block_size=BS)
    for name, q_len, ctx in (("prompt_500", 500, 0), ("chunk_224_after_100", 224, 100)):
        batch = make_paged_batch(spec, [ctx], [q_len], generator=torch.Generator().manual_seed(q_len))
        # cpu_paged (its native prefill kernel where the CPU has one) and the batched path it falls back to
        # (gathers the context, masked SDPA); each writes this step's keys and values, as in a step
        for label, backend in (("cpu_paged", CpuPagedBackend()), ("torch_batched", TorchBatchedBackend())):
            def call(b=backend, batch=batch) -> None:
                b.prepare(batch.metadata)
                b.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, scale=D ** -0.5)

            out[f"{label}_{name}_ms_per_layer"] = round(median_ms(call, 20), 3)
    if dtype == torch.bfloat16:
        # one 500-token prompt's attention: the AMX kernel (where it runs) against torch's fused attention
        import torch.nn.functional as F

        q, k, v = (torch.randn(500, h, D).to(dtype) for h in (H, HKV, HKV))
        if cpu_paged._amx_prefill_on():
            out["amx_prompt_500_ms_per_layer"] = round(median_ms(lambda: cpu_paged.amx_prefill(q, k, v, D ** -0.5), 20), 3)
        out["torch_sdpa_prompt_500_ms_per_layer"] = round(median_ms(lambda: F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=D ** -0.5, enable_gqa=True), 20), 3)
    return out


def gate_up_part() -> dict:
    """The MLP's gate/up GEMM and activation, 30 layers of SmolLM2's shape (random 4-bit codes, cycled as in a step):
    the AMX GEMM then the native SiLU-and-mul against the GEMM with the activation in its epilogue."""
    from plinth.kernels import cpu_native

    if not cpu_native.q4_amx_supported():
        return {"amx": False}
    n, k = LAYER_SHAPES["gate_up"]
    layers = []
    for i in range(30):
        gen = torch.Generator().manual_seed(i)
        scale = torch.rand(n, k // 32, generator=gen) * 0.02
        layers.append(cpu_native.pack_q4_panels(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32), scale,
                                                -8 * scale))
    def unfused(x: torch.Tensor) -> None:
        for p in layers:   # each result dropped before the next, as in a forward pass (no fresh pages per call)
            cpu_native.silu_and_mul(cpu_native.q4_panel_matmul(x, p))

    def fused(x: torch.Tensor) -> None:
        for p in layers:
            cpu_native.q4_panel_silu_mul(x, p)

    out: dict = {"amx": True}
    for rows in (32, 128, 500):
        x = torch.randn(rows, k).to(torch.bfloat16)
        out[f"gemm_then_silu_{rows}_rows_ms"] = round(median_ms(lambda x=x: unfused(x), 7), 2)
        out[f"fused_{rows}_rows_ms"] = round(median_ms(lambda x=x: fused(x), 7), 2)
    return out


def amx_gemms_part() -> dict:
    """A step's four 4-bit GEMMs (q/k/v, o, gate/up, down; SmolLM2's shapes, random codes), 30 layers cycled as in a
    step, on AMX tiles, at 8, 32, 128 and 500 rows: the milliseconds of all 120 products."""
    from plinth.kernels import cpu_native

    if not cpu_native.q4_amx_supported():
        return {"amx": False}
    weights = []
    for i in range(30):
        gen = torch.Generator().manual_seed(i)
        for n, k in (LAYER_SHAPES[name] for name in ("qkv", "o", "gate_up", "down")):
            scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.002).half().float()
            offset = -(torch.rand(n, k // 32, generator=gen) * 0.15).half().float()
            weights.append(cpu_native.pack_q4_panels(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32),
                                                     scale, offset))
    gemm = cpu_native.load_library().library.plinth_q4p_gemm_amx   # the kernel itself: no per-call allocation
    out: dict = {"amx": True}
    for rows in (8, 32, 128, 500):
        calls, buffers = [], {}
        for p in weights:   # one input and one output per shape, reused as a forward pass reuses its buffers
            x, y = buffers.setdefault((p.out_features, p.in_features), (
                torch.randn(rows, p.in_features).to(torch.bfloat16),
                torch.empty(rows, p.out_features, dtype=torch.bfloat16)))
            calls.append((x, y, (x.data_ptr(), x.stride(0), p.codes.data_ptr(), p.scales.data_ptr(),
                                 p.offsets.data_ptr(), y.data_ptr(), rows, p.out_features, p.in_features)))
        x, y, args = calls[0]   # the direct call computes what the public function does
        gemm(*args)
        assert torch.equal(y, cpu_native.q4_panel_matmul(x, weights[0], amx=True))

        def step(calls: list = calls) -> None:
            for _, _, args in calls:
                gemm(*args)

        out[f"{rows}_rows_ms"] = round(median_ms(step, 9), 2)
    return out


def decode_kernel_part() -> dict:
    from plinth.attention_backends.cpu_paged import (
        f32_bf16_available,
        fp8_decode_available,
        paged_decode,
        set_decode_amx,
    )
    from plinth.kernels.cpu_native import amx_switch_on
    from plinth.platforms.cpu import platform as cpu_platform

    # the KV dtype the default model runs with here (bfloat16 where the CPU has it natively, else float32), and an
    # FP8 E4M3 cache (--kv-cache-dtype fp8) where the kernel reads one
    dtype = torch.bfloat16 if cpu_platform.has_fast_bf16() else torch.float32
    out: dict = {"dtype": str(dtype).removeprefix("torch.")}
    # (float32 models: also a bfloat16 cache, --kv-cache-dtype bfloat16, ``bf16kv_`` keys, where the kernel reads one)
    cache_dtypes = [dtype] + ([torch.float8_e4m3fn] if dtype == torch.bfloat16 and fp8_decode_available() else []) \
        + ([torch.bfloat16] if dtype == torch.float32 and f32_bf16_available() else [])
    # a bfloat16 cache on AMX tiles where the kernel takes them, and on AVX512-BF16 vectors (``vec_`` keys)
    amx = dtype == torch.bfloat16 and amx_switch_on() and set_decode_amx(True)
    out["decode_amx"] = amx
    layers, blocks = 30, 5825
    junk = torch.empty(64 << 20, dtype=torch.uint8)
    for cache_dtype in cache_dtypes:
        prefix = "" if cache_dtype == dtype else "bf16kv_" if cache_dtype == torch.bfloat16 else "fp8_"
        caches = []
        for _ in range(layers):
            buf = np.zeros(2 * blocks * BS * HKV * D * cache_dtype.itemsize, dtype=np.uint8)
            cache = torch.from_numpy(buf).view(cache_dtype).view(2, blocks, BS, HKV, D)
            cache.copy_(torch.randn(cache.shape).to(cache_dtype))
            caches.append(cache)
        # 32 sequences of 330 tokens; one sequence of 128 and of 2,000 tokens (its blocks split over the threads)
        for seqs, ctx in ((32, 330), (1, 128), (1, 2000)):
            nb = -(-ctx // BS)
            ids = np.random.default_rng(0).permutation(np.arange(1, blocks))[: seqs * nb]
            tables = torch.from_numpy(ids.reshape(seqs, nb).astype(np.int32))
            lens = torch.full((seqs,), ctx, dtype=torch.int32)
            starts = torch.arange(seqs + 1, dtype=torch.int32)
            q = torch.randn(seqs, H, D).to(dtype)

            def call(layer: int, q=q, tables=tables, lens=lens, starts=starts, seqs=seqs, ctx=ctx,
                     caches=caches) -> float:
                t = time.perf_counter()
                paged_decode(q, caches[layer], tables, lens, starts, seqs, D ** -0.5, max_seq_len=ctx,
                             every_row_owned=True)
                return time.perf_counter() - t

            for kernel in (["", "vec_"] if amx and cache_dtype == dtype else [""]):
                set_decode_amx(kernel == "")
                cold = []
                for it in range(4):
                    for layer in range(layers):
                        junk.fill_(it)
                        cold.append(call(layer))
                warm = [call(0) for _ in range(40)]
                # every layer in turn with nothing in between: a step's reads from memory, without its GEMMs
                cycled = []
                for _ in range(4):
                    t = time.perf_counter()
                    for layer in range(layers):
                        call(layer)
                    cycled.append((time.perf_counter() - t) / layers)
                kv_bytes = seqs * ctx * HKV * D * 2 * cache_dtype.itemsize
                cold_ms, warm_ms = float(np.median(cold[layers:])) * 1e3, float(np.median(warm[5:])) * 1e3
                cycled_ms = float(np.median(cycled)) * 1e3
                key = f"{prefix}{kernel}paged_decode_{seqs}x{ctx}"
                out.update({f"{key}_cold_ms_per_layer": round(cold_ms, 4),
                            f"{key}_cold_gb_s": round(kv_bytes / cold_ms / 1e6, 1),
                            f"{key}_cycled_ms_per_layer": round(cycled_ms, 4),
                            f"{key}_warm_ms_per_layer": round(warm_ms, 4),
                            f"{key}_warm_gb_s": round(kv_bytes / warm_ms / 1e6, 1)})
            set_decode_amx(amx_switch_on())
        del caches
    return out


#: a SmolLM2 layer's four GEMMs, (N, K)
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _random_layers(make: Callable[[int, int], object], count: int = 30) -> list[dict]:
    """``count`` layers of ``{name: make(N, K)}`` for :data:`LAYER_SHAPES` (enough weights that cycling them
    streams from memory as a step does)."""
    return [{name: make(n, k) for name, (n, k) in LAYER_SHAPES.items()} for _ in range(count)]


def _layer_times(layers: list[dict], fn: Callable[[object, torch.Tensor], object], xs: dict[str, torch.Tensor],
                 reps: int) -> dict[str, float]:
    """Median microseconds of ``fn(weight, xs[name])`` per GEMM name, the layers cycled ``reps`` times (the
    first pass warms up)."""
    per: dict[str, list[float]] = {name: [] for name in xs}
    for rep in range(reps):
        for layer in layers:
            for name, w in layer.items():
                t = time.perf_counter()
                fn(w, xs[name])
                if rep:
                    per[name].append(time.perf_counter() - t)
    return {name: float(np.median(v)) * 1e6 for name, v in per.items()}


def decode_gemv_part() -> dict:
    from plinth.kernels import cpu_native
    from plinth.worker.cpu_linear import INT4_GROUP, Int4Weight

    shapes = LAYER_SHAPES
    gen = torch.Generator().manual_seed(0)

    def int4_weight(n: int, k: int) -> Int4Weight:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        scale = torch.rand(n, k // 32, generator=gen) * 0.01
        return Int4Weight.from_blocks(q, scale, torch.rand(n, k // 32, generator=gen) * 0.01, torch.bfloat16)

    layers = _random_layers(int4_weight)
    streamed = sum(w.panels.codes.numel() + 4 * w.panels.scales.numel() for w in layers[0].values())
    kernels = {"torch_int4pack": lambda w, x: torch._weight_int4pack_mm_for_cpu(x, w.packed, INT4_GROUP,
                                                                                 w.scale_zeros)}
    if cpu_native.q4_gemv_supported():
        kernels["native_gemv"] = lambda w, x: w.gemv(x)
    out: dict = {"bytes_per_layer": streamed}
    for rows in (1, 4):
        xs = {name: torch.randn(rows, k, generator=gen).bfloat16() for name, (_, k) in shapes.items()}
        for kname, fn in kernels.items():
            us = _layer_times(layers, fn, xs, 6)
            total = sum(us.values())
            out[f"{kname}_rows{rows}_us"] = {**{k: round(v, 1) for k, v in us.items()}, "layer": round(total, 1),
                                             "gb_s": round(streamed / total / 1e3, 1)}
    return out


def f32_gemm_part() -> dict:
    from plinth.kernels import cpu_native
    from plinth.worker.cpu_linear import packed_linear_supported

    if not cpu_native.q4_gemv_f32_supported():
        return {"error": "the native kernels were not built with AVX2/FMA/F16C"}
    shapes = LAYER_SHAPES
    gen = torch.Generator().manual_seed(0)

    def kernels_of(n: int, k: int) -> dict:
        d = torch.rand(n, k // 32, generator=gen) * 0.01
        panels = cpu_native.pack_q4_panels(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen), d, -8 * d)
        w = torch.randn(n, k, generator=gen) * 0.02
        return {"f32_gemv": cpu_native.Q4GemvF32(panels), "q8_gemm": cpu_native.Q4GemmF32Q8(panels),
                "onednn": torch.ops.mkldnn._reorder_linear_weight(w, 32), "mkl": w}

    layers = _random_layers(kernels_of)
    kernels = {"f32_gemv": lambda e, x: e["f32_gemv"](x), "q8_gemm": lambda e, x: e["q8_gemm"](x),
               "onednn": lambda e, x: torch.ops.mkldnn._linear_pointwise(x, e["onednn"], None, "none", [], ""),
               "mkl": lambda e, x: torch.nn.functional.linear(x, e["mkl"])}
    out: dict = {}
    for rows in (1, 4, 16, 32, 128, 512):
        xs = {name: torch.randn(rows, k, generator=gen) for name, (_, k) in shapes.items()}
        used = layers if rows <= 32 else layers[:6]
        for kname, fn in kernels.items():
            if kname == "f32_gemv" and rows > cpu_native.Q4_GEMV_F32_MAX_ROWS:
                continue
            us = _layer_times(used, fn, xs, 4 if rows <= 32 else 3)
            out[f"{kname}_rows{rows}_us"] = {**{k: round(v, 1) for k, v in us.items()}, "layer": round(sum(us.values()), 1)}
    n, k = VOCAB, 576
    codes = torch.randint(-127, 128, (n, k // 32, 32), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, k // 32, 1, generator=gen) * 0.01).half()
    blocks = torch.cat([scales.view(torch.uint8), codes.view(torch.uint8)], -1).reshape(n, -1).contiguous()
    rows8 = cpu_native.pack_q8_0_rows8(blocks)
    for rows in (1, 2, 3, 4, 8):
        x = torch.randn(rows, k, generator=gen)
        for label, int8 in (("float32", False), ("int8_two_planes", True)):
            out[f"q8_0_head_rows{rows}_{label}_ms"] = round(median_ms(
                lambda i=int8, xr=x: cpu_native.q8_0_matmul(xr, blocks, n, torch.float32, int8_inputs=i, rows8=rows8),
                20), 3)
    # past those rows: the regrouped blocks in float32 against oneDNN's packed float32 GEMM of the same weights,
    # the weights out of the caches as a decode step's layers leave them
    packed = torch.ops.mkldnn._reorder_linear_weight(
        (scales.float() * codes.float()).reshape(n, k), 32) if packed_linear_supported(torch.float32) else None
    junk = torch.empty(400 << 20, dtype=torch.uint8)
    for rows in (8, 16, 31, 64, 128, 256):
        x = torch.randn(rows, k, generator=gen)
        out[f"q8_0_head_rows{rows}_regrouped_f32_cold_ms"] = round(cold_median_ms(
            lambda xr=x: cpu_native.q8_0_rows8_matmul(xr, rows8, n), junk, 9), 3)
        if packed is not None:
            out[f"q8_0_head_rows{rows}_onednn_f32_cold_ms"] = round(cold_median_ms(
                lambda xr=x: torch.ops.mkldnn._linear_pointwise(xr, packed, None, "none", [], ""), junk, 9), 3)
    return out


def steps_part() -> dict:
    from plinth import LLM, SamplingParams

    llm = LLM()
    engine = llm.engine
    rng = np.random.default_rng(1)
    counter = iter(range(10**6))

    def one_prefill() -> None:
        engine.add_request(f"p{next(counter)}", rng.integers(100, 40000, 500).tolist(), SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()

    out = {"prefill_500_step_ms": median_ms(one_prefill, 5)}
    params = SamplingParams(temperature=1.0, max_tokens=512, ignore_eos=True)
    for i in range(31):
        engine.add_request(f"d{i}", rng.integers(100, 40000, 256).tolist(), params)
    for _ in range(60):
        engine.step()                         # every prompt prefilled: 31 decodes per step

    def mixed() -> None:
        engine.add_request(f"m{next(counter)}", rng.integers(100, 40000, 224).tolist(), SamplingParams(max_tokens=1))
        engine.step()

    out["mixed_31_decodes_plus_224_chunk_step_ms"] = median_ms(mixed, 5)
    out["decode_31_step_ms"] = median_ms(engine.step, 5)
    engine.abort_request([f"d{i}" for i in range(31)])
    engine.step()
    engine.add_request("one", rng.integers(100, 40000, 256).tolist(),
                       SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    for _ in range(20):
        engine.step()
    out["decode_1_step_ms_ctx_280"] = median_ms(engine.step, 30)
    return out


def lm_head_part() -> dict:
    from plinth.kernels import cpu_native
    from plinth.worker.cpu_linear import packed_linear_supported

    if not cpu_native.q8_0_supported(torch.bfloat16):
        return {"skipped": "no native Q8_0 GEMV for bfloat16 here"}
    gen = torch.Generator().manual_seed(0)
    n, k = VOCAB, 576
    nb = k // 32
    d = (torch.rand(n, nb, generator=gen) * 0.02 + 1e-4).to(torch.float16)
    q = torch.randint(-128, 128, (n, nb, 32), generator=gen, dtype=torch.int8)
    blocks = torch.cat([d.view(torch.uint8).reshape(n, nb, 2), q.view(torch.uint8)], -1).reshape(n, nb * 34).contiguous()
    weight = (d.float()[..., None] * q.float()).reshape(n, k).to(torch.bfloat16)
    kernels: dict[str, Callable[[torch.Tensor], object]] = {
        "gemv": lambda x: cpu_native.q8_0_matmul(x, blocks, n, torch.float32)}
    if cpu_native.q8_amx_supported():
        panels = cpu_native.pack_q8_panels(blocks)
        kernels["amx"] = lambda x: cpu_native.q8_panel_matmul(x, panels)
    if packed_linear_supported(torch.bfloat16):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        kernels["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()
    junk = torch.empty(400 << 20, dtype=torch.uint8)
    out: dict = {}
    for rows in (1, 2, 4, 8, 32, 64):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        for name, fn in kernels.items():
            if name == "gemv" and rows > 8:
                continue   # its time grows with the rows (32 rows ~20 ms)
            out[f"{name}_{rows}_rows_warm_ms"] = round(median_ms(lambda f=fn, x=x: f(x), 11), 3)
            # the weights out of the caches, as the layers' work between two heads leaves them
            out[f"{name}_{rows}_rows_cold_ms"] = round(cold_median_ms(lambda f=fn, x=x: f(x), junk, 11), 3)
    return out


def gguf_load_part() -> dict:
    from plinth.kernels import cpu_native
    from plinth.model_registry.default_model import default_model_path
    from plinth.model_registry.gguf_loader import iter_gguf_weights

    path = default_model_path()

    def expand_all() -> None:
        for _ in iter_gguf_weights(path, torch.float32):
            pass

    out: dict = {}
    previous = os.environ.get(cpu_native.NATIVE_OPS_ENV)
    try:
        for _ in range(3):   # alternating rounds: the native kernel, then the torch code it replaces
            for name, native in (("native", True), ("torch", False)):
                cpu_native._env_enabled.cache_clear()
                os.environ[cpu_native.NATIVE_OPS_ENV] = "1" if native else "0"
                out.setdefault(f"expand_default_model_{name}_ms", []).append(round(median_ms(expand_all, 3, 1), 1))
    finally:
        if previous is None:
            os.environ.pop(cpu_native.NATIVE_OPS_ENV, None)
        else:
            os.environ[cpu_native.NATIVE_OPS_ENV] = previous
        cpu_native._env_enabled.cache_clear()
    return out


PARTS = {"sampler": sampler_part, "prefill-kernel": prefill_kernel_part, "decode-kernel": decode_kernel_part,
         "decode-gemv": decode_gemv_part, "gate-up": gate_up_part, "amx-gemms": amx_gemms_part, "f32-gemm": f32_gemm_part, "lm-head": lm_head_part,
         "steps": steps_part, "gguf-load": gguf_load_part}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.parts.split(","):
        if name not in PARTS:
            p.error(f"unknown part {name!r}; known: {', '.join(PARTS)}")
        print(json.dumps({"part": name, **PARTS[name]()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
