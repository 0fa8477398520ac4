"""Reproduces the known GPU issue: one prompt longer than ``max_num_batched_tokens`` (its prefill cut into chunks)
intermittently fails with an illegal memory access on an H100 (README, "CUDA graphs and KV-cache sizing").

    python benchmarks/long_prompt_gpu.py --runs 4                    # a 2-layer random Llama, 2,471-token prompt
    python benchmarks/long_prompt_gpu.py --runs 4 --budget 8192      # the workaround: no chunking

Each run is a fresh process (a failed run aborts its process); prints each run's exit status and the tally.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = """
import sys
import numpy as np
import torch
import transformers
from plinth import LLM, SamplingParams

path, prompt_len, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = transformers.LlamaConfig(vocab_size=32064, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
import os
if not os.path.exists(path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
llm = LLM(path, dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=4096, max_num_batched_tokens=budget,
          enable_prefix_caching=False)
ids = [1] + [int(t) for t in np.random.default_rng(0).integers(100, 31000, prompt_len - 1)]
out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                               detokenize=False), use_tqdm=False)
torch.cuda.synchronize()
print("tokens", out[0].outputs[0].token_ids)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=2471)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--model-dir", default="/tmp/plinth-long-prompt-llama")
    args = ap.parse_args()
    failed = 0
    for i in range(args.runs):
        proc = subprocess.run([sys.executable, "-c", CHILD, args.model_dir, str(args.prompt_len), str(args.budget)],
                              capture_output=True, text=True)
        ok = proc.returncode == 0
        failed += not ok
        last = (proc.stdout.strip().splitlines() or [""])[-1] if ok else next(
            (line for line in proc.stderr.splitlines() if "Error" in line), proc.stderr[-200:])
        print(f"run {i + 1}: exit {proc.returncode} {last}", flush=True)
    print(f"{failed} of {args.runs} runs failed (prompt {args.prompt_len} tokens, budget {args.budget})")


if __name__ == "__main__":
    main()
