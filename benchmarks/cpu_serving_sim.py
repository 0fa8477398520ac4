"""A serving-like run in one process: how step budgets trade step latency for output rate (no HTTP).

``--concurrency`` requests in flight out of ``--num-prompts``, each ``--input-len`` random prompt tokens
and ``--output-len`` new tokens at temperature 1 (EOS ignored), a finished request replaced at once by
the next one: the workload of ``benchmarks/serve_peers.sh``, without the server and the client. Prints
the output rate, the engine step times (median, p90, p99, max), the requests' time to first token and
inter-token latencies (gaps between a request's successive tokens), for each ``--budgets`` value and each
``--itl-targets`` value (``SchedulerConfig.itl_target_ms``; 0: off). Before the requests the engine does the
idle work a server does while it waits for its first request (``LLMEngine.idle_work``: faulting the CPU KV
cache in), unless ``--no-idle``.

    python benchmarks/cpu_serving_sim.py --budgets 256,512,2048
    python benchmarks/cpu_serving_sim.py --budgets 2048 --itl-targets 0,120
    python benchmarks/cpu_serving_sim.py --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def run(budget: int, itl_target: float, args: argparse.Namespace) -> dict:
    from plinth import LLM, SamplingParams

    llm = LLM(args.model, max_num_batched_tokens=budget, itl_target_ms=itl_target, kv_cache_dtype=args.kv_cache_dtype,
              block_size=args.block_size)
    engine = llm.engine
    t = time.perf_counter()
    while args.idle and engine.idle_work():   # what a server does before its first request arrives
        pass
    idle_s = time.perf_counter() - t
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(100, 40000, args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    submitted = 0
    added: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}     # request -> (time of its last token, tokens so far)
    ttfts: list[float] = []
    gaps: list[float] = []

    def add() -> None:
        nonlocal submitted
        engine.add_request(str(submitted), prompts[submitted], params)
        added[str(submitted)] = time.perf_counter()
        submitted += 1

    while submitted < min(args.concurrency, args.num_prompts):
        add()
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append(now - t)
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            prev = last.get(out.request_id)
            if prev is None and n:
                ttfts.append(now - added[out.request_id])
            elif prev is not None and n > prev[1]:
                gaps.extend([(now - prev[0]) / (n - prev[1])] * (n - prev[1]))
            if n:
                last[out.request_id] = (now, n)
            if out.finished and submitted < args.num_prompts:
                add()
    elapsed = time.perf_counter() - start
    ms = np.array(steps) * 1e3
    itl, ttft = np.array(gaps) * 1e3, np.array(ttfts) * 1e3
    return {"budget": budget, "itl_target_ms": itl_target, "idle_work_s": idle_s, "output_tok_s": args.num_prompts * args.output_len / elapsed,
            "steps": len(ms), "step_ms_median": float(np.median(ms)), "step_ms_p90": float(np.percentile(ms, 90)),
            "step_ms_p99": float(np.percentile(ms, 99)), "step_ms_max": float(ms.max()),
            "ttft_ms_median": float(np.median(ttft)), "ttft_ms_p99": float(np.percentile(ttft, 99)),
            "itl_ms_median": float(np.median(itl)), "itl_ms_p99": float(np.percentile(itl, 99))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--budgets", default="512", help="comma-separated max_num_batched_tokens values")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--itl-targets", default="0", help="comma-separated itl_target_ms values (0: off)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto, fp8 (an 8-bit E4M3 cache) or bfloat16 (a float32 model's keys and values in 16 bits)")
    p.add_argument("--no-idle", dest="idle", action="store_false",
                   help="start at once, without the idle work an idle server does first (faulting the KV cache in)")
    args = p.parse_args(argv)
    for budget in (int(b) for b in args.budgets.split(",")):
        for target in (float(v) for v in args.itl_targets.split(",")):
            r = run(budget, target, args)
            print(json.dumps(r))
            print(f"budget {budget}, ITL target {target:g} ms: {r['output_tok_s']:.1f} output tok/s, {r['steps']} steps, "
                  f"step ms median {r['step_ms_median']:.1f} p99 {r['step_ms_p99']:.1f}; TTFT median "
                  f"{r['ttft_ms_median']:.0f} p99 {r['ttft_ms_p99']:.0f}; ITL median {r['itl_ms_median']:.1f} "
                  f"p99 {r['itl_ms_p99']:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
