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
from test_distributed_helpers import ENGINE_KW, PROMPTS, children, greedy, run_greedy, save_family, wait_gone

from plinth import LLM, SamplingParams
from plinth.config import EngineConfig
from plinth.core.async_engine import EngineDeadError
from plinth.core.engine import LLMEngine


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_killed_worker_fails_requests_and_leaves_no_process(tmp_path, async_scheduling):
    path = save_family("llama", tmp_path)
    reference = run_greedy(LLMEngine(EngineConfig.from_kwargs(model=str(path), **ENGINE_KW)))
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor="mp", async_scheduling=async_scheduling,
              **ENGINE_KW)
    engine = llm.engine
    assert engine.async_scheduling == async_scheduling
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
    assert wait_gone(pids, 10.0) == []
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[0], greedy(), use_tqdm=False)
    engine.shutdown()   # idempotent


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ctrl_c_during_a_step_is_an_interrupt_not_a_worker_failure(tmp_path, monkeypatch, async_scheduling):
    """Ctrl-C in the driver while the workers compute a step (KeyboardInterrupt in its wait for their answers):
    ``LLM.generate`` raises KeyboardInterrupt, as with one process, not a worker failure. Synchronous steps: the
    workers finish the step (its answers read and dropped) and serve on, so the same LLM then gives the reference
    tokens. Asynchronous steps in flight: the workers stop, and a later call says the engine was interrupted."""
    import multiprocessing.connection as mpc

    path = save_family("llama", tmp_path)
    reference = run_greedy(LLMEngine(EngineConfig.from_kwargs(model=str(path), **ENGINE_KW)))
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor="mp", async_scheduling=async_scheduling,
              **ENGINE_KW)
    pids = llm.engine.executor.worker_pids
    real_wait, calls = mpc.wait, []

    def interrupting(objects, timeout=None):
        calls.append(1)
        if len(calls) == 5:   # inside a step's wait for the workers' answers
            raise KeyboardInterrupt
        return real_wait(objects, timeout)

    monkeypatch.setattr(mpc, "wait", interrupting)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    monkeypatch.setattr(mpc, "wait", real_wait)
    assert not llm.engine.has_unfinished_requests()
    if not async_scheduling:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [reference[f"r{i}"][0] for i in range(len(PROMPTS))]
        assert llm.engine.executor.worker_pids == pids and wait_gone(pids, 0.5) == pids
    else:
        with pytest.raises(EngineDeadError, match="interrupted while the workers were in the middle of a step"):
            llm.generate(PROMPTS[0], greedy(), use_tqdm=False)
        assert wait_gone(pids, 10.0) == []
    llm.close()
    assert wait_gone(pids, 10.0) == []


