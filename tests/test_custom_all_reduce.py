"""The custom all-reduce of tensor-parallel groups (plinth.distributed.custom_all_reduce).

On the CPU: the switch, the routing of ``tp_all_reduce``, and, in a 2-process gloo group with peer
memory stood in by host buffers, which tensors take the one-shot path and which the group's backend,
and that a set-up failure on any one rank makes every rank fall back with a warning.

On two CUDA GPUs (skipped elsewhere): the real symmetric-memory all-reduce equals NCCL's, eagerly and
inside a replayed CUDA graph; the TP worker sets it up and installs the skinny GEMMs; TP=2 greedy
outputs are the same with it and without it (``PLINTH_CUSTOM_ALL_REDUCE=0``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plinth.config import ConfigError
from plinth.distributed import custom_all_reduce as car
from plinth.distributed import parallel_state
from plinth.distributed.communication import tp_all_reduce
from plinth.distributed.parallel_state import ParallelLayout, ParallelState

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=120))


def _spawn(fn, *args) -> None:
    import torch.multiprocessing as tmp

    tmp.start_processes(fn, args=args, nprocs=2, start_method="spawn")


# ------------------------------------------------------------------------------------ CPU, in-process


class _RecordingOps:
    def __init__(self):
        self.calls: list[str] = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append(name)
            raise AssertionError(f"{name} must not be called")
        return record


def test_off_switch_and_non_cuda_devices_set_nothing_up(monkeypatch):
    """No group, a CPU device, or PLINTH_CUSTOM_ALL_REDUCE=0: ``None`` at once, no collective, no
    peer-memory call (the stand-in group below would fail any collective)."""
    monkeypatch.delenv(car.CUSTOM_ALL_REDUCE_ENV, raising=False)   # on by default, but only for CUDA devices
    not_a_group = object()
    assert car.create_custom_all_reduce(None, torch.device("cpu")) is None
    assert car.create_custom_all_reduce(not_a_group, torch.device("cpu")) is None
    ops = _RecordingOps()
    for off in ("0", "false", "off", "NO"):
        monkeypatch.setenv(car.CUSTOM_ALL_REDUCE_ENV, off)
        assert car.create_custom_all_reduce(not_a_group, torch.device("cpu"), ops=ops) is None
    assert ops.calls == []
    monkeypatch.setenv(car.CUSTOM_ALL_REDUCE_ENV, "sometimes")
    with pytest.raises(ConfigError, match="PLINTH_CUSTOM_ALL_REDUCE='sometimes'"):
        car.create_custom_all_reduce(not_a_group, torch.device("cpu"), ops=ops)


def test_tp_all_reduce_routes_through_the_custom_all_reduce(monkeypatch):
    """With a custom all-reduce in the parallel state, ``tp_all_reduce`` hands it the tensor (and returns
    what it returns); without one, the group's backend reduces the tensor in place."""
    import plinth.distributed.communication as communication

    class Doubling:
        def __init__(self):
            self.seen: list[torch.Tensor] = []

        def all_reduce(self, x):
            self.seen.append(x)
            return x.mul_(2)

    group = object()
    backend_calls = []
    monkeypatch.setattr(communication.dist, "all_reduce", lambda x, group: backend_calls.append(group) or x.add_(1))
    custom = Doubling()
    layout = ParallelLayout(0, 2, 1)
    monkeypatch.setattr(parallel_state, "_STATE", ParallelState(layout, "gloo", group, None, custom))
    x = torch.full((1, 8), 3.0)
    assert tp_all_reduce(x) is x and torch.equal(x, torch.full((1, 8), 6.0))
    assert custom.seen == [x] and backend_calls == []
    monkeypatch.setattr(parallel_state, "_STATE", ParallelState(layout, "gloo", group, None))
    y = torch.full((1, 8), 3.0)
    assert tp_all_reduce(y) is y and torch.equal(y, torch.full((1, 8), 4.0))
    assert backend_calls == [group] and custom.seen == [x]


# ----------------------------------------------------------------------- CPU, a 2-process gloo group


