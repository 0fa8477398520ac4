"""One worker process per rank on this machine (``--distributed-executor mp``).

The driver (the engine's process) spawns the workers with torch.multiprocessing's ``spawn``
start method and talks to each over a pipe: every step it pickles the batch once
(:class:`~plinth.distributed.messages.StepBatch`, a few numpy arrays) and writes the same
bytes to every pipe; each worker answers once per call, the output rank with the sampled tokens.
Under asynchronous scheduling (TP-only layouts) a step goes out as ``launch`` without waiting, and the
answers to each launch carry the previous launched step's output (a ``collect`` asks for the last one),
so the pipes and the driver's work overlap the device's. The ranks meet through a ``TCPStore`` the
driver hosts on the loopback interface.

Failure handling: the driver waits on the pipes and on the process sentinels together, with
a deadline, so a worker that dies (or an answer that never comes) is noticed at once and
turns into :class:`~plinth.distributed.executor.WorkerDiedError`; the other workers are then
stopped (``shutdown`` message, then SIGTERM, then SIGKILL, each with a bounded wait). Each
worker watches its parent and exits when the driver is gone, so no worker outlives it.

Programs that create an engine with this executor must guard their entry point with
``if __name__ == "__main__":`` (the ``spawn`` method imports the main module in each worker).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
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

import torch

from plinth.config import ConfigError, EngineConfig
from plinth.distributed.executor import (
    INTERRUPT_DRAIN_S,
    STEP_TIMEOUT_ENV,
    DistributedExecutor,
    MakeSamplingBatch,
    PendingStep,
    WorkerDiedError,
)
from plinth.distributed.messages import StepBatch, pack_tensors, unpack_tensors
from plinth.errors import UserFacingError
from plinth.worker.batching import FlatBatch

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 5.0
DRAIN_WAIT_S = 5.0   # after one rank fails a call, how long the others may take to answer it too
_HOST = "127.0.0.1"


class _CallFailed(Exception):
    """A worker raised; ``in_sync``: every other worker's answer to the same call was read."""

    def __init__(self, error: BaseException, in_sync: bool):
        super().__init__(str(error))
        self.error = error
        self.in_sync = in_sync


