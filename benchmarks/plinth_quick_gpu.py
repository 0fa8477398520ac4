"""Quick plinth-only GPU figures on a dummy preset: batch-1 decode latency and offline throughput.

python benchmarks/plinth_quick_gpu.py --preset llama-3-8b --num-prompts 512
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from plinth import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(a.preset, load_format="dummy", dtype="bfloat16", enforce_eager=a.enforce_eager, max_model_len=2048)
    res: dict = {"load_s": time.perf_counter() - t0, "backend": llm.engine.selection.winner}
    print(res, flush=True)
    rng = np.random.default_rng(0)
    vocab = llm.engine.vocab_size
    prompt = rng.integers(0, vocab, 128).tolist()
    p = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate([prompt], p, use_tqdm=False)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([prompt], p, use_tqdm=False)
        times.append(time.perf_counter() - t)
    res["batch1_tok_s"] = 256 / float(np.median(times))
    print(res, flush=True)
    lens = rng.integers(128, 1024, a.num_prompts)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in lens]
    t = time.perf_counter()
    outs = llm.generate(prompts, p, use_tqdm=False)
    dt = time.perf_counter() - t
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    res.update(tput_elapsed_s=dt, output_tok_s=out_toks / dt, total_tok_s=(out_toks + int(lens.sum())) / dt)
    print(res, flush=True)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
