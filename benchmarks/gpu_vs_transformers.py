"""plinth against transformers on the same random-weight model, side by side in one run.

    python benchmarks/gpu_vs_transformers.py --out results.json            # the full run (H200, ~10 min)
    python benchmarks/gpu_vs_transformers.py --only a,c --weights-dir /tmp/w8b
    python benchmarks/gpu_vs_transformers.py --only b --weights-dir /tmp/w8b   # reuses the same weights

Workloads (``--model-preset``, default llama-3-8b, bf16):
  a) batch 1: a 128-token prompt, 256 new tokens. transformers ``generate`` with sdpa (and with
     ``cache_implementation="static"`` plus its own compile with ``--transformers-static``);
     plinth ``LLMEngine``. Median of ``--iters`` runs after warm-up.
  b) 512 requests, prompt lengths uniform in [128, 1024) (seeded), 256 new tokens each, no EOS.
     transformers ``generate_batch`` (continuous batching, paged sdpa); plinth, all submitted at once.
  c) 1000 requests of 256 prompt tokens and 256 new tokens (plinth only; vLLM's published figure
     for this workload on an H100 is 11,364 output tok/s).

The transformers model is built once from the preset's config with random weights (seeded), saved
with ``save_pretrained`` (safetensors) and loaded by plinth from that directory, so both run the same
weights. Every part runs in its own try/except: a failure is recorded in the results and the run goes
on. Results print as each part finishes and are rewritten to ``--out`` after every part.
Floors (``plinth.benchmarks_floor``): batch-1 decode reads every matmul weight once per step at copy
bandwidth; throughput needs ``2 * params * tokens`` FLOPs at the matmul rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from plinth import benchmarks_floor as floors
from plinth.entrypoints.bench_cmd import bench_latency, bench_throughput, random_prompts

VLLM_H100_PART_C_OUTPUT_TOK_S = 11_364.0
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-preset", default="llama-3-8b", help="a plinth dummy preset (its config is used)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", default="a,b,c", help="comma-separated parts to run (a, b, c)")
    p.add_argument("--skip-transformers", action="store_true", help="plinth only (on the preset's dummy weights)")
    p.add_argument("--transformers-static", action="store_true",
                   help="part a: also transformers with cache_implementation='static' and its compile")
    p.add_argument("--input-len-a", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256, help="new tokens per request in every part")
    p.add_argument("--iters", type=int, default=3, help="part a: timed runs (median)")
    p.add_argument("--num-prompts-b", type=int, default=512)
    p.add_argument("--len-range-b", type=int, nargs=2, default=(128, 1024), metavar=("A", "B"))
    p.add_argument("--num-prompts-c", type=int, default=1000)
    p.add_argument("--input-len-c", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the prompts")
    p.add_argument("--weights-dir", default=None,
                   help="where the random weights are saved and kept (reused if it holds a model); "
                        "default: a temp dir deleted at the end")
    p.add_argument("--engine-kwargs", default="{}", help="JSON of extra plinth engine options")
    p.add_argument("--out", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = set(args.parts) - {"a", "b", "c"}
    if bad:
        p.error(f"--only takes a, b, c; got {', '.join(sorted(bad))}")
    if not 1 <= args.len_range_b[0] < args.len_range_b[1]:
        p.error("--len-range-b A B needs 1 <= A < B")
    return args


class Recorder:
    """The results so far; printed and saved after every part."""

    def __init__(self, out: str | None, meta: dict[str, Any]):
        self.out = Path(out) if out else None
        self.results: dict[str, Any] = {"meta": meta}

    def run(self, part: str, system: str, fn: Any) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        print(f"[{part}/{system}] running ...", flush=True)
        try:
            rec = fn()
        except Exception as exc:  # recorded, not swallowed: the run goes on with the next part
            rec = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(rec["traceback"], file=sys.stderr, flush=True)
            free_memory()
        rec["wall_s"] = time.perf_counter() - t0
        self.results.setdefault(part, {})[system] = rec
        summary = {k: v for k, v in rec.items() if isinstance(v, int | float | str) and k != "traceback"}
        print(f"[{part}/{system}] {json.dumps(summary, default=str)}", flush=True)
        self.save()
        return None if "error" in rec else rec

    def save(self) -> None:
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(self.results, indent=2, default=str) + "\n", encoding="utf-8")


def source_revision() -> str | None:
    """The git commit of the plinth checkout this runs from (``+dirty`` with local changes), if any."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def sync(device: torch.device) -> None:
    floors.synchronize(device)


# ------------------------------------------------------------------------------------ weights

