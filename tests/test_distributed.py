"""Tensor and pipeline parallelism on CPU (gloo): greedy outputs, prompt logprobs and a seeded random
sample with its logprobs under TP=2, PP=2 and TP=2 x PP=2 equal the single-process engine's, for each
native architecture family.

Four worker processes are spawned once for the module and serve every layout in turn
(``WorkerProcesses``), so each case pays for loading a tiny model, not for starting Python.
"""

from __future__ import annotations

import asyncio
import types

import pytest
import torch
from test_distributed_helpers import ENGINE_KW, FAMILIES, PROMPTS, run_greedy, save_family

from plinth.config import ConfigError, EngineConfig
from plinth.core.engine import LLMEngine
from plinth.distributed.executor_mp import MultiprocExecutor, WorkerProcesses
from plinth.distributed.parallel_state import ParallelLayout, pp_layer_range
from plinth.distributed.pipeline import split_microbatches
from plinth.worker.model_runner import SeqBatchEntry

LAYOUTS = [(2, 1), (1, 2), (2, 2)]   # (tensor_parallel_size, pipeline_parallel_size)


@pytest.fixture(scope="module")
def processes():
    procs = WorkerProcesses(4, timeout_s=120.0)
    yield procs
    procs.stop()


def _case(name: str, tmp_path_factory) -> tuple:
    path = save_family(name, tmp_path_factory.mktemp(name))
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), **ENGINE_KW))
    return name, path, run_greedy(engine)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, checkpoint dir, reference result of the single-process engine)."""
    return _case(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory):
    return _case("llama", tmp_path_factory)


def _engine(path, processes, tp: int, pp: int) -> LLMEngine:
    config = EngineConfig.from_kwargs(model=str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                      distributed_executor="mp", **ENGINE_KW)
    return LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}_pp{p}" for t, p in LAYOUTS])
def test_parallel_greedy_equals_single_process(family, processes, tp, pp):
    name, path, reference = family
    engine = _engine(path, processes, tp, pp)
    try:
        assert engine.runner is None and len(engine.executor.worker_pids) == tp * pp
        result = run_greedy(engine)
    finally:
        engine.shutdown()
    assert not processes.broken
    for rid, (tokens, prompt_lps) in reference.items():
        got_tokens, got_lps = result[rid]
        assert got_tokens == tokens, f"{name} tp={tp} pp={pp} request {rid}"
        assert len(got_lps) == len(prompt_lps)
        for ref_pos, got_pos in zip(prompt_lps, got_lps, strict=True):
            assert ref_pos.keys() == got_pos.keys()
            for tid, lp in ref_pos.items():
                assert got_pos[tid] == pytest.approx(lp, abs=1e-4)
    # the reference really depends on the prompt: a different prompt gives different tokens
    assert reference["r0"][0] != reference["r1"][0]
    assert reference["r0"][0] == reference["r2"][0]   # the repeated prompt (prefix cache hit) agrees
    # the seeded sample (drawn on the output rank) is random, not greedy, and has its logprobs
    assert reference["seeded"][0] != reference["r3"][0] and len(reference["seeded"][1]) == len(reference["r3"][0])


def test_async_front_over_workers(llama_case, processes):
    """The server's asyncio front streams from a TP=2 x PP=2 engine."""
    from test_distributed_helpers import greedy

    from plinth.core.async_engine import AsyncLLMEngine

    _, path, reference = llama_case
    engine = _engine(path, processes, 2, 2)
    front = AsyncLLMEngine(engine)

    async def collect(i: int) -> list[int]:
        final = None
        async for out in front.generate(f"a{i}", PROMPTS[i], greedy()):
            final = out
        assert final is not None and final.finished
        return final.outputs[0].token_ids

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))))

    try:
        got = asyncio.run(main())
    finally:
        front.shutdown()
        engine.shutdown()   # releases the worker processes for the next test
    assert got == [reference[f"r{i}"][0] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("ref", ["class", "string"])
def test_registered_models_reach_the_worker_processes(llama_case, processes, ref):
    """A ``ModelRegistry.register_model`` registration made in the driver builds the model on every rank."""
    from test_distributed_helpers import LastTokenLlama

    from plinth.model_registry.registry import ModelRegistry

    _, path, reference = llama_case
    ModelRegistry.register_model("LlamaForCausalLM",
                                 LastTokenLlama if ref == "class" else "test_distributed_helpers:LastTokenLlama")
    try:
        result = _tp2_greedy(path, processes)
    finally:
        ModelRegistry.unregister_model("LlamaForCausalLM")
    _assert_last_token_model(result, reference)


def _tp2_greedy(path, processes) -> dict:
    engine = _engine(path, processes, 2, 1)
    try:
        return run_greedy(engine)
    finally:
        engine.shutdown()


def _assert_last_token_model(result: dict, reference: dict) -> None:
    """``result`` came from :class:`test_distributed_helpers.LastTokenLlama`, not from the checkpoint's Llama."""
    last = 307 - 1   # COMMON's vocab_size - 1
    assert result["r0"][0] == [last] * len(reference["r0"][0]) != reference["r0"][0]


def test_plugins_registered_in_code_reach_the_worker_processes(llama_case, processes):
    """A plugin module registered with ``register_module`` in the driver (here one whose models hook maps Llama to
    another class) is imported and registered by every rank; one that cannot be imported by name there (built in
    code) is refused before any rank starts."""
    import test_distributed_helpers

    from plinth.plugins import PluginError, get_plugin_manager, reset_plugin_manager

    _, path, reference = llama_case
    try:
        get_plugin_manager().register_module(test_distributed_helpers, "last_token_models")
        result = _tp2_greedy(path, processes)
    finally:
        reset_plugin_manager()
    _assert_last_token_model(result, reference)
    built = types.ModuleType("built_in_code")
    built.PLINTH_PLUGIN_API = "1.0"
    try:
        get_plugin_manager().register_module(built, "built_in_code")
        with pytest.raises(PluginError, match="'built_in_code', which worker processes cannot import by name"):
            _engine(path, processes, 2, 1)
    finally:
        reset_plugin_manager()
    assert not processes.broken


def test_a_registered_class_workers_cannot_build_is_refused(llama_case, processes):
    from plinth.model_registry.models.llama import LlamaForCausalLM
    from plinth.model_registry.registry import ModelRegistry

    class Local(LlamaForCausalLM):   # defined in a function: it cannot be pickled
        pass

    ModelRegistry.register_model("LlamaForCausalLM", Local)
    try:
        with pytest.raises(ConfigError, match="cannot be sent to worker processes.*top level of a module"):
            _engine(llama_case[1], processes, 2, 1)
    finally:
        ModelRegistry.unregister_model("LlamaForCausalLM")
    assert not processes.broken


def test_layout_arithmetic():
    layouts = [ParallelLayout(r, 2, 3) for r in range(6)]
    assert [(lay.tp_rank, lay.pp_rank) for lay in layouts] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert [lay.rank for lay in layouts if lay.is_output_rank] == [4] == [ParallelLayout.output_rank(2, 3)]
    assert layouts[3].prev_rank == 1 and layouts[3].next_rank == 5 and layouts[5].next_rank is None
    assert [pp_layer_range(7, s, 3) for s in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [pp_layer_range(4, s, 4) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_microbatches_are_contiguous_and_balanced():
    entries = [SeqBatchEntry([0] * n, 0, [1], True) for n in (1, 1, 1, 9, 1, 1, 2)]
    parts = split_microbatches(entries, 2)
    assert [list(p) for p in parts] == [[0, 1, 2, 3], [4, 5, 6]]
    assert [list(p) for p in split_microbatches(entries[:1], 4)] == [[0]]
    for k in (2, 3, 4, 7):
        parts = split_microbatches(entries, k)
        assert len(parts) == k and [i for p in parts for i in p] == list(range(len(entries)))


def _same_batch(a, b) -> bool:
    return list(a) == list(b) and a.decode_only == b.decode_only


def test_step_batch_carries_the_flat_batch_and_microbatches_slice_it():
    import pickle

    import numpy as np

    from plinth.distributed.messages import StepBatch
    from plinth.distributed.pipeline import sub_batch
    from plinth.worker.batching import FlatBatch

    entries = [SeqBatchEntry([3, 4, 5], 0, [7], True), SeqBatchEntry([9], 12, [2, 8, 4, 11], True),
               SeqBatchEntry([1, 2], 4, [5, 6], False), SeqBatchEntry([6], 3, [1], True)]
    flat = FlatBatch.from_entries(entries)
    sent = pickle.loads(pickle.dumps(StepBatch.from_entries(flat)))   # what a worker receives
    assert _same_batch(sent.flat(), flat) and sent.entries() == entries
    assert np.array_equal(StepBatch.from_entries(entries).block_ids, sent.block_ids)
    assert sent.flat().block_tables.shape == (4, 4) and not sent.flat().decode_only
    for part in (range(0, 2), range(2, 4), range(1, 2), range(3, 4)):
        assert _same_batch(sub_batch(flat, part), FlatBatch.from_entries(entries[part.start:part.stop]))
    assert sub_batch(flat, range(3, 4)).decode_only and sub_batch(flat, range(1, 2)).decode_only
    assert split_microbatches(flat, 2) == split_microbatches(entries, 2)


def test_sampling_parameters_and_outputs_cross_the_pipes_as_numpy_arrays():
    """The step's sampling parameters and sampled tokens travel as numpy arrays (not torch's
    serialiser) and come back as the same tensors, nested ones (tuples, dataclasses) included."""
    import pickle

    from plinth import SamplingParams
    from plinth.core.request import Request
    from plinth.core.sampler import LogprobsTensors, SamplerOutput
    from plinth.core.sampling_batch import SamplingBatch
    from plinth.distributed.messages import HostArray, pack_tensors, unpack_tensors

    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                             presence_penalty=0.5, frequency_penalty=0.1, seed=3, logprobs=2),
              SamplingParams(temperature=0.0)]
    requests = [Request(f"r{i}", [1, 2, 3 + i], p) for i, p in enumerate(params)]
    batch = SamplingBatch.from_requests(requests, 32, "cpu")
    out = SamplerOutput(torch.tensor([4, 9]), LogprobsTensors(torch.tensor([[4, 4, 1], [9, 9, 2]]),
                                                              torch.randn(2, 3), torch.tensor([1, 1])))
    for obj in (batch, out):
        packed = pickle.loads(pickle.dumps(pack_tensors(obj), protocol=pickle.HIGHEST_PROTOCOL))
        arrays, tensors = [], []

        def walk(x, arrays=arrays, tensors=tensors):
            if isinstance(x, HostArray):
                arrays.append(x)
            elif isinstance(x, torch.Tensor):
                tensors.append(x)
            elif isinstance(x, tuple):
                for y in x:
                    walk(y)
            elif hasattr(x, "__dataclass_fields__"):
                for name in x.__dataclass_fields__:
                    walk(getattr(x, name))

        walk(packed)
        assert arrays and not tensors   # every tensor went as an array
        back = unpack_tensors(packed, torch.device("cpu"))
        for name in obj.__dataclass_fields__:
            a, b = getattr(obj, name), getattr(back, name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), name
            elif isinstance(a, tuple):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), name
            elif isinstance(a, LogprobsTensors):
                assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("token_ids", "logprobs", "ranks"))
            else:
                assert a == b, name
    assert batch.seed_keys is not None and batch.top_k is not None   # the optional fields were there