def test_ctrl_c_while_an_answer_is_being_read_stops_the_workers(tmp_path, monkeypatch):
    """Ctrl-C while the driver reads a worker's answer (a large one comes in several reads): that pipe may be in
    the middle of a message, so the workers are not trusted to be in step: they stop, and a later call says why
    (instead of the next step misreading the rest of the answer)."""
    import multiprocessing.connection as mpc

    path = save_family("llama", tmp_path)
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor="mp", **ENGINE_KW)
    pids = llm.engine.executor.worker_pids
    real, calls = mpc.Connection.recv_bytes, []

    def interrupting(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(mpc.Connection, "recv_bytes", interrupting)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    monkeypatch.setattr(mpc.Connection, "recv_bytes", real)
    with pytest.raises(EngineDeadError, match="interrupted while the workers were in the middle of a step"):
        llm.generate(PROMPTS[0], greedy(), use_tqdm=False)
    assert wait_gone(pids, 10.0) == []
    llm.close()


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
    assert wait_gone(pids, 10.0) == []


_CTRL_C_DRIVER = """
import time
from plinth.distributed.executor_mp import WorkerProcesses
if __name__ == "__main__":
    procs = WorkerProcesses(2)
    try:
        print(" ".join(map(str, procs.pids)), flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        procs.stop()
        print("stopped", flush=True)
"""


def _python_handles_sigint(pid: int) -> bool:
    """Whether process ``pid`` catches or ignores SIGINT (a Python interpreter past its start does one or the other)."""
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    return bool((int(status["SigCgt"], 16) | int(status["SigIgn"], 16)) & (1 << (signal.SIGINT - 1)))


def test_ctrl_c_while_the_workers_start_interrupts_only_the_driver(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the whole process group) while the workers still import their modules, before
    they ignore it: the driver is interrupted and stops them, and no worker prints a KeyboardInterrupt traceback."""
    script = tmp_path / "driver.py"
    script.write_text(_CTRL_C_DRIVER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        deadline = time.monotonic() + 30.0   # each worker's interpreter is up (it would turn SIGINT into an exception)
        while not all(map(_python_handles_sigint, pids)) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "stopped" in out, err
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err
    assert len(pids) == 2 and wait_gone(pids, 10.0) == []


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
        workers = children(server.proc.pid, "spawn_main")
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60.0)
        assert r.status_code == 503 and "killed by SIGKILL" in r.text, r.text
        assert httpx.get(f"{server.base_url}/health", timeout=10.0).status_code == 503
        server.terminate()
        assert server.wait(30.0) == 0
    assert wait_gone(workers, 10.0) == []


def server_model(server) -> str:
    import httpx

    return httpx.get(f"{server.base_url}/v1/models", timeout=10.0).json()["data"][0]["id"]


# ------------------------------------------------------------------------------------------ shutdown


def _tp2_kwargs() -> dict:
    return dict(ENGINE_KW, tensor_parallel_size=2, distributed_executor="mp")


def test_llm_close_and_deletion_stop_the_workers(tmp_path):
    path = save_family("llama", tmp_path)
    with LLM(str(path), **_tp2_kwargs()) as llm:
        pids = llm.engine.executor.worker_pids
        assert len(pids) == 2 and wait_gone(pids, 0.0) == pids
        llm.generate(PROMPTS[1], greedy(), use_tqdm=False)
    assert wait_gone(pids, 10.0) == []
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[1], greedy(), use_tqdm=False)
    llm.close()   # idempotent

    llm = LLM(str(path), **_tp2_kwargs())
    pids = llm.engine.executor.worker_pids
    del llm   # the engine is referenced nowhere else: its workers stop with it
    assert wait_gone(pids, 10.0) == []


def test_async_front_stops_the_workers_of_the_engine_it_owns(tmp_path):
    """A front built from a config owns its engine: shutdown stops the worker processes. A front given
    an engine leaves it running: the caller can step it again (the server tests rely on that)."""
    import asyncio

    from plinth.core.async_engine import AsyncLLMEngine

    path = save_family("llama", tmp_path)
    config = EngineConfig.from_kwargs(model=str(path), **_tp2_kwargs())

    async def one(front: AsyncLLMEngine, rid: str) -> list[int]:
        final = None
        async for out in front.generate(rid, PROMPTS[1], greedy()):
            final = out
        return final.outputs[0].token_ids

    owning = AsyncLLMEngine.from_config(config)
    pids = owning._engine.executor.worker_pids
    expected = asyncio.run(one(owning, "a"))
    assert len(expected) == 10
    start = time.monotonic()
    owning.shutdown(timeout_s=30.0)
    assert wait_gone(pids, 10.0) == [] and time.monotonic() - start < 30.0
    assert not owning.is_healthy

    engine = LLMEngine(config)
    pids = engine.executor.worker_pids
    borrowing = AsyncLLMEngine(engine)
    assert asyncio.run(one(borrowing, "b")) == expected
    borrowing.shutdown()
    assert wait_gone(pids, 0.5) == pids   # still running
    assert run_greedy(engine, prompts=[PROMPTS[1]])["r0"][0] == expected   # and reusable
    engine.shutdown()
    assert wait_gone(pids, 10.0) == []


def test_async_front_shutdown_stops_workers_stuck_in_a_step(tmp_path):
    """A worker that stops answering (SIGSTOP) leaves the loop inside a step: shutdown still returns in
    bounded time, stops every worker, and the stuck request ends with an error."""
    import asyncio

    from plinth.core.async_engine import AsyncLLMEngine

    path = save_family("llama", tmp_path)
    front = AsyncLLMEngine.from_config(EngineConfig.from_kwargs(model=str(path), **_tp2_kwargs()))
    pids = front._engine.executor.worker_pids
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def stuck() -> BaseException | None:
        stopped = False
        try:
            async for out in front.generate("s", PROMPTS[0], params):
                if not stopped and len(out.outputs[0].token_ids) >= 2:
                    stopped = True
                    os.kill(pids[1], signal.SIGSTOP)
                    await asyncio.sleep(1.0)   # the loop, stepping the running request, is now stuck
                    await asyncio.get_running_loop().run_in_executor(None, front.shutdown, True, 1.0)
        except EngineDeadError as exc:
            return exc
        return None

    start = time.monotonic()
    try:
        error = asyncio.run(asyncio.wait_for(stuck(), 60.0))
    finally:
        for pid in pids:   # never leave a stopped process behind, whatever happened
            if wait_gone([pid], 0.0):
                os.kill(pid, signal.SIGKILL)
    elapsed = time.monotonic() - start
    assert wait_gone(pids, 10.0) == []
    assert elapsed < 30.0, f"shutting down a stuck engine took {elapsed:.1f} s"
    assert isinstance(error, EngineDeadError)
    assert not front.is_healthy and not front._thread.is_alive()


@pytest.mark.server
def test_serve_sigterm_stops_tensor_parallel_workers(tmp_path):
    """``plinth serve -tp 2`` answers, then SIGTERM ends it with status 0 and no worker left."""
    import httpx
    from server_utils import make_tiny_model, running_server

    path = make_tiny_model(tmp_path / "model", max_position_embeddings=256)
    args = [str(path), "--dtype", "float32", "--block-size", "4", "--tensor-parallel-size", "2",
            "--distributed-executor", "mp"]
    with running_server(args) as server:
        body = {"model": server_model(server), "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60.0).status_code == 200
        workers = children(server.proc.pid, "spawn_main")
        assert len(workers) == 2, workers
        server.terminate()
        assert server.wait(30.0) == 0
    assert wait_gone(workers, 10.0) == []


def test_a_user_error_in_the_workers_is_one_line(tmp_path):
    """A configuration the workers refuse while loading (a quantization method the checkpoint does not have) ends
    ``plinth generate -tp 2`` with the one-line error of one process, no worker traceback."""
    from server_utils import make_tiny_model

    path = make_tiny_model(tmp_path / "model", max_position_embeddings=256)
    done = subprocess.run([sys.executable, "-m", "plinth", "generate", str(path), "--prompt", "hi", "--max-tokens",
                           "2", "--quantization", "gptq", "--tensor-parallel-size", "2", "--distributed-executor",
                           "mp"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "failed:" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("plinth generate: error: quantization method 'gptq'")

def test_worker_timeouts_from_the_environment(monkeypatch):
    """``PLINTH_WORKER_STEP_TIMEOUT_S`` / ``_START_TIMEOUT_S``: positive seconds up to a week; ``inf``, ``nan`` and
    1e300 are configuration errors naming the variable (they overflowed the waits, a traceback in a worker)."""
    from plinth.config import ConfigError
    from plinth.distributed.executor import STEP_TIMEOUT_ENV, env_seconds

    monkeypatch.setenv(STEP_TIMEOUT_ENV, "90.5")
    assert env_seconds(STEP_TIMEOUT_ENV, 1.0) == 90.5
    monkeypatch.delenv(STEP_TIMEOUT_ENV)
    assert env_seconds(STEP_TIMEOUT_ENV, 7.0) == 7.0
    for bad in ("inf", "nan", "1e300", "0", "-3", "soon"):
        monkeypatch.setenv(STEP_TIMEOUT_ENV, bad)
        with pytest.raises(ConfigError, match=STEP_TIMEOUT_ENV):
            env_seconds(STEP_TIMEOUT_ENV, 1.0)


def test_reading_a_step_after_a_shutdown_from_another_thread_says_so():
    """``LLM.close()`` from another thread while asynchronous steps are awaited: the reader is told the executor
    was shut down (it failed with ``IndexError: pop from an empty deque``, reported as a worker failure)."""
    import collections

    from plinth.distributed.executor import WorkerDiedError
    from plinth.distributed.executor_mp import MultiprocExecutor

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._closed, executor._unread = True, collections.deque()   # as shutdown() leaves them
    with pytest.raises(WorkerDiedError, match="the executor was shut down"):
        executor._read_answer()
