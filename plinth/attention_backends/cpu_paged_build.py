"""Build and load the native CPU paged-attention kernel (``csrc/cpu_paged_attention.cpp``).

Built at first use by :mod:`plinth.kernels.native_build` (the system C++ compiler with OpenMP, into
``plinth.config.cache_dir() / "cpu_paged"``, reused by later processes). :func:`load_kernel` never
raises for a missing compiler or a failed build: it returns a build whose ``reason`` says what went
wrong, for ``supports()`` to show.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from plinth.kernels.native_build import NativeBuild, build_and_open

SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_attention.cpp"
#: the ABI the Python side expects (``plinth_cpu_paged_abi()`` in the source)
ABI_VERSION = 6

KernelBuild = NativeBuild


@functools.cache
def load_kernel() -> NativeBuild:
    """The kernel library, built on first use (once per process; later processes load the build).

    Returns:
        A :class:`~plinth.kernels.native_build.NativeBuild`; ``library`` is None and ``reason`` says
        why when there is no C++ compiler or the build fails.
    """
    build = build_and_open(SOURCE, "cpu_paged", "plinth_cpu_paged_abi", ABI_VERSION, "CPU paged-attention kernel")
    if build.library is not None:
        fn = build.library.plinth_cpu_paged_decode
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 10 + [ctypes.c_double] + [ctypes.c_int64] * 2
        fn = build.library.plinth_cpu_paged_prefill
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 10 + [ctypes.c_double] + [ctypes.c_int64] * 2
        for name in ("plinth_cpu_paged_has_fp8", "plinth_cpu_paged_has_f32_bf16"):
            fn = getattr(build.library, name)
            fn.restype = ctypes.c_int64
            fn.argtypes = []
        fn = build.library.plinth_cpu_gather_e4m3   # cache half, table, tokens, block size, row, out, threads
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int64]
        fn = build.library.plinth_cpu_amx_prefill
        fn.restype = ctypes.c_int64
        p, i = ctypes.c_void_p, ctypes.c_int64   # query, q_row, key, value, kv_row, out, out_row, L, S, H, Hkv, D
        fn.argtypes = [p, i, p, p, i, p, i, i, i, i, i, i, ctypes.c_double, i]
        fn = build.library.plinth_cpu_paged_decode_amx_heads   # heads, KV heads, head size, block size
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_int64] * 4
        fn = build.library.plinth_cpu_paged_set_decode_amx
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_int64]
        from plinth.kernels.cpu_native import amx_switch_on

        fn(1 if amx_switch_on() else 0)   # PLINTH_CPU_AMX=0 keeps decode on AVX512 vectors too
    return build