class WorkerProcesses:
    """``size`` spawned worker processes, process ``i`` serving rank ``i``; each has a pipe.

    An executor normally owns its processes and stops them on shutdown. Processes created
    separately can serve several executors one after another (each releases its ranks on
    shutdown), which saves the start-up of a process (importing torch) per engine.

    Args:
        size: the number of processes.
        timeout_s: the bound on each worker's connection to the ranks' rendezvous store.
    """

    def __init__(self, size: int, timeout_s: float = 600.0):
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, self.conns, SHUTDOWN_WAIT_S)
        for index in range(size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, name=f"plinth-worker-{index}",
                               args=(index, child, os.getpid(), timeout_s))
            with _sigint_blocked():   # (inherited: a Ctrl-C while the worker starts is no traceback there)
                proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.broken = False

    def __len__(self) -> int:
        return len(self.procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, ranks: Any, method: str, args: tuple, timeout_s: float, describe: Any = None) -> list[Any]:
        """Send ``(method, args)`` to the processes ``ranks`` and wait for every answer.

        Raises:
            WorkerDiedError: a process died, its pipe closed, or an answer did not come in time.
            the worker's own exception, when the call raised there.
        """
        ranks = list(ranks)
        self.send(ranks, method, args, describe)
        return self.receive(ranks, method, timeout_s, describe)

    def send(self, ranks: Any, method: str, args: tuple, describe: Any = None) -> None:
        """Send ``(method, args)`` to the processes ``ranks`` without waiting; read the answers, in order,
        with :meth:`receive`.

        Raises:
            WorkerDiedError: a pipe is closed.
        """
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for r in ranks:
                try:
                    self.conns[r].send_bytes(payload)
                except OSError as exc:
                    raise self._died(r, f"its pipe is closed ({exc})", describe) from exc
        except BaseException:
            self.broken = True
            raise

    def receive(self, ranks: Any, method: str, timeout_s: float, describe: Any = None) -> list[Any]:
        """The next answer of every process ``ranks`` (to a call of ``method``, sent before), in rank order.

        Raises:
            WorkerDiedError: a process died, its pipe closed, or an answer did not come in time.
            the worker's own exception, when the call raised there.
        """
        ranks = list(ranks)
        pending = {self.conns[r]: r for r in ranks}
        reading = None
        try:
            sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
            results: dict[int, Any] = {}
            deadline = time.monotonic() + timeout_s
            while pending:
                ready = mpc.wait([*pending, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    waiting = ", ".join(str(r) for r in sorted(pending.values()))
                    raise WorkerDiedError(f"worker(s) {waiting} did not answer {method!r} within {timeout_s:.0f} s "
                                          f"(${STEP_TIMEOUT_ENV} raises the limit)")
                for obj in ready:   # answers first: a worker may answer and then exit
                    if obj in pending:
                        rank = pending[obj]
                        reading = obj   # (an interrupt in the middle of an answer leaves its pipe out of step)
                        try:
                            data = obj.recv_bytes()
                        except (EOFError, OSError) as exc:
                            raise self._died(rank, "its pipe closed", describe) from exc
                        del pending[obj]
                        reading = None
                        status, value = pickle.loads(data)
                        if status == "error":
                            # a collective that failed because a peer died: report the death, the cause
                            dead = mpc.wait(list(sentinels), timeout=1.0)
                            if dead:
                                raise self._died(sentinels[dead[0]], f"worker {rank} then failed "
                                                 f"({type(value).__name__})", describe) from value
                            in_sync = self._drain(pending, DRAIN_WAIT_S)
                            raise _CallFailed(value, in_sync)
                        results[rank] = value
                for obj in ready:   # then deaths: a dead rank leaves the others stuck in collectives
                    if obj in sentinels:
                        raise self._died(sentinels[obj], "", describe)
        except _CallFailed as failed:
            # every other rank answered too: the pipes are in step and the processes can serve on
            self.broken = self.broken or not failed.in_sync
            raise failed.error from None
        except KeyboardInterrupt:   # Ctrl-C in the driver (the workers ignore it): their answers are still due
            self.broken = True
            if reading is None:   # (else a pipe is in the middle of an answer: out of step)
                self.broken = not self._drain(pending, INTERRUPT_DRAIN_S)
            raise
        except BaseException:
            self.broken = True
            raise
        return [results[r] for r in ranks]

    def _drain(self, pending: dict[Any, int], wait_s: float) -> bool:
        """Read (and drop) the answers still due after one rank failed; whether all came in time."""
        deadline = time.monotonic() + wait_s
        while pending:
            ready = mpc.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            for obj in ready:
                pending.pop(obj)
                try:
                    obj.recv_bytes()
                except (EOFError, OSError):
                    return False
        return True

    def _died(self, rank: int, detail: str, describe: Any) -> WorkerDiedError:
        proc = self.procs[rank]
        proc.join(0.5)
        code = proc.exitcode
        if code is None:
            how = "stopped answering"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
            if code == 1:   # a Python error in the worker: at start-up, most often an unguarded main module
                how += (" (its error is on stderr; if it died while starting, a script that starts worker "
                        "processes must run its engine under `if __name__ == \"__main__\":`)")
        where = describe(rank) if describe is not None else ""
        msg = f"worker {rank} (pid {proc.pid}{where}) {how}"
        return WorkerDiedError(f"{msg}: {detail}" if detail else msg)

    def stop(self) -> None:
        """Stop every process (shutdown message, SIGTERM, SIGKILL; bounded waits) and reap them."""
        self._finalizer()


class MultiprocExecutor(DistributedExecutor):
    """Spawned worker processes on this machine, one per rank (and per device on accelerators).

    Args:
        config: the engine configuration.
        processes: processes to run the ranks in (at least one per rank), kept running after
            :meth:`shutdown`; by default the executor starts its own and stops them.

    Raises:
        ConfigError: more ranks than this machine has devices (CPUs accept any count).
    """

    def __init__(self, config: EngineConfig, processes: WorkerProcesses | None = None):
        super().__init__(config)
        from plinth.platforms.selection import select_platform

        platform = select_platform(config.device.platform)
        if platform.device_type != "cpu" and platform.device_count() < self.world_size:
            raise ConfigError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} needs "
                              f"{self.world_size} {platform.name} devices; this machine has "
                              f"{platform.device_count()}")
        if processes is not None and (len(processes) < self.world_size or processes.broken):
            raise ConfigError(f"the given worker processes ({len(processes)}, broken={processes.broken}) cannot "
                              f"serve {self.world_size} ranks")
        self._owns_processes = processes is None
        self._procs = processes or WorkerProcesses(self.world_size, self.step_timeout_s)
        self._store: Any = None
        # asynchronous steps (TP-only layouts): for each launch/collect message whose answers are unread,
        # the step whose output those answers carry (None: nothing); the last launched step, until a
        # message asks for its output
        self.supports_async_steps = config.parallel.pipeline_parallel_size == 1
        self._unread: collections.deque[_RemoteStep | None] = collections.deque()
        self._owed: _RemoteStep | None = None
        self._start()

    def _start_workers(self) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore(_HOST, 0, None, is_master=True, wait_for_workers=False,
                                    timeout=_td(self.start_timeout_s))
        from plinth.model_registry.registry import ModelRegistry
        from plinth.plugins import get_plugin_manager

        self._call_all("__init_worker__", self.config, ModelRegistry.user_registrations(),
                       get_plugin_manager().code_registrations(), timeout_s=self.start_timeout_s)
        self._call_all("init_distributed", self._store.port, self.step_timeout_s, timeout_s=self.start_timeout_s)

    @property
    def worker_pids(self) -> list[int]:
        return self._procs.pids[: self.world_size]

    def _call_all(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        return self._call(range(self.world_size), method, args, timeout_s)

    def _call_one(self, rank: int, method: str, *args: Any, timeout_s: float) -> Any:
        return self._call([rank], method, args, timeout_s)[0]

    def _call(self, ranks: Any, method: str, args: tuple, timeout_s: float) -> list[Any]:
        self._check_alive()
        self._settle()
        try:
            return self._procs.call(ranks, method, args, timeout_s, self._describe)
        except Exception as exc:
            if self._procs.broken and self._dead is None and not isinstance(exc, WorkerDiedError):
                # a rank raised and another did not answer in time (its answer would be read as the next call's):
                # the error goes on, and the workers stop
                self._dead = WorkerDiedError(f"{method!r} failed on a worker ({type(exc).__name__}: {exc}) while "
                                             f"another had not answered it within {DRAIN_WAIT_S:.0f} s")
                logger.error("%s; stopping all workers", self._dead)
                self.shutdown()
            raise

    # ------------------------------------------------------------------ asynchronous steps

    def launch(self, batch: FlatBatch, make_sampling_batch: MakeSamplingBatch | None,
               pool_ranges: list[tuple[int, int]] | None = None) -> PendingStep:
        """Send one step to every worker and return at once. The workers queue it (its ``batch.feed`` rows
        read the previous launched step's tokens on their devices) and answer with the previous launched
        step's output, so one step's answer travels while the next runs. Embedding steps run synchronously
        (``pool_ranges`` is refused)."""
        self._check_alive()
        if not self.supports_async_steps:
            raise NotImplementedError("asynchronous steps need a TP-only layout (no pipeline stages)")
        if pool_ranges:
            raise NotImplementedError("embedding steps on worker processes run synchronously")
        feed = batch.feed
        step_batch = StepBatch.from_entries(dataclasses.replace(batch, feed=None) if feed is not None else batch)
        sampling = make_sampling_batch(torch.device("cpu")) if make_sampling_batch is not None else None
        args = (step_batch, pack_tensors(sampling), (feed.rows, feed.src) if feed is not None else None)
        step = _RemoteStep(self)
        try:
            self._procs.send(range(self.world_size), "launch", args, self._describe)
        except KeyboardInterrupt:
            self._interrupted_async()
            raise
        except BaseException as exc:
            raise self._fail(exc) from exc
        self._unread.append(self._owed)   # its answers carry the step launched before this one
        self._owed = step
        return step

    def _await(self, step: _RemoteStep, timeout_s: float | None = None) -> None:
        """Read answers until ``step``'s output is in (asking for it when no later launch will carry it)."""
        self._check_alive()
        try:
            if step is self._owed:
                self._procs.send(range(self.world_size), "collect", (), self._describe)
                self._unread.append(step)
                self._owed = None
            while not step.done:
                self._read_answer(timeout_s)
        except KeyboardInterrupt:
            self._interrupted_async()
            raise
        except BaseException as exc:
            raise self._fail(exc) from exc

    def _read_answer(self, timeout_s: float | None = None) -> None:
        self._check_unread()
        carried = self._unread[0]
        results = self._procs.receive(range(self.world_size), "launch", timeout_s or self.step_timeout_s,
                                      self._describe)
        self._check_unread()
        self._unread.popleft()
        if carried is not None:
            out = results[self.output_rank]
            carried.output = unpack_tensors(out, torch.device("cpu")) if out is not None else None
            carried.done = True

    def _check_unread(self) -> None:
        """Raises WorkerDiedError where a shutdown (from another thread) cleared the answers being awaited."""
        if self._closed or not self._unread:
            raise WorkerDiedError("the executor was shut down")

    def _settle(self, timeout_s: float | None = None) -> None:
        """Before any other call: read every answer due and collect the last launched step, so the pipes
        carry answers to that call next."""
        if self._owed is not None:
            self._await(self._owed, timeout_s)
        while self._unread:
            try:
                self._read_answer(timeout_s)
            except KeyboardInterrupt:
                self._interrupted_async()
                raise
            except BaseException as exc:
                raise self._fail(exc) from exc

    def _interrupted_async(self) -> None:
        """Ctrl-C while asynchronous steps were in flight: their answers are no longer matched to their steps, so
        the workers stop (:meth:`_interrupted`, never in step here)."""
        self._procs.broken = True
        self._interrupted()

    def _workers_in_step(self) -> bool:
        return not self._procs.broken and not self._unread and self._owed is None

    def _describe(self, rank: int) -> str:
        tp = self.config.parallel.tensor_parallel_size
        return f", tp rank {rank % tp}, pp rank {rank // tp}"

    def shutdown(self) -> None:
        if self._closed:
            return
        if (self._unread or self._owed is not None) and not self._owns_processes and not self._procs.broken \
                and self._dead is None:
            with contextlib.suppress(BaseException):   # the answers still due go before the release's
                self._settle(SHUTDOWN_WAIT_S)
            if self._closed:   # settling failed, and that failure shut the executor down
                return
        if self._unread or self._owed is not None:
            self._procs.broken = True   # answers still due: the pipes are out of step, stop the processes
        self._closed = True
        self._unread.clear()
        self._owed = None
        if self._owns_processes or self._procs.broken:
            self._procs.stop()
        else:
            try:
                self._procs.call(range(self.world_size), "__release__", (), SHUTDOWN_WAIT_S)
            except BaseException:
                self._procs.stop()
                raise
        self._store = None


@contextlib.contextmanager
def _sigint_blocked() -> Any:
    """SIGINT blocked in this thread meanwhile (one that comes is delivered after). A process started meanwhile
    inherits the mask: a terminal's Ctrl-C, sent to the whole process group, does not interrupt a worker while it
    imports its modules, before it ignores SIGINT (``_worker_main``); the driver stops the workers."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()   # (the first spawn starts it, and that start unblocks SIGINT)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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


def _worker_main(index: int, conn: Any, parent_pid: int, timeout_s: float) -> None:
    """A worker process: serves one rank at a time (``__init_worker__`` .. ``__release__``)."""
    _watch_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the driver, which stops the workers
    if hasattr(signal, "pthread_sigmask"):   # (blocked since the start: see _sigint_blocked)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # the ranks of one machine talk over loopback
    from plinth.distributed.parallel_state import destroy_parallel_state
    from plinth.distributed.worker import Worker

    worker: Any = None
    try:
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return   # the driver is gone
            if method == "shutdown":
                break
            try:
                if method == "__init_worker__":
                    worker = Worker(args[0], index, index, models=args[1], plugins=args[2])
                    result: Any = os.getpid()
                elif method == "__pid__":
                    result = os.getpid()
                elif method == "__release__":
                    try:
                        if worker is not None:
                            worker.close()   # its decode graphs go before the process groups
                    finally:
                        worker = None
                        destroy_parallel_state()
                        gc.collect()
                    result = None
                elif worker is None:
                    raise RuntimeError(f"no rank is assigned to worker process {index}")
                elif method == "init_distributed":
                    import torch.distributed as dist

                    port, collective_timeout = args
                    store = dist.TCPStore(_HOST, port, None, is_master=False, timeout=_td(timeout_s))
                    result = worker.init_distributed(store, collective_timeout)
                else:
                    result = getattr(worker, method)(*args)
                reply = ("ok", result)
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
                if isinstance(exc, UserFacingError | ConfigError):   # the driver prints it, once, in one line
                    logger.debug("worker %d: %s failed: %s", index, method, exc)
                else:
                    logger.error("worker %d: %s failed:\n%s", index, method, traceback.format_exc())
                reply = ("error", _picklable(exc))
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        if worker is not None:
            with contextlib.suppress(Exception):   # a broken device must not keep the process from leaving
                worker.close()
        destroy_parallel_state()
    # asked to stop: skip the interpreter's slow teardown of torch (nothing is left to flush but stdio)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _RemoteStep(PendingStep):
    """A step launched on the workers; its output arrives with a later answer (:meth:`token_ids` reads it)."""

    def __init__(self, executor: MultiprocExecutor):
        super().__init__(None)
        self._executor = executor
        self.done = False

    @property
    def device_tokens(self) -> None:
        """The tokens stay on the workers' devices (they feed the next step there)."""
        return None

    def token_ids(self) -> list[int]:
        if not self.done:
            self._executor._await(self)
        return [] if self.output is None else self.output.sampled_token_ids.tolist()
