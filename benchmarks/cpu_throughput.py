"""Offline throughput on the CPU: plinth against transformers on the default model, in one run.

    python benchmarks/cpu_throughput.py --out cpu_throughput.json
    python benchmarks/cpu_throughput.py --num-prompts 16      # a quick, smaller run
    python benchmarks/cpu_throughput.py --rounds 3            # best of three, for a shared machine

Workload: ``--num-prompts`` (64) prompts of random token ids (seeded), lengths uniform in
[``--min-len``, ``--max-len``] (64..512), ``--output-len`` (128) new tokens each, greedy, EOS ignored.
Model: SmolLM2-135M-Instruct (the GGUF plinth runs by default), dequantized to ``--dtype`` by both
(default: the dtype plinth picks on this machine, bfloat16 on CPUs with native bf16).

Systems, each timed from the first request to the last token (loading not timed, a short warm-up first):
  - plinth: ``LLMEngine`` (what ``LLM.generate`` drives), every request submitted at once;
  - transformers ``generate``: left-padded batches of ``--hf-batch-size`` prompts (sorted by length,
    so padding is small), sdpa attention;
  - transformers ``generate_batch``: its continuous batching (paged attention).
transformers reads the same GGUF file with its own reader (``load_gguf_checkpoint``, the code behind
``from_pretrained(..., gguf_file=...)``, which also needs ``accelerate`` to place weights).
Prints output and total tokens/s for each system and plinth's ratio to each. On a machine shared
with other work, ``--rounds N`` runs every system N times in a rotating order and keeps each one's
best run (the least disturbed); the load average around every run is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_vs_transformers import (  # noqa: E402
    Recorder,
    disable_eos,
    hf_generate_batch,
    source_revision,
)

from plinth.entrypoints.bench_cmd import bench_throughput, random_prompts  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512, help="longest prompt (inclusive)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype of both (auto: what plinth picks on this machine)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="prompts per padded transformers batch")
    p.add_argument("--only", default="plinth,generate,generate_batch",
                   help="comma-separated systems: plinth, generate, generate_batch")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, in a rotating order; the table shows each one's best")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.rounds < 1 or args.num_prompts < 1 or args.output_len < 1:
        p.error("--rounds, --num-prompts and --output-len must be >= 1")
    args.systems = [s.strip() for s in args.only.split(",") if s.strip()]
    return args


def load_transformers(gguf_path: Path, dtype: torch.dtype) -> Any:
    """The GGUF model in transformers, dequantized by transformers' own GGUF reader."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    result = model.load_state_dict(tensors, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing or result.unexpected_keys:
        raise RuntimeError(f"GGUF load: missing {sorted(missing)}, unexpected {result.unexpected_keys}")
    model.tie_weights()
    disable_eos(model)
    return model


@torch.inference_mode()
def hf_padded_generate(model: Any, prompts: list[list[int]], new_tokens: int, batch_size: int) -> dict[str, Any]:
    """transformers ``generate`` over left-padded batches of prompts sorted by length."""
    pad = 0

    def batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)     # [B, L]
        mask = torch.zeros_like(ids)                                    # [B, L]
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        return ids, mask

    def generate(rows: list[list[int]], n: int) -> int:
        ids, mask = batch(rows)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             pad_token_id=pad)                          # [B, L + n]
        if out.shape[1] - ids.shape[1] != n:
            raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens, expected {n}")
        return len(rows) * n

    generate([p[:16] for p in prompts[:2]], 4)   # warm-up
    ordered = sorted(prompts, key=len)
    t0, cpu0 = time.perf_counter(), time.process_time()
    out_tokens = sum(generate(ordered[i:i + batch_size], new_tokens) for i in range(0, len(ordered), batch_size))
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    prompt_tokens = sum(len(p) for p in prompts)
    padded = sum(len(ordered[min(i + batch_size, len(ordered)) - 1]) * len(ordered[i:i + batch_size])
                 for i in range(0, len(ordered), batch_size))
    return {"elapsed_s": elapsed, "prompt_tokens": prompt_tokens, "padded_prompt_tokens": padded,
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + out_tokens) / elapsed, "batch_size": batch_size,
            "process_cpu_s": cpu_s}


