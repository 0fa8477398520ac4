"""Shared set-up of the test modules that run Triton kernels in Triton's CPU interpreter.

Triton decides between compiling and interpreting when a kernel module is imported, so each such test
module imports its kernels with ``TRITON_INTERPRET=1`` set (:func:`import_interpreted`); when Triton was
already imported compiled earlier in the session, the module's tests are skipped and
:func:`run_in_fresh_process` runs the whole file again in a fresh interpreter instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

_VARS = ("TRITON_INTERPRET", "PLINTH_TRITON_INTERPRET")


def import_interpreted(load_kernel: Callable[[], object]) -> bool:
    """Import Triton and ``load_kernel()``'s kernel with the interpreter on; False if Triton was imported
    compiled before (the kernel is then not an interpreted function)."""
    saved = {k: os.environ.get(k) for k in _VARS}
    for k in _VARS:
        os.environ[k] = "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(tl.zeros, InterpretedFunction) and isinstance(load_kernel(), InterpretedFunction)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def interpreter_usable(interpreted: bool) -> bool:
    """The module's kernels were imported interpreted and Triton's language functions still are
    interpreted functions now (checked when each test starts, not only at collection)."""
    if not interpreted:
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction) and isinstance(tl.zeros, InterpretedFunction)


def needs(interpreted: bool) -> pytest.MarkDecorator:
    """Skip a test when the kernels cannot run interpreted in this process (test_in_a_fresh_process
    covers the module then)."""
    return pytest.mark.skipif(f"not interpreter_usable({interpreted})",
                              reason="triton runs compiled in this process; see test_in_a_fresh_process")


#: the test files whose kernels run in the interpreter: one fresh process runs them all (a process's start-up
#: and Triton's imports once, not once per file)
INTERPRETED_FILES = ("test_triton_ops.py", "test_triton_attention.py", "test_quantization_triton.py")
_runs: dict[tuple[str, ...], subprocess.CompletedProcess] = {}


def run_in_fresh_process(path: str, interpreted: bool) -> None:
    """Run the test file ``path`` in a new interpreter with the interpreter variables set, unless its
    kernels run interpreted in this process (then the module's own tests cover them). The first of the
    :data:`INTERPRETED_FILES` to ask runs them all in one process; each passes if none of its own tests failed."""
    if interpreter_usable(interpreted):
        pytest.skip("the kernels run interpreted in this process")
    here, name = os.path.split(os.path.abspath(path))
    files = tuple(os.path.join(here, f) for f in INTERPRETED_FILES) if name in INTERPRETED_FILES else (path,)
    done = _runs.get(files)
    if done is None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PY_COLORS", "FORCE_COLOR")}
        env.update(TRITON_INTERPRET="1", PLINTH_TRITON_INTERPRET="1")
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "--color=no", "-o", "addopts=",
                                   "-p", "no:cacheprovider", *files],
                                  env=env, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired as exc:   # (kept: the other files do not start it again)
            done = subprocess.CompletedProcess(exc.cmd, -1, str(exc.stdout or ""), f"timed out after {exc.timeout} s")
        _runs[files] = done
    report = done.stdout[-6000:] + done.stderr[-2000:]
    if done.returncode == 1:   # some tests failed: this file's own? ('FAILED path::test - ...', 'ERROR path - ...')
        mine = [line for line in done.stdout.splitlines()
                if line.startswith(("FAILED", "ERROR")) and (f"{name}::" in line or f"{name} " in line)]
        assert not mine, "\n".join(mine) + "\n" + report
    else:
        assert done.returncode == 0, report


def set_interpreter_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter variables for one test's duration (kernels read them when launched)."""
    for k in _VARS:
        monkeypatch.setenv(k, "1")
