"""Attention time and whole-step time per decode step on the CPU, one attention backend against another.

    python benchmarks/cpu_paged_attention.py                                  # torch_batched vs cpu_paged
    python benchmarks/cpu_paged_attention.py --backends torch_batched cpu_paged --rounds 2 --json out.json

The default model (SmolLM2-135M-Instruct, GGUF, ``plinth.LLM()`` defaults apart from the forced attention
backend) gets ``--num-seqs`` requests of 30-60 random prompt tokens at once, greedy, exactly
``--output-len`` new tokens each. Every ``engine.step`` and every attention ``forward`` call is timed with the
calling thread's CPU time (``time.thread_time``, which other processes on a shared machine hardly move) and
with wall time. Reported per backend: medians over the decode-only steps (all requests start together and
stop together, so each runs every sequence; the first eighth is skipped as warm-up) of the attention time
summed over the model's layers and of the whole step, the wall time of the whole generation, and whether the
greedy tokens equal the first backend's. Backends take turns for ``--rounds`` rounds.

Thread CPU time counts only the engine thread: the OpenMP worker threads of torch's ops and of the native
kernel run beside it, so with 2 threads a parallel region counts about half of its total CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["torch_batched", "cpu_paged"])
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument("--float32-reference", action="store_true",
                   help="also run torch_sdpa in float32 and report how far each run's greedy tokens follow it")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def run_once(backend: str, prompts: list[list[int]], args: argparse.Namespace, **engine_kw: Any) -> dict[str, Any]:
    from plinth import LLM, SamplingParams

    with LLM(args.model, attention_backend=backend, **engine_kw) as llm:
        engine = llm.engine
        attn = engine.runner.backend
        assert attn.name == backend, attn.name
        calls: list[tuple[float, float, bool]] = []
        forward = attn.forward

        def timed_forward(*a: Any, **kw: Any) -> Any:
            t, w = time.thread_time(), time.perf_counter()
            out = forward(*a, **kw)
            calls.append((time.thread_time() - t, time.perf_counter() - w, a[4].is_decode_only))
            return out

        attn.forward = timed_forward
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, params)
        steps, tokens = [], {}
        w0 = time.perf_counter()
        while engine.has_unfinished_requests():
            calls.clear()
            t, w = time.thread_time(), time.perf_counter()
            outs = engine.step(final_only=True)
            step_t, step_w = time.thread_time() - t, time.perf_counter() - w
            for out in outs:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
            if calls:
                steps.append({"thread_ms": step_t * 1e3, "wall_ms": step_w * 1e3,
                              "attn_thread_ms": sum(c[0] for c in calls) * 1e3,
                              "attn_wall_ms": sum(c[1] for c in calls) * 1e3,
                              "decode": all(c[2] for c in calls)})
        total_s = time.perf_counter() - w0
    full = [s for s in steps if s["decode"]][: args.output_len - 2]
    full = full[len(full) // 8:]  # skip the first decode steps (caches warming up)

    def med(key: str) -> float:
        return statistics.median(s[key] for s in full)

    return {
        "backend": backend, "decode_steps": len(full), "total_s": total_s,
        "tok_per_s": len(prompts) * args.output_len / total_s,
        "attn_thread_ms": med("attn_thread_ms"), "attn_wall_ms": med("attn_wall_ms"),
        "step_thread_ms": med("thread_ms"), "step_wall_ms": med("wall_ms"),
        "tokens": [tokens[i] for i in ids],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, size=int(rng.integers(30, 61))).tolist() for _ in range(args.num_seqs)]
    print(f"load before: {os.getloadavg()}")
    results: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for backend in args.backends:
            res = run_once(backend, prompts, args)
            res["round"] = r + 1
            res["load"] = os.getloadavg()[0]
            results.append(res)
            print(f"round {r + 1} {backend:14s} attention/step {res['attn_thread_ms']:7.2f} ms thread "
                  f"({res['attn_wall_ms']:7.2f} wall)  step {res['step_thread_ms']:7.2f} ms thread "
                  f"({res['step_wall_ms']:7.2f} wall)  {res['tok_per_s']:6.1f} tok/s  load {res['load']:.2f}",
                  flush=True)
    ref = results[0]["tokens"]
    for res in results:
        same = sum(a == b for a, b in zip(res["tokens"], ref, strict=True))
        res["same_tokens_as_first"] = f"{same}/{len(ref)}"
        print(f"{res['backend']} round {res['round']}: greedy outputs equal to the first run's: {same}/{len(ref)}")
    if args.float32_reference:
        ref32 = run_once("torch_sdpa", prompts, args, dtype="float32")["tokens"]
        for res in results:
            prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                      for x, y in zip(res["tokens"], ref32, strict=True)]
            res["float32_same"] = sum(p == args.output_len for p in prefix)
            res["float32_mean_prefix"] = statistics.mean(prefix)
            print(f"{res['backend']} round {res['round']}: equal to float32 torch_sdpa: {res['float32_same']}/"
                  f"{len(prefix)}, mean agreeing prefix {res['float32_mean_prefix']:.1f} of {args.output_len} tokens")
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in results], indent=1))
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