def with_host_stats(fn: Any) -> Any:
    """Record the 1-minute load average around a run and the output tokens per CPU-second of the
    timed part: other processes may share the cores, and the load average says how much they did."""
    def wrapped() -> dict[str, Any]:
        before = os.getloadavg()[0]
        rec = fn()
        rec.update(loadavg_before=before, loadavg_after=os.getloadavg()[0],
                   output_tokens_per_cpu_s=rec["output_tokens"] / rec["process_cpu_s"])
        return rec
    return wrapped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers

    import plinth
    from plinth.config import ModelConfig
    from plinth.model_registry.default_model import default_model_path
    from plinth.model_registry.gguf_loader import read_gguf_config
    from plinth.model_registry.loader import resolve_dtype
    from plinth.platforms.selection import select_platform

    gguf = Path(default_model_path())
    dtype = resolve_dtype(ModelConfig(model=str(gguf), dtype=args.dtype), read_gguf_config(str(gguf))[0],
                          select_platform(None).supported_dtypes())
    args.dtype = str(dtype).removeprefix("torch.")
    meta = {"model": gguf.name, "dtype": args.dtype, "torch": torch.__version__,
            "transformers": transformers.__version__, "plinth": plinth.__version__,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "argv": sys.argv[1:],
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "revision": source_revision(), "num_prompts": args.num_prompts,
            "prompt_lens": [args.min_len, args.max_len], "output_len": args.output_len, "rounds": args.rounds}
    rec = Recorder(args.out, meta)
    vocab = int(read_gguf_config(str(gguf))[0].vocab_size)
    prompts = random_prompts(args.num_prompts, (args.min_len, args.max_len + 1), vocab, args.seed)
    runners: dict[str, Any] = {}
    if "plinth" in args.systems:
        engine = plinth.LLM(None, dtype=args.dtype).engine
        runners["plinth"] = lambda: bench_throughput(engine, prompts, args.output_len, 4, args.seed)
    if {"generate", "generate_batch"} & set(args.systems):
        model = load_transformers(gguf, dtype)
        if model.config.vocab_size != vocab:
            raise RuntimeError(f"unexpected vocabulary size {model.config.vocab_size}")
        if "generate" in args.systems:
            runners["transformers_generate"] = lambda: hf_padded_generate(model, prompts, args.output_len,
                                                                          args.hf_batch_size)
        if "generate_batch" in args.systems:
            runners["transformers_generate_batch"] = lambda: hf_generate_batch(model, prompts, args.output_len)
    names = list(runners)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:   # a different order every round
            rec.run(f"round{r + 1}", name, with_host_stats(runners[name]))
    best: dict[str, Any] = {}
    for name in names:
        ok = [rec.results[f"round{r + 1}"][name] for r in range(args.rounds)]
        ok = [x for x in ok if "error" not in x]
        best[name] = max(ok, key=lambda x: x["output_tokens_per_s"]) if ok else {"error": "every round failed"}
    rec.results["best"] = best
    rec.save()
    print_table(best)
    return 0


def print_table(systems: dict[str, Any]) -> None:
    plinth = systems.get("plinth", {})
    print("\nsystem                       elapsed s  output tok/s  total tok/s  plinth/this  "
          "output tok/CPU-s  plinth/this  load avg")
    for name, r in systems.items():
        if "error" in r:
            print(f"{name:<28} error: {r['error'][:80]}")
            continue
        ok = plinth and "error" not in plinth
        ratio = f"{plinth['output_tokens_per_s'] / r['output_tokens_per_s']:.2f}x" if ok else ""
        cpu_ratio = f"{plinth['output_tokens_per_cpu_s'] / r['output_tokens_per_cpu_s']:.2f}x" if ok else ""
        print(f"{name:<28} {r['elapsed_s']:>9.1f}  {r['output_tokens_per_s']:>12.1f}  {r['total_tokens_per_s']:>11.1f}  "
              f"{ratio:>11}  {r['output_tokens_per_cpu_s']:>16.1f}  {cpu_ratio:>11}  "
              f"{r['loadavg_before']:.1f}-{r['loadavg_after']:.1f}")
    print(json.dumps({k: round(v["output_tokens_per_s"], 1) for k, v in systems.items() if "error" not in v}),
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
