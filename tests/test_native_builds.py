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


CHECK = """
import sys
from pathlib import Path
from plinth.kernels.native_build import build_and_open
source = Path(sys.argv[1])
build = build_and_open(source, "integrity_test", "integrity_abi", 7, "test kernel")
print("library" if build.library is not None else "none", "|", build.reason)
"""


def test_a_damaged_build_is_built_again_not_loaded(tmp_path):
    """A cached library that no longer matches the checksum its build wrote (truncated by a crash or a full disk)
    is compiled again instead of handed to the dynamic loader, which dies on it (SIGBUS); a library without the
    ABI entry point is a reason, not a traceback."""
    import os
    import subprocess
    import sys

    if compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    source = tmp_path / "k.cpp"
    source.write_text('#include <cstdint>\nextern "C" int64_t integrity_abi() { return 7; }\n')
    env = {**os.environ, "PLINTH_CACHE_DIR": str(tmp_path / "cache")}

    def build() -> subprocess.CompletedProcess:   # in a process of its own: this one never maps the library
        return subprocess.run([sys.executable, "-c", CHECK, str(source)], env=env, capture_output=True, text=True,
                              timeout=120)

    first = build()
    assert first.returncode == 0 and first.stdout.startswith("library |"), first.stderr[-2000:]
    [library] = (tmp_path / "cache" / "integrity_test").glob("*.so")
    assert library.with_name(library.name + ".sha256").is_file()
    # readable (and loadable) by the cache's other users: mkstemp's file was private (0600) before
    from plinth.config import shared_mode

    assert library.stat().st_mode & 0o777 == shared_mode(0o755)
    assert library.with_name(library.name + ".sha256").stat().st_mode & 0o777 == shared_mode(0o644)
    os.truncate(library, 4096)
    again = build()
    assert again.returncode == 0 and again.stdout.startswith("library |"), again.stderr[-2000:]
    assert library.stat().st_size > 4096
    source.write_text('#include <cstdint>\nextern "C" int64_t other_name() { return 7; }\n')   # a new build
    lacking = build()
    assert lacking.returncode == 0 and lacking.stdout.startswith("none | cannot load"), lacking.stderr[-2000:]
    assert "integrity_abi" in lacking.stdout
