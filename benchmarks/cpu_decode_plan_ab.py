"""Decode speed with and without the CPU decode plan, on random weights of a model's shape.

    python benchmarks/cpu_decode_plan_ab.py --config qwen3-0.6b   # or --config path/to/config.json
    python benchmarks/cpu_decode_plan_ab.py --config my/config.json --starts 4 --new-tokens 64

Each start is a fresh process (``PLINTH_CPU_DECODE_PLAN`` alternating 1, 0, 1, 0, ...) that builds an ``LLM`` on
random weights of the config (``load_format="dummy"``), runs one warm-up, then times ``--runs`` generations of
``--new-tokens`` greedy tokens after a ``--prompt-len``-token prompt (the prompt's time included) and prints
tokens/s and the first tokens (equal on both paths: the plan runs the same kernels in the same order).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# shapes of published models (config.json fields), for --config NAME
CONFIGS = {
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
                   "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
                   "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                   "tie_word_embeddings": True, "attention_bias": False, "torch_dtype": "bfloat16",
                   "bos_token_id": 151643, "eos_token_id": 151645},
    "gemma-3-270m": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
                     "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
                     "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                     "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
                     "rms_norm_eps": 1e-06, "query_pre_attn_scalar": 256, "sliding_window": 512,
                     "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
                     "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "final_logit_softcapping": None,
                     "attn_logit_softcapping": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                     "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
}


def _child(model_dir: str, prompt_len: int, new_tokens: int, runs: int, dtype: str) -> None:
    import plinth

    llm = plinth.LLM(model_dir, load_format="dummy", max_model_len=prompt_len + new_tokens + 64, dtype=dtype)
    plan = type(llm.engine.runner.graphs).__name__ if llm.engine.runner is not None else "none"
    params = plinth.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(100, 100 + prompt_len))}], params, use_tqdm=False)
    rates, tokens = [], []
    for _ in range(runs):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": list(range(200, 200 + prompt_len))}], params, use_tqdm=False)
        rates.append(new_tokens / (time.perf_counter() - t))
        tokens = out[0].outputs[0].token_ids[:8]
    print(json.dumps({"plan_env": os.environ.get("PLINTH_CPU_DECODE_PLAN", "1"), "graphs": plan,
                      "tok_s": [round(r, 1) for r in rates], "first_tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-0.6b", help=f"a config.json path or one of {sorted(CONFIGS)}")
    parser.add_argument("--starts", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (Gemma's norms need float32 for the plan)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.prompt_len, args.new_tokens, args.runs, args.dtype)
        return
    with tempfile.TemporaryDirectory() as model_dir:
        config = CONFIGS.get(args.config)
        if config is None:
            with open(args.config, encoding="utf-8") as f:
                config = json.load(f)
        with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        for i in range(args.starts):
            env = {**os.environ, "PLINTH_CPU_DECODE_PLAN": "1" if i % 2 == 0 else "0"}
            cmd = [sys.executable, __file__, "--child", model_dir, "--runs", str(args.runs), "--dtype", args.dtype,
                   "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
