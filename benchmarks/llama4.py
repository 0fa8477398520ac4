"""Llama 4: plinth against transformers on the same random checkpoint, in one process.

    python benchmarks/llama4.py --device cpu              # a ~0.4B-parameter shape, 2 cores are enough
    python benchmarks/llama4.py                            # GPU: a ~2.3B-parameter shape (16 experts a layer)
    python benchmarks/llama4.py --chunk 64                 # plinth again with 64-token attention chunks

The shapes keep Llama 4 Scout's layout (three chunked RoPE layers with q/k norms, then a NoPE layer; 16 experts, top 1,
and a shared expert on every layer) at a smaller width. Measured as ``benchmarks/mamba_models.py`` measures (one
request: ms per output token after the first and the time to the first token; ``--requests`` at once: output tok/s;
the prefix cache's long prompt and next turn, plinth only). Scout's attention chunk (8,192 tokens) is longer than
these contexts, so its chunked layers attend to everything; ``--chunk N`` adds a plinth run with ``N``-token chunks
(``hf_overrides``), where decodes and prompts cross chunk boundaries, to show what the chunked view costs.
transformers runs its own Llama 4 code: every expert for every token (``bmm`` over the stacked experts, the router's
scores zeroing the unchosen ones).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from mamba_models import print_comparison, run_plinth, run_transformers

#: name -> Llama4TextConfig fields
SHAPES = {
    "small": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                  intermediate_size=512, intermediate_size_mlp=2048, num_local_experts=16, vocab_size=49152),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
               intermediate_size=1024, intermediate_size_mlp=4096, num_local_experts=16, vocab_size=100352),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=128, intermediate_size_mlp=256, num_local_experts=4, vocab_size=512),
}


def build_checkpoint(shape: str, path: str, dtype: torch.dtype) -> None:
    import transformers

    cfg = transformers.Llama4TextConfig(**SHAPES[shape], num_experts_per_tok=1, interleave_moe_layer_step=1,
                                        attention_chunk_size=8192, max_position_embeddings=16384, eos_token_id=0,
                                        pad_token_id=0, bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.Llama4ForCausalLM(cfg).to(dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):   # experts chosen clearly (a zero-initialised router ties them all)
                p.copy_(torch.randn(p.shape, generator=g).to(dtype))
            elif ".experts." in name:
                p.copy_((0.02 * torch.randn(p.shape, generator=g)).to(dtype))
    model.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: small on a CPU, 1b on a GPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=None, help="also run plinth with attention chunks of this many tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.arch = "llama4"
    shape = args.shape or ("1b" if args.device == "cuda" else "small")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, SHAPES[shape]["vocab_size"], (args.prompt_len,), generator=g).tolist()
               for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(shape, tmp, getattr(torch, args.dtype))
        size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.endswith(".safetensors"))
        ours = run_plinth(tmp, args, prompts)
        chunked = (run_plinth(tmp, args, prompts, hf_overrides={"attention_chunk_size": args.chunk})
                   if args.chunk else None)
        theirs = run_transformers(tmp, args, prompts, "Llama4ForCausalLM")
    print(f"llama4 shape {shape} ({size / 2**20:.0f} MiB of weights, {args.dtype}) on {args.device}; prompt "
          f"{args.prompt_len} tokens, {args.max_tokens} new, {args.requests} requests at once")
    agree, _ = print_comparison(ours, theirs, {f"plinth chunk {args.chunk}": chunked} if chunked else {})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "device": args.device, "dtype": args.dtype, "plinth": ours,
                       "plinth_chunked": chunked, "transformers": theirs, "agree": agree}, f, indent=1)


if __name__ == "__main__":
    main()
