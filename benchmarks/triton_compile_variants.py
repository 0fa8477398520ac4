"""How many Triton kernels a GPU engine compiles, and when: at start-up, in a warm-up, in each later run.

    python benchmarks/triton_compile_variants.py --model-preset gemma-3-1b --num-prompts 256 --out variants.json

Empties Triton's cache first (``--keep-cache`` to keep it), starts an ``LLMEngine`` on random weights of a preset,
then runs a warm-up (32 prompts of the workload's first lengths, 16 new tokens) and ``--runs`` throughput runs of
``--num-prompts`` prompts (lengths uniform in ``[128, 1024)``, new ones each run, ``--output-len`` new tokens, EOS
ignored). After each phase it counts the compiled kernels in Triton's cache by name: a kernel that keeps gaining
copies after the warm-up is specialised on values that change from step to step (Triton compiles a copy per
divisibility class of each integer argument: divisible by 16, equal to 1, other), and its compile time lands in
serving.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import time


def _cache_dir() -> str:
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def compiled_kernels() -> collections.Counter:
    """Kernel name -> compiled copies in Triton's cache (one ``<name>.json`` per compiled copy)."""
    counts: collections.Counter = collections.Counter()
    for path in glob.glob(os.path.join(_cache_dir(), "*", "*.json")):
        name = os.path.basename(path)[: -len(".json")]
        if not name.startswith("__grp__"):
            counts[name] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-preset", default="gemma-3-1b")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--keep-cache", action="store_true", help="do not empty Triton's cache first")
    parser.add_argument("--out", default=None, help="write the counts and times as JSON here")
    args = parser.parse_args()
    if not args.keep_cache:
        shutil.rmtree(_cache_dir(), ignore_errors=True)

    import plinth
    from plinth.entrypoints.bench_cmd import random_prompts, timed_run

    t = time.perf_counter()
    llm = plinth.LLM(args.model_preset, load_format="dummy", dtype="bfloat16")
    engine = llm.engine
    phases = [{"phase": "start-up", "seconds": time.perf_counter() - t, "new": dict(compiled_kernels())}]
    seen = compiled_kernels()
    prompts = random_prompts(args.num_prompts, (128, 1024), engine.vocab_size, 0)
    warm = [random_prompts(1, len(p), engine.vocab_size, 7919 + i)[0] for i, p in enumerate(prompts[:32])]
    # each run has prompts of its own (the same lengths), so no run is served from an earlier run's prefix cache
    runs = [prompts] + [random_prompts(args.num_prompts, (128, 1024), engine.vocab_size, r)
                        for r in range(1, args.runs)]
    work = [("warm-up", warm, 16)] + [(f"run {r}", batch, args.output_len) for r, batch in enumerate(runs)]
    for label, batch, new_tokens in work:
        t = time.perf_counter()
        timed_run(engine, batch, new_tokens, label)
        now = compiled_kernels()
        seconds = time.perf_counter() - t
        phases.append({"phase": label, "seconds": seconds, "output_tok_s": len(batch) * new_tokens / seconds,
                       "new": dict(now - seen)})
        seen = now
    for p in phases:
        rate = f" ({p['output_tok_s']:,.0f} output tok/s)" if "output_tok_s" in p else ""
        print(f"{p['phase']:>10}: {p['seconds']:7.2f} s{rate}, new compiled kernels {sum(p['new'].values())}: "
              f"{p['new']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model_preset": args.model_preset, "num_prompts": args.num_prompts, "phases": phases}, f,
                      indent=2)


if __name__ == "__main__":
    main()
