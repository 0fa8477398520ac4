"""Tensor-parallel all-reduces on two GPUs: what one costs alone and inside a decode step.

    python benchmarks/tp_allreduce_gpu.py --out tp_allreduce.json

Two processes (one per GPU) build Llama-3-8B's layer shapes split for TP=2 (qkv 3072 x 4096, o 4096 x 2048,
gate_up 14336 x 4096, down 4096 x 7168 per rank, bfloat16, 32 layers) and capture one CUDA graph per
variant of a decode step's all-reduces:

  none          no all-reduce (the floor the all-reduces add to)
  nccl          ``dist.all_reduce`` (NCCL)
  torch_one_shot  copy into a symmetric buffer + ``torch.ops.symm_mem.one_shot_all_reduce_out``
  peer          plinth's peer-memory kernel (``PeerKernel.all_reduce``), then the fused RMSNorm kernel
  peer_fused    plinth's peer-memory kernel with the residual add and RMSNorm in the same launch

A step is: RMSNorm(+residual), qkv GEMM, o GEMM (on the first 2048 qkv outputs: a stand-in for attention),
all-reduce, RMSNorm(+residual), gate_up GEMM, SiLU-and-mul, down GEMM, all-reduce: per layer. Also timed:
64 all-reduces of one ``[rows, 4096]`` tensor back to back in one graph (the latency of one). Before timing,
the peer kernel's sums are checked against NCCL's bit for bit, and the fused kernel against NCCL + RMSNorm.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HIDDEN, LAYERS = 4096, 32
SHAPES = {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)}
VARIANTS = ("none", "nccl", "torch_one_shot", "peer", "peer_fused")


def _rank(rank: int, port: int, a: argparse.Namespace, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from plinth.distributed import custom_all_reduce as car
    from plinth.kernels import ops

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=device)
    group = dist.new_group([0, 1])
    os.environ[car.CUSTOM_ALL_REDUCE_ENV] = "1"
    one_shot = car.create_custom_all_reduce(group, device)
    peer = car.PeerKernel(group, device, blocks=a.peer_blocks)
    peer.connect()
    result: dict = {"torch_one_shot": one_shot is not None}

    # correctness against NCCL, different data on each rank
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    checks = {}
    norm_w = (torch.rand(HIDDEN, generator=gen, device=device) + 0.5).to(torch.bfloat16)
    dist.broadcast(norm_w, 0, group=group)
    for rows in (1, 3, 8, 33, 128):
        x = torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
        ref = x.clone()
        dist.all_reduce(ref, group=group)
        mine = x.clone()
        peer.all_reduce(mine)
        res = torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
        dist.broadcast(res, 0, group=group)
        ref_y, ref_h = ops.rms_norm(ref, norm_w, 1e-5, res.clone())
        res_mine = res.clone()
        y = peer.all_reduce_add_rms_norm(x, res_mine, norm_w, 1e-5)
        checks[rows] = {"sum_equal": bool(torch.equal(mine, ref)), "residual_equal": bool(torch.equal(res_mine, ref_h)),
                        "norm_max_diff": float((y.float() - ref_y.float()).abs().max()),
                        "norm_mismatches": int((y != ref_y).sum())}
    result["checks"] = checks

    ws = {name: [torch.randn(n, k, generator=gen, device=device).to(torch.bfloat16) * 0.02 for _ in range(LAYERS)]
          for name, (n, k) in SHAPES.items()}
    norms = [(torch.rand(HIDDEN, generator=gen, device=device) + 0.5).to(torch.bfloat16) for _ in range(2 * LAYERS)]

    def reduce(kind: str, t: torch.Tensor) -> None:
        if kind == "nccl":
            dist.all_reduce(t, group=group)
        elif kind == "torch_one_shot":
            one_shot.all_reduce(t)
        elif kind in ("peer", "peer_fused"):
            peer.all_reduce(t)

    def norm_after(kind: str, t: torch.Tensor, residual: torch.Tensor, w: torch.Tensor):
        if kind == "peer_fused":
            y = peer.all_reduce_add_rms_norm(t, residual, w, 1e-5)
            return y, residual
        reduce(kind, t)
        return ops.rms_norm(t, w, 1e-5, residual)

    def step(kind: str, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, residual = ops.rms_norm(x, norms[0], 1e-5, residual)
        for i in range(LAYERS):
            qkv = h @ ws["qkv"][i].t()
            o = qkv[:, :2048].contiguous() @ ws["o"][i].t()
            h2, residual = norm_after(kind, o, residual, norms[2 * i])
            d = ops.silu_and_mul(h2 @ ws["gate_up"][i].t()) @ ws["down"][i].t()
            h, residual = norm_after(kind, d, residual, norms[2 * i + 1])
        return h

    def time_graph(fn, iters: int) -> float:
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize(device)
        dist.barrier(group=group, device_ids=[rank])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / iters
        del graph
        return ms

    timings: dict = {}
    for rows in [int(r) for r in a.rows.split(",")]:
        x = torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
        res = torch.zeros_like(x)
        for kind in VARIANTS:
            if kind == "torch_one_shot" and one_shot is None:
                continue
            step_ms = time_graph(lambda kind=kind, x=x, res=res: step(kind, x, res.clone()), a.iters)
            t = torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
            if kind == "none":
                alone = None
            elif kind == "peer_fused":
                alone = time_graph(lambda t=t, res=res: [peer.all_reduce_add_rms_norm(t, res, norms[0], 1e-5)
                                                          for _ in range(64)],
                                   a.iters) / 64 * 1000
            else:
                alone = time_graph(lambda kind=kind, t=t: [reduce(kind, t) for _ in range(64)], a.iters) / 64 * 1000
            timings[f"{rows}:{kind}"] = {"step_ms": step_ms, "one_all_reduce_us": alone}
    result["timings"] = timings
    peer.close()
    if one_shot is not None:
        one_shot.close()
    dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--peer-blocks", type=int, default=16, help="blocks per launch of plinth's kernel")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    with tempfile.TemporaryDirectory() as out:
        tmp.start_processes(_rank, args=(store.port, a, out), nprocs=2, start_method="spawn")
        results = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]
    r0 = results[0]
    print("checks (rank 0):", json.dumps(r0["checks"]))
    print("checks (rank 1):", json.dumps(results[1]["checks"]))
    print(f"{'rows':>5} {'variant':>15} {'step ms':>9} {'vs none':>8} {'one all-reduce us':>18}")
    for key, v in r0["timings"].items():
        rows, kind = key.split(":")
        base = r0["timings"][f"{rows}:none"]["step_ms"]
        alone = "" if v["one_all_reduce_us"] is None else f"{v['one_all_reduce_us']:.2f}"
        print(f"{rows:>5} {kind:>15} {v['step_ms']:9.3f} {v['step_ms'] - base:+8.3f} {alone:>18}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
