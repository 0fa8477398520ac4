"""Where a GPU decode step's time goes: device busy time against wall time, and kernels by kind.

    python benchmarks/step_timeline_gpu.py --batch-sizes 1,256 --out step_timeline.json

For each batch size: ``B`` requests of ``--input-len`` random prompt tokens are prefilled, then
``--warmup`` decode steps run untimed and ``--steps`` decode steps run under ``torch.profiler`` (CPU and
CUDA activity). Reported per decode step: wall time (host clock around ``LLMEngine.step``), device busy
time (the union of kernel and copy intervals), the idle remainder (the host gap between graph replays),
and the kernel time by kind (GEMM, attention, norm/rope/activation, sampling, copies, other).
Engine options come from ``--engine-kwargs`` (JSON) on top of the dummy ``--model-preset``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

KINDS = (
    ("attention", ("attn", "attention", "paged", "merge", "split_kv", "decode_kernel", "decode_split", "_write_kv")),
    ("gemm", ("gemm", "gemv", "skinny", "matmul", "cutlass", "sm90", "nvjet", "xmma", "ampere", "w4a16",
              "int4", "mm_kernel")),
    ("norm/rope/act", ("rms", "norm", "rotary", "rope", "silu", "act_and_mul", "quantize_rows")),
    ("sampling", ("argmax", "softmax", "topk", "top_k", "sort", "multinomial", "exponential", "max_", "reduce")),
    ("copy", ("memcpy", "memset", "copy", "fill", "index", "gather", "scatter", "cat")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def run_batch(engine: Any, batch: int, a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from plinth import SamplingParams
    from plinth.worker.profiling import union_us

    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=a.warmup + a.steps + 8, ignore_eos=True, detokenize=False)
    for i in range(batch):
        ids = torch.randint(0, engine.vocab_size, (a.input_len,), generator=gen).tolist()
        engine.add_request(f"b{batch}-{i}", ids, params)
    # prefill (until every request has one output token), then untimed decode steps
    while engine.scheduler.stats().num_waiting or any(
            not g.seqs[0].request.output_token_ids for g in engine._groups.values()):
        engine.step()
    for _ in range(a.warmup):
        engine.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    walls: list[float] = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t_start = time.perf_counter()
        for _ in range(a.steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
        sync()
        window = time.perf_counter() - t_start
    intervals, by_kind, by_name = [], {}, {}
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        s, e = evt.time_range.start, evt.time_range.end   # us
        intervals.append((s, e))
        k = kind_of(evt.name)
        by_kind[k] = by_kind.get(k, 0.0) + (e - s)
        by_name[evt.name] = by_name.get(evt.name, 0.0) + (e - s)
    busy_us = union_us(intervals)
    span_us = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    engine.abort_request([f"b{batch}-{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    n = a.steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[: a.top]
    return {
        "batch": batch,
        "steps": n,
        "wall_ms_per_step_median": statistics.median(walls) * 1e3,
        "wall_ms_per_step_mean": window / n * 1e3,
        "device_busy_ms_per_step": busy_us / n / 1e3,
        "device_span_ms_per_step": span_us / n / 1e3,
        "device_idle_ms_per_step": (window * 1e6 - busy_us) / n / 1e3,
        "kernel_ms_per_step_by_kind": {k: v / n / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": [(name[:90], v / n / 1e3) for name, v in top],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-preset", default="llama-3-8b")
    p.add_argument("--batch-sizes", default="1,256")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--engine-kwargs", default="{}", help="JSON engine options")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from plinth import LLM

    kwargs = dict(load_format="dummy", dtype="bfloat16", max_model_len=2048)
    kwargs.update(json.loads(a.engine_kwargs))
    llm = LLM(a.model_preset, **kwargs)
    engine = llm.engine
    results = [run_batch(engine, int(b), a) for b in a.batch_sizes.split(",")]
    for r in results:
        print(f"batch {r['batch']}: wall {r['wall_ms_per_step_mean']:.3f} ms/step (median "
              f"{r['wall_ms_per_step_median']:.3f}), device busy {r['device_busy_ms_per_step']:.3f}, "
              f"idle {r['device_idle_ms_per_step']:.3f}")
        print("  by kind: " + ", ".join(f"{k} {v:.3f}" for k, v in r["kernel_ms_per_step_by_kind"].items()))
        for name, v in r["top_kernels_ms_per_step"]:
            print(f"    {v:8.4f} ms  {name}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
