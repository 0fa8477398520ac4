"""A serving-like run in one process: how step budgets trade step latency for output rate (no HTTP).

``--concurrency`` requests in flight out of ``--num-prompts``, each ``--input-len`` random prompt tokens
and ``--output-len`` new tokens at temperature 1 (EOS ignored), a finished request replaced at once by
the next one: the workload of ``benchmarks/serve_peers.sh``, without the server and the client. Prints
the output rate and the engine step times (median, p90, p99, max), for each ``--budgets`` value.

    python benchmarks/cpu_serving_sim.py --budgets 256,512,2048
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def run(budget: int, args: argparse.Namespace) -> dict:
    from plinth import LLM, SamplingParams

    llm = LLM(args.model, max_num_batched_tokens=budget)
    engine = llm.engine
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(100, 40000, args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    submitted = 0
    while submitted < min(args.concurrency, args.num_prompts):
        engine.add_request(str(submitted), prompts[submitted], params)
        submitted += 1
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t)
        for out in outputs:
            if out.finished and submitted < args.num_prompts:
                engine.add_request(str(submitted), prompts[submitted], params)
                submitted += 1
    elapsed = time.perf_counter() - start
    ms = np.array(steps) * 1e3
    return {"budget": budget, "output_tok_s": args.num_prompts * args.output_len / elapsed, "steps": len(ms),
            "step_ms_median": float(np.median(ms)), "step_ms_p90": float(np.percentile(ms, 90)),
            "step_ms_p99": float(np.percentile(ms, 99)), "step_ms_max": float(ms.max())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--budgets", default="512", help="comma-separated max_num_batched_tokens values")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    for budget in (int(b) for b in args.budgets.split(",")):
        r = run(budget, args)
        print(json.dumps(r))
        print(f"budget {budget}: {r['output_tok_s']:.1f} output tok/s, {r['steps']} steps, step ms median "
              f"{r['step_ms_median']:.1f} p90 {r['step_ms_p90']:.1f} p99 {r['step_ms_p99']:.1f} max {r['step_ms_max']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
