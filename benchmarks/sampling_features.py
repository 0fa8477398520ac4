"""What logprobs modes and custom logits processors cost: offline decode throughput of one model with each.

    python benchmarks/sampling_features.py [--model PATH] [--num-prompts 32] [--max-tokens 128]

Every configuration runs the same prompts with the same sampling (temperature 0.8, top-k 50, 5 logprobs per token);
one engine per configuration (all loaded first, each warmed up), then ``--iters`` rounds in which the configurations
take turns (the median of each reported):

* ``raw``: the default ``logprobs_mode`` (the model's log-probabilities);
* ``processed``: ``logprobs_mode="processed_logprobs"`` (those of the distribution each token was drawn from);
* ``noop-processor``: a custom logits processor that applies to every request and returns the logits unchanged
  (what synchronous steps and the processor call cost);
* ``ban-last-processor``: one that bans each row's previous token (a Python loop over the rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from plinth import LLM, SamplingParams
from plinth.core.logits_processors import LogitsProcessor


class NoOp(LogitsProcessor):
    def apply(self, logits, rows):
        return logits


class BanLast(LogitsProcessor):
    def apply(self, logits, rows):
        for j, row in enumerate(rows):
            logits[j, (row.output_token_ids or row.prompt_token_ids)[-1]] = float("-inf")
        return logits


CONFIGS = {
    "raw": {},
    "processed": {"logprobs_mode": "processed_logprobs"},
    "noop-processor": {"logits_processors": [NoOp]},
    "ban-last-processor": {"logits_processors": [BanLast]},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    prompts = [f"Write a short story about a {w} who learns to cook." for w in
               ("cat", "dog", "robot", "pirate", "wizard", "baker", "farmer", "pilot")]
    prompts = [prompts[i % len(prompts)] + f" Story {i}:" for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=args.max_tokens, ignore_eos=True,
                            logprobs=5)
    names = args.configs.split(",")
    engines = {name: LLM(args.model, **CONFIGS[name]) for name in names}   # all loaded, then timed in turn
    for llm in engines.values():
        llm.generate(prompts[:4], params.clone(max_tokens=8), use_tqdm=False)   # warm-up
    times: dict[str, list[float]] = {name: [] for name in names}
    tokens = {}
    for _ in range(args.iters):   # the configurations alternate, so that the machine's drift hits each alike
        for name in names:
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
            tokens[name] = sum(len(o.outputs[0].token_ids) for o in outs)
    results = {}
    for name in names:
        elapsed = statistics.median(times[name])
        results[name] = {"elapsed_s": round(elapsed, 3), "output_tok_s": round(tokens[name] / elapsed, 1),
                         "runs_s": [round(t, 3) for t in times[name]]}
        print(f"{name:20s} {results[name]['output_tok_s']:8.1f} output tok/s (median {elapsed:.2f} s of "
              f"{', '.join(f'{t:.2f}' for t in times[name])})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
