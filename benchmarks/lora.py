"""What serving LoRA adapters costs: plinth with adapters against its base model and against transformers + PEFT.

    python benchmarks/lora.py                                   # Llama-3-8B shape, bf16, on the GPU
    python benchmarks/lora.py --preset tiny-llama --dtype float32 --num-prompts 8 --output-len 8   # anywhere

Adapters: ``--num-adapters`` adapters of rank ``--rank`` on all seven projections of every layer (q, k, v, o,
gate, up, down), random weights written in PEFT's file format (``adapter_config.json`` and
``adapter_model.safetensors``: the files plinth reads). The models have random weights of the preset's shape
(speed does not depend on the values; tests/test_lora.py checks the outputs against PEFT).

Parts (``--parts``):

* ``latency``: batch-1 decode, ms per token (the time of ``--output-len`` new tokens less that of one, over the
  difference): plinth's base model, plinth with one adapter (an engine with ``max_loras=1``), and transformers
  with the same adapter through PEFT (not merged), plus transformers' base model. The floor reads every
  weight once per step plus every slot's A and B (a captured decode step computes all ``max_loras`` slots).
* ``throughput``: ``--num-prompts`` requests of ``--prompt-len`` random tokens and ``--output-len`` new tokens
  (``ignore_eos``), all at once: an engine without adapters, then one engine with ``max_loras =
  --num-adapters`` running the same requests (a) with no adapter, (b) all with one adapter, (c) spread
  round-robin over every adapter.

Each measurement is the median of ``--iters`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from plinth import benchmarks_floor as floors
from plinth.lora.adapter import TARGETS  # the projections adapted (all seven)

timed = floors.median_seconds   # (fn, iters, device) -> median seconds after a warm-up

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3-8b", help="a plinth dummy preset (the model's shape)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--parts", default="latency,throughput")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers + PEFT side")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def preset_config(preset: str) -> dict:
    from plinth.model_registry.loader import PRESET_DIR

    return json.loads((PRESET_DIR / f"{preset}.json").read_text())


def write_adapter(path: Path, cfg: dict, rank: int, seed: int, dtype: torch.dtype) -> Path:
    """A PEFT-format LoRA adapter with random weights for a model of config ``cfg``."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from plinth.lora.adapter import BLOCK, model_sizes

    sizes = model_sizes(SimpleNamespace(**{"head_dim": None, "num_key_value_heads": None, **cfg}))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, (in_kind, out_kind) in TARGETS.items():
            n_in, n_out = sizes[in_kind], sizes[out_kind]
            prefix = f"base_model.model.model.layers.{layer}.{BLOCK[proj]}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in ** 0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(TARGETS), "bias": "none"}))
    return path