def test_warm_up_collective_checks_the_capture_ladders(tmp_path):
    """The eager collective run before graph capture passes when every TP rank will capture the same
    batch sizes, and fails on every rank (instead of capturing mismatched graphs) when they differ."""
    import datetime

    import torch.distributed as dist
    import torch.multiprocessing as tmp
    from test_distributed_helpers import warm_up_rank

    from plinth.worker.cuda_graphs import graph_batch_sizes

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    same = graph_batch_sizes(32)
    fingerprints = [[same, same], [same, graph_batch_sizes(48)]]
    tmp.start_processes(warm_up_rank, args=(store.port, fingerprints, str(tmp_path)), nprocs=2,
                        start_method="spawn")
    for rank in (0, 1):
        ok, mismatch = (tmp_path / f"rank{rank}").read_text().split("\n")
        assert ok == "ok"
        assert "the ranks disagree on the graphs to capture" in mismatch and f"rank {rank}" in mismatch
        assert str([len(same), sum(same)])[:-1] in mismatch


@pytest.mark.parametrize("kw,match", [
    (dict(tensor_parallel_size=3), "attention heads"),
    (dict(pipeline_parallel_size=4), "exceeds the model's 3 layers"),
    (dict(tensor_parallel_size=2, distributed_executor="uniproc"), "uniproc"),
])
def test_bad_layouts_fail_before_any_worker_starts(tmp_path, kw, match):
    path = save_family("llama", tmp_path)
    with pytest.raises(ConfigError, match=match):
        LLMEngine(EngineConfig.from_kwargs(model=str(path), **{**ENGINE_KW, **kw}))


