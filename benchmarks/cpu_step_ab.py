"""A/B of one CPU fast-path switch on decode steps of the default model, both sides in one process.

    python benchmarks/cpu_step_ab.py --toggle native --batch 1
    python benchmarks/cpu_step_ab.py --toggle plan --batch 32 --rounds 6 --steps 15

``--batch`` requests of 50 random prompt tokens (seeded) are prefilled, then decode steps (greedy, EOS
ignored) alternate between the switch on and off, ``--steps`` steps per side per round. Printed: the
median and lower quartile of ``LLMEngine.step`` wall time per side. Alternating in one process keeps the
machine's load (other jobs on shared cores) about equal for both sides.

Switches: ``native`` = everything ``PLINTH_CPU_NATIVE_OPS`` covers (the fused small ops, the Q8_0 LM head,
the 4-bit panel GEMM), both sides through the module tree (the decode plan calls the native ops directly, so
it is off for this A/B); ``plan`` = the decode plan (the runner's ``graphs``) against the module tree;
``int8`` = the GEMMs with 8-bit inputs (``PLINTH_CPU_INT8_ACT=1``, the engine built with it) against the
default GEMMs of the same layers (4-bit panels, bfloat16 LM head), decode plan on for both; ``layer_ops`` =
the native RMSNorm, SiLU-and-mul and RoPE for float32 models (CPUs without native bfloat16, where the default
model runs in float32) against the torch code of those layers, both through the module tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toggle", choices=("native", "plan", "int8", "layer_ops"), required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=15)
    a = p.parse_args(argv)
    from plinth import LLM, SamplingParams
    from plinth.kernels import cpu_native

    if a.toggle == "int8":
        os.environ["PLINTH_CPU_INT8_ACT"] = "1"
    llm = LLM()
    engine = llm.engine
    vnni = {m: m.vnni for m in _linear_methods(engine.runner.model) if getattr(m, "vnni", None) is not None}
    if a.toggle == "int8" and not vnni:
        p.error("no layer multiplies with 8-bit inputs (see the start-up log)")
    # with 8-bit inputs a layer keeps no prepacked bfloat16 copy; the "off" side gets the default one back
    packed = {m: torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 32) for m in vnni}
    plan = engine.runner.graphs
    if a.toggle == "plan" and plan is None:
        p.error("this engine runs no decode plan (see the start-up log)")
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - 50, ignore_eos=True, detokenize=False)
    for i in range(a.batch):
        engine.add_request(f"r{i}", torch.randint(0, engine.vocab_size, (50,), generator=gen).tolist(), params)

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - t0)
        return out

    if a.toggle in ("native", "layer_ops"):   # the plan calls the native ops directly
        engine.runner.graphs = None
    layer_ops = cpu_native.layer_ops_enabled
    steps(5)   # prefill and warm-up
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(a.rounds):
        for side in ("on", "off"):
            if a.toggle == "native":
                os.environ[cpu_native.NATIVE_OPS_ENV] = "1" if side == "on" else "0"
                cpu_native._env_enabled.cache_clear()
            elif a.toggle == "layer_ops":
                cpu_native.layer_ops_enabled = layer_ops if side == "on" else cpu_native.enabled
            elif a.toggle == "int8":
                for method, panels in vnni.items():
                    method.vnni = panels if side == "on" else None
                    method.packed = None if side == "on" else packed[method]
            else:
                engine.runner.graphs = plan if side == "on" else None
            times[side] += steps(a.steps)
    for side, ts in times.items():
        ts = sorted(ts)
        print(f"{a.toggle} {side}, batch {a.batch}: median {statistics.median(ts) * 1e3:.2f} ms/step, "
              f"p25 {ts[len(ts) // 4] * 1e3:.2f} ms")
    return 0


def _linear_methods(model: torch.nn.Module) -> list:
    """The CPU GEMM methods of the layers and of the LM head."""
    out = []
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        gemm = getattr(module, "gemm", None)
        if method is not None and hasattr(method, "vnni"):
            out.append(method)
        elif gemm is not None and hasattr(getattr(gemm, "__self__", None), "vnni"):
            out.append(gemm.__self__)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