class HostPeerOps:
    """Peer memory stood in by host buffers: the "one-shot" reduction is a gloo all-reduce of the staged
    copy. ``fault`` makes one step fail on one rank (or a dtype fail on every rank)."""

    def __init__(self, group, rank: int, fault: str | None):
        self.group, self.rank, self.fault = group, rank, fault
        self.buffer: torch.Tensor | None = None
        self.calls = 0
        self.staged_in_buffer = True

    def empty(self, nbytes, device):
        if self.fault == "alloc" and self.rank == 0:
            raise RuntimeError("no peer memory on this device")
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.buffer

    def rendezvous(self, buffer, group_name):
        assert buffer is self.buffer and group_name == self.group.group_name
        if self.fault == "map" and self.rank == 1:
            raise RuntimeError("cannot map the peer's buffer")
        return object()

    def one_shot_all_reduce_out(self, staged, group_name, out):
        if self.fault == "no_fp16" and staged.dtype == torch.float16:
            raise NotImplementedError("one_shot_all_reduce not implemented for 'Half'")
        assert self.buffer is not None and staged.shape == out.shape
        self.calls += 1
        self.staged_in_buffer &= staged.data_ptr() == self.buffer.data_ptr()
        total = staged.clone()
        dist.all_reduce(total, group=self.group)
        if self.fault == "wrong_sum" and self.rank == 1:
            total += 1
        out.copy_(total)


SCENARIOS = ["ok", "alloc", "map", "wrong_sum", "hosts", "no_fp16"]


