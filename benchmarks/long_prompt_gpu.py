"""One prompt longer than ``max_num_batched_tokens`` (its prefill cut into chunks) on a GPU: before session 55's fix
(the skinny GEMM's zero-row case) it failed intermittently with an illegal memory access on an H100 (README, "CUDA
graphs and KV-cache sizing"); every run should now pass.

    python benchmarks/long_prompt_gpu.py --runs 3          # a 2-layer random Llama, a 2,471-token prompt
    python benchmarks/long_prompt_gpu.py --runs 4 --gpu-memory-utilization 0.3 --cpu-init --budget 2048
    python benchmarks/long_prompt_gpu.py --runs 2 --budget 8192                   # no chunking

Each run is a fresh process (a failed run aborts its process); prints each run's exit status and the tally. Before the
fix the first line failed 3 of 3 and the second passed 4 of 4: whether the start-up timing chose the skinny kernel for
a few rows of the LM head's shape decided it (benchmarks/RESULTS.md, session 55).
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

path, prompt_len, budget, util, cpu_init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
    sys.argv[5] == "1"
cfg = transformers.LlamaConfig(vocab_size=32064, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
import os
if not os.path.exists(path):
    torch.manual_seed(0)
    with torch.device("cpu" if cpu_init else "cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
limits = {"max_num_batched_tokens": budget} if budget else {}
llm = LLM(path, dtype="bfloat16", gpu_memory_utilization=util, max_model_len=4096, enable_prefix_caching=False,
          **limits)
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
    ap.add_argument("--budget", type=int, default=0, help="max_num_batched_tokens (0: the platform's default)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--cpu-init", action="store_true", help="draw the random weights on the CPU (default: the GPU)")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()
    args.model_dir = args.model_dir or f"/tmp/plinth-long-prompt-llama-{'cpu' if args.cpu_init else 'gpu'}"
    failed = 0
    for i in range(args.runs):
        proc = subprocess.run([sys.executable, "-c", CHILD, args.model_dir, str(args.prompt_len), str(args.budget),
                               str(args.gpu_memory_utilization), "1" if args.cpu_init else "0"],
                              capture_output=True, text=True)
        ok = proc.returncode == 0
        failed += not ok
        last = (proc.stdout.strip().splitlines() or [""])[-1] if ok else next(
            (line for line in proc.stderr.splitlines() if "Error" in line), proc.stderr[-200:])
        print(f"run {i + 1}: exit {proc.returncode} {last}", flush=True)
    print(f"{failed} of {args.runs} runs failed (prompt {args.prompt_len} tokens, budget {args.budget or 'default'}, "
          f"gpu_memory_utilization {args.gpu_memory_utilization}, weights drawn on the "
          f"{'CPU' if args.cpu_init else 'GPU'})")


if __name__ == "__main__":
    main()
