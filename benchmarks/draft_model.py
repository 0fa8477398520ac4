"""What a step of speculative decoding with a draft model costs, and what it gains at a given acceptance rate.

    python benchmarks/draft_model.py                     # llama-3-8b target, llama-3.2-1b draft, bfloat16, GPU
    python benchmarks/draft_model.py --target tiny-llama --draft tiny-llama --dtype float32   # anywhere

Random weights of the presets' shapes: a random draft's tokens are almost never the target's, so what is measured
is the cost of a step (the draft's catch-up pass and ``k - 1`` decode passes, the target's verification of
``1 + k`` rows); the target drafting for itself (``--self``) has every draft accepted (its tokens per step are the
ceiling, ``1 + k``, at the price of a target-sized draft). For each configuration: ``--batch`` requests of a
``--prompt-len``-token random prompt, ``--max-tokens`` greedy tokens each (EOS ignored), after a warm-up; ms per
output token, steps, tokens per step, ms per step, and whether the tokens equal the target's alone (they must:
the verification keeps the target's greedy tokens; in bfloat16 a step's row count can change the GEMMs' rounding
and so flip a near tie).

From the measured step times, the output speed at an acceptance rate ``a`` per draft follows: a step yields
``(1 - a^(k+1)) / (1 - a)`` tokens on average, so the speedup over the target alone is that times
``ms per plain step / ms per step with drafts``; the script prints it for a few rates (computed, not measured:
trained draft/target pairs of these shapes are not available here).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch


def run(target: str, draft: str | None, k: int, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from plinth import LLM, SamplingParams

    spec = {"speculative_config": {"model": draft, "num_speculative_tokens": k}} if draft else {}
    llm = LLM(target, load_format="dummy", dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16,
              max_num_seqs=max(args.batch, 1), seed=0, **spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)   # warm-up
    engine = llm.engine
    steps0 = engine.speculative.num_drafts if engine.speculative else 0
    base = dict(engine.stats().get("speculative", {}))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    out_tokens = sum(len(t) for t in tokens)
    stats = engine.stats().get("speculative", {})
    drafted = stats.get("num_draft_tokens", 0) - base.get("num_draft_tokens", 0)
    accepted = stats.get("num_accepted_tokens", 0) - base.get("num_accepted_tokens", 0)
    # steps: every output token of a request comes from one step; a step with drafts gives 1 + accepted tokens
    spec_steps = (engine.speculative.num_drafts - steps0) if engine.speculative else 0
    per_request_steps = (out_tokens - accepted) / len(prompts)
    row = {"elapsed_s": elapsed, "ms_per_token": 1000 * elapsed / (out_tokens / len(prompts)),
           "steps": per_request_steps, "tokens_per_step": out_tokens / len(prompts) / per_request_steps,
           "ms_per_step": 1000 * elapsed / per_request_steps, "drafted": drafted, "accepted": accepted,
           "acceptance": accepted / drafted if drafted else None, "steps_with_drafts": spec_steps}
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="llama-3-8b")
    p.add_argument("--draft", default="llama-3.2-1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ks", default="2,4")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--self", dest="self_draft", action="store_true", help="also the target drafting for itself")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from plinth.model_registry.loader import load_preset

    vocab = load_preset(args.target).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    results = {"target": args.target, "draft": args.draft, "dtype": args.dtype, "batch": args.batch,
               "hardware": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "runs": {}}
    plain, want = run(args.target, None, 0, args, prompts)
    results["runs"]["target alone"] = plain
    print(f"{args.target} alone: {plain['ms_per_token']:.3f} ms/token, {plain['ms_per_step']:.3f} ms/step")
    for k in (int(x) for x in args.ks.split(",")):
        for name, draft in ((args.draft, args.draft), *((("itself", args.target),) if args.self_draft else ())):
            row, tokens = run(args.target, draft, k, args, prompts)
            row["tokens_equal"] = tokens == want
            ratio = plain["ms_per_step"] / row["ms_per_step"]
            rates = {a: (1 - a ** (k + 1)) / (1 - a) * ratio for a in (0.5, 0.6, 0.7, 0.8)}
            row["speedup_at_acceptance"] = rates
            row["break_even_tokens_per_step"] = row["ms_per_step"] / plain["ms_per_step"]
            results["runs"][f"k={k}, draft {name}"] = row
            acc = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "-"
            print(f"k={k}, draft {name}: {row['ms_per_token']:.3f} ms/token, {row['ms_per_step']:.3f} ms/step, "
                  f"{row['tokens_per_step']:.2f} tokens/step, acceptance {acc}, tokens equal {row['tokens_equal']}; "
                  f"break-even at {row['break_even_tokens_per_step']:.2f} tokens/step; speedup at acceptance "
                  + ", ".join(f"{a}: {s:.2f}x" for a, s in rates.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
