"""What n-gram speculative decoding (prompt lookup) gains and costs: the same requests with and without drafts.

    python benchmarks/spec_decode.py                                   # the default model, on this machine
    python benchmarks/spec_decode.py --preset llama-3-8b --dtype bfloat16 --batches 1,32   # random weights, GPU

For each batch size (``--batches``: that many requests at once) and each draft length (``--ks``; 0: no
speculation), one engine generates ``--max-tokens`` tokens per request (greedy, EOS ignored) and the script
prints output tok/s, ms per output token, the drafts' acceptance rate, the mean tokens a sequence gains per step
with drafts, and how many tokens equal those of ``k = 0`` before the first difference (all of them in float32:
greedy verification changes no token; in bfloat16 a step's row count can change the GEMMs' rounding and flip a
near tie, as any change of batch shape can).

Workloads (``--workload``):

* ``edit``: the model is asked to repeat a code listing with one change (the case prompt lookup serves: the
  output copies long stretches of the prompt);
* ``chat``: open questions (little to copy: what drafts cost when few are accepted).

With ``--preset`` the model has random weights of the preset's shape and the prompts are random tokens (an edit
prompt holds its random stretch twice): acceptance then says what such a model repeats, not what real text
does, while the cost of a step with drafts is the real one. ``--oracle`` measures that cost at full acceptance:
the drafts are the next tokens of the ``k = 0`` run itself (a stand-in proposer, not a method: the ceiling of
what drafts of that length can gain on this model and machine).
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

LISTING = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """The length of the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''

EDITS = ["Rename the function merge_intervals to join_ranges everywhere.",
         "Rename the variable merged to result everywhere.",
         "Rename the variable ordered to by_start everywhere.",
         "Add a comment line at the top that says '# interval helpers'."]

QUESTIONS = ["Please write a detailed explanation of how rainbows form for a curious student.",
             "Please write a detailed explanation of the rules of chess for a curious student.",
             "Please write a detailed explanation of why the sky is blue for a curious student.",
             "Please write a detailed explanation of how vaccines work for a curious student."]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model path (default: the default model)")
    p.add_argument("--preset", default=None, help="a dummy preset (random weights) instead of --model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workload", default="edit", choices=("edit", "chat"))
    p.add_argument("--ks", default="0,2,4,8", help="draft lengths (num_speculative_tokens; 0: off)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--batches", default="1,8", help="requests at once")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--iters", type=int, default=1, help="timed runs per case (median), after a warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-path", default="auto", choices=("auto", "query"),
                   help="query: drafts as a multi-token query of each sequence even where they could go as rows of "
                        "a decode step (for comparison)")
    p.add_argument("--oracle", action="store_true",
                   help="draft the k = 0 run's own next tokens (every draft accepted: the ceiling)")
    return p.parse_args(argv)


def make_prompts(llm, args, n: int) -> list:
    """``n`` prompts (token ids) of the workload."""
    if args.preset is not None:
        rng = np.random.default_rng(args.seed)
        vocab = llm.engine.vocab_size
        out = []
        for _ in range(n):
            stretch = rng.integers(100, vocab - 100, 200).tolist()
            out.append(stretch + stretch if args.workload == "edit" else rng.integers(100, vocab - 100, 400).tolist())
        return [{"prompt_token_ids": p} for p in out]
    prompts = []
    for i in range(n):
        if args.workload == "edit":
            text = f"Here is some Python code:\n\n```python\n{LISTING}```\n\n{EDITS[i % len(EDITS)]} " \
                   "Reply with the complete code only."
        else:
            text = QUESTIONS[i % len(QUESTIONS)]
        rendered = llm.engine.render_chat([{"role": "user", "content": text}])
        prompts.append({"prompt_token_ids": llm.engine.tokenize(rendered, add_special_tokens=False)})
    return prompts


def oracle_proposer(reference: dict[tuple[int, ...], list[int]], k: int):
    """Drafts that are the reference run's next tokens for the request's prompt."""
    def propose(req, limit: int) -> list[int]:
        ref = reference[tuple(req.prompt_token_ids)]
        i = req.num_output_tokens
        return ref[i:i + min(k, limit)]
    return propose


def run_case(args, k: int, batch: int, reference: dict | None = None) -> dict:
    from plinth import LLM, SamplingParams

    spec = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.prompt_lookup_min,
             "prompt_lookup_max": args.prompt_lookup_max} if k else None)
    kw = dict(load_format="dummy", model=args.preset) if args.preset else dict(model=args.model)
    llm = LLM(dtype=args.dtype, speculative_config=spec, max_num_seqs=max(batch, 8), seed=args.seed, **kw)
    device = llm.engine.device
    prompts = make_prompts(llm, args, batch)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if reference is not None and k:
        llm.engine.scheduler.proposer = oracle_proposer(reference, k)
    if args.draft_path == "query":
        llm.engine._batch_builder.drafts_as_rows = False
    rows = llm.engine._batch_builder.drafts_as_rows
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    times, outs = [], None
    before = dict(llm.engine.stats().get("speculative", {}))
    for _ in range(args.iters):
        _sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        times.append(time.perf_counter() - t0)
    stats = llm.engine.stats().get("speculative", {})
    drafts = stats.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
    accepted = stats.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    steps = stats.get("num_drafts", 0) - before.get("num_drafts", 0)
    seconds = float(np.median(times))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    by_prompt = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in outs}
    text = outs[0].outputs[0].text
    llm.engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    n_out = sum(map(len, tokens))
    return {"k": k, "batch": batch, "seconds": seconds, "tok_s": n_out / seconds,
            "ms_per_token": seconds / args.max_tokens * 1e3, "acceptance": accepted / drafts if drafts else None,
            "per_step": 1 + accepted / steps if steps else None, "tokens": tokens, "text": text, "by_prompt": by_prompt,
            "device": str(device) + (", drafts as decode rows" if k and rows else ", drafts as queries" if k else "")}


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    model = args.preset or args.model or "the default model"
    drafts = "oracle drafts (the k=0 run's next tokens)" if args.oracle else (
        f"n-grams {args.prompt_lookup_min}-{args.prompt_lookup_max}")
    print(f"{model}, workload {args.workload}, {args.max_tokens} new tokens per request (greedy), {drafts}; "
          f"median of {args.iters}")
    for batch in batches:
        base = None
        for k in ks:
            r = run_case(args, k, batch, base["by_prompt"] if args.oracle and base is not None else None)
            if base is None:
                base = r
            # the leading tokens equal to k=0's, over all requests (greedy verification changes no token; in bfloat16
            # a step's shape can still flip a near tie, as any change of batch shape can)
            same = sum(next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b),
                            min(len(x), len(y)))
                       for x, y in zip(r["tokens"], base["tokens"], strict=True))
            same = f"{same}/{sum(map(len, base['tokens']))}"
            acc = f"{r['acceptance']:.1%}" if r["acceptance"] is not None else "-"
            per = f"{r['per_step']:.2f}" if r["per_step"] is not None else "-"
            print(f"  batch {batch:3d}  k={k}: {r['tok_s']:9,.1f} output tok/s ({r['tok_s'] / base['tok_s']:.2f}x)  "
                  f"{r['ms_per_token']:7.2f} ms per token  acceptance {acc:>6}  tokens per draft step {per:>5}  "
                  f"tokens equal to k={base['k']}'s until the first difference: {same}  [{r['device']}]", flush=True)
        print(f"  (first output of batch {batch}: {base['text'][:160]!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
