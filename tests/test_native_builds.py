"""The native CPU libraries build wherever a C++ compiler exists: their tests skip when a library is missing,
so a source that stopped compiling would otherwise pass unnoticed (and run the torch fallbacks)."""

from __future__ import annotations

import pytest

from plinth.kernels import cpu_native
from plinth.kernels.native_build import compiler


def test_the_cpu_ops_library_builds_where_a_compiler_exists():
    if compiler() is None:
        pytest.skip("no C++ compiler on this machine: the native CPU ops are off here")
    build = cpu_native.load_library()
    assert build.library is not None, build.reason
