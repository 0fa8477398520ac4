"""Start-up time of ``plinth serve`` (to the first ``/health`` 200) and ``plinth generate`` (one token).

    python benchmarks/startup_time.py --runs 3                  # warm caches, the checkout on PYTHONPATH
    python benchmarks/startup_time.py --cold --runs 3           # every run with an empty cache directory
    python benchmarks/startup_time.py --root /path/to/checkout  # another revision, for a before/after

Warm: one unrecorded run fills the cache directory (``--cache-dir``, default plinth's own), then each
recorded run starts with it. Cold: each run gets an empty cache directory (no tokenizer, selection or
int4 caches; the model file itself comes from ``$PLINTH_DEFAULT_MODEL`` or plinth's model cache, so
nothing is downloaded; the operating system's page cache is not dropped). The load average is printed
before each run: other work on the machine slows a start down.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(root: Path, cache_dir: str | None, model: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PLINTH_DEFAULT_MODEL"] = model
    if cache_dir is not None:
        env["PLINTH_CACHE_DIR"] = cache_dir
    return env


def time_serve(python: str, env: dict[str, str], timeout_s: float, log: Path) -> float:
    """Seconds from spawning ``plinth serve`` to its first ``/health`` 200."""
    port = _free_port()
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([python, "-m", "plinth.entrypoints.cli", "serve", "--port", str(port)],
                                env=env, cwd=env["PYTHONPATH"].split(os.pathsep)[0], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"plinth serve exited with status {proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return time.perf_counter() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.02)
        raise RuntimeError(f"plinth serve not healthy after {timeout_s:.0f} s; see {log}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def time_generate(python: str, env: dict[str, str], timeout_s: float, log: Path) -> float:
    """Seconds of a whole ``plinth generate`` run of one prompt and one new token."""
    start = time.perf_counter()
    with open(log, "w") as out:
        subprocess.run([python, "-m", "plinth.entrypoints.cli", "generate", "--prompt", "Hello", "--max-tokens", "1"],
                       env=env, cwd=env["PYTHONPATH"].split(os.pathsep)[0], stdout=out, stderr=subprocess.STDOUT,
                       timeout=timeout_s, check=True)
    return time.perf_counter() - start


def _python_facts(python: str, root: Path) -> tuple[str, str]:
    """The default model's path and where ``plinth`` is imported from, as the timed runs see them
    (``python -m`` puts the working directory first on ``sys.path``, so runs start in ``root``)."""
    env = dict(os.environ, PYTHONPATH=str(root))
    code = ("import plinth; from plinth.model_registry.default_model import default_model_path; "
            "print(default_model_path()); print(plinth.__file__)")
    lines = subprocess.run([python, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    return lines[-2], lines[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout to time (default: this one)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="an empty cache directory for every run")
    parser.add_argument("--cache-dir", default=None, help="warm runs: the cache directory (default: plinth's)")
    parser.add_argument("--what", choices=["serve", "generate", "both"], default="both")
    parser.add_argument("--no-prime", action="store_true", help="warm runs: the caches are already filled")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    model, package = _python_facts(args.python, args.root)
    model = os.environ.get("PLINTH_DEFAULT_MODEL") or model
    print(f"timing plinth from {os.path.dirname(package)}, model {model}", flush=True)
    commands = {"serve": time_serve, "generate": time_generate}
    wanted = list(commands) if args.what == "both" else [args.what]
    with tempfile.TemporaryDirectory(prefix="plinth-startup-") as tmp:
        log = Path(tmp) / "run.log"
        for name in wanted:
            timer = commands[name]
            if not args.cold and not args.no_prime:
                timer(args.python, _env(args.root, args.cache_dir, model), args.timeout, log)  # fills the caches
            times = []
            for i in range(args.runs):
                cache = tempfile.mkdtemp(dir=tmp) if args.cold else args.cache_dir
                load = os.getloadavg()[0]
                seconds = timer(args.python, _env(args.root, cache, model), args.timeout, log)
                times.append(seconds)
                print(f"{name} {'cold' if args.cold else 'warm'} run {i + 1}: {seconds:.2f} s "
                      f"(load average {load:.2f} before)", flush=True)
            print(f"{name} {'cold' if args.cold else 'warm'}: best {min(times):.2f} s, "
                  f"median {statistics.median(times):.2f} s over {len(times)} runs ({args.root})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