def free_memory() -> None:
    """The device memory of engines and models no longer referenced back (call after the last reference is gone)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def plinth_latency(args, prompt: list[int], lora) -> tuple[float, float, str]:
    """(ms per decode token, the floor in ms, device name) on an engine with one adapter slot, or none."""
    from plinth import LLM, SamplingParams

    kw = dict(enable_lora=True, max_loras=1, max_lora_rank=args.rank) if lora is not None else {}
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, max_num_seqs=8, **kw)
    device = llm.engine.device
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    t1 = timed(lambda: llm.generate([prompt], one, lora_request=lora, use_tqdm=False), args.iters, device)
    tn = timed(lambda: llm.generate([prompt], many, lora_request=lora, use_tqdm=False), args.iters, device)
    ms = (tn - t1) / (args.output_len - 1) * 1e3
    floor_ms, name = float("nan"), floors.device_name(device)
    ceilings = floors.ceilings_for(name)
    model = llm.engine.runner.model if llm.engine.runner is not None else None
    if ceilings is not None and model is not None:
        stats = floors.weight_stats(model)
        extra = 0
        if lora is not None:   # every slot's A and B, read by every step
            extra = sum(lo.A.numel() * lo.A.element_size() + lo.B.numel() * lo.B.element_size()
                        for lo in model.lora_state.layers)
        floor_ms = (floors.decode_step_floor_s(stats, ceilings) + extra / ceilings.copy_bytes_per_s) * 1e3
    llm.engine.shutdown()
    return ms, floor_ms, name


def transformers_latency(args, prompt: list[int], adapter: Path | None, device: torch.device) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**preset_config(args.preset))
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.dtype]).eval()
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter), torch_device=str(device)).eval()
    ids = torch.tensor([prompt], device=device)

    @torch.no_grad()
    def gen(n: int) -> None:
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)

    t1 = timed(lambda: gen(1), args.iters, device)
    tn = timed(lambda: gen(args.output_len), args.iters, device)
    return (tn - t1) / (args.output_len - 1) * 1e3


def throughput(args, prompts: list[list[int]], loras: list) -> dict[str, float]:
    from plinth import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    tokens = len(prompts) * args.output_len
    out: dict[str, float] = {}
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype)
    device = llm.engine.device
    out["no LoRA engine"] = tokens / timed(lambda: llm.generate(prompts, params, use_tqdm=False), args.iters, device)
    llm.engine.shutdown()
    del llm
    free_memory()
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, enable_lora=True, max_loras=len(loras),
              max_lora_rank=args.rank)
    runs = {"LoRA engine, base requests": None, "LoRA engine, one adapter": [loras[0]] * len(prompts),
            f"LoRA engine, {len(loras)} adapters": [loras[i % len(loras)] for i in range(len(prompts))]}
    for name, picks in runs.items():
        out[name] = tokens / timed(lambda picks=picks: llm.generate(prompts, params, lora_request=picks,
                                                                    use_tqdm=False), args.iters, device)
    llm.engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from plinth import LoRARequest

    cfg = preset_config(args.preset)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(10, cfg["vocab_size"] - 10, size=args.prompt_len).tolist() for _ in range(args.num_prompts)]
    parts = args.parts.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_adapter(Path(tmp) / f"a{i}", cfg, args.rank, args.seed + i, DTYPES[args.dtype])
                 for i in range(args.num_adapters)]
        loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        print(f"{args.preset} {args.dtype}, adapters of rank {args.rank} on {', '.join(TARGETS)}; median of "
              f"{args.iters}")
        if "latency" in parts:
            base_ms, base_floor, name = plinth_latency(args, prompts[0], None)
            free_memory()
            lora_ms, lora_floor, _ = plinth_latency(args, prompts[0], loras[0])
            free_memory()
            print(f"batch-1 decode on {name} ({args.prompt_len}-token prompt, {args.output_len} new tokens), ms/token:")
            print(f"  plinth base          {base_ms:7.3f}   floor {base_floor:.3f} ({base_floor / base_ms * 100:.0f}%)")
            print(f"  plinth + adapter     {lora_ms:7.3f}   floor {lora_floor:.3f} ({lora_floor / lora_ms * 100:.0f}%)"
                  f"   cost of the adapter {(lora_ms / base_ms - 1) * 100:+.1f}%")
            if not args.no_transformers:
                hf_base = transformers_latency(args, prompts[0], None, device)
                free_memory()
                hf_lora = transformers_latency(args, prompts[0], paths[0], device)
                free_memory()
                print(f"  transformers base    {hf_base:7.3f}   plinth {hf_base / base_ms:.2f}x faster")
                print(f"  transformers + PEFT  {hf_lora:7.3f}   plinth {hf_lora / lora_ms:.2f}x faster")
        if "throughput" in parts:
            results = throughput(args, prompts, loras)
            base = results["no LoRA engine"]
            print(f"throughput: {args.num_prompts} requests x ({args.prompt_len} prompt + {args.output_len} new) "
                  f"tokens, output tok/s:")
            for name, rate in results.items():
                print(f"  {name:28s} {rate:10,.0f}   {rate / base * 100:5.1f}% of the engine without LoRA")


if __name__ == "__main__":
    main()
