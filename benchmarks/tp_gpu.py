"""Tensor and pipeline parallelism on GPUs: TP=2 and PP=2 against one GPU, on random weights.

    python benchmarks/tp_gpu.py --out tp_gpu.json                 # 1x1, 2x1 and 1x2 on a 2-GPU machine
    python benchmarks/tp_gpu.py --layouts 2x1 --enforce-eager     # TP=2 without decode graphs only

Layouts are ``TPxPP``. Each layout runs in its own process (the GPUs start empty each time) with the
``llama-3-8b`` dummy preset in bfloat16 and the multi-process executor for more than one rank:

  latency     batch 1: a 128-token prompt, 256 new tokens; median of ``--iters`` runs after one warm-up.
              TPOT (time per output token) is the figure TP should lower.
  throughput  ``--num-prompts`` requests of 256 prompt and 256 new tokens, all submitted at once
              (after a few short warm-up requests).

Decode graphs: each layout first runs with CUDA graphs (single-stage layouts capture them; under TP
they hold the layers' NCCL all-reduces). When that run fails or hangs, the layout runs again with
``--enforce-eager``, and the table says which mode produced its figures. A layout that fails both
ways prints its error and the next layout runs.

Time: the whole invocation stays within ``--budget-s`` seconds (default 500, inside a 10-minute
limit): every attempt gets a deadline that leaves ``--min-layout-s`` for each layout still to run,
and is killed with its worker processes when it passes it. Worker steps fail after 120 s
(``PLINTH_WORKER_STEP_TIMEOUT_S``), so a hung collective becomes an error, not a stall.

Floors (``plinth bench``'s): a batch-1 decode step reads the largest TP shard of each stage, stages
one after another, so TP=t divides the TPOT floor by about t and PP does not lower it (PP's gain is
throughput, from micro-batches that keep both stages busy). The ratios to the 1x1 run are printed
at the end.

NCCL_NVLS_ENABLE=0 is set before torch loads (NVLink SHARP multicast stays off on shared machines).
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # this checkout's plinth (plugins are found through its installed entry points)

STEP_TIMEOUT_S = "120"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-preset", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layouts", default="1x1,2x1,1x2", help="comma-separated TPxPP layouts")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--breakdown-steps", type=int, default=64, help="batch-1 decode steps of the host-time breakdown")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true", help="no decode graphs (no graph attempt first)")
    p.add_argument("--executor", choices=("auto", "mp"), default="auto",
                   help="mp: worker processes for one GPU too (1x1), to compare with the in-process engine")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="asynchronous scheduling (auto: the engine's default, on for GPUs without pipeline stages)")
    p.add_argument("--budget-s", type=float, default=500.0, help="wall-clock limit of the whole invocation")
    p.add_argument("--min-layout-s", type=float, default=100.0,
                   help="time kept for each layout still to run when an attempt's deadline is set")
    p.add_argument("--log-dir", default=None, help="where each attempt's log goes (default: a temporary dir)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)   # internal: run one layout, print JSON
    return p.parse_args(argv)


def parse_layout(text: str) -> tuple[int, int]:
    try:
        tp, pp = (int(x) for x in text.lower().split("x"))
    except ValueError as exc:
        raise SystemExit(f"layout {text!r}: expected TPxPP, e.g. 2x1") from exc
    if tp < 1 or pp < 1:
        raise SystemExit(f"layout {text!r}: sizes must be >= 1")
    return tp, pp


# ------------------------------------------------------------------------------------ one layout


def run_one(args: argparse.Namespace, tp: int, pp: int) -> dict[str, Any]:
    """Load the model with this layout, run both benchmarks, shut the workers down."""
    from plinth import LLM
    from plinth.entrypoints.bench_cmd import bench_latency, bench_throughput, random_prompts

    t0 = time.perf_counter()
    llm = LLM(args.model_preset, load_format="dummy", dtype=args.dtype, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              distributed_executor="mp" if tp * pp > 1 or args.executor == "mp" else "auto",
              async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])
    engine = llm.engine
    out: dict[str, Any] = {
        "layout": f"{tp}x{pp}", "startup_s": time.perf_counter() - t0, "executor": type(engine.executor).__name__,
        "kv_blocks": engine.executor.num_blocks, "async_scheduling": engine.async_scheduling,
        # single-stage layouts capture decode graphs unless eager (a failed capture fails the start-up)
        "decode_graphs": not args.enforce_eager and pp == 1,
        # the switches of the multi-process workers' GPU paths, as this run had them
        "env": {k: os.environ.get(k) for k in ("PLINTH_CUSTOM_ALL_REDUCE", "PLINTH_WORKER_FAST_PATH")},
    }
    try:
        lat = bench_latency(engine, 1, args.input_len, args.output_len, args.iters, 1)
        out.update(ttft_s=lat["median_ttft_s"], tpot_s=lat["median_tpot_s"], device=lat["device"],
                   streamed_weight_bytes=lat["streamed_weight_bytes"], params=lat["params"])
        if lat.get("floor_tpot_s"):
            out.update(floor_tpot_s=lat["floor_tpot_s"], tpot_floor_fraction=lat["tpot_floor_fraction"])
        out["step_breakdown"] = step_breakdown(engine, args.input_len, args.breakdown_steps)
        prompts = random_prompts(args.num_prompts, args.input_len * 2, engine.vocab_size, 7)
        tput = bench_throughput(engine, prompts, args.output_len, num_warmup=4)
        out.update(throughput_elapsed_s=tput["elapsed_s"], output_tokens_per_s=tput["output_tokens_per_s"],
                   total_tokens_per_s=tput["total_tokens_per_s"])
        if tput.get("floor_elapsed_s"):
            out["throughput_floor_fraction"] = tput["floor_fraction"]
    finally:
        llm.close()
    return out


def step_breakdown(engine: Any, input_len: int, steps: int) -> dict[str, Any]:
    """Median host times of ``steps`` batch-1 decode steps: the engine's ``step()``, the executor's
    ``execute`` inside it, and on each worker rank (multi-process layouts) the time to run the model
    (launch its kernels) and then to sample and wait for the step's tokens. Under asynchronous scheduling
    the executor's ``launch`` replaces ``execute`` (not timed), and a worker's second figure is the time to
    sample, then wait for the previous step's tokens and answer."""
    import statistics

    from plinth import SamplingParams

    ex = engine.executor
    times: list[float] = []
    original = ex.execute

    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            times.append(time.perf_counter() - t)

    workers = hasattr(ex, "_call_all")
    if workers:
        ex._call_all("take_step_times", timeout_s=60)
    ex.execute = timed
    walls: list[float] = []
    try:
        engine.add_request("breakdown", list(range(1, input_len + 1)),
                           SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True, detokenize=False))
        engine.step()   # the prefill
        times.clear()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
    finally:
        del ex.execute
    med = lambda xs: statistics.median(xs) * 1e3 if xs else None  # noqa: E731
    out: dict[str, Any] = {"steps": len(walls), "engine_step_ms": med(walls), "executor_execute_ms": med(times[1:])}
    if workers:
        per_rank = ex._call_all("take_step_times", timeout_s=60)
        out["worker_run_ms"] = [med([r for r, _ in t[1:]]) for t in per_rank]
        out["worker_sample_wait_ms"] = [med([w for _, w in t[1:]]) for t in per_rank]
    return out


