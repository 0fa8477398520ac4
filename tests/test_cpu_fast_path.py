"""The CPU fast path against the reference path: prepacked and int4 GEMMs, compiled decode steps,
the greedy sampling fast path, batch arrays and thread sizing.

References: ``F.linear`` on the same weights (prepacked GEMMs are bit-identical), float64 products
with gguf's own dequantization (int4), the eager forward pass (compiled decode, bf16 tolerance and
identical greedy tokens), ``torch.argmax`` and a Python loop (batch helpers).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cpu_features import needs_packed_bf16

from plinth import LLM, SamplingParams
from plinth.config import ConfigError
from plinth.core.request import Request
from plinth.core.sampler import Sampler, SamplingBatch, fast_argmax
from plinth.kernels import cpu_native
from plinth.platforms.cpu.platform import CpuPlatform, cpu_thread_count
from plinth.worker.batching import block_table_array
from plinth.worker.cpu_graphs import CompiledDecodeRunner
from plinth.worker.cpu_int4 import decode_q4_blocks, int4_weights_from_gguf
from plinth.worker.cpu_linear import Q8_0_INT8_MAX_ROWS, Q8_0_ROWS8_F32_MAX_ROWS, CpuLinearMethod, Int4Weight
from plinth.worker.model_runner import SeqBatchEntry

PROMPTS = [[5, 17, 99], list(range(20, 61)), list(range(100, 117)), [7] * 9]   # mixed lengths
Q = gguf.GGMLQuantizationType


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama_dir) -> list[list[int]]:
    """Greedy tokens of the plain path: F.linear GEMMs, eager decode through the modules."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PLINTH_CPU_PACKED", "0")
    mp.setenv("PLINTH_CPU_DECODE_PLAN", "0")
    try:
        llm = LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=4)
        assert llm.engine.runner.graphs is None
        return tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def fast_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=4)


# ---------------------------------------------------------------------------------------- GEMMs


def test_cpus_without_the_packed_bf16_linear_take_f_linear(monkeypatch):
    """Where oneDNN refuses the packed bfloat16 linear (CPUs without AVX512 BW/VL/DQ or AVX-NE-CONVERT: torch
    raises at the first use), no layer is prepacked and the GEMM is ``F.linear``'s."""
    from plinth.worker import cpu_linear

    def refuse(*args):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or ...")

    for name in ("_onednn_bf16_linear_runs", "_onednn_f32_linear_runs"):   # fresh caches for this test
        monkeypatch.setattr(cpu_linear, name, functools.cache(getattr(cpu_linear, name).__wrapped__))
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    assert not cpu_linear.packed_linear_supported(torch.bfloat16)
    assert not cpu_linear.packed_linear_supported(torch.float32)
    weight, x = torch.randn(96, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    method = CpuLinearMethod(weight)
    assert method.packed is None and torch.equal(method.matmul(x), F.linear(x, weight))


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_float32_weights_are_packed_where_float32_is_the_default(monkeypatch, fast_bf16):
    """On x86-64 CPUs without native bfloat16 (float32 the default dtype) float32 layers multiply oneDNN-packed
    weights for inputs of up to ``F32_PACKED_MAX_ROWS`` rows (float32 sums: within float32 rounding of the
    exact product), longer inputs ``F.linear``; with native bfloat16 float32 stays on ``F.linear``."""
    from plinth.platforms.cpu import platform as cpu_platform
    from plinth.worker import cpu_linear

    if not cpu_linear._onednn_f32_linear_runs() or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("oneDNN's packed float32 linear is not used here")
    monkeypatch.setattr(cpu_platform, "has_fast_bf16", lambda: fast_bf16)
    packed_calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: packed_calls.append(x.shape[0]) or real(x, *a))
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    method = CpuLinearMethod(weight)
    assert (method.packed is None) == fast_bf16
    assert CpuLinearMethod(weight, pack=False).packed is None
    cap = cpu_linear.F32_PACKED_MAX_ROWS
    for rows in (1, 5, 40, cap, cap + 1):
        x = torch.randn(rows, 64, generator=gen)
        packed_calls.clear()
        for b in (None, bias):
            out = method.matmul(x, b)
            exact = x.double() @ weight.double().T + (b.double() if b is not None else 0)
            bound = 1e-5 * (x.double().abs() @ weight.double().abs().T + 1)
            assert bool(((out.double() - exact).abs() <= bound).all()), rows
        assert packed_calls == ([] if fast_bf16 or rows > cap else [rows, rows]), (rows, packed_calls)
    x3 = torch.randn(2, 3, 64, generator=gen)                               # leading dimensions kept
    torch.testing.assert_close(method.matmul(x3), F.linear(x3, weight), rtol=1e-5, atol=1e-4)


def test_released_weights_are_held_packed_only(monkeypatch):
    """A layer whose weight is released once packed keeps a ``[0, K]`` parameter of its dtype, and its packed copy
    takes every row count, past ``F32_PACKED_MAX_ROWS`` too, with the same results as a layer that kept its weight
    (bit for bit where both take the packed GEMM; within float32 rounding of the exact product past the cap)."""
    from plinth.platforms.cpu import platform as cpu_platform
    from plinth.worker import cpu_linear

    if not cpu_linear._onednn_f32_linear_runs() or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("oneDNN's packed float32 linear is not used here")
    monkeypatch.setattr(cpu_platform, "has_fast_bf16", lambda: False)
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    param = torch.nn.Parameter(weight.clone(), requires_grad=False)
    kept, released = CpuLinearMethod(weight), CpuLinearMethod(param, release_weight=True)
    assert released.weight_released and not kept.weight_released
    assert param.shape == (0, 64) and param.dtype == torch.float32 and released.out_features == 96
    assert CpuLinearMethod(weight.clone(), pack=False, release_weight=True).weight.shape == (96, 64)  # nothing packed
    packed_calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: packed_calls.append(x.shape[0]) or real(x, *a))
    cap = cpu_linear.F32_PACKED_MAX_ROWS
    for rows in (1, 40, cap + 1):
        x = torch.randn(rows, 64, generator=gen)
        packed_calls.clear()
        out = released.matmul(x, bias)
        assert packed_calls == [rows]
        if rows <= cap:
            assert torch.equal(out, kept.matmul(x, bias))
        exact = x.double() @ weight.double().T + bias.double()
        assert bool(((out.double() - exact).abs() <= 1e-5 * (x.double().abs() @ weight.double().abs().T + 1)).all())
    assert released.matmul(torch.randn(0, 64)).shape == (0, 96)
    with pytest.raises(TypeError, match="packed for oneDNN only"):
        released.matmul(torch.randn(2, 64, dtype=torch.float64))


