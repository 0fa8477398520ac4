"""Embedding (or classification) throughput: plinth (``task="embed"`` / ``"classify"``) against transformers on the
same model shape, in one run.

    python benchmarks/embeddings.py                                  # Llama-3-8B shape, bf16, on the GPU
    python benchmarks/embeddings.py --preset tiny-llama --dtype float32 --num-prompts 64   # anywhere
    python benchmarks/embeddings.py --task classify                  # the preset's decoder as a 2-label classifier

With ``--task classify`` both run the preset's ``*ForSequenceClassification`` (plinth through ``hf_overrides``,
``LLM.classify``; transformers' class, whose pad token is set so that it batches; no prompt holds it) and
softmax the two labels' logits.

    python benchmarks/embeddings.py --preset bert-base --len-range 32 512    # an encoder (first-token pooling)
    python benchmarks/embeddings.py --preset bert-base --len-range 32 512 --systems plinth \
        --engine-kwargs '{"async_scheduling": false}'                        # plinth's steps one after another

Workload: ``--num-prompts`` prompts of random token ids, lengths uniform in ``[--len-range)`` (seeded), each
pooled to one vector (last token, normalized; an encoder's first token). plinth gets all prompts at once (``LLM.embed``, prefix cache off:
every run computes every prompt); transformers
runs its base model (sdpa) over length-sorted batches of ``--hf-batch`` prompts, padded on the right, and takes
each prompt's last real position. Both models have random weights of the preset's shape (plinth's dummy
weights, transformers' own initialisation: speed does not depend on the values; tests/test_embeddings.py
compares the vectors on shared weights). The floor is ``2 * params * tokens`` FLOPs at the device's measured
matmul rate (``plinth.benchmarks_floor``). Each system is timed ``--iters`` times after a warm-up; the median
is reported.
"""

from __future__ import annotations

import argparse
import gc
import json

import numpy as np
import torch

from plinth import benchmarks_floor as floors

timed = floors.median_seconds   # (fn, iters, device) -> median seconds after a warm-up

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3-8b", help="a plinth dummy preset (the model's shape)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--len-range", type=int, nargs=2, default=(128, 1024), metavar=("A", "B"))
    p.add_argument("--hf-batch", type=int, default=32, help="prompts per transformers forward")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--systems", default="plinth,transformers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", default="embed", choices=("embed", "classify"))
    p.add_argument("--engine-kwargs", type=json.loads, default={},
                   help='more LLM(...) arguments for plinth, as JSON (e.g. \'{"async_scheduling": false}\')')
    return p.parse_args(argv)


def is_encoder(preset: str) -> bool:
    """Whether a preset is an encoder-only model (``bert-base``, ``bge-m3``): pooled at its first token."""
    from plinth.model_registry.loader import PRESET_DIR, is_encoder_architecture

    return is_encoder_architecture(json.loads((PRESET_DIR / f"{preset}.json").read_text())["architectures"][0])


def classifier_overrides(preset: str) -> dict:
    """The ``hf_overrides`` that make a preset's causal LM (or encoder) a 2-label sequence classifier."""
    from plinth.model_registry.loader import PRESET_DIR

    arch = json.loads((PRESET_DIR / f"{preset}.json").read_text())["architectures"][0]
    if is_encoder(preset):
        return {"architectures": [arch.removesuffix("Model") + "ForSequenceClassification"], "num_labels": 2}
    return {"architectures": [arch.replace("ForCausalLM", "ForSequenceClassification")], "num_labels": 2,
            "pad_token_id": 0}


def prompts_of(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(args.len_range[0], args.len_range[1], size=args.num_prompts)
    return [rng.integers(10, vocab - 10, size=int(n)).tolist() for n in lens]


def run_plinth(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, int, str]:
    from plinth import LLM

    # without the prefix cache: the timed runs repeat the warm-up's prompts, which would otherwise be cached
    extra = {"hf_overrides": classifier_overrides(args.preset)} if args.task == "classify" else {}
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, task=args.task, enable_prefix_caching=False,
              **extra, **args.engine_kwargs)
    device = llm.engine.device
    run = llm.classify if args.task == "classify" else llm.embed
    seconds = timed(lambda: run(prompts, use_tqdm=False), args.iters, device)
    params = floors.weight_stats(llm.engine.runner.model).matmul_params if llm.engine.runner is not None else 0
    name = floors.device_name(device)
    llm.engine.shutdown()
    return seconds, params, name


def run_transformers(args: argparse.Namespace, prompts: list[list[int]], device: torch.device) -> float:
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    from plinth.model_registry.loader import PRESET_DIR

    fields = json.loads((PRESET_DIR / f"{args.preset}.json").read_text())
    if args.task == "classify":
        fields.update(classifier_overrides(args.preset))
    config = AutoConfig.for_model(**fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    builder = AutoModelForSequenceClassification if args.task == "classify" else AutoModel
    with torch.device(device):
        model = builder.from_config(config, dtype=DTYPES[args.dtype]).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    encoder = is_encoder(args.preset)

    @torch.no_grad()
    def embed_all() -> None:
        for start in range(0, len(order), args.hf_batch):
            batch = [prompts[i] for i in order[start:start + args.hf_batch]]
            width = max(map(len, batch))
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, p in enumerate(batch):
                ids[row, :len(p)] = torch.tensor(p)
                mask[row, :len(p)] = 1
            ids, mask = ids.to(device), mask.to(device)
            if args.task == "classify":   # pooled at the last non-pad token by the class itself
                model(input_ids=ids, attention_mask=mask).logits.float().softmax(-1).cpu()
                continue
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            if encoder:   # (an encoder's first token)
                last = hidden[:, 0].float()
            else:
                last = hidden[torch.arange(len(batch), device=device), mask.sum(1) - 1].float()
            torch.nn.functional.normalize(last, dim=-1).cpu()

    return timed(embed_all, args.iters, device)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from plinth.model_registry.loader import load_preset

    vocab = load_preset(args.preset).vocab_size
    prompts = prompts_of(args, vocab)
    tokens = sum(map(len, prompts))
    systems = args.systems.split(",")
    results: dict[str, float] = {}
    params, name = 0, "cpu"
    if "plinth" in systems:
        results["plinth"], params, name = run_plinth(args, prompts)
        gc.collect()   # the engine's memory back before transformers' model is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "transformers" in systems:
        results["transformers"] = run_transformers(args, prompts, device)
    print(f"{args.preset} {args.dtype} {args.task} on {name}: {len(prompts)} prompts, {tokens} tokens "
          f"(lengths {args.len_range[0]}-{args.len_range[1] - 1}), median of {args.iters}")
    for system, seconds in results.items():
        print(f"  {system:13s} {seconds:8.3f} s  {tokens / seconds:12,.0f} prompt tok/s  "
              f"{len(prompts) / seconds:9,.1f} {'embeddings' if args.task == 'embed' else 'classifications'}/s")
    if len(results) == 2:
        print(f"  plinth / transformers: {results['transformers'] / results['plinth']:.2f}x")
    ceilings = floors.ceilings_for(name)
    floor = (floors.compute_floor_s(floors.WeightStats(params, params, 0), tokens, DTYPES[args.dtype], ceilings)
             if ceilings is not None and params else None)
    if floor is not None and "plinth" in results:
        print(f"  floor (2 x {params / 1e9:.2f} G params x tokens at the matmul rate): {floor:.3f} s; "
              f"plinth at {floor / results['plinth'] * 100:.0f}% of it")
    else:
        print(f"  {floors.UNKNOWN}")


if __name__ == "__main__":
    main()