def hf_attention(cfg: Any) -> str:
    """transformers' attention for the baseline: SDPA, or eager for a model whose SDPA path it refuses (gpt-oss:
    SDPA has no sinks)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def build_or_load_weights(args: argparse.Namespace, weights_dir: Path) -> Any:
    """A transformers model on the device: loaded from ``weights_dir`` or built (seeded) and saved there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    if (weights_dir / "config.json").is_file():
        print(f"loading the weights saved in {weights_dir}", flush=True)
        cfg = AutoConfig.from_pretrained(weights_dir)
        return AutoModelForCausalLM.from_pretrained(weights_dir, dtype=dtype, attn_implementation=hf_attention(cfg),
                                                    device_map=str(device)).eval()
    from plinth.model_registry.loader import load_preset

    cfg = load_preset(args.model_preset)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=hf_attention(cfg)).eval()
    weights_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(weights_dir, safe_serialization=True)
    print(f"built {args.model_preset} with random weights and saved it to {weights_dir} "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return model


def disable_eos(model: Any) -> None:
    """No early stop: every sequence generates exactly max_new_tokens."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.config.eos_token_id = None


# ------------------------------------------------------------------------------------ transformers

def hf_latency(model: Any, prompt: list[int], new_tokens: int, iters: int, static: bool) -> dict[str, Any]:
    device = model.device
    ids = torch.tensor([prompt], device=device)                  # [1, L]
    mask = torch.ones_like(ids)

    def once(n: int) -> float:
        extra = {"cache_implementation": "static"} if static else {}
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **extra)
        sync(device)
        elapsed = time.perf_counter() - t0
        if out.shape[1] - ids.shape[1] != n:
            raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens, expected {n}")
        return elapsed

    t_warm = [once(new_tokens) for _ in range(2)] if static else [once(min(16, new_tokens))]
    times = [once(new_tokens) for _ in range(iters)]
    ttft = None if static else statistics.median(once(1) for _ in range(iters))
    lat = statistics.median(times)
    return {"median_latency_s": lat, "latencies_s": times, "warmup_s": t_warm, "median_ttft_s": ttft,
            "output_tokens_per_s": new_tokens / lat}


def hf_generate_batch(model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    def call(inputs: list[list[int]], n: int) -> tuple[float, dict[str, Any]]:
        config = GenerationConfig(max_new_tokens=n, eos_token_id=-1, pad_token_id=0, do_sample=False)
        sync(model.device)
        t0, cpu0 = time.perf_counter(), time.process_time()
        res = model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False)
        sync(model.device)
        return time.perf_counter() - t0, time.process_time() - cpu0, res

    warm_s, _, _ = call([p[:32] for p in prompts[:4]], 8)
    elapsed, cpu_s, res = call(prompts, new_tokens)
    produced = [len(r.generated_tokens) for r in res.values()]
    errors = [r.error for r in res.values() if r.error]
    out_tokens = sum(produced)
    prompt_tokens = sum(len(p) for p in prompts)
    wrong = sum(n != new_tokens for n in produced) + len(prompts) - len(res)
    if wrong:   # a figure over requests that failed is no throughput
        raise RuntimeError(f"{wrong} of {len(prompts)} requests failed or ended early "
                           f"(first errors: {errors[:2]}); {out_tokens} tokens in {elapsed:.1f} s")
    return {
        "elapsed_s": elapsed, "warmup_call_s": warm_s, "num_prompts": len(prompts), "num_results": len(res),
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "requests_per_s": len(res) / elapsed, "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + out_tokens) / elapsed, "process_cpu_s": cpu_s,
    }


# ------------------------------------------------------------------------------------ report

def floor_fields(stats: floors.WeightStats, ceilings: floors.DeviceCeilings | None, dtype: torch.dtype,
                 rec: dict[str, Any], part: str) -> None:
    """Add the fraction of the physical floor to a result record (in place)."""
    if ceilings is None or "error" in rec:
        return
    if part == "a":
        floor_tok_s = 1.0 / floors.decode_step_floor_s(stats, ceilings)
        rec["floor_fraction"] = rec["output_tokens_per_s"] / floor_tok_s
    else:
        floor_s = floors.compute_floor_s(stats, rec["prompt_tokens"] + rec["output_tokens"], dtype, ceilings)
        if floor_s is not None:
            rec["floor_elapsed_s"] = floor_s
            rec["floor_fraction"] = floor_s / rec["elapsed_s"]


def print_table(results: dict[str, Any]) -> None:
    rows = []
    for part in ("a", "b", "c"):
        systems = results.get(part, {})
        plinth = systems.get("plinth", {})
        for name, rec in systems.items():
            if name == "plinth":
                continue
            rows.append((part, name, rec, plinth))
        rows.append((part, "plinth", plinth, None))
    print("\npart  system                        value   unit               plinth/this  floor", flush=True)
    for part, name, rec, plinth in rows:
        if not rec:
            continue
        if "error" in rec:
            print(f"{part:<5} {name:<28} error: {rec['error'][:80]}")
            continue
        value = rec["output_tokens_per_s"]
        ratio = ""
        if plinth and "error" not in plinth:
            ratio = f"{plinth['output_tokens_per_s'] / value:.2f}x"
        elif name == "plinth" and part == "c":
            ratio = f"{value / VLLM_H100_PART_C_OUTPUT_TOK_S:.2f} of vLLM H100 (11,364)"
        frac = f"{rec['floor_fraction']:.1%}" if "floor_fraction" in rec else "floor unknown"
        unit = {"a": "tok/s (batch 1)"}.get(part, "output tok/s")
        print(f"{part:<5} {name:<28} {value:>10.1f}   {unit:<18} {ratio:<12} {frac}")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers

    import plinth

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    name = floors.device_name(device)
    ceilings = floors.ceilings_for(name)
    meta = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "plinth": plinth.__version__, "preset": args.model_preset, "dtype": args.dtype,
            "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S"), "revision": source_revision(),
            "floor": ceilings.name if ceilings else floors.UNKNOWN}
    rec = Recorder(args.out, meta)
    vocab = _preset_vocab(args.model_preset)
    prompt_a = random_prompts(1, args.input_len_a, vocab, args.seed)[0]
    prompts_b = random_prompts(args.num_prompts_b, tuple(args.len_range_b), vocab, args.seed)
    prompts_c = random_prompts(args.num_prompts_c, args.input_len_c, vocab, args.seed + 1)
    temp = args.weights_dir is None
    weights_dir = Path(args.weights_dir or tempfile.mkdtemp(prefix="plinth-bench-weights-"))
    stats = None
    try:
        if not args.skip_transformers:
            model = build_or_load_weights(args, weights_dir)
            disable_eos(model)
            stats = floors.weight_stats(model)
            if "a" in args.parts:
                rec.run("a", "transformers_sdpa",
                        lambda: hf_latency(model, prompt_a, args.output_len, args.iters, static=False))
                if args.transformers_static:
                    rec.run("a", "transformers_static",
                            lambda: hf_latency(model, prompt_a, args.output_len, args.iters, static=True))
            if "b" in args.parts:
                rec.run("b", "transformers_generate_batch",
                        lambda: hf_generate_batch(model, prompts_b, args.output_len))
            del model
            free_memory()
            if device.type == "cuda":
                print(f"transformers freed: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB still allocated",
                      flush=True)
        llm_box: dict[str, Any] = {}

        def load_plinth() -> dict[str, Any]:
            kwargs = {"dtype": args.dtype, **json.loads(args.engine_kwargs)}
            if args.skip_transformers:
                kwargs.update(load_format="dummy", seed=args.seed)
            target = args.model_preset if args.skip_transformers else str(weights_dir)
            if device.type == "cpu":
                kwargs.setdefault("platform", "cpu")
            llm_box["engine"] = plinth.LLM(target, **kwargs).engine
            return {"load_time_s": llm_box["engine"].load_time_s, "engine_kwargs": kwargs}

        rec.run("setup", "plinth", load_plinth)
        engine = llm_box.get("engine")
        if engine is not None:
            stats = stats or floors.weight_stats(engine.runner.model)
            if "a" in args.parts:
                rec.run("a", "plinth", lambda: bench_latency(engine, 1, args.input_len_a, args.output_len,
                                                             args.iters, 1, args.seed))
            if "b" in args.parts:
                rec.run("b", "plinth", lambda: bench_throughput(engine, prompts_b, args.output_len, 32, args.seed))
            if "c" in args.parts:
                rec.run("c", "plinth", lambda: bench_throughput(engine, prompts_c, args.output_len, 32, args.seed))
    finally:
        if temp:
            shutil.rmtree(weights_dir, ignore_errors=True)
    if stats is not None:
        rec.results["meta"].update(params=stats.params, matmul_params=stats.matmul_params,
                                   streamed_weight_bytes=stats.streamed_bytes)
        for part in ("a", "b", "c"):
            for r in rec.results.get(part, {}).values():
                floor_fields(stats, ceilings, dtype, r, part)
    rec.save()
    print_table(rec.results)
    return 0


def _preset_vocab(preset: str) -> int:
    from plinth.model_registry.loader import load_preset

    return int(load_preset(preset).vocab_size)


if __name__ == "__main__":
    sys.exit(main())