@pytest.mark.parametrize("case", ["hf", "fast_bf16", "gguf_unpacked", "gguf_low_memory"])
def test_float32_cpu_path_set_up(case, monkeypatch, tmp_path, tiny_llama_dir):
    """What the CPU path installs for float32 models: packed GEMMs on x86-64 CPUs without native bfloat16 (a
    safetensors model), nothing where bfloat16 is native; a GGUF model keeps its 4-bit copies and Q8_0 head
    with packing switched off (``PLINTH_CPU_PACKED=0``) or refused for memory."""
    from test_gguf import small_model, write_gguf

    from plinth.platforms.cpu import platform as cpu_platform
    from plinth.worker import cpu_linear, cpu_path

    if not cpu_linear._onednn_f32_linear_runs() or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("oneDNN's packed float32 linear is not used here")
    monkeypatch.setattr(cpu_platform, "has_fast_bf16", lambda: case == "fast_bf16")
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    if case == "gguf_unpacked":
        monkeypatch.setenv("PLINTH_CPU_PACKED", "0")
    if case == "gguf_low_memory":
        monkeypatch.setattr(cpu_path, "_free_memory", lambda: 1)
    model = tiny_llama_dir
    if case.startswith("gguf"):
        model = write_gguf(tmp_path / "m.gguf", small_model("llama", False), "llama", gguf.GGMLQuantizationType.Q4_1)
    with LLM(str(model), tokenizer=str(tiny_llama_dir), dtype="float32", block_size=4) as llm:
        methods = [m.linear_method for m in llm.engine.runner.model.modules() if hasattr(m, "linear_method")]
        ours = [m for m in methods if isinstance(m, CpuLinearMethod)]
        if case == "hf":
            assert ours and all(m.packed is not None and m.int4 is None and m.weight_released for m in ours)
            assert all(m.weight.shape[0] == 0 for m in llm.engine.runner.model.modules()
                       if isinstance(getattr(m, "linear_method", None), CpuLinearMethod))
        elif case == "fast_bf16":
            assert not ours
        else:
            assert ours and all(m.packed is None and m.int4 is not None for m in ours)


@needs_packed_bf16
def test_bfloat16_gguf_keeps_its_int4_copies_without_packing(monkeypatch, tmp_path, tiny_llama_dir):
    """``PLINTH_CPU_PACKED=0`` (or too little memory for the packed copies) turns off the oneDNN-packed GEMMs only:
    a bfloat16 GGUF model keeps its 4-bit copies and Q8_0 head (they have switches of their own), and greedy
    tokens are the packed path's."""
    from test_gguf import small_model, write_gguf

    from plinth.worker import cpu_path

    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    model = write_gguf(tmp_path / "m.gguf", small_model("llama", False), "llama", gguf.GGMLQuantizationType.Q4_1)
    runs = {}
    for case in ("packed", "unpacked", "low_memory"):
        with monkeypatch.context() as mp:
            if case == "unpacked":
                mp.setenv("PLINTH_CPU_PACKED", "0")
            if case == "low_memory":
                mp.setattr(cpu_path, "_free_memory", lambda: 1)
            with LLM(str(model), tokenizer=str(tiny_llama_dir), dtype="bfloat16", block_size=4) as llm:
                ours = [m.linear_method for m in llm.engine.runner.model.modules()
                        if isinstance(getattr(m, "linear_method", None), CpuLinearMethod)]
                assert ours and all(m.int4 is not None for m in ours), case
                assert all((m.packed is not None) == (case == "packed") for m in ours), case
                runs[case] = tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    assert runs["unpacked"] == runs["packed"] == runs["low_memory"]


@needs_packed_bf16
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_prepacked_gemm_is_bit_identical(rows):
    torch.manual_seed(0)
    weight = torch.randn(96, 64).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    method = CpuLinearMethod(weight)
    assert method.packed is not None
    assert torch.equal(method.matmul(x), F.linear(x, weight))
    bias = torch.randn(96).bfloat16()
    assert torch.equal(method.matmul(x, bias), F.linear(x, weight, bias))


@needs_packed_bf16
def test_fast_path_engine_equals_reference(fast_llm, reference_tokens):
    model = fast_llm.engine.runner.model
    methods = [m.linear_method for m in model.modules() if hasattr(m, "linear_method")]
    assert methods and all(isinstance(m, CpuLinearMethod) for m in methods)
    assert model.lm_head.gemm is not None
    assert tokens(fast_llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference_tokens
    solo = [tokens(fast_llm.generate([p], greedy(), use_tqdm=False))[0] for p in PROMPTS[:2]]
    assert solo == reference_tokens[:2]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_int4_blocks_match_gguf_dequantization(qtype):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (48, 128)).astype(np.float32)
    w[:, :32] += 0.03                                       # blocks whose minimum is not near -max
    raw = gguf.quants.quantize(w, qtype)                    # uint8 [48, 4 * block bytes]
    dequant = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()   # [48, 128]
    q, scale, zero = decode_q4_blocks(raw, qtype.name)
    assert q.shape == (48, 128) and int(q.min()) >= 0 and int(q.max()) <= 15
    # the decoded blocks are the file's values exactly (in float32) ...
    rebuilt = (q.double() - 8) * scale.double().repeat_interleave(32, 1) + zero.double().repeat_interleave(32, 1)
    torch.testing.assert_close(rebuilt, dequant, rtol=0, atol=1e-6)
    # ... and the int4 GEMM computes with them up to bfloat16 rounding of scale, zero, input and output
    weight = Int4Weight.from_blocks(q, scale, zero, torch.bfloat16)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = weight.matmul(x).double()
    ref = x.double() @ dequant.T
    torch.testing.assert_close(got, ref, rtol=0, atol=0.02 * float(ref.abs().max()))