# ------------------------------------------------------------------------------------ the driver


def _attempt(argv: list[str], layout: str, eager: bool, timeout_s: float, log_dir: str) -> dict[str, Any]:
    """Run one layout in a child process (its own process group, killed with its workers at the
    deadline); returns its result or ``{"error": ...}``."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--one", layout, *(["--enforce-eager"] if eager else [])]
    log_path = os.path.join(log_dir, f"{layout}-{'eager' if eager else 'graphs'}.log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.setdefault("PLINTH_WORKER_STEP_TIMEOUT_S", STEP_TIMEOUT_S)
    env.setdefault("PLINTH_WORKER_START_TIMEOUT_S", str(int(max(60.0, timeout_s))))
    print(f"== {layout} ({'eager' if eager else 'decode graphs'}, deadline {timeout_s:.0f} s, log {log_path})",
          flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # the child and its worker processes
            stdout, _ = proc.communicate()
            return {"error": f"no result within {timeout_s:.0f} s (killed); log {log_path}:\n{_tail(log_path)}",
                    "wall_s": time.monotonic() - t0}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit status {proc.returncode}; log {log_path}:\n{_tail(log_path)}",
                "wall_s": time.monotonic() - t0}
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["wall_s"] = time.monotonic() - t0
    return result


def _tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def run_layout(args: argparse.Namespace, argv: list[str], layout: str, deadline: float, later: int,
               log_dir: str) -> dict[str, Any]:
    """Graphs first, eager when that fails; within the time left to this layout."""
    modes = [True] if args.enforce_eager else [False, True]
    errors: dict[str, str] = {}
    for i, eager in enumerate(modes):
        left = deadline - time.monotonic() - later * args.min_layout_s
        if left < 30.0:
            errors["budget"] = f"{max(left, 0.0):.0f} s left for this layout: not run"
            break
        retry_left = len(modes) - i - 1
        # keep time for the eager retry, unless that would leave this attempt too little
        timeout = left - retry_left * args.min_layout_s if left - retry_left * args.min_layout_s >= 60.0 else left
        result = _attempt(argv, layout, eager, timeout, log_dir)
        if "error" not in result:
            result["mode"] = "eager" if eager else "graphs"
            if errors:
                result["graph_error"] = errors.get("graphs", "")[-2000:]
            return result
        errors["eager" if eager else "graphs"] = result["error"]
        print(f"   {layout} {'eager' if eager else 'with graphs'} failed:\n{result['error'][-1500:]}", flush=True)
    return {"layout": layout, "error": "\n".join(f"[{k}] {v}" for k, v in errors.items())}


def print_table(results: list[dict[str, Any]]) -> None:
    base = next((r for r in results if r.get("layout") == "1x1" and "tpot_s" in r), None)
    print(f"{'layout':>7} {'mode':>6} {'TPOT ms':>9} {'floor ms':>9} {'TTFT ms':>9} {'out tok/s':>10} "
          f"{'vs 1x1 TPOT':>12} {'vs 1x1 tok/s':>13}")
    for r in results:
        if "tpot_s" not in r:
            print(f"{r['layout']:>7} failed: {r.get('error', '')[-300:]}")
            continue
        speed = f"{base['tpot_s'] / r['tpot_s']:.2f}x" if base else "-"
        tput = f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x" if base else "-"
        floor = f"{r['floor_tpot_s'] * 1e3:9.2f}" if r.get("floor_tpot_s") else f"{'?':>9}"
        print(f"{r['layout']:>7} {r['mode']:>6} {r['tpot_s'] * 1e3:9.2f} {floor} {r['ttft_s'] * 1e3:9.1f} "
              f"{r['output_tokens_per_s']:10.0f} {speed:>12} {tput:>13}")
    for r in results:
        b = r.get("step_breakdown")
        if b:
            ranks = ""
            if "worker_run_ms" in b:
                ranks = ", workers run / sample+wait: " + ", ".join(
                    f"rank {i} {run:.3f} / {wait:.3f}" for i, (run, wait) in
                    enumerate(zip(b["worker_run_ms"], b["worker_sample_wait_ms"], strict=True)) if run is not None)
            execute = b.get("executor_execute_ms")
            execute_text = f", executor.execute {execute:.3f}" if execute is not None else ""
            print(f"{r['layout']:>7} batch-1 step (median ms): engine.step {b['engine_step_ms']:.3f}"
                  f"{execute_text}{ranks}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        tp, pp = parse_layout(args.one)
        print("RESULT " + json.dumps(run_one(args, tp, pp)), flush=True)
        return 0
    deadline = time.monotonic() + args.budget_s
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    for layout in layouts:
        parse_layout(layout)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="plinth-tp-gpu-")
    os.makedirs(log_dir, exist_ok=True)
    results: list[dict[str, Any]] = []
    for i, layout in enumerate(layouts):
        results.append(run_layout(args, argv, layout, deadline, len(layouts) - i - 1, log_dir))
        print(json.dumps(results[-1], indent=1), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
