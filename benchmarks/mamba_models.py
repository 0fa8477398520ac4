"""Models with recurrent layers: plinth against transformers on the same random checkpoint, in one process: a Granite
4.0-H shape (Mamba-2 and attention layers, a shared MLP), or with ``--arch`` Jamba's (Mamba-1), Qwen3.5's or
Qwen3-Next's (gated DeltaNet and gated attention; Qwen3-Next with experts).

    python benchmarks/mamba_models.py --device cpu                 # a ~135M-parameter shape, 2 cores are enough
    python benchmarks/mamba_models.py --shape 1b                    # GPU: a ~1.6B-parameter shape
    python benchmarks/mamba_models.py --arch qwen3_5 --eager

Measured for each engine: one request (``--prompt-len`` random tokens, ``--max-tokens`` new ones, greedy, EOS ignored):
milliseconds per output token after the first (from runs of ``--max-tokens`` / 4 and ``--max-tokens`` tokens, so the
prompt's cost cancels) and the time to the first token; ``--requests`` such requests at once: output tokens per
second (transformers: one left-padded ``generate``, its Mamba layers through its own PyTorch scan, as on any machine
without the ``mamba_ssm`` kernels). Whether the single request's greedy tokens agree is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

#: name -> GraniteMoeHybridConfig fields: every sixth layer attention, the others Mamba-2
SHAPES = {
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  shared_intermediate_size=2048, mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128,
                  vocab_size=49152),
    "1b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
               shared_intermediate_size=5632, mamba_n_heads=64, mamba_d_head=64, mamba_d_state=128,
               vocab_size=100352),
    "tiny": dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                 shared_intermediate_size=256, mamba_n_heads=8, mamba_d_head=32, mamba_d_state=32, vocab_size=512),
}


#: name -> JambaConfig fields (``--arch jamba``): Mamba-1 layers, attention every eighth layer, experts every second
JAMBA_SHAPES = {
    "small": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=1024, num_experts=8, mamba_d_state=16, mamba_dt_rank=48, vocab_size=49152),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=4096, num_experts=8, mamba_d_state=16, mamba_dt_rank=128, vocab_size=100352),
    "tiny": dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, num_experts=4, mamba_d_state=16, mamba_dt_rank=8, vocab_size=512),
}


#: name -> Qwen3_5TextConfig fields (``--arch qwen3_5``; ``qwen3_next`` adds experts): gated DeltaNet layers, gated
#: attention every fourth layer
QWEN_SHAPES = {
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                  intermediate_size=2048, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
                  linear_value_head_dim=64, vocab_size=49152),
    "1b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
               intermediate_size=6144, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, vocab_size=100352),
    "tiny": dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, vocab_size=512),
}
#: the expert fields of ``--arch qwen3_next`` (a mixture of experts on every layer, a shared expert)
QWEN_NEXT_EXPERTS = {"small": (16, 256), "1b": (32, 512), "tiny": (4, 64)}
MODEL_CLASSES = {"granite": "GraniteMoeHybridForCausalLM", "jamba": "JambaForCausalLM",
                 "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def build_qwen(shape: str, path: str, dtype: torch.dtype, arch: str) -> None:
    import transformers

    fields = dict(QWEN_SHAPES[shape], linear_conv_kernel_dim=4, max_position_embeddings=4096, eos_token_id=0,
                  pad_token_id=0, bos_token_id=1, tie_word_embeddings=False)
    fields["layer_types"] = ["full_attention" if i % 4 == 3 else "linear_attention"
                             for i in range(fields["num_hidden_layers"])]
    if arch == "qwen3_next":
        experts, size = QWEN_NEXT_EXPERTS[shape]
        cfg = transformers.Qwen3NextConfig(**fields, num_experts=experts, num_experts_per_tok=4,
                                           moe_intermediate_size=size, shared_expert_intermediate_size=size)
    else:
        cfg = transformers.Qwen3_5TextConfig(**fields)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = getattr(transformers, MODEL_CLASSES[arch])(cfg).to(dtype)
    model.save_pretrained(path)


def build_jamba(shape: str, path: str, dtype: torch.dtype) -> None:
    import transformers

    cfg = transformers.JambaConfig(
        **JAMBA_SHAPES[shape], attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1,
        num_experts_per_tok=2, mamba_d_conv=4, mamba_expand=2, eos_token_id=0, pad_token_id=0, bos_token_id=1,
        max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.JambaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path)


def build_checkpoint(shape: str, path: str, dtype: torch.dtype, arch: str = "granite") -> None:
    import transformers

    if arch == "jamba":
        build_jamba(shape, path, dtype)
        return
    if arch in ("qwen3_5", "qwen3_next"):
        build_qwen(shape, path, dtype, arch)
        return
    fields = dict(SHAPES[shape])
    n = fields["num_hidden_layers"]
    cfg = transformers.GraniteMoeHybridConfig(
        **fields, intermediate_size=fields["shared_intermediate_size"], num_local_experts=0,
        layer_types=["attention" if i % 6 == 5 else "mamba" for i in range(n)], mamba_n_groups=1,
        mamba_chunk_size=256, mamba_expand=fields["mamba_n_heads"] * fields["mamba_d_head"] // fields["hidden_size"],
        position_embedding_type=None, max_position_embeddings=4096, eos_token_id=0, pad_token_id=0, bos_token_id=1,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.GraniteMoeHybridForCausalLM(cfg).to(dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * -4 - 1)
    model.save_pretrained(path)


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_plinth(path: str, args: argparse.Namespace, prompts: list[list[int]], eager: bool = False,
               hf_overrides: dict | None = None) -> dict:
    import plinth

    kw = {"gpu_memory_utilization": 0.5} if args.device == "cuda" else {}
    if eager:
        kw["enforce_eager"] = True
    if hf_overrides:
        kw["hf_overrides"] = hf_overrides
    llm = plinth.LLM(path, dtype=args.dtype, max_model_len=4 * args.prompt_len + 2 * args.max_tokens + 16,
                     max_num_seqs=max(args.requests, 1), **kw)

    def sp(n):
        return plinth.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    one = [{"prompt_token_ids": prompts[0]}]
    llm.generate(one, sp(4), use_tqdm=False)   # warm-up
    short_n, long_n = max(2, args.max_tokens // 4), args.max_tokens
    tokens: list[int] = []

    def long_run():
        tokens[:] = llm.generate(one, sp(long_n), use_tqdm=False)[0].outputs[0].token_ids

    # (the prefix cache emptied before each measurement: every prompt computed, as transformers computes it)
    llm.reset_prefix_cache()
    ttft = _timed(lambda: llm.generate(one, sp(1), use_tqdm=False))
    llm.reset_prefix_cache()
    t_short = _timed(lambda: llm.generate(one, sp(short_n), use_tqdm=False))
    llm.reset_prefix_cache()
    t_long = _timed(long_run)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.reset_prefix_cache()
    t_batch = _timed(lambda: llm.generate(batch, sp(args.max_tokens), use_tqdm=False))
    # the prefix cache: a long prompt (4x, tokens not seen before) cold, then again (resuming from the state saved at its last
    # block boundary); then a next turn (its prompt, output and 8 tokens more) resuming inside the output
    long_prompt = [t for p in prompts[:4] for t in reversed(p)]
    cold = _timed(lambda: llm.generate({"prompt_token_ids": long_prompt}, sp(1), use_tqdm=False))
    warm = _timed(lambda: llm.generate({"prompt_token_ids": long_prompt}, sp(1), use_tqdm=False))
    reply = llm.generate({"prompt_token_ids": long_prompt}, sp(args.max_tokens), use_tqdm=False)[0]
    turn = long_prompt + list(reply.outputs[0].token_ids) + long_prompt[:8]
    hits = llm.engine.block_manager.stats.hit_tokens
    next_turn = _timed(lambda: llm.generate({"prompt_token_ids": turn}, sp(1), use_tqdm=False))
    turn_hit = llm.engine.block_manager.stats.hit_tokens - hits
    llm.close()
    return {"ttft_s": ttft, "ms_per_token": 1e3 * (t_long - t_short) / (long_n - short_n),
            "batch_tok_s": len(prompts) * args.max_tokens / t_batch, "tokens": tokens,
            "long_prompt": len(long_prompt), "ttft_cold_s": cold, "ttft_cached_s": warm,
            "next_turn": len(turn), "next_turn_hit": turn_hit, "ttft_next_turn_s": next_turn}


def run_transformers(path: str, args: argparse.Namespace, prompts: list[list[int]],
                     architecture: str | None = None) -> dict:
    import transformers

    dtype = getattr(torch, args.dtype)
    model_class = getattr(transformers, architecture or MODEL_CLASSES[args.arch])
    model = model_class.from_pretrained(path, dtype=dtype).to(args.device).eval()
    dev = args.device

    def gen(batch: list[list[int]], n: int) -> torch.Tensor:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)[:, width:]

    gen([prompts[0]], 4)
    gen([prompts[0]], 4)
    short_n, long_n = max(2, args.max_tokens // 4), args.max_tokens
    out: list[torch.Tensor] = []
    ttft = _timed(lambda: gen([prompts[0]], 1))
    t_short = _timed(lambda: gen([prompts[0]], short_n))
    t_long = _timed(lambda: out.append(gen([prompts[0]], long_n)))
    t_batch = _timed(lambda: gen(prompts, args.max_tokens))
    gc.collect()
    return {"ttft_s": ttft, "ms_per_token": 1e3 * (t_long - t_short) / (long_n - short_n),
            "batch_tok_s": len(prompts) * args.max_tokens / t_batch, "tokens": out[0][0].tolist()}


def print_comparison(ours: dict, theirs: dict, extra: dict[str, dict]) -> tuple[int, int]:
    """The side-by-side table (``extra``: more plinth runs as columns), the single request's agreement and the
    prefix-cache lines; returns ``(tokens that agree, the first run of them)``."""
    pairs = list(zip(ours["tokens"], theirs["tokens"], strict=False))
    agree = sum(a == b for a, b in pairs)
    prefix = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    print(f"{'':14}{'plinth':>12}{'transformers':>14}{'ratio':>8}" + "".join(f"{name:>20}" for name in extra))
    for key, label, better_low in [("ms_per_token", "ms/token", True), ("ttft_s", "TTFT s", True),
                                   ("batch_tok_s", "batch tok/s", False)]:
        a, b = ours[key], theirs[key]
        ratio = b / a if better_low else a / b
        print(f"{label:14}{a:12.2f}{b:14.2f}{ratio:7.2f}x" + "".join(f"{run[key]:20.2f}" for run in extra.values()))
    print(f"greedy tokens of the single request agree: {agree}/{len(ours['tokens'])} (the first {prefix} in a row)")
    for name, run in {"plinth": ours, **extra}.items():
        print(f"{name}'s prefix cache: a {run['long_prompt']}-token prompt's first token in {run['ttft_cold_s']:.3f} s "
              f"cold, {run['ttft_cached_s']:.3f} s again; a next turn of {run['next_turn']} tokens "
              f"({run['next_turn_hit']} from the cache) in {run['ttft_next_turn_s']:.3f} s")
    return agree, prefix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(MODEL_CLASSES), default="granite",
                    help="granite: Granite 4.0-H (Mamba-2 layers); jamba: Jamba (Mamba-1 layers and experts); "
                         "qwen3_5: Qwen3.5 (gated DeltaNet layers, a dense MLP); qwen3_next: Qwen3-Next (the same "
                         "with experts)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: small on a CPU, 1b on a GPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--eager", action="store_true",
                    help="also run plinth with --enforce-eager (no CUDA graphs, no compiled CPU decode) in a column")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shape = args.shape or ("1b" if args.device == "cuda" else "small")
    g = torch.Generator().manual_seed(7)
    shapes = {"jamba": JAMBA_SHAPES, "qwen3_5": QWEN_SHAPES, "qwen3_next": QWEN_SHAPES}.get(args.arch, SHAPES)
    vocab = shapes[shape]["vocab_size"]
    prompts = [torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(shape, tmp, getattr(torch, args.dtype), args.arch)
        params = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.endswith(".safetensors"))
        ours = run_plinth(tmp, args, prompts)
        eager = run_plinth(tmp, args, prompts, eager=True) if args.eager else None
        theirs = run_transformers(tmp, args, prompts)
    print(f"{args.arch} shape {shape} ({params / 2**20:.0f} MiB of weights, {args.dtype}) on {args.device}; prompt "
          f"{args.prompt_len} tokens, {args.max_tokens} new, {args.requests} requests at once")
    agree, prefix = print_comparison(ours, theirs, {"plinth eager": eager} if eager else {})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "shape": shape, "device": args.device, "dtype": args.dtype, "plinth": ours,
                       "transformers": theirs, "plinth_eager": eager, "agree": agree, "agree_prefix": prefix}, f, indent=1)


if __name__ == "__main__":
    main()