def _q4_1_model_and_copies(tmp_path, monkeypatch):
    """A small Llama written as a Q4_1 GGUF file, loaded in bfloat16, and its layers' int4 copies (cached under
    ``tmp_path``): ``(path, model, copies)``."""
    from test_gguf import small_model, write_gguf

    from plinth.attention_backends.torch_batched import TorchBatchedBackend
    from plinth.config import ModelConfig
    from plinth.model_registry.interface import ModelContext
    from plinth.model_registry.loader import load_model, resolve_model_source

    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", True), "llama", Q.Q4_1)
    source = resolve_model_source(ModelConfig(model=path))
    ctx = ModelContext(hf_config=source.hf_config, dtype=torch.bfloat16, device=torch.device("cpu"),
                       attention_backend=TorchBatchedBackend(), block_size=4)
    model = load_model(source, ctx)
    return path, model, int4_weights_from_gguf(path, model, torch.bfloat16)


def test_int4_copies_of_a_gguf_model(tmp_path, monkeypatch):
    """Fused layers stack their projections in shard order, Q/K rows in HF order: every int4 copy
    multiplies like the layer's dequantized bf16 weight; a second build reads the cache."""
    from plinth.model_registry.layers.linear import LinearBase

    path, model, copies = _q4_1_model_and_copies(tmp_path, monkeypatch)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    assert set(copies) == set(layers) and len(copies) == 2 * 4      # qkv, o, gate_up, down per layer
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    for name, layer in layers.items():
        xi = x if layer.weight.shape[1] == 64 else torch.randn(2, layer.weight.shape[1]).bfloat16()
        ref = F.linear(xi.float(), layer.weight.float())
        got = copies[name].matmul(xi).float()
        torch.testing.assert_close(got, ref, rtol=0, atol=0.03 * float(ref.abs().max()), msg=name)
        # the panel layout of the same copy (decode batches above the int4 switch-over): the bf16-rounded
        # file weights, i.e. the layer's own weight, up to float32 summation order
        xm = torch.randn(9, layer.weight.shape[1]).bfloat16()
        if cpu_native.q4_panels_supported():
            panel = cpu_native.q4_panel_matmul(xm, copies[name].panels)
            exact = xm.double() @ layer.weight.double().T
            torch.testing.assert_close(panel.double(), exact, rtol=8e-3, atol=2e-3 * float(exact.abs().max()), msg=name)
    assert list((tmp_path / "cache" / "cpu_int4").glob("*.safetensors"))
    again = int4_weights_from_gguf(path, model, torch.bfloat16)
    for name, w in copies.items():
        assert torch.equal(again[name].packed, w.packed) and torch.equal(again[name].scale_zeros, w.scale_zeros)
        for field in ("codes", "scales", "offsets"):
            assert torch.equal(getattr(again[name].panels, field), getattr(w.panels, field)), (name, field)



def test_int4_cache_tells_a_replaced_file_and_survives_a_full_disk(tmp_path, monkeypatch, caplog):
    """Another file put in the model's place with the same size and modification time (``cp -p``, ``touch -r``)
    gets its own int4 cache entry, not the old file's copies; a cache that cannot be written (safetensors' error
    for a full disk) is a warning, and no partial file is left."""
    from safetensors import SafetensorError

    from plinth.worker import cpu_int4

    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"a" * 64)
    before = cpu_int4._cache_file(str(model), torch.bfloat16)
    stat = model.stat()
    other = tmp_path / "other.gguf"
    other.write_bytes(b"b" * 64)
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, model)
    assert model.stat().st_size == stat.st_size and model.stat().st_mtime_ns == stat.st_mtime_ns
    assert cpu_int4._cache_file(str(model), torch.bfloat16) != before
    # torch packs the codes for the CPU's instruction set (AVX512, AVX2, none), each read only by its own GEMM: a
    # cache shared by two kinds of CPU (or a start with ATEN_CPU_CAPABILITY) keeps one entry per kind
    now = cpu_int4._cache_file(str(model), torch.bfloat16)
    capability = torch.backends.cpu.get_cpu_capability()
    other_isa = "DEFAULT" if capability != "DEFAULT" else "AVX2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other_isa)
    assert cpu_int4._cache_file(str(model), torch.bfloat16) != now
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)

    def interrupted(tensors, filename, metadata=None):   # Ctrl-C (or a kill) while the entry is written
        Path(filename).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr("safetensors.torch.save_file", interrupted)
    weight = cpu_int4.Int4Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(2, 1, 4), 32, None)
    with pytest.raises(KeyboardInterrupt):
        cpu_int4._store_cached(before, {"layer": weight}, str(model), torch.bfloat16)
    assert not list(before.parent.iterdir())   # no half-written temporary file stays behind

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("No space left on device (os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with caplog.at_level("WARNING"):
        cpu_int4._store_cached(before, {"layer": weight}, str(model), torch.bfloat16)
    assert "could not write the int4 cache" in caplog.text and not list(before.parent.iterdir())


def test_int4_cache_entries_are_checked_shared_and_replaced(tmp_path, monkeypatch, caplog):
    """An entry whose bytes were damaged with its header intact (silently wrong weights before) fails its checksum
    and is rebuilt; entries are readable by other users of the cache; a new state of the same model file (touched,
    replaced) replaces the entry of the old one instead of adding a copy."""
    path, model, copies = _q4_1_model_and_copies(tmp_path, monkeypatch)
    entries = list((tmp_path / "cache" / "cpu_int4").glob("*.safetensors"))
    from plinth.config import shared_mode

    assert len(entries) == 1 and entries[0].stat().st_mode & 0o777 == shared_mode(0o644)   # safetensors': 0600
    data = bytearray(entries[0].read_bytes())
    for i in range(len(data) - 4096, len(data), 7):   # tensor bytes at the end of the file; the header stays
        data[i] ^= 0x5A
    entries[0].write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        again = int4_weights_from_gguf(path, model, torch.bfloat16)
    assert "do not match their checksum" in caplog.text
    for name, w in copies.items():
        assert torch.equal(again[name].packed, w.packed) and torch.equal(again[name].scale_zeros, w.scale_zeros)
    caplog.clear()
    with caplog.at_level("WARNING"):
        int4_weights_from_gguf(path, model, torch.bfloat16)   # the rebuilt entry reads back whole
    assert "checksum" not in caplog.text
    # an entry written before the instruction set was part of the key (no start reads it now) goes too
    from safetensors.torch import save_file

    legacy = tmp_path / "cache" / "cpu_int4" / "0123456789abcdef01234567.safetensors"
    save_file({"x": torch.zeros(1)}, str(legacy), metadata={
        "source": os.path.realpath(path), "made_for": json.dumps([torch.__version__, str(torch.bfloat16)])})
    os.utime(path, ns=(1, 10**18))   # another state of the same file: a new key
    int4_weights_from_gguf(path, model, torch.bfloat16)
    now = list((tmp_path / "cache" / "cpu_int4").glob("*.safetensors"))
    assert len(now) == 1 and now != entries and not legacy.exists()
    # another torch (another environment sharing the cache): its entry and this one's both stay
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    int4_weights_from_gguf(path, model, torch.bfloat16)
    assert len(list((tmp_path / "cache" / "cpu_int4").glob("*.safetensors"))) == 2
    # another instruction set for torch's packing (another kind of CPU sharing the cache): a third entry
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT" if capability != "DEFAULT"
                        else "AVX2")
    int4_weights_from_gguf(path, model, torch.bfloat16)
    assert len(list((tmp_path / "cache" / "cpu_int4").glob("*.safetensors"))) == 3


