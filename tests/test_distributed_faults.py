"""Worker failures: a killed worker fails the in-flight requests with a clear error and the engine
shuts down within a bounded time, leaving no process; workers exit when their driver dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_distributed_helpers import ENGINE_KW, PROMPTS, greedy, run_greedy, save_family

from plinth import LLM, SamplingParams
from plinth.config import EngineConfig
from plinth.core.async_engine import EngineDeadError
from plinth.core.engine import LLMEngine


def _gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for a parent that is not us)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


def test_killed_worker_fails_requests_and_leaves_no_process(tmp_path):
    path = save_family("llama", tmp_path)
    reference = run_greedy(LLMEngine(EngineConfig.from_kwargs(model=str(path), **ENGINE_KW)))
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor="mp", **ENGINE_KW)
    engine = llm.engine
    pids = engine.executor.worker_pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    # the plain LLM path over worker processes works first
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[f"r{i}"][0] for i in range(len(PROMPTS))]

    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"k{i}", prompt, params)
    engine.step()
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker 1 \(pid \d+, tp rank 1, pp rank 0\) was killed by SIGKILL") \
            as info:
        for _ in range(50):
            engine.step()
    elapsed = time.monotonic() - start
    assert elapsed < 20.0, f"noticing the dead worker and stopping the rest took {elapsed:.1f} s"
    failed = info.value.outputs
    assert sorted(o.request_id for o in failed) == [f"k{i}" for i in range(len(PROMPTS))]
    assert all(o.finished and "killed by SIGKILL" in (o.error or "") for o in failed)
    lengths = [len(o.outputs[0].token_ids) for o in failed]
    assert max(lengths) > 0 and max(lengths) < 200, lengths   # they were in flight, not finished
    assert _wait_gone(pids, 10.0) == []
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[0], greedy(), use_tqdm=False)
    engine.shutdown()   # idempotent


_DRIVER = """
import os, signal, sys
from plinth.distributed.executor_mp import WorkerProcesses
if __name__ == "__main__":
    procs = WorkerProcesses(2)
    pids = procs.call([0, 1], "__pid__", (), 120.0)
    print(" ".join(map(str, pids)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_exit_when_their_driver_dies(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    assert _wait_gone(pids, 10.0) == []


def _children(pid: int, marker: str) -> list[int]:
    """Processes whose parent is ``pid`` and whose command line contains ``marker``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and marker in cmdline:
            out.append(int(entry.name))
    return sorted(out)


@pytest.mark.server
def test_serve_with_tensor_parallel_workers_and_a_dead_worker(tmp_path):
    """``plinth serve --tensor-parallel-size 2`` answers like one process; a killed worker turns
    requests into 503s and /health unhealthy; SIGTERM then stops the server and leaves no worker."""
    import httpx
    from server_utils import make_tiny_model, running_server

    path = make_tiny_model(tmp_path / "model", max_position_embeddings=256)
    prompt = "The quick brown fox"
    expected = LLM(str(path), dtype="float32", block_size=4).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    args = [str(path), "--dtype", "float32", "--block-size", "4", "--tensor-parallel-size", "2",
            "--distributed-executor", "mp"]
    with running_server(args) as server:
        body = {"model": server_model(server), "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60.0)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        workers = _children(server.proc.pid, "spawn_main")
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60.0)
        assert r.status_code == 503 and "killed by SIGKILL" in r.text, r.text
        assert httpx.get(f"{server.base_url}/health", timeout=10.0).status_code == 503
        server.terminate()
        assert server.wait(30.0) == 0
    assert _wait_gone(workers, 10.0) == []


def server_model(server) -> str:
    import httpx

    return httpx.get(f"{server.base_url}/v1/models", timeout=10.0).json()["data"][0]["id"]
