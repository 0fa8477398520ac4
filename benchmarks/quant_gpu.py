"""Quantized decode and throughput on a GPU: bf16 against int4 and fp8, on random weights.

    python benchmarks/quant_gpu.py --out quant_gpu.json                     # all parts (~10 min on an H200)
    python benchmarks/quant_gpu.py --configs int4:triton_w4a16,int4:torch_int4pack --parts latency
    python benchmarks/quant_gpu.py --model-preset tiny-llama --num-prompts 8 --output-len 16 --iters 1  # smoke

Configurations are ``METHOD[+head][:KERNEL]`` (``bf16`` is no quantization; ``+head`` adds
``--quantize-lm-head``; a kernel name forces ``--gemm-kernel``, else startup selection chooses). Each runs in its own process, so the GPU starts
empty, with the ``llama-3-8b`` dummy preset: the bf16 random weights are quantized while loading.

  latency     batch 1: a 128-token prompt, 256 new tokens; median of ``--iters`` runs after one warm-up.
              Reported with the decode floor: one step reads every matmul weight (packed codes and
              scales for quantized layers) once at the device's copy bandwidth.
  throughput  ``--num-prompts`` requests with prompts uniform in [128, 1024) (seeded), 256 new tokens,
              all submitted at once (run for the configurations in ``--throughput-configs``).

Each record also holds the load time, the chosen GEMM kernel with every candidate's check error and
times (the selection report), and the weight bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-preset", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--configs", default="bf16,int4,fp8", help="latency configurations, METHOD[+head][:KERNEL]")
    p.add_argument("--throughput-configs", default="bf16,fp8", help="throughput configurations")
    p.add_argument("--parts", default="latency,throughput")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="latency part: requests decoded together")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--len-range", type=int, nargs=2, default=(128, 1024))
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--selection", default="benchmark", choices=("benchmark", "cached", "off"))
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: PART/CONFIG in this process
    return p.parse_args(argv)


def _engine(a: argparse.Namespace, config: str) -> tuple[Any, dict[str, Any]]:
    from plinth import LLM

    method, _, kernel = config.partition(":")
    method, plus, suffix = method.partition("+")
    head = bool(plus)
    if plus and (suffix != "head" or method == "bf16"):
        raise SystemExit(f"configuration {config!r}: expected METHOD[+head][:KERNEL] with a quantization method")
    kwargs: dict[str, Any] = dict(load_format="dummy", dtype=a.dtype, max_model_len=a.max_model_len,
                                  gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
                                  selection=a.selection)
    if method != "bf16":
        kwargs["quantization"] = method
        kwargs["quantize_lm_head"] = head
        if kernel:
            kwargs["gemm_kernel"] = kernel
    t0 = time.perf_counter()
    llm = LLM(a.model_preset, **kwargs)
    info: dict[str, Any] = {"config": config, "load_s": time.perf_counter() - t0,
                            "attention": llm.engine.selection.winner}
    runner = llm.engine.runner
    if runner is not None:
        from plinth.benchmarks_floor import ceilings_for, decode_step_floor_s, device_name, weight_stats

        stats = weight_stats(runner.model)
        info["streamed_bytes"] = stats.streamed_bytes
        ceilings = ceilings_for(device_name(llm.engine.device))
        info["decode_floor_ms"] = decode_step_floor_s(stats, ceilings) * 1e3 if ceilings else None
        quant = runner.model.ctx.quant_method
        if quant is not None and quant.kernel_selection is not None:
            info["gemm_kernel"] = quant.kernel_selection.to_dict()
        head_selection = getattr(getattr(runner.model, "lm_head", None), "kernel_selection", None)
        if head_selection is not None:
            info["lm_head_kernel"] = head_selection.to_dict()
    return llm, info


def _latency(a: argparse.Namespace, config: str) -> dict[str, Any]:
    import numpy as np
    import torch

    from plinth import SamplingParams

    llm, res = _engine(a, config)
    rng = np.random.default_rng(0)
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    prompt_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    totals, ttfts = [], []

    def fresh() -> list[list[int]]:  # fresh prompts: the prefix cache never helps
        return [rng.integers(0, vocab, a.input_len).tolist() for _ in range(a.batch)]

    llm.generate(fresh(), params, use_tqdm=False)  # warm-up at the measured batch
    llm.generate(fresh(), prompt_params, use_tqdm=False)

    for _ in range(a.iters):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t = time.perf_counter()
        llm.generate(fresh(), prompt_params, use_tqdm=False)
        ttfts.append(time.perf_counter() - t)
        prompts = fresh()
        sync()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        totals.append(time.perf_counter() - t)
    total, ttft = statistics.median(totals), statistics.median(ttfts)
    tpot = (total - ttft) / max(a.output_len - 1, 1)
    res.update(part="latency", batch=a.batch, total_s=total, ttft_ms=ttft * 1e3, tpot_ms=tpot * 1e3,
               output_tok_s=a.batch * a.output_len / total)
    if res.get("decode_floor_ms"):
        res["tpot_floor_fraction"] = res["decode_floor_ms"] / res["tpot_ms"]
    return res


def _throughput(a: argparse.Namespace, config: str) -> dict[str, Any]:
    import numpy as np

    from plinth import SamplingParams

    llm, res = _engine(a, config)
    rng = np.random.default_rng(1)
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate([rng.integers(0, vocab, 64).tolist() for _ in range(4)], params, use_tqdm=False)  # warm-up
    lens = rng.integers(a.len_range[0], a.len_range[1], a.num_prompts)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in lens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res.update(part="throughput", num_prompts=a.num_prompts, elapsed_s=elapsed, output_tok_s=out_tokens / elapsed,
               total_tok_s=(out_tokens + int(lens.sum())) / elapsed, requests_s=a.num_prompts / elapsed)
    return res


def _run_one(a: argparse.Namespace) -> None:
    part, _, config = a.one.partition("/")
    try:
        res = (_latency if part == "latency" else _throughput)(a, config)
    except Exception as exc:  # report the failure of this configuration and let the others run
        res = {"part": part, "config": config, "error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(res), flush=True)


def _without_out(args: list[str]) -> list[str]:
    """The command line minus ``--out PATH`` (children print their results instead)."""
    out, skip = [], False
    for x in args:
        if skip:
            skip = False
        elif x == "--out":
            skip = True
        elif not x.startswith("--out="):
            out.append(x)
    return out


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.one:
        _run_one(a)
        return
    parts = [p for p in a.parts.split(",") if p]
    jobs = [("latency", c) for c in a.configs.split(",") if c and "latency" in parts]
    jobs += [("throughput", c) for c in a.throughput_configs.split(",") if c and "throughput" in parts]
    results = []
    forwarded = _without_out(list(argv if argv is not None else sys.argv[1:]))
    for part, config in jobs:
        cmd = [sys.executable, __file__, *forwarded, "--one", f"{part}/{config}"]
        print(f"== {part} {config}", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        res = json.loads(lines[-1][7:]) if lines else {
            "part": part, "config": config, "error": f"exit {done.returncode}", "stderr": done.stderr[-3000:]}
        results.append(res)
        shown = {k: v for k, v in res.items() if k not in ("gemm_kernel", "traceback", "stderr")}
        if "gemm_kernel" in res:
            shown["gemm_kernel"] = res["gemm_kernel"]["winner"]
        print(json.dumps(shown), flush=True)
    base = {r["part"]: r for r in results if r.get("config") == "bf16" and "error" not in r}
    for r in results:
        ref = base.get(r["part"])
        if ref and "error" not in r and r is not ref:
            key = "tpot_ms" if r["part"] == "latency" else "output_tok_s"
            ratio = ref[key] / r[key] if key == "tpot_ms" else r[key] / ref[key]
            print(f"{r['part']} {r['config']}: {ratio:.2f}x bf16 ({key})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
