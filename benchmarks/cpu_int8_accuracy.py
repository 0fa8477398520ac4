"""How far the CPU's 8-bit-input GEMMs (``PLINTH_CPU_INT8_ACT=1``) move the default model's outputs, against the
bfloat16 default, both measured from a float32 run of the same GGUF weights.

    python benchmarks/cpu_int8_accuracy.py

Each mode runs in its own process (the switch is read at engine start-up): ``fp32`` (the file's weights
dequantized to float32, float32 compute: the reference), ``bf16`` (the default CPU path) and ``int8``. For
eight texts (prose, code, a chat turn; ~50 tokens each) the teacher-forced log-probability of every prompt
token is taken (``prompt_logprobs``), and for four of them 64 greedy tokens with their log-probabilities.
Printed per mode, against fp32: the mean and largest change of the prompt tokens' log-probabilities, how often
the most likely next token is the same, how many greedy tokens agree before the first difference, and the mean
and largest change of the greedy tokens' log-probabilities up to there (decode steps: on CPUs without native
bfloat16 the default is float32 and the prompt runs no 8-bit GEMM, so this is where ``int8`` differs). There
``int8-all`` (``PLINTH_CPU_INT8_ACT=all``) also computes the prompts with 8-bit inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

TEXTS = [
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city to the fall "
    "of Constantinople. Its institutions shaped law, language and architecture across Europe.",
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n    left = [x for x "
    "in items[1:] if x < pivot]\n    right = [x for x in items[1:] if x >= pivot]\n    return quicksort(left) + "
    "[pivot] + quicksort(right)\n",
    "Photosynthesis converts light energy into chemical energy. Plants take in carbon dioxide and water and, using "
    "sunlight, produce glucose and oxygen in their chloroplasts.",
    "User: What is the capital of France and why is it famous?\nAssistant: The capital of France is Paris. It is "
    "famous for the Eiffel Tower, the Louvre museum, its cafes and its long history as a center of art and culture.",
]
TEXTS = [f"{t} {i}" for i, t in enumerate(TEXTS * 2)]


def run_mode(mode: str) -> dict:
    """In this process: the prompt scores and greedy tokens of one mode."""
    from plinth import LLM, SamplingParams

    llm = LLM(**({"dtype": "float32"} if mode == "fp32" else {}))
    outs = llm.generate(TEXTS, SamplingParams(max_tokens=1, prompt_logprobs=5, temperature=0), use_tqdm=False)
    scores = []
    for o in outs:
        rows = []
        for pos, d in enumerate(o.prompt_logprobs):
            if d is not None:
                top = max(d.items(), key=lambda kv: kv[1].logprob)[0]
                rows.append((d[o.prompt_token_ids[pos]].logprob, top))
        scores.append(rows)
    greedy = llm.generate(TEXTS[:4], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=1),
                          use_tqdm=False)
    return {"scores": scores, "greedy": [g.outputs[0].token_ids for g in greedy],
            "greedy_logprobs": [[d[t].logprob for t, d in zip(g.outputs[0].token_ids, g.outputs[0].logprobs,
                                                              strict=True)] for g in greedy]}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--mode":
        print("RESULT " + json.dumps(run_mode(sys.argv[2])), flush=True)
        return 0
    results = {}
    modes = ("bf16", "int8", "int8-all")
    for mode in ("fp32", *modes):
        env = dict(os.environ, PLINTH_CPU_INT8_ACT={"int8": "1", "int8-all": "all"}.get(mode, "0"))
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--mode", mode], env=env, check=True,
                             capture_output=True, text=True).stdout
        results[mode] = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    ref = results["fp32"]
    for mode in modes:
        r = results[mode]
        pairs = [(a, b) for ra, rb in zip(ref["scores"], r["scores"], strict=True) for a, b in zip(ra, rb, strict=True)]
        delta = np.array([abs(a[0] - b[0]) for a, b in pairs])
        top1 = np.mean([a[1] == b[1] for a, b in pairs])
        agree, steps = [], []
        for i, (x, y) in enumerate(zip(ref["greedy"], r["greedy"], strict=True)):
            n = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
            agree.append(n)
            steps += [abs(a - b) for a, b in zip(ref["greedy_logprobs"][i][:n], r["greedy_logprobs"][i][:n],
                                                 strict=True)]
        steps_txt = f"mean {np.mean(steps):.4f}, max {np.max(steps):.3f}" if steps else "none"
        print(f"{mode} vs fp32: prompt log-probabilities |change| mean {delta.mean():.4f}, max {delta.max():.3f}; "
              f"same top-1 token {top1:.1%} of {len(pairs)} positions; greedy tokens equal before the first "
              f"difference: {agree} of 64; their log-probabilities |change| {steps_txt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