def _dispatch_cases(rank: int) -> dict[str, torch.Tensor]:
    """Tensors an all-reduce may see, different on each rank; which path each takes is asserted below."""
    too_large = car.MAX_BYTES // 4 + 4
    return {
        "bf16_rows": (torch.arange(2 * 64).view(2, 64) % 50 + rank).to(torch.bfloat16),
        "fp32_row": torch.arange(64.0).view(1, 64) * (rank + 1),
        "fp16_row": (torch.arange(64).view(1, 64) % 9 + rank).to(torch.float16),
        "largest_bf16": torch.full((car.MAX_BYTES // 2,), float(rank + 1), dtype=torch.bfloat16),
        "too_large": torch.full((too_large,), float(rank + 1)),
        "int64": torch.arange(64) + rank,
        "odd_bytes": torch.full((7,), float(rank + 1), dtype=torch.bfloat16),      # 14 bytes
        "misaligned": torch.full((65,), float(rank + 1))[1:],                     # 4 bytes past an aligned base
    }


def _gloo_rank(rank: int, port: int, out_dir: str) -> None:
    from plinth.distributed.parallel_state import destroy_parallel_state, init_parallel_state

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ[car.CUSTOM_ALL_REDUCE_ENV] = "1"
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger(car.__name__).addHandler(Collect())
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=60))
    state = init_parallel_state(ParallelLayout(rank, 2, 1), "gloo", store, 60.0, device=torch.device("cpu"))
    assert state.custom_all_reduce is None   # a CPU worker's groups: nothing set up
    results = {}
    real_host_id = car._host_id
    try:
        for scenario in SCENARIOS:
            warnings.clear()
            if scenario == "hosts" and rank == 1:
                car._host_id = lambda: real_host_id() + 1
            ops = HostPeerOps(state.tp_group, rank, scenario)
            comm = car.create_custom_all_reduce(state.tp_group, torch.device("cpu"), ops=ops)
            car._host_id = real_host_id
            result: dict = {"created": comm is not None, "warnings": list(warnings)}
            if comm is not None:
                result["dtypes"] = sorted(str(d) for d in comm.dtypes)
                result["non_contiguous"] = comm.can_reduce(torch.zeros(64, 2).t())
                paths, equal = {}, {}
                for name, x in _dispatch_cases(rank).items():
                    reference = x.clone()
                    dist.all_reduce(reference, group=state.tp_group)
                    before = ops.calls
                    assert comm.all_reduce(x) is x
                    paths[name] = "one_shot" if ops.calls > before else "backend"
                    equal[name] = bool(torch.equal(x, reference))
                result.update(paths=paths, equal=equal, staged_in_buffer=ops.staged_in_buffer)
                comm.close()
            results[scenario] = result
    finally:
        destroy_parallel_state()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("car")
    store = _store()
    _spawn(_gloo_rank, store.port, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_small_aligned_tensors_take_the_one_shot_path_and_the_rest_the_backend(gloo_results):
    one_shot = {"bf16_rows", "fp32_row", "fp16_row", "largest_bf16"}
    for rank, results in enumerate(gloo_results):
        ok = results["ok"]
        assert ok["created"] and ok["warnings"] == [], rank
        assert ok["dtypes"] == ["torch.bfloat16", "torch.float16", "torch.float32"]
        assert ok["paths"] == {name: "one_shot" if name in one_shot else "backend" for name in ok["paths"]}
        assert all(ok["equal"].values()), ok["equal"]          # every path gives the group's sum
        assert ok["staged_in_buffer"]                          # staged in the static buffer, not a new tensor
        assert ok["non_contiguous"] is False


def test_a_dtype_the_op_refuses_goes_to_the_backend(gloo_results):
    for results in gloo_results:
        r = results["no_fp16"]
        assert r["created"] and r["dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert r["paths"]["fp16_row"] == "backend" and r["paths"]["bf16_rows"] == "one_shot"
        assert all(r["equal"].values())


@pytest.mark.parametrize("scenario,failed_rank,local,remote", [
    ("alloc", 0, "allocating the peer-memory buffer failed on this rank (RuntimeError: no peer memory",
     "allocating the peer-memory buffer failed on rank(s) [0]"),
    ("map", 1, "mapping the peers' buffers failed on this rank (RuntimeError: cannot map",
     "mapping the peers' buffers failed on rank(s) [1]"),
    ("wrong_sum", 1, "the test reduction failed on this rank (RuntimeError: wrong sums for torch.bfloat16, torch.float32",
     "the test reduction failed on rank(s) [1]"),
    ("hosts", None, "the ranks of the tensor-parallel group are on different hosts",
     "the ranks of the tensor-parallel group are on different hosts"),
])
def test_a_failure_on_any_rank_makes_every_rank_fall_back_with_one_warning(gloo_results, scenario, failed_rank,
                                                                           local, remote):
    for rank, results in enumerate(gloo_results):
        r = results[scenario]
        assert not r["created"]
        assert len(r["warnings"]) == 1, r["warnings"]
        assert "custom all-reduce not used, tensor-parallel all-reduces use gloo" in r["warnings"][0]
        assert (local if rank == failed_rank or failed_rank is None else remote) in r["warnings"][0]


# ------------------------------------------------------------------------------------ two CUDA GPUs


def _captured(body):
    """``body`` run once eagerly (compilation, warm-up), then captured as a CUDA graph: (graph, its outputs)."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = body()
    return graph, out


def _gpu_rank(rank: int, port: int, out_dir: str) -> None:
    from plinth.distributed.communication import tp_all_gather
    from plinth.distributed.parallel_state import destroy_parallel_state, init_parallel_state

    os.environ[car.CUSTOM_ALL_REDUCE_ENV] = "1"
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=120))
    state = init_parallel_state(ParallelLayout(rank, 2, 1), "nccl", store, 120.0, device=device)
    group = state.tp_group
    try:
        comm = state.custom_all_reduce
        assert comm is not None, "the custom all-reduce was not set up on two GPUs"
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        paths = {}
        for dtype in (torch.bfloat16, torch.float32):
            for rows in (1, 3, 8, 64, 128, 300):
                x = torch.randn(rows, 4096, generator=gen, device=device).to(dtype)   # [rows, 4096]
                reference = x.clone()
                dist.all_reduce(reference, group=group)
                paths[f"{dtype}x{rows}"] = comm.can_reduce(x)
                assert tp_all_reduce(x) is x
                assert torch.equal(x, reference), (dtype, rows)
                everyone = tp_all_gather(x.unsqueeze(0), dim=0)                      # [2, rows, 4096]
                assert torch.equal(everyone[0], everyone[1]), (dtype, rows)
        # the one-shot kernel up to 1 MiB: 128 rows of bfloat16, 64 of float32
        assert paths == {f"{d}x{r}": r * 4096 * (2 if d == torch.bfloat16 else 4) <= car.MAX_BYTES
                         for d in (torch.bfloat16, torch.float32) for r in (1, 3, 8, 64, 128, 300)}

        static = torch.zeros(4, 4096, dtype=torch.bfloat16, device=device)   # [4, 4096] the graph's input

        def body() -> tuple[torch.Tensor, torch.Tensor]:
            a = static.clone()
            tp_all_reduce(a)                     # [4, 4096] bfloat16
            b = a[:1].float() * 0.5
            tp_all_reduce(b)                     # [1, 4096] float32
            return a, b

        graph, (a_out, b_out) = _captured(body)
        for step in range(5):
            fresh = torch.randn(4, 4096, generator=gen, device=device).to(torch.bfloat16)
            static.copy_(fresh)
            graph.replay()
            ra = fresh.clone()
            dist.all_reduce(ra, group=group)
            rb = ra[:1].float() * 0.5
            dist.all_reduce(rb, group=group)
            assert torch.equal(a_out, ra) and torch.equal(b_out, rb), step
            assert not torch.equal(ra, fresh)   # the inputs really differ across ranks

        # plinth's peer kernel: bfloat16 rows, alone and with the residual add and RMSNorm, eager and in a graph
        assert comm.peer is not None, "plinth's peer all-reduce kernel was not set up"
        from plinth.distributed.communication import tp_all_reduce_add_rms_norm
        from plinth.kernels import ops
        from plinth.model_registry.layers.layernorm import RMSNorm

        norm = RMSNorm(4096, eps=1e-5).to(device=device, dtype=torch.bfloat16)
        norm.weight.data = (torch.rand(4096, generator=gen, device=device) + 0.5).to(torch.bfloat16)
        dist.broadcast(norm.weight.data, 0, group=group)
        assert comm.peer.can_reduce(torch.empty(128, 4096, dtype=torch.bfloat16, device=device))
        assert not comm.peer.can_reduce(torch.empty(129, 4096, dtype=torch.bfloat16, device=device))   # > 1 MiB
        assert not comm.peer.can_reduce(torch.empty(2, 4100, dtype=torch.bfloat16, device=device))    # not 8k wide
        for rows in (1, 5, 16, 128, 129):
            x = torch.randn(rows, 4096, generator=gen, device=device).to(torch.bfloat16)
            residual = torch.randn(rows, 4096, generator=gen, device=device).to(torch.bfloat16)
            reference = x.clone()
            dist.all_reduce(reference, group=group)
            ref_y, ref_h = ops.rms_norm(reference, norm.weight, norm.eps, residual.clone())
            y, h = tp_all_reduce_add_rms_norm(x.clone(), residual.clone(), norm)
            assert torch.equal(y, ref_y) and torch.equal(h, ref_h), rows
            fused = comm.all_reduce_add_rms_norm(x.clone(), residual.clone(), norm.weight, norm.eps)
            assert (fused is None) == (rows > 128), rows

        xs = torch.zeros(3, 4096, dtype=torch.bfloat16, device=device)    # [3, 4096] the graph's inputs
        rs = torch.zeros(3, 4096, dtype=torch.bfloat16, device=device)

        def fused_body() -> tuple[torch.Tensor, torch.Tensor]:
            return tp_all_reduce_add_rms_norm(xs.clone(), rs.clone(), norm)

        graph, (y_out, h_out) = _captured(fused_body)
        for step in range(5):
            xs.copy_(torch.randn(3, 4096, generator=gen, device=device).to(torch.bfloat16))
            rs.copy_(torch.randn(3, 4096, generator=gen, device=device).to(torch.bfloat16))
            dist.broadcast(rs, 0, group=group)
            graph.replay()
            reference = xs.clone()
            dist.all_reduce(reference, group=group)
            ref_y, ref_h = ops.rms_norm(reference, norm.weight, norm.eps, rs.clone())
            assert torch.equal(y_out, ref_y) and torch.equal(h_out, ref_h), step
        (Path(out_dir) / f"rank{rank}").write_text("ok")
    finally:
        destroy_parallel_state()


@two_gpus
def test_gpu_custom_all_reduce_equals_nccl_eager_and_in_graphs(tmp_path):
    store = _store()
    _spawn(_gpu_rank, store.port, str(tmp_path))
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["ok", "ok"]


def _gpu_worker_rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    from plinth.config import EngineConfig
    from plinth.distributed.parallel_state import destroy_parallel_state, get_parallel_state
    from plinth.distributed.worker import WORKER_FAST_PATH_ENV, Worker
    from plinth.model_registry.layers.embedding import LMHead
    from plinth.model_registry.layers.linear import LinearBase
    from plinth.worker import gpu_linear

    os.environ[car.CUSTOM_ALL_REDUCE_ENV] = "1"
    os.environ[WORKER_FAST_PATH_ENV] = "1"
    os.environ.pop(gpu_linear.SKINNY_ENV, None)
    calls = []
    install = gpu_linear.install_skinny_gemms

    def recording(model):
        report = install(model)
        calls.append((model, report))
        return report

    gpu_linear.install_skinny_gemms = recording
    config = EngineConfig.from_kwargs(model=model_dir, tensor_parallel_size=2, dtype="bfloat16",
                                      attention_backend="triton", selection="off", block_size=16, num_blocks=64,
                                      max_num_seqs=8, max_num_batched_tokens=128)
    worker = Worker(config, rank, rank)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=120))
    worker.init_distributed(store, 120.0)
    try:
        worker.load("triton")
        worker.init_cache(64)
        model = worker._model
        heads = [m for m in model.modules() if isinstance(m, (LinearBase, LMHead))]
        wrapped = sum(isinstance(getattr(m, "linear_method", None), gpu_linear.SkinnyLinearMethod)
                      or (isinstance(m, LMHead) and m.gemm is not None) for m in heads)
        result = {
            "custom": get_parallel_state().custom_all_reduce is not None,
            "calls": len(calls), "same_model": bool(calls) and calls[0][0] is model,
            "timed_shapes": sorted(calls[0][1]["shapes"]) if calls else [],
            "shard_shapes": sorted({f"{m.weight.shape[0]}x{m.weight.shape[1]}" for m in heads}),
            "layers": calls[0][1]["layers"] if calls else -1, "wrapped": wrapped,
            "graphs": worker.runner is not None and worker.runner.graphs is not None,
        }
    finally:
        worker.close()   # the graphs hold NCCL collectives: they go before the process group
        destroy_parallel_state()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


@two_gpus
def test_gpu_tp_worker_sets_up_the_custom_all_reduce_and_skinny_gemms(tiny_llama_dir, tmp_path):
    from plinth.kernels import ops

    if not ops.triton_available():
        pytest.skip("needs Triton")
    store = _store()
    _spawn(_gpu_worker_rank, store.port, str(tiny_llama_dir), str(tmp_path))
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["custom"] and r["graphs"], r
        assert r["calls"] == 1 and r["same_model"], r
        # every weight shape of this rank's shard was timed (o_proj's is [64, 32]: half of the 64 inputs)
        assert r["timed_shapes"] == r["shard_shapes"] and "64x32" in r["timed_shapes"], r
        assert r["wrapped"] == r["layers"], r


PROMPTS = ["The quick brown fox", "Paris is the capital of France, and Berlin is", "0123",
           "Large language models generate text one token at a time. Continuous batching keeps"]


def _tp2_greedy(model_dir) -> list[list[int]]:
    """Greedy tokens of a TP=2 engine with decode graphs: the prompts batched, then one alone (batch 1)."""
    from plinth import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(model_dir), tensor_parallel_size=2, dtype="bfloat16", attention_backend="triton",
             max_num_seqs=8, block_size=16) as llm:
        batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        alone = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids   # batch-1 decode graph
    return batched + [alone]


@two_gpus
def test_gpu_tp2_greedy_outputs_equal_with_and_without_the_custom_all_reduce(tiny_llama_dir, monkeypatch, capfd):
    """With two ranks both all-reduces round each sum once, so the tokens match exactly. The skinny GEMMs
    are off in both engines: their per-shape choice is timed at start-up and could differ between runs."""
    from plinth.worker.gpu_linear import SKINNY_ENV

    monkeypatch.setenv(SKINNY_ENV, "0")
    monkeypatch.setenv(car.CUSTOM_ALL_REDUCE_ENV, "1")
    with_custom = _tp2_greedy(tiny_llama_dir)
    assert "custom all-reduce not used" not in capfd.readouterr().err   # the workers' warnings reach stderr
    monkeypatch.setenv(car.CUSTOM_ALL_REDUCE_ENV, "0")
    with_nccl = _tp2_greedy(tiny_llama_dir)
    assert with_custom == with_nccl
    assert len({tuple(t) for t in with_custom}) > 2   # the outputs depend on the prompt


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("fused", ["false", "true"])
def test_peer_kernel_source_compiles_without_spills(arch, fused):
    """The peer all-reduce kernel compiles with NVRTC (from its wheel; no GPU needed) for Ampere and
    Hopper, every value in registers."""
    from nvrtc_compile import compile_source

    from plinth.kernels.nvrtc import CSRC

    source = (CSRC / "tp_all_reduce.cu").read_bytes()
    status, log = compile_source(source, "tp_all_reduce.cu", f"tp_all_reduce<{fused}>", arch)
    assert status == 0, log
    assert "0 bytes spill stores" in log, log
    assert f"#define FLAG_BYTES {car.PeerKernel.FLAG_BYTES}\n" in source.decode()   # the two sides agree
