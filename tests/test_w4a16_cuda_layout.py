"""The NVRTC W4A16 decode kernel's packed layout and data flow, checked on the CPU.

The kernel itself needs an NVIDIA GPU (``tests/test_w4a16_cuda_gpu.py``); here: packing against an
unpacking written independently from PTX's m16n8k16 fragment description, a lane-by-lane simulation of
the kernel's operands (A from the packed words, B from the activation slots, C to the output) against
float64, the scales' rounding, and the kernel source compiled with NVRTC.
"""

from __future__ import annotations

import pytest
import torch
from nvrtc_compile import compile_source

from plinth.quantization.kernels.interface import GemmProblem
from plinth.quantization.kernels.w4a16_cuda import (
    SCALE_BYTES,
    SOURCE,
    CudaW4A16Kernel,
    fit_shared,
    group_shift,
    integral_zeros,
    mma_decode,
    pack_mma_codes,
    pack_mma_scales,
    pair_rows,
    reference_decode,
    slot_bytes,
    unpack_mma_codes,
    unpack_mma_scales,
)
from plinth.quantization.quantizers import random_int_weights


@pytest.mark.parametrize("shape", [(16, 64), (48, 192), (32, 512)])
def test_pack_inverts_the_fragment_layout(shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    words = pack_mma_codes(q)
    assert words.dtype == torch.int32 and tuple(words.shape) == (n // 16, k // 64, 32, 4)
    assert torch.equal(unpack_mma_codes(words, n, k), q)


def test_pack_places_one_known_code():
    """Row 9 = 8 + 1 (g = 1, second half), feature 64 + 16 * 2 + 4 * 3 + 3 (chunk 1, t = 2, step 3, e = 3):
    lane 4 * 1 + 2 = 6, word 3, nibble rs + 2 eh + 4 el = 1 + 2 + 4 = 7."""
    q = torch.zeros(16, 128, dtype=torch.uint8)
    q[9, 64 + 32 + 12 + 3] = 0xB
    words = pack_mma_codes(q)
    nonzero = words.nonzero().tolist()
    assert nonzero == [[0, 1, 6, 3]]
    assert (int(words[0, 1, 6, 3]) & 0xFFFFFFFF) == 0xB << 28


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [64, 128, None])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_bfloat16_scales_are_the_only_difference_from_the_file(dtype, group, rows):
    """``reference_decode`` (the packed codes and bfloat16 scales in float64) against the file's weights:
    zero points are exact, scales rounded to bfloat16."""
    n, k = 32, 256
    gen = torch.Generator().manual_seed(rows)
    weights = random_int_weights(n, k, 4, group or k, symmetric=False, act_order=False,
                                 device=torch.device("cpu"), generator=gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    codes = pack_mma_codes(weights.q)
    scales = pack_mma_scales(weights.scales, weights.zeros)
    assert tuple(scales.shape) == (n // 16, k // (group or k), 8, 2)
    out = reference_decode(x, codes, scales, n)
    ref = x.double() @ weights.dequantize(torch.float64).T
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert 0 < rel < 4e-3, rel


def test_scales_pack_pairs_rows_g_and_g_plus_8():
    n, groups = 32, 3
    scales = torch.rand(n, groups) + 0.5
    zeros = torch.randint(0, 16, (n, groups)).float()
    words = pack_mma_scales(scales, zeros)
    s, z = unpack_mma_scales(words, n)
    assert torch.equal(s, scales.to(torch.bfloat16).float()) and torch.equal(z, zeros)
    # tile 1, group 2, g = 3: rows 16 + 3 and 16 + 11
    halves = words[1, 2, 3].view(torch.bfloat16).float()
    assert halves.tolist() == [scales[19, 2].bfloat16().item(), zeros[19, 2].item(),
                               scales[27, 2].bfloat16().item(), zeros[27, 2].item()]


@pytest.mark.parametrize("k,groups,shift", [(4096, 32, 1), (4096, 64, 0), (4096, 1, 31), (14336, 112, 1),
                                            (4096, 16, 2), (768, 4, None)])
def test_group_shift(k, groups, shift):
    assert group_shift(k, groups) == shift


@pytest.mark.parametrize("problem,reason", [
    (GemmProblem("int", torch.bfloat16, "cpu", None, bits=4, group_size=128, shapes=((64, 128),)), "NVIDIA"),
    (GemmProblem("int", torch.bfloat16, "cuda", (9, 0), bits=8, group_size=128, shapes=((64, 128),)), "4-bit"),
    (GemmProblem("int", torch.bfloat16, "cuda", (7, 5), bits=4, group_size=128, shapes=((64, 128),)), "8.0"),
    (GemmProblem("int", torch.float32, "cuda", (9, 0), bits=4, group_size=128, shapes=((64, 128),)), "float32"),
    (GemmProblem("int", torch.float16, "cuda", (9, 0), bits=4, group_size=128, shapes=((64, 128),)), "bfloat16"),
])
def test_supports_says_why_not(problem, reason):
    support = CudaW4A16Kernel.supports(problem)
    assert not support and reason in support.reason


def test_layout_needs_whole_tiles_and_chunks():
    with pytest.raises(ValueError, match="N % 16"):
        pack_mma_codes(torch.zeros(24, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="N % 16"):
        pack_mma_scales(torch.ones(24, 1), torch.zeros(24, 1))
    assert SOURCE.is_file() and "w4a16_mma_decode" in SOURCE.read_text()


def test_fractional_zero_points_are_left_to_triton():
    assert integral_zeros(torch.tensor([[0.0, 15.0], [8.0, 3.0]]))
    assert not integral_zeros(torch.tensor([[0.5, 15.0]]))
    assert not integral_zeros(torch.tensor([[200.0]]))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("bf16", ["true", "false"])
@pytest.mark.parametrize("nb", [1, 2])
def test_kernel_source_compiles_without_spills(arch, bf16, nb):
    """Every instance the launcher can ask for compiles with NVRTC, and on Hopper (where it was tuned) the
    default ring depths keep every value in registers (a spill would add local-memory traffic to a
    bandwidth-bound kernel; for sm_80 ptxas spills 4 bytes in the 9-16-row instances)."""
    from plinth.quantization.kernels.w4a16_cuda import _STAGES, launch_config

    source = SOURCE.read_text().encode()
    defaults = {launch_config(4096)[1], launch_config(14336)[1]}
    for stages in _STAGES:
        name = f"w4a16_mma_decode<{bf16}, {nb}, {stages}>"
        status, text = compile_source(source, "w4a16_mma.cu", name, arch)
        assert status == 0, f"{name} ({arch}):\n{text}"
        if stages in defaults and arch == "sm_90":
            assert "0 bytes spill stores" in text, f"{name} ({arch}) spills:\n{text}"


def simulate_kernel(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int, pair_half: int = 0,
                    silu: bool = False) -> torch.Tensor:
    """The kernel's data flow lane by lane, in float64, with the mma written from PTX's m16n8k16 fragment
    description: lane ``4 g + t`` gives A registers (rows g, g+8, g, g+8; k 2t, 2t, 2t+8, 2t+8, two
    halves each), B registers (k 2t and 2t+8, two halves each, column g) and takes C (rows g, g+8;
    columns 2t, 2t+1). The operands come from the packed words and from the slot layout the kernel
    copies activations into (lane ``4 g + t``: features ``16 t .. 16 t + 15`` of batch row ``g + 8 nb``, B
    words ``2 s, 2 s + 1`` for step ``s``). Batch rows the input lacks are NaN: they must stay in their
    own output columns."""
    m, k = x.shape
    words = codes.to(torch.int64) & 0xFFFFFFFF                       # [N/16, K/64, 32, 4]
    s_all, z_all = unpack_mma_scales(scales, n)                      # [N, G]
    per_group = k // s_all.shape[1]
    xs = torch.full((16, k), float("nan"), dtype=torch.float64)
    xs[:m] = x.double()
    y = torch.zeros(m, n // 2 if silu else n, dtype=torch.float64)
    for tile in range(n // 16):
        for nb in range(1 if m <= 8 else 2):
            out = torch.zeros(16, 8, dtype=torch.float64)
            for c in range(k // 64):
                group = c * 64 // per_group
                rows = torch.arange(16) + 16 * tile
                for s in range(4):
                    a = torch.zeros(16, 16, dtype=torch.float64)
                    b = torch.zeros(16, 8, dtype=torch.float64)
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        v = int(words[tile, c, lane, s])
                        for reg, (row, kk) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                            zero = float(z_all[16 * tile + row, group])
                            a[row, kk] = ((v >> (4 * reg)) & 0xF) - zero           # low half
                            a[row, kk + 1] = ((v >> (4 * reg + 16)) & 0xF) - zero  # high half
                        feats = xs[g + 8 * nb, 64 * c + 16 * t: 64 * c + 16 * t + 16]
                        b[2 * t: 2 * t + 2, g] = feats[4 * s: 4 * s + 2]          # word 2 s
                        b[2 * t + 8: 2 * t + 10, g] = feats[4 * s + 2: 4 * s + 4]  # word 2 s + 1
                    out += s_all[rows, group].double()[:, None] * (a @ b)
            for lane in range(32):
                g, t = divmod(lane, 4)
                for i in range(4):
                    row, channel = 8 * nb + 2 * t + (i & 1), g + 8 * (i >> 1)
                    # the kernel's store: paired rows go back to the layer's own channels, or (silu) the
                    # lane's gate sum (tile row g) and up sum (tile row g + 8) become one output
                    if silu:
                        if i < 2 and row < m:
                            gate, up = out[g, 2 * t + i], out[g + 8, 2 * t + i]
                            y[row, 8 * tile + g] = gate / (1 + torch.exp(-gate)) * up
                        continue
                    store = (i >> 1) * pair_half + 8 * tile + g if pair_half else 16 * tile + channel
                    if row < m:
                        y[row, store] = out[channel, 2 * t + (i & 1)]
    return y


@pytest.mark.parametrize("rows,group", [(1, 128), (5, 64), (13, 256)])
def test_lane_simulation_matches_float64(rows, group):
    n, k = 32, 256
    gen = torch.Generator().manual_seed(rows)
    weights = random_int_weights(n, k, 4, group, symmetric=False, act_order=False, device=torch.device("cpu"),
                                 generator=gen)
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    codes, scales = pack_mma_codes(weights.q), pack_mma_scales(weights.scales, weights.zeros)
    y = simulate_kernel(x, codes, scales, n)
    assert not torch.isnan(y).any()
    ref = reference_decode(x, codes, scales, n)                      # the same bfloat16 scales
    assert torch.allclose(y, ref, rtol=1e-12, atol=1e-12)
    file = x @ weights.dequantize(torch.float64).T
    assert ((y - file).abs().max() / file.abs().max()).item() < 4e-3


def test_paired_rows_put_gate_and_up_rows_in_one_tile():
    n = 64
    order = pair_rows(n)
    assert sorted(order.tolist()) == list(range(n))
    # tile 1: gate rows 8..15 as its rows 0..7, up rows 32 + 8..15 as its rows 8..15
    assert order[16:32].tolist() == list(range(8, 16)) + list(range(40, 48))
    with pytest.raises(ValueError, match="N % 16"):
        pair_rows(24)


@pytest.mark.parametrize("rows", [1, 6, 11])
def test_paired_rows_come_back_in_the_layers_channel_order(rows):
    """Packed in :func:`pair_rows` order, the lane simulation with the kernel's paired store gives the same
    outputs, channel for channel, as the layer packed in its own order."""
    n, k = 64, 128
    gen = torch.Generator().manual_seed(rows)
    weights = random_int_weights(n, k, 4, 64, symmetric=False, act_order=False, device=torch.device("cpu"),
                                 generator=gen)
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    order = pair_rows(n)
    paired = simulate_kernel(x, pack_mma_codes(weights.q[order]),
                             pack_mma_scales(weights.scales[order], weights.zeros[order]), n, pair_half=n // 2)
    plain = reference_decode(x, pack_mma_codes(weights.q), pack_mma_scales(weights.scales, weights.zeros), n)
    assert torch.allclose(paired, plain, rtol=1e-12, atol=1e-12)
    fused = simulate_kernel(x, pack_mma_codes(weights.q[order]),
                            pack_mma_scales(weights.scales[order], weights.zeros[order]), n, pair_half=n // 2,
                            silu=True)
    gate, up = plain[:, : n // 2], plain[:, n // 2:]
    assert torch.allclose(fused, torch.nn.functional.silu(gate) * up, rtol=1e-12, atol=1e-12)


def test_launcher_rejects_what_the_kernel_cannot_take():
    codes = pack_mma_codes(torch.zeros(32, 128, dtype=torch.uint8))
    scales = pack_mma_scales(torch.ones(32, 1), torch.zeros(32, 1))
    with pytest.raises(ValueError, match="1-16 rows"):
        mma_decode(torch.zeros(17, 128, dtype=torch.bfloat16), codes, scales, 32)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        mma_decode(torch.zeros(2, 128), codes, scales, 32)
    with pytest.raises(ValueError, match="do not hold"):
        mma_decode(torch.zeros(2, 192, dtype=torch.bfloat16), codes, scales, 32)
    with pytest.raises(ValueError, match="paired gate/up rows"):
        mma_decode(torch.zeros(2, 128, dtype=torch.bfloat16), codes, scales, 32, silu=True)


def test_launch_shrinks_to_the_shared_memory_there_is():
    limit = 100 * 1024
    assert fit_shared(8, 4, 1, 32, limit) == (8, 4)
    warps, stages = fit_shared(8, 16, 16, 112, limit)
    assert SCALE_BYTES * 112 + warps * stages * slot_bytes(16) <= limit and (warps, stages) == (8, 3)
