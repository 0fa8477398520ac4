"""An FP8 KV cache against the model's dtype: capacity, long-context throughput and decode latency, one run.

    python benchmarks/kv_cache_dtype.py                            # Llama-3-8B shape, bf16, on the GPU
    python benchmarks/kv_cache_dtype.py --preset tiny-llama --dtype float32 --num-prompts 8 --prompt-len 64 \\
        --output-len 8 --latency-context 128   # anywhere (the torch backends; Triton's FP8 needs a GPU)

For each ``--kv-cache-dtypes`` setting an engine with random weights of the preset's shape reports:

* capacity: KV blocks and tokens the cache holds at the default memory budget;
* throughput: ``--num-prompts`` requests of ``--prompt-len`` random tokens and ``--output-len`` new tokens
  (``ignore_eos``) at once, output tok/s (long prompts: the cache's size and the attention's reads matter);
* latency: one request decoding after a ``--latency-context``-token prompt, ms per token (the time of
  ``--output-len`` tokens less that of one, over the difference), against the floor: the weights plus the
  sequence's keys and values read once per step.

Each measurement is the median of ``--iters`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import gc

import numpy as np
import torch

from plinth import benchmarks_floor as floors

timed = floors.median_seconds   # (fn, iters, device) -> median seconds after a warm-up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtypes", default="auto,fp8")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--latency-context", type=int, default=7936, help="the prompt of the latency run (with the "
                   "output, within the model's max_position_embeddings)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: enough for both workloads")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run(args: argparse.Namespace, kv: str, vocab: int) -> dict:
    from plinth import LLM, SamplingParams

    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(10, vocab - 10, size=args.prompt_len).tolist() for _ in range(args.num_prompts)]
    long_prompt = rng.integers(10, vocab - 10, size=args.latency_context).tolist()
    max_len = args.max_model_len or max(args.prompt_len, args.latency_context) + args.output_len
    # without the prefix cache: every run computes every prompt (the runs repeat the same prompts)
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, kv_cache_dtype=kv, max_model_len=max_len,
              enable_prefix_caching=False)
    engine = llm.engine
    device = engine.device
    bs = engine.config.cache.block_size
    caches = engine.runner.kv_caches if engine.runner is not None else []
    out = {"backend": engine.selection.winner if engine.selection else "?",
           "blocks": engine.block_manager.num_usable_blocks, "tokens": engine.block_manager.num_usable_blocks * bs,
           # every layer's keys and values of one token (the block count may be capped by max_num_seqs x the
           # sequence length, so bytes per token is the capacity's measure)
           "token_bytes": sum(c[:, :1].numel() * c.element_size() for c in caches) // bs}
    many = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seconds = timed(lambda: llm.generate(prompts, many, use_tqdm=False), args.iters, device)
    out["throughput"] = args.num_prompts * args.output_len / seconds
    t1 = timed(lambda: llm.generate([long_prompt], one, use_tqdm=False), args.iters, device)
    tn = timed(lambda: llm.generate([long_prompt], many, use_tqdm=False), args.iters, device)
    out["ms"] = (tn - t1) / (args.output_len - 1) * 1e3
    ceilings = floors.ceilings_for(floors.device_name(device))
    model = engine.runner.model if engine.runner is not None else None
    if ceilings is not None and model is not None:
        step_bytes = (floors.weight_stats(model).streamed_bytes
                      + out["token_bytes"] * (args.latency_context + args.output_len // 2))
        out["floor_ms"] = step_bytes / ceilings.copy_bytes_per_s * 1e3
    engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from plinth.model_registry.loader import load_preset

    vocab = load_preset(args.preset).vocab_size
    results = {}
    for kv in args.kv_cache_dtypes.split(","):
        results[kv] = run(args, kv, vocab)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"{args.preset} {args.dtype}; throughput: {args.num_prompts} x ({args.prompt_len} prompt + {args.output_len} "
          f"new) tokens; latency: one request after {args.latency_context} tokens; median of {args.iters}")
    base = next(iter(results.values()))
    for kv, r in results.items():
        floor = f"   floor {r['floor_ms']:.3f} ({r['floor_ms'] / r['ms'] * 100:.0f}%)" if "floor_ms" in r else ""
        print(f"  kv_cache_dtype={kv:5s} ({r['backend']}): {r['token_bytes']:,} KV bytes per token, {r['tokens']:,} "
              f"tokens in the cache ({r['tokens'] / base['tokens']:.2f}x), {r['throughput']:,.0f} output tok/s "
              f"({r['throughput'] / base['throughput']:.2f}x), batch-1 {r['ms']:.3f} ms/token{floor}")


if __name__ == "__main__":
    main()
