"""What ``LLM.sleep()`` frees and how long sleeping and waking take (reinforcement learning: the engine gives
its GPU memory to the trainer between rounds of generation), against the PCIe floor.

    python benchmarks/sleep_mode.py                     # llama-3-8b shape, bfloat16, on the GPU
    python benchmarks/sleep_mode.py --preset tiny-llama --dtype float32   # anywhere (a CPU frees the KV cache only)

For each level (1: weights copied to pinned host memory, 2: weights discarded), ``--iters`` rounds of: generate
(greedy, the same prompts every round), sleep, wake up; the device memory the engine holds before and after
sleeping (``torch.cuda.memory_reserved``: what another process can take), the sleep and wake times (the wake
includes capturing the decode graphs again) and whether each round's tokens equal the first round's (level 2
loads the weights saved before it slept with ``update_weights``, from host memory, not timed with the wake). The
floor of a level-1 sleep or wake is the weights' bytes over PCIe once (``--pcie-gbs``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--levels", default="1,2")
    p.add_argument("--pcie-gbs", type=float, default=55.0, help="host-device bandwidth, GB/s (PCIe 5 x16)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    from plinth import LLM, SamplingParams

    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, max_model_len=2048, enable_sleep_mode=True)
    runner = llm.engine.executor.runner
    device = runner.device
    cuda = device.type == "cuda"
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(64)] for i in range(8)]

    def tokens() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    def held() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize(device)
        return torch.cuda.memory_reserved(device)

    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    results: dict = {"preset": args.preset, "dtype": args.dtype,
                     "hardware": torch.cuda.get_device_name(device) if cuda else "cpu",
                     "weights_gb": weights / 1e9, "kv_cache_gb": runner.kv_cache_bytes / 1e9}
    print(f"{args.preset} {args.dtype} on {results['hardware']}: weights {weights / 1e9:.2f} GB, KV cache "
          f"{runner.kv_cache_bytes / 1e9:.2f} GB")
    want = tokens()
    for level in (int(x) for x in args.levels.split(",")):
        if level == 2 and not cuda:
            continue
        saved = {n: t.detach().cpu() for n, t in runner.model.state_dict().items()} if level == 2 else None
        sleeps, wakes, equal, freed = [], [], [], []
        for _ in range(args.iters):
            before = held()
            t0 = time.perf_counter()
            llm.sleep(level=level)
            sleeps.append(time.perf_counter() - t0)
            freed.append(before - held())
            t0 = time.perf_counter()
            llm.wake_up()
            wakes.append(time.perf_counter() - t0)
            if saved is not None:   # the trainer's weights (here the ones from before the sleep)
                llm.engine.update_weights(_checkpoint_names(llm, saved))
            equal.append(tokens() == want)
        floor = weights / 1e9 / args.pcie_gbs if cuda and level == 1 else None
        row = {"sleep_s": statistics.median(sleeps), "wake_s": statistics.median(wakes),
               "freed_gb": statistics.median(freed) / 1e9, "tokens_equal": all(equal), "pcie_floor_s": floor}
        results[f"level{level}"] = row
        print(f"level {level}: freed {row['freed_gb']:.2f} GB, sleep {row['sleep_s']:.3f} s, wake {row['wake_s']:.3f} s"
              + (f" (floor {floor:.3f} s each way)" if floor else "") + f", tokens equal: {all(equal)}"
              + f" (runs: sleep {', '.join(f'{t:.3f}' for t in sleeps)}; wake {', '.join(f'{t:.3f}' for t in wakes)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _checkpoint_names(llm, state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The model's own parameters as checkpoint pairs: plinth's fused projections split back into the checkpoint's
    names (the loaders take the checkpoint's layout)."""
    out = []
    hf = llm.engine.model_source.hf_config
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    for name, t in state.items():
        if name.endswith("qkv_proj.weight"):
            q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            base = name.removesuffix("qkv_proj.weight")
            out += [(base + "q_proj.weight", q), (base + "k_proj.weight", k), (base + "v_proj.weight", v)]
        elif name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2)
            base = name.removesuffix("gate_up_proj.weight")
            out += [(base + "gate_proj.weight", gate), (base + "up_proj.weight", up)]
        elif "rotary" not in name:
            out.append((name, t))
    return out


if __name__ == "__main__":
    main()