def test_gate_up_activation_is_fused_where_the_amx_gemm_takes_the_rows(tmp_path, monkeypatch):
    """A gate/up layer's ``forward_silu_and_mul`` runs the fused AMX GEMM for the rows the layer sends to the AMX
    panel GEMM (the same bits as the GEMM then the activation) and declines (``None``) for the GEMV's rows, for a
    layer with a bias and where there is no AMX."""
    if not cpu_native.q4_amx_supported():
        pytest.skip("this CPU has no AMX-BF16")
    _, model, copies = _q4_1_model_and_copies(tmp_path, monkeypatch)
    layer = model.model.layers[0].mlp.gate_up_proj
    method = CpuLinearMethod(layer.weight, copies["model.layers.0.mlp.gate_up_proj"], int4_max_rows=1,
                             q4_panel_max_rows=sys.maxsize)
    layer.linear_method = method
    inter = layer.weight.shape[0] // 2
    gemv_rows = method.gemv_max_rows
    for m in (1, gemv_rows, gemv_rows + 1, 32, 200):
        x = torch.randn(m, layer.weight.shape[1], generator=torch.Generator().manual_seed(m)).bfloat16()
        fused = layer.forward_silu_and_mul(x)
        if m <= gemv_rows:
            assert fused is None, m
            continue
        assert fused is not None and fused.shape == (m, inter)
        assert torch.equal(fused, cpu_native.silu_and_mul(method.matmul(x))), m
    assert method.apply_silu_mul(layer, x, torch.zeros(2 * inter, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(cpu_native, "q4_amx_supported", lambda: False)
    assert layer.forward_silu_and_mul(x) is None

# ------------------------------------------------------------------------------ compiled decode


def _decode_entries(llm: LLM, n: int) -> list[SeqBatchEntry]:
    """Prefill ``n`` prompts of mixed lengths, then the decode batch of their next step."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:n]):
        engine.add_request(f"d{i}", prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    reqs = [engine._seqs[f"d{i}"].request for i in range(n)]
    return [SeqBatchEntry([r.output_token_ids[-1]], r.num_computed_tokens, list(r.block_ids), True) for r in reqs]


def test_compiled_decode_equals_eager_and_reuses_the_cache(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=4)
    runner = llm.engine.runner
    entries = _decode_entries(llm, 3)
    eager, rows, _ = runner.execute(entries)
    assert rows == [0, 1, 2]
    results = []
    for attempt in range(2):          # the second compiles again after a reset: from the on-disk cache
        torch._dynamo.reset()
        runner.compile_cpu_decode(4, sizes=[4])
        assert isinstance(runner.graphs, CompiledDecodeRunner)
        logits, rows, hidden = runner.execute(entries)
        assert hidden is None and runner.graphs.compiled_sizes == {4} and not runner.graphs.failed, attempt
        results.append(logits.clone())
    for logits in results:
        assert logits.shape == eager.shape
        torch.testing.assert_close(logits, eager, rtol=0, atol=0.05 * float(eager.abs().max()))
        assert torch.equal(logits.argmax(-1), eager.argmax(-1))
    # a whole generation through the compiled step (batches 4..1 padded to 4) keeps every greedy token
    reference = tokens(LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=4, enforce_eager=True)
                       .generate(PROMPTS, greedy(), use_tqdm=False))
    assert tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    assert runner.graphs.compiled_sizes == {4}


def test_enforce_eager_turns_compilation_off(tiny_llama_dir, monkeypatch, reference_tokens):
    monkeypatch.setenv("PLINTH_CPU_COMPILE", "1")
    eager = LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=4, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert tokens(eager.generate(PROMPTS, greedy(), use_tqdm=False)) == reference_tokens
    compiled = LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=4, max_num_seqs=8)
    assert isinstance(compiled.engine.runner.graphs, CompiledDecodeRunner)
    assert compiled.engine.runner.graphs.sizes == [1, 2, 4, 8]   # compiled lazily: nothing yet
    assert compiled.engine.runner.graphs.compiled_sizes == set()


def test_bad_switch_values_are_config_errors(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PLINTH_CPU_COMPILE", "maybe")
    with pytest.raises(ConfigError, match="PLINTH_CPU_COMPILE"):
        LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=4)


# ------------------------------------------------------------------------- sampling and batching


@pytest.mark.parametrize("vocab", [300, 4096, 49152, 5000])
def test_fast_argmax_equals_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=gen)
    x[1] = 0.0                                      # all ties: the first index
    x[2, vocab - 1] = 100.0                         # the maximum in the tail
    x[3, [5, vocab // 2]] = 50.0                    # two equal maxima: the first one
    assert torch.equal(fast_argmax(x), x.argmax(dim=-1))
    xb = x.bfloat16()
    assert torch.equal(fast_argmax(xb), xb.argmax(dim=-1))


def test_plain_greedy_batch_and_general_path_agree():
    vocab = 2048
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    reqs = [Request(f"r{i}", [1, 2, 3], greedy()) for i in range(5)]
    plain = SamplingBatch.from_requests(reqs, vocab, "cpu")
    assert plain.all_greedy and plain.output_counts is None and plain.max_num_logprobs is None
    assert torch.equal(Sampler().sample(logits, plain).sampled_token_ids, logits.argmax(-1))
    # one row with logprobs takes the general path and still chooses the same tokens
    reqs[2] = Request("lp", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))
    general = SamplingBatch.from_requests(reqs, vocab, "cpu")
    assert general.max_num_logprobs == 2
    out = Sampler().sample(logits, general)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1)) and out.logprobs is not None


def test_block_table_array_matches_a_loop():
    rng = np.random.default_rng(0)
    block_ids = [list(rng.integers(1, 100, size=n)) for n in (0, 1, 5, 9, 3)]
    for width, rows in ((4, None), (9, 8), (1, 5)):
        expected = np.zeros((rows or len(block_ids), width), dtype=np.int64)
        for i, ids in enumerate(block_ids):
            expected[i, : min(len(ids), width)] = ids[:width]
        assert np.array_equal(block_table_array(block_ids, width, rows), expected)


def test_compiled_runner_inputs_pad_rows():
    runner = CompiledDecodeRunner.__new__(CompiledDecodeRunner)
    runner.block_size = 4
    ids, pos, slots, tables, lens = runner.inputs(np.array([7, 8]), np.array([5, 0]), [[3, 9], [4]], 4)
    assert ids.tolist() == [7, 8, 0, 0] and pos.tolist() == [5, 0, 0, 0]
    assert slots.tolist() == [9 * 4 + 1, 4 * 4, 0, 0] and lens.tolist() == [6, 1, 1, 1]
    assert tables.tolist() == [[3, 9], [4, 0], [0, 0], [0, 0]]


# -------------------------------------------------------------------------------------- threads


def test_thread_count_from_env_and_affinity(monkeypatch):
    import os

    monkeypatch.delenv("PLINTH_CPU_THREADS", raising=False)
    assert 1 <= cpu_thread_count() <= len(os.sched_getaffinity(0))
    monkeypatch.setenv("PLINTH_CPU_THREADS", "1")
    assert cpu_thread_count() == 1
    before = torch.get_num_threads()
    try:
        CpuPlatform().set_device(0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    # 100000 crashed the process starting that many threads; "²" passes str.isdigit but not int()
    for bad in ("0", "two", "-1", "100000", "\u00b2", "\u0663"):
        monkeypatch.setenv("PLINTH_CPU_THREADS", bad)
        with pytest.raises(ConfigError, match="PLINTH_CPU_THREADS"):
            cpu_thread_count()


# ------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("num_kv_heads,group", [(2, 3), (3, 3), (8, 1)])
def test_matmul_decode_attention_equals_sdpa(num_kv_heads, group):
    from plinth.attention_backends.torch_batched import _decode_attention

    gen = torch.Generator().manual_seed(num_kv_heads)
    n, length, d = 7, 40, 16
    q = torch.randn(n, num_kv_heads, group, d, generator=gen, dtype=torch.float64)
    k = torch.randn(n, length, num_kv_heads, d, generator=gen, dtype=torch.float64)
    v = torch.randn(n, length, num_kv_heads, d, generator=gen, dtype=torch.float64)
    lens = torch.tensor([1, 5, 17, 40, 33, 2, 29])
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]         # [n, 1, 1, L]
    ref = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(_decode_attention(q, k, v, mask, 0.3), ref, rtol=1e-10, atol=1e-10)



@pytest.mark.parametrize("int8", ["default", "0"])
def test_float32_gguf_model_decodes_through_int4_copies_without_native_bf16(int8, tmp_path, monkeypatch,
                                                                            tiny_llama_dir):
    """On a CPU without native bfloat16 (float32 is the default there), a Q4_1 GGUF model's decode rows (up to
    ``PLINTH_CPU_INT4_MAX_ROWS``) multiply the file's 4-bit blocks through the native float32 GEMV (AVX2/FMA),
    the rows as they are; without AVX2 rounded to bfloat16 through torch's int4 kernel; longer inputs keep the
    float32 weights. In decode steps (by default; not with ``PLINTH_CPU_INT8_ACT=0``) every row count takes
    the copies' 8-bit-input GEMM instead.
    Greedy tokens follow the float32 path's (``PLINTH_CPU_INT4=0``) except where a near tie parts them."""
    from test_cpu_native_ops import int8_rows
    from test_gguf import small_model, write_gguf

    from plinth.platforms.cpu import platform as cpu_platform
    from plinth.worker import cpu_linear as cpu_linear_mod
    from plinth.worker.cpu_linear import decode_step

    monkeypatch.setattr(cpu_platform, "has_fast_bf16", lambda: False)
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    if int8 != "default":
        monkeypatch.setenv("PLINTH_CPU_INT8_ACT", int8)
    else:
        monkeypatch.delenv("PLINTH_CPU_INT8_ACT", raising=False)
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", False), "llama", gguf.GGMLQuantizationType.Q4_1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 14, 3], [7, 8, 9, 10, 11, 12]]
    runs = []
    for int4 in ("1", "0"):
        monkeypatch.setenv("PLINTH_CPU_INT4", int4)
        with LLM(str(path), tokenizer=str(tiny_llama_dir), dtype="float32", block_size=4) as llm:
            model = llm.engine.runner.model
            down = model.model.layers[0].mlp.down_proj
            if int4 == "1":
                method = down.linear_method
                assert isinstance(method, CpuLinearMethod) and method.int4 is not None and method.int4_max_rows == 4
                raw = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
                w_file = torch.from_numpy(gguf.quants.dequantize(np.asarray(raw.data), raw.tensor_type)).double()
                x = torch.randn(3, w_file.shape[1], generator=torch.Generator().manual_seed(3))
                got = method.matmul(x)
                assert got.dtype == torch.float32
                assert torch.equal(method.matmul(x.t().contiguous().t()), got)   # a strided input alike
                if cpu_native.q4_gemv_f32_supported():
                    # with the 8-bit GEMM for decode steps, a prompt's few rows take the packed float32 weights,
                    # the same sums as those rows inside a longer prompt (a prompt's last tokens computed apart after
                    # a prefix-cache hit); else the native float32 GEMV: the file's weights times the rows as they
                    # are, float32 sums
                    assert method.int4.int8_inputs == (int8 == "default")
                    if method.int4.int8_inputs and method.packed is not None:
                        longer = torch.cat([x, torch.randn(20, x.shape[1])])
                        assert torch.equal(got, method.matmul(longer)[:3])
                    else:
                        assert method.int4.gemv_f32 is not None and torch.equal(got, method.int4.gemv_f32(x))
                    want = x.double() @ w_file.T
                    bound = 1e-5 * (x.double().abs() @ w_file.abs().T)
                    assert bool(((got.double() - want).abs() <= bound).all())
                else:   # torch's int4 kernel on the bfloat16-rounded rows
                    assert torch.equal(got, method.int4.matmul(x.bfloat16()).float())
                    want = x.bfloat16().double() @ w_file.T
                    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-2
                many = torch.randn(40, w_file.shape[1])
                # past the row limit the float32 weights (oneDNN-packed where float32 is the default, and then held
                # packed only): within float32 rounding of the file's weights' exact product
                exact = many.double() @ w_file.T
                assert bool(((method.matmul(many).double() - exact).abs()
                             <= 1e-5 * (many.double().abs() @ w_file.abs().T) + 1e-6).all())
                if method.int4.int8_inputs:   # in a decode step every row count takes the 8-bit GEMM
                    for rows_in in (x, many):
                        with decode_step():
                            got8 = method.matmul(rows_in)
                        assert torch.equal(got8, method.int4.gemm_q8(rows_in))
                        want = int8_rows(rows_in) @ w_file.T
                        bound = 1e-5 * (int8_rows(rows_in).abs() @ w_file.abs().T)
                        assert bool(((got8.double() - want).abs() <= bound).all())
            else:   # no 4-bit copy; the float32 weight packed where oneDNN's float32 GEMM is used
                method = down.linear_method
                assert getattr(method, "int4", None) is None
                assert (isinstance(method, CpuLinearMethod) and method.packed is not None) == \
                    cpu_linear_mod.packed_linear_supported(torch.float32)
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert [r[:3] for r in runs[0]] == [r[:3] for r in runs[1]]
    agree = sum(a == b for x, y in zip(*runs, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.75 * sum(len(r) for r in runs[0])


def test_float32_gguf_prompts_take_8_bit_inputs_with_int8_act_all(tmp_path, monkeypatch, tiny_llama_dir):
    """``PLINTH_CPU_INT8_ACT=all`` (a float32 GGUF model on a CPU without native bfloat16): prompts and mixed
    steps multiply the 4-bit layers with 8-bit inputs too, not only decode steps, so those layers keep no
    oneDNN-packed float32 copy; the prompt's scores move from the default's by the inputs' 8-bit rounding only;
    a value that is not a switch or ``all`` fails at start-up with the accepted values."""
    from test_gguf import small_model, write_gguf

    from plinth.platforms.cpu import platform as cpu_platform

    if not cpu_native.q4_gemv_f32_supported():
        pytest.skip("the native AVX2 kernels are not built here")
    monkeypatch.setattr(cpu_platform, "has_fast_bf16", lambda: False)
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", False), "llama", gguf.GGMLQuantizationType.Q4_1)
    prompt = [[5, 17, 99, 3, 120, 41, 7, 7, 112, 64, 33, 2, 90, 11]]   # the model's vocabulary is 128
    rows_seen: list[int] = []
    real_call = cpu_native.Q4GemmF32Q8.__call__
    monkeypatch.setattr(cpu_native.Q4GemmF32Q8, "__call__",
                        lambda self, x: (rows_seen.append(x.shape[0]), real_call(self, x))[1])

    def score(mode: str) -> tuple[list[float], list[int], int, list[int]]:
        monkeypatch.setenv("PLINTH_CPU_INT8_ACT", mode)
        rows_seen.clear()
        with LLM(str(path), tokenizer=str(tiny_llama_dir), dtype="float32", block_size=4) as llm:
            model = llm.engine.runner.model
            methods = [m.linear_method for m in model.modules()
                       if isinstance(getattr(m, "linear_method", None), CpuLinearMethod)]
            assert len(methods) == 2 * 4 and all(m.int4 is not None and m.int4.int8_inputs for m in methods)
            packed = sum(m.packed is not None for m in methods)
            out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
            prompt_rows = sorted(set(rows_seen))
            tokens = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids
        scores = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
        return scores, prompt_rows, packed, tokens

    on, rows_on, packed_on, tokens_on = score("1")
    every, rows_all, packed_all, tokens_all = score("all")
    assert rows_on == [] and rows_all == [len(prompt[0])]   # the prompt's 14 rows: the 8-bit GEMM with "all" only
    assert packed_all == 0 and packed_on == packed_linear_count(8)
    assert on != every                                       # the 8-bit prompt really ran
    np.testing.assert_allclose(every, on, atol=0.05)
    assert len(tokens_on) == len(tokens_all) == 6
    monkeypatch.setenv("PLINTH_CPU_INT8_ACT", "prompts")
    with pytest.raises(ConfigError, match="on/off or all"):
        LLM(str(path), tokenizer=str(tiny_llama_dir), dtype="float32", block_size=4)


def test_float32_gguf_decode_rows_of_mixed_steps_take_the_8_bit_gemm(tmp_path, monkeypatch, tiny_llama_dir):
    """A float32 GGUF model on a CPU without native bfloat16 (8-bit decode inputs, the default): in a mixed step
    (a prompt beside decodes) the decode rows take the 8-bit GEMM as in a decode-only step and the prompt rows the
    float32 path, so the decoding sequences' tokens are those of the same batch with no prompt arriving and their
    log-probabilities within float32 rounding (with the decode rows on the float32 path they moved by the 8-bit
    rounding, ~1e-3)."""
    from test_gguf import small_model, write_gguf

    from plinth.platforms.cpu import platform as cpu_platform

    if not cpu_native.q4_gemv_f32_supported():
        pytest.skip("the native AVX2 kernels are not built here")
    monkeypatch.setattr(cpu_platform, "has_fast_bf16", lambda: False)
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PLINTH_CPU_INT8_ACT", raising=False)   # the default: 8-bit decode steps, float32 prompts
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", False), "llama", gguf.GGMLQuantizationType.Q4_1)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 128, 9 + 3 * i).tolist() for i in range(3)]
    intruder = rng.integers(0, 128, 30).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    rows_seen: list[int] = []
    real_call = cpu_native.Q4GemmF32Q8.__call__
    monkeypatch.setattr(cpu_native.Q4GemmF32Q8, "__call__",
                        lambda self, x: (rows_seen.append(x.shape[0]), real_call(self, x))[1])

    # (no prefix cache: the second batch's prompts compute all their tokens again, as the first's did)
    with LLM(str(path), tokenizer=str(tiny_llama_dir), dtype="float32", block_size=4,
             enable_prefix_caching=False) as llm:
        engine = llm.engine

        def run(tag: str, intrude_at: tuple[int, ...]) -> dict[str, tuple[list[int], list[float]]]:
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{tag}{i}", prompt, params)
            done, step = {}, 0
            while engine.has_unfinished_requests():
                step += 1
                if step in intrude_at:   # a prompt arrives while the three decode
                    engine.add_request(f"{tag}x{step}", intruder, SamplingParams(temperature=0, max_tokens=1))
                for out in engine.step():
                    if out.finished and "x" not in out.request_id:
                        c = out.outputs[0]
                        done[out.request_id[1:]] = (c.token_ids, [d[t].logprob for t, d in zip(c.token_ids, c.logprobs,
                                                                                               strict=True)])
            return done

        alone = run("a", ())
        rows_seen.clear()
        mixed = run("b", (3, 7, 11))
    assert sorted(alone) == sorted(mixed) == ["0", "1", "2"]
    for key, (tokens, logprobs) in alone.items():
        assert mixed[key][0] == tokens
        # the layers' rows are bit for bit those of the decode-only steps; the LM head's rows are not (a mixed
        # step's 3 decode rows and the prompt's last row take the 4-row head kernel): float32 rounding apart
        np.testing.assert_allclose(mixed[key][1], logprobs, rtol=0, atol=2e-6)
    # the mixed steps' decode rows (3 sequences) went through the 8-bit GEMM layer by layer beside a 30-row prompt
    assert rows_seen.count(3) > 0 and 30 not in rows_seen and 33 not in rows_seen


def packed_linear_count(layers: int) -> int:
    """How many of ``layers`` float32 linear layers get a oneDNN-packed copy here (all or none)."""
    from plinth.worker import cpu_linear as cpu_linear_mod

    return layers if cpu_linear_mod.packed_linear_supported(torch.float32) else 0


@pytest.mark.parametrize("int8", ["default", "0"])
def test_float32_gguf_model_takes_the_q8_0_lm_head_without_native_bf16(int8, tmp_path, monkeypatch, tiny_llama_dir):
    """On a CPU without native bfloat16 a float32 GGUF model's Q8_0 LM head (here the tied embedding) serves
    decode rows from the file's blocks with float32 inputs: the logits are the file's weights times the rows,
    quantized to 8 bits per 32 features (the default, with AVX2) or as they are (``PLINTH_CPU_INT8_ACT=0``),
    in float32 sums; 5-8 rows multiply the blocks regrouped eight rows at a time in float32 (AVX2, whatever the
    8-bit setting), more rows the float32 weight. Greedy tokens match the float32 head's
    (``PLINTH_CPU_Q8_HEAD_MAX_ROWS=0``) up to near ties."""
    from test_cpu_native_ops import int8_rows
    from test_gguf import small_model, write_gguf

    from plinth.kernels import cpu_native
    from plinth.platforms.cpu import platform as cpu_platform
    from plinth.worker.cpu_path import Q8_HEAD_ROWS_ENV

    if not cpu_native.q8_0_supported(torch.float32):
        pytest.skip("the native CPU kernels are not built here")
    monkeypatch.setattr(cpu_platform, "has_fast_bf16", lambda: False)
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    if int8 != "default":
        monkeypatch.setenv("PLINTH_CPU_INT8_ACT", int8)
    else:
        monkeypatch.delenv("PLINTH_CPU_INT8_ACT", raising=False)
    quantized = int8 == "default" and cpu_native.q8_0_int8_supported()
    from plinth.worker.cpu_linear import decode_step
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", True), "llama", gguf.GGMLQuantizationType.Q8_0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 14, 3], [7, 8, 9, 10, 11, 12]]
    calls: list[tuple[int, torch.dtype, bool]] = []   # (rows, input dtype, 8-bit inputs) of every Q8_0 GEMV
    real = cpu_native.q8_0_matmul
    monkeypatch.setattr(cpu_native, "q8_0_matmul",
                        lambda x, *a, **k: (calls.append((x.shape[0], x.dtype, k.get("int8_inputs", False))),
                                            real(x, *a, **k))[1])
    runs = []
    for rows in ("4", "0"):
        monkeypatch.setenv(Q8_HEAD_ROWS_ENV, rows)
        with LLM(str(path), tokenizer=str(tiny_llama_dir), dtype="float32", block_size=4) as llm:
            head = llm.engine.runner.model.lm_head
            method = getattr(getattr(head, "gemm", None), "__self__", None)
            if rows == "4":
                assert isinstance(method, CpuLinearMethod) and method.q8_0 is not None and method.q8_0_max_rows == 4
                w_file = torch.from_numpy(gguf.quants.dequantize(method.q8_0.numpy(), gguf.GGMLQuantizationType.Q8_0))
                gen = torch.Generator().manual_seed(4)
                for m, decoding in ((1, False), (1, True), (2, True), (3, True), (4, True)):
                    x = torch.randn(m, w_file.shape[1], generator=gen)
                    calls.clear()
                    with decode_step(decoding):
                        got = head(x)
                    # the file's blocks, float32 rows (two 8-bit planes for 1-3 rows of a decode step)
                    two_planes = quantized and decoding and m <= Q8_0_INT8_MAX_ROWS
                    assert calls == [(m, torch.float32, two_planes)]
                    rows_in = int8_rows(x, planes=2) if two_planes else x.double()
                    exact = rows_in @ w_file.double().T
                    bound = 1e-5 * (rows_in.abs() @ w_file.double().abs().T)
                    assert got.dtype == torch.float32 and bool(((got.double() - exact).abs() <= bound).all())
                # 5-8 rows: the regrouped blocks in float32 where the head has them (AVX2), whatever the 8-bit
                # setting; past 8 rows the float32 weight
                for m in (5, Q8_0_ROWS8_F32_MAX_ROWS, Q8_0_ROWS8_F32_MAX_ROWS + 1):
                    many = torch.randn(m, w_file.shape[1], generator=gen)
                    regrouped = []
                    real_rows8 = cpu_native.q8_0_rows8_matmul
                    monkeypatch.setattr(cpu_native, "q8_0_rows8_matmul",
                                        lambda x, *a, seen=regrouped, real=real_rows8, **k:
                                        (seen.append(x.shape[0]), real(x, *a, **k))[1])
                    calls.clear()
                    got = head(many)
                    monkeypatch.setattr(cpu_native, "q8_0_rows8_matmul", real_rows8)
                    has_rows8 = cpu_native.q8_0_int8_supported()
                    assert method.q8_0_rows8 is not None if has_rows8 else method.q8_0_rows8 is None
                    assert not calls and regrouped == ([m] if has_rows8 and m <= Q8_0_ROWS8_F32_MAX_ROWS else [])
                    exact = many.double() @ w_file.double().T
                    assert bool(((got.double() - exact).abs() <= 1e-5 * (many.double().abs() @ w_file.double().abs().T)
                                 + 1e-6).all())
            else:
                assert method is None or method.q8_0 is None
            calls.clear()
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            assert bool(calls) == (rows == "4")   # decode steps of 2 sequences took the Q8_0 head, or never
            if rows == "4":   # the prompts' step (its 2 logits rows) in float32, the decode steps' 2 rows in 8 bits
                assert calls[0][2] is False and {flag for _, _, flag in calls[1:]} == {quantized}, calls
    assert [r[:3] for r in runs[0]] == [r[:3] for r in runs[1]]
    agree = sum(a == b for x, y in zip(*runs, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.75 * sum(len(r) for r in runs[0])


def test_a_4_bit_layer_of_output_rows_torch_cannot_pack_runs_from_floats(tmp_path, monkeypatch):
    """intermediate_size 100: ffn_gate/ffn_up are Q4_0 (K = 64), ffn_down float32 (100 columns are no whole
    32-blocks, as llama.cpp's quantizer leaves them); the fused gate/up has 200 rows, not whole groups of 16
    for torch's int4 packing: that layer gets no 4-bit copy (start-up crashed), and the tokens equal the
    dequantized reference's."""
    import gguf
    from conftest import make_tokenizer
    from test_gguf import small_model, transformers_gguf_tensors, write_gguf

    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PLINTH_CPU_INT8_ACT", "0")   # float inputs: the tokens of the dequantized weights
    model = small_model("llama", False, intermediate_size=100, vocab_size=300)
    cfg = model.config
    make_tokenizer().save_pretrained(tmp_path)
    path = write_gguf(tmp_path / "m.gguf", model, "llama", gguf.GGMLQuantizationType.Q4_0)
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM(cfg).eval()
    reference.load_state_dict({k: v.float() for k, v in transformers_gguf_tensors(path, cfg).items()}, strict=False)
    prompt = [5, 9, 14, 3, 77, 120]
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    with LLM(path, tokenizer=str(tmp_path), dtype="float32") as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == want


@pytest.mark.parametrize("name,value", [("PLINTH_CPU_INT4_MAX_ROWS", "abc"), ("PLINTH_CPU_INT8_ACT", "maybe"),
                                        ("PLINTH_CPU_COMPILE", "sometimes"), ("PLINTH_CPU_Q8_HEAD_MAX_ROWS", "-1")])
def test_cpu_path_switches_are_checked_for_every_model(monkeypatch, tiny_llama_dir, name, value):
    """A bad CPU-path value stops the start even where the model never reaches the part that reads it (here a
    safetensors model, whose int4/Q8_0 parts do not apply)."""
    from plinth.config import ConfigError, EngineConfig

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        EngineConfig.from_kwargs(model=str(tiny_llama_dir))
