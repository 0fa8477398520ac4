"""One worker process per rank on this machine (``--distributed-executor mp``).

The driver (the engine's process) spawns the workers with torch.multiprocessing's ``spawn``
start method and talks to each over a pipe: every step it pickles the batch once
(:class:`~plinth.distributed.messages.StepBatch`, a few numpy arrays) and writes the same
bytes to every pipe; each worker answers once per call, the output rank with the logits.
The ranks meet through a ``TCPStore`` the driver hosts on the loopback interface.

Failure handling: the driver waits on the pipes and on the process sentinels together, with
a deadline, so a worker that dies (or an answer that never comes) is noticed at once and
turns into :class:`~plinth.distributed.executor.WorkerDiedError`; the other workers are then
stopped (``shutdown`` message, then SIGTERM, then SIGKILL, each with a bounded wait). Each
worker watches its parent and exits when the driver is gone, so no worker outlives it.

Programs that create an engine with this executor must guard their entry point with
``if __name__ == "__main__":`` (the ``spawn`` method imports the main module in each worker).
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from typing import Any

from plinth.config import ConfigError, EngineConfig
from plinth.distributed.executor import STEP_TIMEOUT_ENV, DistributedExecutor, WorkerDiedError

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 5.0
_HOST = "127.0.0.1"


class MultiprocExecutor(DistributedExecutor):
    """Spawned worker processes on this machine, one per rank (and per device on accelerators).

    Raises:
        ConfigError: more ranks than this machine has devices (CPUs accept any count).
    """

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        from plinth.platforms.selection import select_platform

        platform = select_platform(config.device.platform)
        if platform.device_type != "cpu" and platform.device_count() < self.world_size:
            raise ConfigError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} needs "
                              f"{self.world_size} {platform.name} devices; this machine has "
                              f"{platform.device_count()}")
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._conns, SHUTDOWN_WAIT_S)
        self._start()

    # ------------------------------------------------------------------------------------ start

    def _start_workers(self) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self._store = dist.TCPStore(_HOST, 0, None, is_master=True, wait_for_workers=False,
                                    timeout=_td(self.start_timeout_s))
        port = self._store.port
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, name=f"plinth-worker-{rank}",
                               args=(self.config, rank, rank, child, port, os.getpid(), self.step_timeout_s))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._call_all("init_distributed", timeout_s=self.start_timeout_s)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ------------------------------------------------------------------------------------ calls

    def _call_all(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        return self._call(range(self.world_size), method, args, timeout_s)

    def _call_one(self, rank: int, method: str, *args: Any, timeout_s: float) -> Any:
        return self._call([rank], method, args, timeout_s)[0]

    def _call(self, ranks: Any, method: str, args: tuple, timeout_s: float) -> list[Any]:
        self._check_alive()
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for r in ranks:
            try:
                self._conns[r].send_bytes(payload)
            except OSError as exc:
                raise self._died(r, f"its pipe is closed ({exc})") from exc
        pending = {self._conns[r]: r for r in ranks}
        sentinels = {self._procs[r].sentinel: r for r in range(self.world_size)}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready = mpc.wait([*pending, *sentinels], timeout=max(0.0, left))
            if not ready:
                waiting = ", ".join(str(r) for r in sorted(pending.values()))
                raise WorkerDiedError(f"worker(s) {waiting} did not answer {method!r} within {timeout_s:.0f} s "
                                      f"(${STEP_TIMEOUT_ENV} raises the limit)")
            for obj in ready:   # answers first: a worker may answer and then exit
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        status, value = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError) as exc:
                        raise self._died(rank, "its pipe closed") from exc
                    if status == "error":
                        raise value
                    results[rank] = value
            for obj in ready:   # then deaths: any dead rank leaves the others stuck in collectives
                if obj in sentinels:
                    raise self._died(sentinels[obj], "")
        return [results[r] for r in ranks]

    def _died(self, rank: int, detail: str) -> WorkerDiedError:
        proc = self._procs[rank]
        proc.join(0.5)
        code = proc.exitcode
        if code is None:
            how = "stopped answering"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        par = self.config.parallel
        tp, pp = rank % par.tensor_parallel_size, rank // par.tensor_parallel_size
        msg = f"worker {rank} (pid {proc.pid}, tp rank {tp}, pp rank {pp}) {how}"
        return WorkerDiedError(f"{msg}: {detail}" if detail else msg)

    # ------------------------------------------------------------------------------------ stop

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self._store = None


def _td(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def _stop_processes(procs: list[Any], conns: list[Any], wait_s: float) -> None:
    """Ask every worker to stop, then SIGTERM, then SIGKILL what is left; reap them all."""
    shutdown = pickle.dumps(("shutdown", ()))
    for conn, proc in zip(conns, procs, strict=False):
        if proc.is_alive():
            try:
                conn.send_bytes(shutdown)
            except OSError:
                pass   # its pipe is already gone: the signals below stop it
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for conn in conns:
        conn.close()


# ---------------------------------------------------------------------------------- worker side


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker as soon as the driver that started it is gone."""
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="plinth-parent-watch", daemon=True).start()


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure means: send a plain description instead
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _worker_main(config: EngineConfig, rank: int, device_index: int, conn: Any, port: int, parent_pid: int,
                 timeout_s: float) -> None:
    _watch_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the driver, which stops the workers
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # the ranks of one machine talk over loopback
    logging.basicConfig(level=logging.getLogger().level or logging.WARNING)
    from plinth.distributed.parallel_state import destroy_parallel_state

    worker: Any = None
    init_error: BaseException | None = None
    try:
        from plinth.distributed.worker import Worker

        worker = Worker(config, rank, device_index)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver on its first call
        init_error = exc
    try:
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return   # the driver is gone
            if method == "shutdown":
                return
            try:
                if init_error is not None:
                    raise init_error
                if method == "init_distributed":
                    import torch.distributed as dist

                    store = dist.TCPStore(_HOST, port, None, is_master=False, timeout=_td(timeout_s))
                    args = (store, timeout_s)
                reply = ("ok", getattr(worker, method)(*args))
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
                logger.error("worker %d: %s failed:\n%s", rank, method, traceback.format_exc())
                reply = ("error", _picklable(exc))
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        destroy_parallel_state()
