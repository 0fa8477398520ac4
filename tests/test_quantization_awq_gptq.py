"""AWQ and GPTQ checkpoints, packed here from the published layout descriptions (not with plinth's
packing code), against transformers on the weights the packed tensors decode to.

AWQ (AutoAWQ, GEMM version): ``qweight`` ``[K, N/8]`` int32 whose nibble ``i`` of word ``j`` holds
output ``8j + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``qzeros`` ``[K/g, N/8]`` the same; ``scales`` ``[K/g, N]``.
GPTQ (AutoGPTQ): ``qweight`` ``[K/p, N]`` with input ``p*r + i`` in bits ``b*i`` of row ``r``
(``p = 32/b``); ``qzeros`` ``[K/g, N/p]`` packed sequentially along outputs, storing ``zero - 1`` in
version-1 checkpoints; ``scales`` ``[K/g, N]``; ``g_idx`` ``[K]``.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from test_quantization_support import (
    compare,
    float_state,
    is_linear,
    load_plinth,
    one_thread,  # noqa: F401 (an autouse fixture)
    reference_model,
    write_checkpoint,
)

from plinth.config import ConfigError
from plinth.quantization.formats import IntWeights
from plinth.quantization.packing import AWQ_ORDER, unpack_int32

AWQ_NIBBLE_SOURCE = [0, 2, 4, 6, 1, 3, 5, 7]


# ------------------------------------------------------------------------- packers from the layouts


def to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((words.astype(np.uint64) & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def awq_pack(codes: np.ndarray) -> torch.Tensor:
    """``[rows, N]`` 4-bit codes -> ``[rows, N/8]`` int32 in AWQ's interleaved nibble order."""
    rows, n = codes.shape
    words = np.zeros((rows, n // 8), dtype=np.uint64)
    for j in range(n // 8):
        for i, src in enumerate(AWQ_NIBBLE_SOURCE):
            words[:, j] |= codes[:, 8 * j + src].astype(np.uint64) << np.uint64(4 * i)
    return to_int32(words)


def gptq_pack_rows(codes: np.ndarray, bits: int) -> torch.Tensor:
    """``[K, N]`` codes -> ``[K/p, N]``: ``p`` consecutive rows per word, row ``p*r + i`` in bits ``bits*i``."""
    per = 32 // bits
    k, n = codes.shape
    words = np.zeros((k // per, n), dtype=np.uint64)
    for r in range(k // per):
        for i in range(per):
            words[r] |= codes[per * r + i].astype(np.uint64) << np.uint64(bits * i)
    return to_int32(words)


def gptq_pack_cols(codes: np.ndarray, bits: int) -> torch.Tensor:
    """``[G, N]`` codes -> ``[G, N/p]`` packed sequentially along the columns."""
    return gptq_pack_rows(codes.T.copy(), bits).t().contiguous()


def rtn_groups(w: np.ndarray, cols_of_group: list[np.ndarray], bits: int, symmetric: bool):
    """Round-to-nearest per group of input columns: codes ``[N, K]``, scales and zeros ``[G, N]``."""
    levels = (1 << bits) - 1
    n, k = w.shape
    codes = np.zeros((n, k), dtype=np.int64)
    scales = np.zeros((len(cols_of_group), n))
    zeros = np.zeros((len(cols_of_group), n), dtype=np.int64)
    for g, cols in enumerate(cols_of_group):
        block = w[:, cols]
        if symmetric:
            s = np.abs(block).max(1) / ((levels + 1) // 2 - 1)
            z = np.full(n, (levels + 1) // 2)
        else:
            lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
            s = (hi - lo) / levels
            z = np.clip(np.round(-lo / s), 0, levels).astype(np.int64)
        codes[:, cols] = np.clip(np.round(block / s[:, None]) + z[:, None], 0, levels)
        scales[g], zeros[g] = s, z
    return codes, scales.astype(np.float16), zeros


def dequantize(codes, scales, zeros, group_of_col) -> torch.Tensor:
    s = scales.astype(np.float64)[group_of_col].T                       # [N, K]
    z = zeros[group_of_col].T
    return torch.from_numpy((codes - z) * s).to(torch.float32)


def awq_checkpoint(base, out, group: int, quantize=is_linear):
    """An AWQ copy of ``base`` (the tensors ``quantize`` names) and the weights it decodes to."""
    tensors, deq = {}, {}
    for name, w in float_state(base).items():
        if not quantize(name):
            tensors[name] = w
            continue
        w64 = w.double().numpy()
        k = w64.shape[1]
        cols = [np.arange(g * group, (g + 1) * group) for g in range(k // group)]
        codes, scales, zeros = rtn_groups(w64, cols, 4, symmetric=False)
        stem = name.removesuffix(".weight")
        tensors[f"{stem}.qweight"] = awq_pack(codes.T)
        tensors[f"{stem}.qzeros"] = awq_pack(zeros)
        tensors[f"{stem}.scales"] = torch.from_numpy(scales)
        deq[name] = dequantize(codes, scales, zeros, np.arange(k) // group)
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return write_checkpoint(base, out, tensors, config), deq


def gptq_checkpoint(base, out, bits: int, group: int, desc_act: bool, symmetric: bool, fmt: str = "gptq",
                    quantize=is_linear):
    """A GPTQ copy of ``base`` (the tensors ``quantize`` names) and the weights it decodes to."""
    rng = np.random.default_rng(bits + group)
    tensors, deq, orders = {}, {}, {}
    for name, w in float_state(base).items():
        if not quantize(name):
            tensors[name] = w
            continue
        w64 = w.double().numpy()
        k = w64.shape[1]
        # The order GPTQ visited the columns (by the Hessian of the layer's input): projections that
        # read the same input (q/k/v, gate/up) share it.
        shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        order = orders.setdefault(shared, rng.permutation(k) if desc_act else np.arange(k))
        g_idx = np.empty(k, dtype=np.int64)
        g_idx[order] = np.arange(k) // group
        cols = [np.flatnonzero(g_idx == g) for g in range(k // group)]
        codes, scales, zeros = rtn_groups(w64, cols, bits, symmetric)
        stored = (zeros - 1) & ((1 << bits) - 1) if fmt == "gptq" else zeros
        stem = name.removesuffix(".weight")
        tensors[f"{stem}.qweight"] = gptq_pack_rows(codes.T.copy(), bits)
        tensors[f"{stem}.qzeros"] = gptq_pack_cols(stored, bits)
        tensors[f"{stem}.scales"] = torch.from_numpy(scales)
        tensors[f"{stem}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        deq[name] = dequantize(codes, scales, zeros, g_idx)
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": symmetric,
              "checkpoint_format": fmt}
    return write_checkpoint(base, out, tensors, config), deq


# -------------------------------------------------------------------------------------- round trips


def test_packers_round_trip_through_plinth_unpacking():
    rng = np.random.default_rng(0)
    codes4 = rng.integers(0, 16, (32, 64))
    assert torch.equal(unpack_int32(awq_pack(codes4), 4, dim=1, order=AWQ_ORDER).long(), torch.from_numpy(codes4))
    for bits in (4, 8):
        codes = rng.integers(0, 1 << bits, (64, 24))
        assert torch.equal(unpack_int32(gptq_pack_rows(codes, bits), bits, dim=0).long(), torch.from_numpy(codes))
        assert torch.equal(unpack_int32(gptq_pack_cols(codes, bits), bits, dim=1).long(), torch.from_numpy(codes))


# ---------------------------------------------------------------------------------------- AWQ / GPTQ


@pytest.mark.parametrize("kernel", ["dequant", "torch_int4pack"])
def test_awq_matches_reference(tiny_llama_dir, tmp_path, kernel):
    path, deq = awq_checkpoint(tiny_llama_dir, tmp_path / "awq", group=32)
    model, backend, method = load_plinth(path, gemm_kernel=kernel)
    assert method.name == "awq" and method.kernel.name == kernel
    # measured: max logit error ~1e-6, 48/48 greedy tokens equal (GPTQ cases too)
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)


@pytest.mark.parametrize("bits,desc_act,symmetric,fmt,kernel", [
    (4, True, False, "gptq", "torch_int4pack"),
    (4, False, True, "gptq_v2", "dequant"),
    (8, True, True, "gptq", "dequant"),
    (8, False, False, "gptq", "dequant"),
], ids=["4bit-act_order", "4bit-sym-v2", "8bit-act_order-sym", "8bit"])
def test_gptq_matches_reference(tiny_llama_dir, tmp_path, bits, desc_act, symmetric, fmt, kernel):
    path, deq = gptq_checkpoint(tiny_llama_dir, tmp_path / "gptq", bits, 32, desc_act, symmetric, fmt)
    model, backend, method = load_plinth(path, gemm_kernel=kernel)
    assert method.name == "gptq" and method.bits == bits and method.act_order == desc_act
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert hasattr(qkv, "perm") == desc_act  # act order: the input features were sorted by group
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)


@pytest.mark.parametrize("key,value", [
    ("dynamic", {"-:.*mlp.*": {}, "+:.*self_attn.*": {"bits": 4, "group_size": 32}}),   # GPTQModel
    # in order, the first match decides (attention quantized before '-:.*' skips the rest); keys that only
    # steered the quantization are no override
    ("dynamic", {"+:.*self_attn.*": {"damp_percent": 0.05}, "-:.*": {}}),
    ("modules_in_block_to_quantize", [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                                      ["self_attn.o_proj"]]),                                # transformers / optimum
], ids=["dynamic", "dynamic-first-match", "modules_in_block"])
def test_gptq_checkpoint_quantizing_only_some_modules(tiny_llama_dir, tmp_path, key, value):
    """The keys that leave modules of a GPTQ checkpoint in floating point: the MLPs load as float weights."""
    import json

    from plinth.model_registry.layers.linear import UnquantizedLinearMethod

    path, deq = gptq_checkpoint(tiny_llama_dir, tmp_path / "gptq", 4, 32, False, False,
                                quantize=lambda n: is_linear(n) and ".mlp." not in n)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"][key] = value
    (path / "config.json").write_text(json.dumps(config))
    model, backend, method = load_plinth(path, gemm_kernel="dequant")
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.linear_method is method
    assert isinstance(layer.mlp.down_proj.linear_method, UnquantizedLinearMethod)
    floats = {n: w for n, w in float_state(tiny_llama_dir).items() if is_linear(n) and n not in deq}
    compare(model, backend, reference_model(tiny_llama_dir, {**deq, **floats}), atol=1e-3, min_agreement=0.95)


def test_gptq_checkpoint_with_zero_biases_loads(tiny_llama_dir, tmp_path):
    """Older GPTQ writers add an all-zero float16 ``.bias`` to every quantized layer, also where the architecture
    has none (Llama): they are skipped; a non-zero one is still refused, naming the tensor."""
    from safetensors.torch import load_file, save_file

    from plinth.errors import ModelLoadError

    path, deq = gptq_checkpoint(tiny_llama_dir, tmp_path / "gptq", 4, 32, False, False)
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".qweight")]:
        tensors[name.replace(".qweight", ".bias")] = torch.zeros(tensors[name].shape[1], dtype=torch.float16)
    save_file(tensors, str(path / "model.safetensors"))
    model, backend, _method = load_plinth(path, gemm_kernel="dequant")
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)
    tensors["model.layers.0.mlp.down_proj.bias"][3] = 0.5
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj.bias"):
        load_plinth(path, gemm_kernel="dequant")


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_settings_in_the_writers_own_file(tiny_llama_dir, tmp_path, kind):
    """Older AutoGPTQ / AutoAWQ checkpoints keep their settings in ``quantize_config.json`` / ``quant_config.json``
    (AutoAWQ's keys, no ``quant_method``) instead of ``config.json``: they load as that method; a float checkpoint
    with such a stray file stays float."""
    import json

    if kind == "gptq":
        path, deq = gptq_checkpoint(tiny_llama_dir, tmp_path / kind, 4, 32, True, False)
        settings_file = "quantize_config.json"
    else:
        path, deq = awq_checkpoint(tiny_llama_dir, tmp_path / kind, group=32)
        settings_file = "quant_config.json"
    config = json.loads((path / "config.json").read_text())
    settings = config.pop("quantization_config")
    if kind == "awq":
        settings = {"zero_point": True, "q_group_size": settings["group_size"], "w_bit": settings["bits"],
                    "version": "GEMM"}
    else:
        del settings["quant_method"]
    (path / "config.json").write_text(json.dumps(config))
    (path / settings_file).write_text(json.dumps(settings))
    model, backend, method = load_plinth(path, gemm_kernel="dequant")
    assert method.name == kind
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)

    float_copy = tmp_path / "float"
    shutil.copytree(tiny_llama_dir, float_copy)
    (float_copy / settings_file).write_text(json.dumps(settings))
    _model, _backend, method = load_plinth(float_copy)
    assert method is None


def test_gptq_default_kernel_choice(tiny_llama_dir, tmp_path):
    """With selection off the highest-priority kernel that runs here is taken (not the Triton one on a CPU)."""
    path, _ = gptq_checkpoint(tiny_llama_dir, tmp_path / "gptq", 4, 32, False, False)
    _model, _backend, method = load_plinth(path)
    reasons = {r.name: r.reason for r in method.kernel_selection.candidates}
    assert method.kernel.name == "torch_int4pack" and "need a GPU" in reasons["triton_w4a16"]


def test_gptq_bad_g_idx_names_the_layer(tiny_llama_dir, tmp_path):
    """A ``g_idx`` that does not give each group its share of the input features is refused at load, naming the
    layer."""
    from safetensors.torch import load_file, save_file

    from plinth.errors import ModelLoadError

    path, _ = gptq_checkpoint(tiny_llama_dir, tmp_path / "gptq", 4, 32, True, False)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.g_idx"][:5] = 0
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layer model\.layers\.1\.mlp\.down_proj: g_idx does not assign"):
        load_plinth(path, gemm_kernel="dequant")


# ------------------------------------------------------------------------------ tensor parallelism


def _dequantized_layer(layer) -> torch.Tensor:
    """The weight a 4-bit layer on the dequant kernel holds, in checkpoint input order."""
    from plinth.quantization.packing import unpack_nibbles

    codes = unpack_nibbles(layer.qcodes)                                   # [N, K]
    group = codes.shape[1] // layer.qscales.shape[1]
    return IntWeights(codes, layer.qscales, layer.qzeros, 4, group, getattr(layer, "perm", None)).dequantize()


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_tensor_parallel_shards_decode_to_slices(tiny_llama_dir, tmp_path, fmt):
    if fmt == "awq":
        path, deq = awq_checkpoint(tiny_llama_dir, tmp_path / "q", group=32)
    else:
        path, deq = gptq_checkpoint(tiny_llama_dir, tmp_path / "q", 4, 32, False, False)
    pre = "model.layers.1"
    q, k, v = (deq[f"{pre}.self_attn.{p}_proj.weight"] for p in "qkv")
    gate, up = deq[f"{pre}.mlp.gate_proj.weight"], deq[f"{pre}.mlp.up_proj.weight"]
    for rank in (0, 1):
        model, _backend, _method = load_plinth(path, gemm_kernel="dequant", tp=(rank, 2))
        layer = model.model.layers[1]
        half = lambda t, dim, rank=rank: t.chunk(2, dim)[rank]  # noqa: E731
        expected = {
            "qkv": torch.cat([half(q, 0), half(k, 0), half(v, 0)]),
            "o": half(deq[f"{pre}.self_attn.o_proj.weight"], 1),
            "gate_up": torch.cat([half(gate, 0), half(up, 0)]),
            "down": half(deq[f"{pre}.mlp.down_proj.weight"], 1),
        }
        got = {
            "qkv": _dequantized_layer(layer.self_attn.qkv_proj), "o": _dequantized_layer(layer.self_attn.o_proj),
            "gate_up": _dequantized_layer(layer.mlp.gate_up_proj), "down": _dequantized_layer(layer.mlp.down_proj),
        }
        for name in expected:
            assert torch.allclose(got[name], expected[name], atol=1e-6), (fmt, rank, name)


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq: 3-bit checkpoints are not supported"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 8}, "awq: 8-bit checkpoints are not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*mlp.*": {"bits": 8}}},
     r"'dynamic' overrides for '\+:\.\*mlp\.\*' \(\{'bits': 8\}\) are not supported"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:(": {}}}, "'dynamic' key '-:\\(' is not a regular"),
    ({"quant_method": "gptq", "bits": 4, "modules_in_block_to_quantize": "q_proj"}, "must be lists of module names"),
])
def test_unsupported_settings_fail_at_load(tiny_llama_dir, tmp_path, config, message):
    path = write_checkpoint(tiny_llama_dir, tmp_path / "q", float_state(tiny_llama_dir), config)
    with pytest.raises(ConfigError, match=message):
        load_plinth(path)


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "gptq", "bits": None}, r"gptq: bits must be an integer \(4 or 8 bits\), got None"),
    ({"quant_method": "gptq", "bits": "4"}, r"gptq: bits must be an integer \(4 or 8 bits\), got '4'"),
    ({"quant_method": "awq", "bits": True}, r"awq: bits must be an integer \(4 bits\), got True"),
    ({"quant_method": "awq", "w_bit": None}, r"awq: w_bit must be an integer \(4 bits\), got None"),
    ({"quant_method": "gptq", "bits": 4, "group_size": "128"}, "gptq: group_size must be a positive integer or -1"),
], ids=["gptq-null", "gptq-string", "awq-bool", "awq-w_bit-null", "group_size-string"])
def test_mistyped_bits_are_refused(tiny_llama_dir, tmp_path, config, message):
    """``bits`` (and the group size) must be JSON integers: null, a string or a bool is refused naming the field and
    the widths that load (not a TypeError, nor ``true`` read as 1 bit)."""
    path = write_checkpoint(tiny_llama_dir, tmp_path / "q", float_state(tiny_llama_dir), config)
    with pytest.raises(ConfigError, match=message):
        load_plinth(path)


@pytest.mark.parametrize("method,key,value", [
    ("gptq", "desc_act", "false"), ("gptq", "sym", 0), ("gptq", "lm_head", "false"), ("awq", "zero_point", "false"),
])
def test_settings_that_are_booleans_must_be_json_booleans(tiny_llama_dir, tmp_path, method, key, value):
    """``"desc_act": "false"`` was read as act order (a non-empty string is true): a string or a number in place of
    a boolean is refused, naming the setting, rather than guessed."""
    config = {"quant_method": method, "bits": 4, "group_size": 32, key: value}
    path = write_checkpoint(tiny_llama_dir, tmp_path / "q", float_state(tiny_llama_dir), config)
    with pytest.raises(ConfigError, match=f"{method}: {key} must be true or false, got {value!r}"):
        load_plinth(path)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_modules_to_not_convert_must_be_a_list(tiny_llama_dir, tmp_path, method):
    """A single string was read character by character (every module with an 'l' or an 'm' in a dotted part...):
    refused, as transformers and vLLM take only a list."""
    config = {"quant_method": method, "bits": 4, "group_size": 32, "modules_to_not_convert": "down_proj"}
    path = write_checkpoint(tiny_llama_dir, tmp_path / "q", float_state(tiny_llama_dir), config)
    with pytest.raises(ConfigError, match=f"{method}: modules_to_not_convert must be a list of module names, got "
                                          f"'down_proj'"):
        load_plinth(path)


@pytest.mark.parametrize("kind,tensor,dtype", [
    ("gptq", "model.layers.0.self_attn.q_proj.qweight", torch.int64),
    ("gptq", "model.layers.1.mlp.down_proj.qzeros", torch.int16),
    ("gptq", "model.layers.0.mlp.up_proj.g_idx", torch.int64),
    ("awq", "model.layers.1.self_attn.o_proj.qweight", torch.int64),
])
def test_packed_tensors_of_another_integer_dtype_are_refused(tiny_llama_dir, tmp_path, kind, tensor, dtype):
    """Packed words and ``g_idx`` are int32 in the published layouts: another integer type was cast silently; it is
    refused naming the tensor."""
    from safetensors.torch import load_file, save_file

    from plinth.errors import ModelLoadError

    if kind == "gptq":
        path, _ = gptq_checkpoint(tiny_llama_dir, tmp_path / kind, 4, 32, False, False)
    else:
        path, _ = awq_checkpoint(tiny_llama_dir, tmp_path / kind, group=32)
    tensors = load_file(str(path / "model.safetensors"))
    tensors[tensor] = tensors[tensor].to(dtype)
    save_file(tensors, str(path / "model.safetensors"))
    dtype_name = str(dtype).removeprefix("torch.")
    with pytest.raises(ModelLoadError, match=rf"tensor '{tensor}': expected an int32 tensor .*checkpoint has "
                                             rf"{dtype_name}"):
        load_plinth(path, gemm_kernel="dequant")


def test_gptq_without_g_idx_loads_unless_act_order(tiny_llama_dir, tmp_path):
    """Without act order ``g_idx`` can only be ``k // g`` and writers may leave it out: such a checkpoint gives the
    logits of the same one with its ``g_idx`` (also a row-parallel rank's, whose groups start at its first input
    feature); with act order a missing ``g_idx`` is still refused."""
    from safetensors.torch import load_file, save_file
    from test_quantization_support import plinth_logits_and_greedy

    from plinth.errors import ModelLoadError

    with_idx, _ = gptq_checkpoint(tiny_llama_dir, tmp_path / "with", 4, 32, False, False)
    without = tmp_path / "without"
    shutil.copytree(with_idx, without)
    tensors = load_file(str(without / "model.safetensors"))
    assert any(n.endswith(".g_idx") for n in tensors)
    save_file({n: t for n, t in tensors.items() if not n.endswith(".g_idx")}, str(without / "model.safetensors"))
    expected, expected_tokens = plinth_logits_and_greedy(*load_plinth(with_idx, gemm_kernel="dequant")[:2])
    got, got_tokens = plinth_logits_and_greedy(*load_plinth(without, gemm_kernel="dequant")[:2])
    assert got_tokens == expected_tokens
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))

    def row_parallel(path):   # rank 1 of 2
        layer = load_plinth(path, gemm_kernel="dequant", tp=(1, 2))[0].model.layers[1]
        return [_dequantized_layer(layer.mlp.down_proj), _dequantized_layer(layer.self_attn.o_proj)]

    assert all(torch.equal(a, b) for a, b in zip(row_parallel(without), row_parallel(with_idx), strict=True))

    act_order, _ = gptq_checkpoint(tiny_llama_dir, tmp_path / "act_order", 4, 32, True, False)
    tensors = load_file(str(act_order / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.g_idx"]
    save_file(tensors, str(act_order / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.down_proj\.g_idx'"):
        load_plinth(act_order, gemm_kernel="dequant")


def test_awq_needs_an_awq_checkpoint(tiny_llama_dir):
    with pytest.raises(ConfigError, match="'awq' reads checkpoints quantized with it.*float weights.*fp8, int4"):
        load_plinth(tiny_llama_dir, "awq")
