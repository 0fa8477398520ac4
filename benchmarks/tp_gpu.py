"""Tensor and pipeline parallelism on GPUs: TP=2 and PP=2 against one GPU, on random weights.

    python benchmarks/tp_gpu.py --out tp_gpu.json                 # 1x1, 2x1 and 1x2 on a 2-GPU machine
    python benchmarks/tp_gpu.py --layouts 2x1 --enforce-eager     # TP=2 without decode graphs

Layouts are ``TPxPP``. Each layout runs in its own process (the GPUs start empty each time) with the
``llama-3-8b`` dummy preset in bfloat16 and the multi-process executor for more than one rank:

  latency     batch 1: a 128-token prompt, 256 new tokens; median of ``--iters`` runs after one warm-up.
              TPOT (time per output token) is the figure TP should lower.
  throughput  ``--num-prompts`` requests of 256 prompt and 256 new tokens, all submitted at once.

Floors: a batch-1 decode step reads every matmul weight once; with TP=t each GPU reads 1/t of them in
parallel, so the TPOT floor is ``bytes / (t * copy bandwidth)``. PP does not lower it (the stages run
one after the other for one sequence); PP's gain is throughput, from micro-batches that keep both
stages busy. The ratios to the 1x1 run are printed at the end.

NCCL_NVLS_ENABLE=0 is set before torch loads (NVLink SHARP multicast stays off on shared machines).
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-preset", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layouts", default="1x1,2x1,1x2", help="comma-separated TPxPP layouts")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true", help="no decode graphs (CUDA graphs with TP)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)   # internal: run one layout, print JSON
    return p.parse_args(argv)


def _floors(preset: str, dtype_name: str, tp: int) -> dict[str, Any]:
    """The batch-1 TPOT floor from the preset's weights (built on the meta device) and the GPU's bandwidth."""
    import torch

    from plinth import benchmarks_floor as floors
    from plinth.model_registry.interface import ModelContext
    from plinth.model_registry.loader import architecture_of, load_preset
    from plinth.model_registry.registry import ModelRegistry

    if not torch.cuda.is_available():
        return {"device": "cpu", "floor": floors.UNKNOWN}
    dtype = getattr(torch, dtype_name)
    cfg = load_preset(preset)
    cls = ModelRegistry.resolve(architecture_of(cfg, preset))
    ctx = ModelContext(hf_config=cfg, dtype=dtype, device=torch.device("meta"), attention_backend=None,  # type: ignore[arg-type]
                       block_size=16)
    with torch.device("meta"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            stats = floors.weight_stats(cls(ctx))
        finally:
            torch.set_default_dtype(prev)
    name = torch.cuda.get_device_name(0)
    ceilings = floors.ceilings_for(name)
    if ceilings is None:
        return {"device": name, "floor": floors.UNKNOWN}
    return {"device": name, "params": stats.params,
            "floor_tpot_s": floors.decode_step_floor_s(stats, ceilings) / tp}


def run_one(args: argparse.Namespace, tp: int, pp: int) -> dict[str, Any]:
    from plinth import LLM
    from plinth.entrypoints.bench_cmd import random_prompts, timed_run

    t0 = time.perf_counter()
    llm = LLM(args.model_preset, load_format="dummy", dtype=args.dtype, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    engine = llm.engine
    out: dict[str, Any] = {"layout": f"{tp}x{pp}", "startup_s": time.perf_counter() - t0,
                           "executor": type(engine.executor).__name__, "kv_blocks": engine.executor.num_blocks}
    try:
        runs = []
        for it in range(1 + args.iters):
            prompts = random_prompts(1, args.input_len, engine.vocab_size, 1000 * it)
            timing = timed_run(engine, prompts, args.output_len, f"lat{it}")
            if it:
                runs.append(timing)
        out["ttft_s"] = statistics.median(r.first_token_s for r in runs)
        out["tpot_s"] = statistics.median((r.elapsed_s - r.first_token_s) / (args.output_len - 1) for r in runs)
        prompts = random_prompts(args.num_prompts, args.input_len * 2, engine.vocab_size, 7)
        timing = timed_run(engine, prompts, args.output_len, "tput")
        out["throughput_elapsed_s"] = timing.elapsed_s
        out["output_tokens_per_s"] = timing.output_tokens / timing.elapsed_s
        out["total_tokens_per_s"] = (timing.output_tokens + timing.prompt_tokens) / timing.elapsed_s
        out.update(_floors(args.model_preset, args.dtype, tp))
        if out.get("floor_tpot_s"):
            out["tpot_floor_fraction"] = out["floor_tpot_s"] / out["tpot_s"]
    finally:
        engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        tp, pp = (int(x) for x in args.one.split("x"))
        print("RESULT " + json.dumps(run_one(args, tp, pp)), flush=True)
        return 0
    results: list[dict[str, Any]] = []
    for layout in args.layouts.split(","):
        cmd = [sys.executable, __file__, "--one", layout, *(argv if argv is not None else sys.argv[1:])]
        print(f"== {layout}: {' '.join(cmd)}", flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                results.append({"layout": layout, "error": proc.stderr[-4000:]})
            else:
                results.append(json.loads(lines[-1].removeprefix("RESULT ")))
        except (subprocess.TimeoutExpired, OSError):
            results.append({"layout": layout, "error": traceback.format_exc()})
        print(json.dumps(results[-1], indent=1), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    base = next((r for r in results if r.get("layout") == "1x1" and "tpot_s" in r), None)
    print(f"{'layout':>7} {'TPOT ms':>9} {'floor ms':>9} {'TTFT ms':>9} {'out tok/s':>10} {'vs 1x1 TPOT':>12} "
          f"{'vs 1x1 tok/s':>13}")
    for r in results:
        if "tpot_s" not in r:
            print(f"{r['layout']:>7} failed: {r.get('error', '')[-300:]}")
            continue
        speed = f"{base['tpot_s'] / r['tpot_s']:.2f}x" if base else "-"
        tput = f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x" if base else "-"
        floor = f"{r['floor_tpot_s'] * 1e3:9.2f}" if r.get("floor_tpot_s") else f"{'?':>9}"
        print(f"{r['layout']:>7} {r['tpot_s'] * 1e3:9.2f} {floor} {r['ttft_s'] * 1e3:9.1f} "
              f"{r['output_tokens_per_s']:10.0f} {speed:>12} {tput:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
