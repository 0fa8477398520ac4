"""How long ``LLM.update_weights`` takes to load a whole model's new weights (reinforcement-learning weight sync),
from tensors on the GPU (a colocated trainer's) and from host memory, against the copy floor.

    python benchmarks/weight_update.py                      # llama-3-8b shape, bfloat16, on the GPU
    python benchmarks/weight_update.py --preset tiny-llama --dtype float32   # anywhere (CPU: PLINTH_CPU_PACKED=0)

The new tensors carry the checkpoint (Hugging Face) names and shapes of the preset's architecture (a transformers
model built on the meta device names them). Floors: on the GPU, every byte read once and written once at the
copy bandwidth (``--copy-gbs``, ../shared/GPU.md); from the host, every byte over PCIe (``--pcie-gbs``). Each
source is timed ``--iters`` times after one warm-up update; the prefix cache reset is included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def checkpoint_shapes(preset: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The preset architecture's checkpoint tensors (transformers' names), from a model built on the meta device."""
    import transformers

    from plinth.model_registry.loader import PRESET_DIR

    config = transformers.AutoConfig.for_model(**json.loads((PRESET_DIR / f"{preset}.json").read_text()))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {name: (t.shape, t.dtype) for name, t in state.items() if not name.endswith("rotary_emb.inv_freq")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--copy-gbs", type=float, default=4210.0, help="device copy bandwidth, GB/s (H200: 4,210)")
    p.add_argument("--pcie-gbs", type=float, default=55.0, help="host-to-device bandwidth, GB/s (PCIe 5 x16)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    os.environ.setdefault("PLINTH_CPU_PACKED", "0")   # the CPU path's plain weights take new values

    from plinth import LLM

    dtype = getattr(torch, args.dtype)
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, max_model_len=2048, max_num_seqs=8)
    runner = llm.engine.executor.runner
    device = runner.device
    shapes = checkpoint_shapes(args.preset)
    torch.manual_seed(0)
    made = {n: torch.randn(s, dtype=dtype, device=device) * 0.02 for n, (s, _) in shapes.items()}   # (fast there)
    nbytes = sum(t.numel() * t.element_size() for t in made.values())
    sources = {"host": {n: t.cpu() for n, t in made.items()}}   # a trainer's CPU state dict (pageable memory)
    if device.type == "cuda":
        sources["device"] = made   # a colocated trainer's tensors on the same GPU
    host = sources["host"]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    results = {"preset": args.preset, "dtype": args.dtype, "hardware": str(torch.cuda.get_device_name(device)
               if device.type == "cuda" else "cpu"), "tensors": len(host), "gb": nbytes / 1e9}
    for name, weights in sources.items():
        llm.update_weights(weights)   # warm-up
        sync()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            llm.update_weights(weights)
            sync()
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        # the floor on a GPU: each byte read and written once on the device, or carried over PCIe once
        floor = None if device.type != "cuda" else (2 * nbytes / 1e9 / args.copy_gbs if name == "device"
                                                    else nbytes / 1e9 / args.pcie_gbs)
        results[name] = {"median_s": median, "min_s": min(times), "floor_s": floor}
        print(f"{args.preset} {args.dtype}, {len(host)} tensors, {nbytes / 1e9:.2f} GB from the {name}: "
              f"median {median:.3f} s (min {min(times):.3f})"
              + (f", floor {floor:.3f} s ({median / floor:.1f}x)" if floor else ""))
    # the engine still generates, with the last weights
    out = llm.generate([[1, 2, 3, 4]], use_tqdm=False)[0]
    print("generates after the updates:", len(out.outputs[0].token_ids) > 0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