def test_more_ranks_than_devices_fails_clearly(tmp_path, monkeypatch):
    """On an accelerator platform, the multi-process executor needs one device per rank."""
    import plinth.platforms.selection as platform_selection
    from plinth.platforms.cpu.platform import CpuPlatform

    class TwoGpus(CpuPlatform):
        name = "fake-gpu"
        device_type = "cuda"

        def device_count(self) -> int:
            return 2

    monkeypatch.setattr(platform_selection, "select_platform", lambda *a, **k: TwoGpus())
    config = EngineConfig.from_kwargs(model=str(tmp_path), tensor_parallel_size=2, pipeline_parallel_size=2,
                                      distributed_executor="mp")
    with pytest.raises(ConfigError, match="needs 4 fake-gpu devices; this machine has 2"):
        MultiprocExecutor(config)


def test_load_error_on_some_ranks_is_typed_and_keeps_processes_usable(llama_case, processes, tmp_path):
    """A tensor missing from the checkpoint fails only the stage that needs it: the engine raises the
    loader's own error, and the worker processes stay in step for the next engine."""
    from safetensors.torch import load_file, save_file

    from plinth.errors import ModelLoadError

    _, good, reference = llama_case
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in good.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(good / "model.safetensors"))
    del tensors["model.layers.2.mlp.down_proj.weight"]   # layer 2 lives on the second stage
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.down_proj\.weight"):
        _engine(bad, processes, 2, 2)
    assert not processes.broken
    engine = _engine(good, processes, 2, 1)
    try:
        assert run_greedy(engine)["r1"][0] == reference["r1"][0]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("config_class, field", [("Qwen2MoeConfig", "shared_expert_intermediate_size"),
                                                 ("GraniteMoeSharedConfig", "shared_intermediate_size")])
def test_a_shared_expert_width_tensor_parallelism_cannot_split_is_refused_before_workers(config_class, field):
    """A shared expert's width is split over the ranks like the experts': one that the TP size does not divide is a
    ConfigError naming the field, before any worker starts (it was a bare ValueError from every worker's load)."""
    import transformers

    from plinth.config import ParallelConfig
    from plinth.distributed.driver import validate_parallel_layout

    cfg = getattr(transformers, config_class)(hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                              num_key_value_heads=2, **{field: 47})
    arch = config_class.removesuffix("Config") + "ForCausalLM"
    with pytest.raises(ConfigError, match=rf"must divide the model's {field} \(47\)"):
        validate_parallel_layout(cfg, arch, ParallelConfig(tensor_parallel_size=2))
    validate_parallel_layout(cfg, arch, ParallelConfig(pipeline_parallel_size=2))
