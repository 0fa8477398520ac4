"""Executors: how the engine runs a step's batch on one or many workers.

* :class:`UniprocExecutor`: the model runner in the engine's own process (TP = PP = 1).
* :class:`~plinth.distributed.executor_mp.MultiprocExecutor`: one spawned process per rank on
  this machine, the batch sent over pipes.
* :class:`~plinth.distributed.executor_ray.RayExecutor`: one Ray actor per rank, placed with a
  placement group on an existing Ray cluster or a local one.

The scheduler stays in the engine (the driver), which also gathers each step's sampling
parameters (a :class:`~plinth.core.sampler.SamplingBatch`). The logits are sampled where they
are: in-process, or on TP rank 0 of the last pipeline stage, which returns only the sampled
token ids (and logprobs when asked), never the ``[batch, vocab]`` logits.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from plinth import benchmarks_floor as floors
from plinth.config import MAX_TIMEOUT_S, ConfigError, EngineConfig
from plinth.core.async_engine import EngineDeadError
from plinth.core.sampler import Sampler, SamplerOutput, SamplingBatch
from plinth.distributed.messages import StepBatch, pack_tensors, unpack_tensors
from plinth.distributed.parallel_state import ParallelLayout
from plinth.worker.batching import FlatBatch
from plinth.worker.model_runner import SeqBatchEntry

logger = logging.getLogger(__name__)

#: builds the step's sampling parameters on a device (called by the executor where it samples)
MakeSamplingBatch = Callable[[torch.device], SamplingBatch]

STEP_TIMEOUT_ENV = "PLINTH_WORKER_STEP_TIMEOUT_S"
#: after Ctrl-C in the driver: how long the workers (which ignore it) may take to finish the call in hand, so that
#: they stay in step and serve on
INTERRUPT_DRAIN_S = 30.0
START_TIMEOUT_ENV = "PLINTH_WORKER_START_TIMEOUT_S"


def env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ConfigError(f"${name} must be a number of seconds, got {raw!r}") from exc
    if not 0 < value <= MAX_TIMEOUT_S:   # NaN fails too; inf and 1e300 are more than a wait can take
        raise ConfigError(f"${name} must be a positive number of seconds up to {MAX_TIMEOUT_S:g} (a week), "
                          f"got {raw!r}")
    return value


class WorkerDiedError(EngineDeadError):
    """A worker process or actor died or stopped answering; the engine cannot go on."""


@dataclasses.dataclass(frozen=True)
class RankWeights:
    """The model shard one rank holds (what benchmark floors are computed from).

    Attributes:
        tp_rank, pp_rank: the rank's place in the layout.
        device_name: the product name of the rank's device (``"cpu"`` on the CPU).
        stats: the parameters of the rank's shard.
    """

    tp_rank: int
    pp_rank: int
    device_name: str
    stats: floors.WeightStats

    @classmethod
    def of(cls, model: Any, device: torch.device, tp_rank: int = 0, pp_rank: int = 0) -> RankWeights:
        return cls(tp_rank, pp_rank, floors.device_name(device), floors.weight_stats(model))


class PendingStep:
    """A step whose work is queued on the device and whose sampled tokens are read later.

    Args:
        output: the sampler's output (device tensors), or None when the step samples nothing.
        host: where the sampled tokens are being copied (pinned host memory), or None.
        copied: an event recorded after that copy (None: the tokens are on the host already).
    """

    def __init__(self, output: SamplerOutput | None, host: torch.Tensor | None = None,
                 copied: torch.cuda.Event | None = None):
        self.output = output
        self._host = host
        self._copied = copied
        self._pooled: torch.Tensor | None = None   # the rows asked for by ``pool_ranges`` (see with_pooled)
        self._pooled_copied: torch.cuda.Event | None = None

    def with_pooled(self, rows: torch.Tensor, copied: torch.cuda.Event | None = None) -> PendingStep:
        """This step, with the hidden-state rows an embedding step reads (float32 on the host, or being copied
        there until ``copied``)."""
        self._pooled, self._pooled_copied = rows, copied
        return self

    def pooled_rows(self) -> np.ndarray:
        """The hidden-state rows the launch was asked for (``pool_ranges``), float32 ``[rows, hidden]``: a copy,
        waiting for this step only."""
        if self._pooled is None:
            raise RuntimeError("this step was launched without pool_ranges")
        if self._pooled_copied is not None:
            self._pooled_copied.synchronize()
        return self._pooled.numpy().copy()

    @property
    def device_tokens(self) -> torch.Tensor | None:
        """The sampled token ids ``[S]`` int64 where they were sampled (feeds the next step)."""
        return None if self.output is None else self.output.sampled_token_ids

    def token_ids(self) -> list[int]:
        """The sampled token ids, waiting for this step only (not for steps queued after it)."""
        if self.output is None:
            return []
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host if self._host is not None else self.output.sampled_token_ids
        return host[: len(self.output.sampled_token_ids)].tolist()


class PinnedPair:
    """Two pinned host buffers used in turn, for a step's results copied off the device while the next step is
    launched (the other buffer may still be read by the step in flight's owner); they grow as needed."""

    def __init__(self, dtype: torch.dtype, min_size: int = 0):
        self.dtype = dtype
        self.min_size = min_size
        self._buffers: list[torch.Tensor] = []

    def copy(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """``values`` (on a CUDA device) on their way to the next buffer: (a host view of ``values``' shape, the event
        after the copy)."""
        n = values.numel()
        if not self._buffers or self._buffers[0].numel() < n:
            size = max(n, self.min_size, 2 * self._buffers[0].numel() if self._buffers else 0)
            self._buffers = [torch.empty(size, dtype=self.dtype, pin_memory=True) for _ in range(2)]
        self._buffers.reverse()
        host = self._buffers[0][:n].view(values.shape)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(values.device))
        return host, copied


def gather_rows(hidden: torch.Tensor | None, ranges: list[tuple[int, int]], on_device: bool = False) -> torch.Tensor:
    """Rows ``[a, b)`` of ``hidden`` for each range, concatenated, float32 on the host (``on_device``: where
    ``hidden`` is).

    Raises:
        RuntimeError: the step kept no hidden states (a replayed decode step).
    """
    if hidden is None:
        raise RuntimeError("the step kept no hidden states (a replayed decode graph); embeddings need an eager step")
    index = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges])
    rows = hidden.index_select(0, torch.from_numpy(index).to(hidden.device, non_blocking=True)).float()
    return rows if on_device else rows.cpu()


class Executor(abc.ABC):
    """Runs the model for the engine.

    Attributes:
        num_blocks: KV blocks per layer (the same on every rank).
        selection: the attention-backend selection result.
        supports_async_steps: :meth:`launch` is implemented (asynchronous scheduling).
        supports_async_pooling: :meth:`launch` takes ``pool_ranges`` (embedding steps run asynchronously too).
    """

    num_blocks: int
    selection: Any
    supports_async_steps: bool = False
    supports_async_pooling: bool = False

    def launch(self, batch: FlatBatch, make_sampling_batch: MakeSamplingBatch | None,
               pool_ranges: list[tuple[int, int]] | None = None) -> PendingStep:
        """Queue one step (its ``batch.feed`` rows read from the previous step's output on the device)
        and return at once; :meth:`PendingStep.token_ids` waits for its tokens. ``pool_ranges``: flat-batch
        rows ``[a, b)`` of the step's final hidden states that :meth:`PendingStep.pooled_rows` then gives
        (embeddings; only where ``supports_async_pooling``)."""
        raise NotImplementedError(f"{type(self).__name__} runs steps synchronously")

    @abc.abstractmethod
    def execute(self, entries: Sequence[SeqBatchEntry],
                make_sampling_batch: MakeSamplingBatch | None) -> tuple[SamplerOutput | None, Any]:
        """Run one step and sample the entries whose ``sample`` flag is set.

        Args:
            entries: the step's sequences.
            make_sampling_batch: builds the sampling parameters of the sampled entries (in entry
                order) on a device; ``None`` when no entry is sampled.

        Returns:
            (the sampler's output, one row per sampled entry, or ``None``; a handle to the step's
            hidden states for :meth:`prompt_logits`, or ``None``).

        Raises:
            WorkerDiedError: a worker died or timed out; the executor has shut itself down.
        """

    @abc.abstractmethod
    def prompt_logits(self, hidden: Any, rows: slice) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` float32 of flat-batch rows of the latest step."""

    @abc.abstractmethod
    def hidden_rows(self, hidden: Any, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Final hidden states float32, on the host, of the flat-batch rows ``[a, b)`` of each range of the latest
        step, concatenated (embeddings)."""

    @abc.abstractmethod
    def rank_weights(self) -> list[RankWeights]:
        """What each rank holds, in rank order (one entry for the in-process executor).

        Raises:
            WorkerDiedError: a worker died or timed out.
        """

    def update_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Copy new values into the model's weights on every rank (each takes its shard or stage; see
        :func:`~plinth.model_registry.weight_update.update_weights`); the number of tensors given.

        Raises:
            ModelLoadError: a rank's model cannot take them.
            WorkerDiedError: a worker died or timed out.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot update weights")

    def apply_model(self, fn: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """``fn(model)`` on every rank's model, between steps; the results in rank order.

        Raises:
            TypeError: ``fn`` (or a result) cannot cross to (or from) worker processes.
            WorkerDiedError: a worker died or timed out.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot apply functions to its model")

    def sleep(self, level: int) -> int:
        """Free the KV cache on every rank, and on accelerators the weights (see
        :meth:`~plinth.worker.model_runner.ModelRunner.sleep`); the device bytes freed, all ranks together."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def wake_up(self, tags: list[str]) -> None:
        """Take the memory of ``tags`` again on every rank (see
        :meth:`~plinth.worker.model_runner.ModelRunner.wake_up`)."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def idle_work(self) -> bool:
        """Do a few milliseconds of background work while the engine has no request (see
        :meth:`~plinth.worker.model_runner.ModelRunner.idle_work`); return whether any is left. Workers in
        other processes do none."""
        return False

    def shutdown(self) -> None:  # noqa: B027 (nothing to release in-process)
        """Stop the workers and release what the executor holds (bounded time; idempotent)."""

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers (the engine's own for the in-process executor)."""
        return [os.getpid()]


class UniprocExecutor(Executor):
    """The model runner of the engine's own process."""

    supports_async_steps = True
    supports_async_pooling = True

    def __init__(self, runner: Any, num_blocks: int, selection: Any, seed: int = 0, processors: Sequence[type] = (),
                 logprobs_mode: str = "raw_logprobs"):
        from plinth.worker.profiling import StepProfiler

        self.runner = runner
        self.num_blocks = num_blocks
        self.selection = selection
        # the engine seed: rows without their own seed draw from it; the engine's custom logits processors
        self.sampler = Sampler(seed, processors, logprobs_mode)
        self._pinned_tokens = PinnedPair(torch.int64, 256)   # sampled tokens
        self._pinned_rows = PinnedPair(torch.float32)        # pooled hidden-state rows
        device = getattr(runner, "device", None)
        sync = (lambda: torch.cuda.synchronize(device)) if device is not None and device.type == "cuda" else (
            lambda: None)
        self.profiler = StepProfiler(0, sync)

    def launch(self, batch: FlatBatch, make_sampling_batch: MakeSamplingBatch | None,
               pool_ranges: list[tuple[int, int]] | None = None) -> PendingStep:
        with self.profiler:
            logits, sample_seqs, hidden = self.runner.execute(batch)
            # the pooled rows are gathered before sampling, so that their copy to the host overlaps it
            pooled = self._pool_async(hidden, pool_ranges) if pool_ranges else None
            step = self._sample_async(logits, sample_seqs, make_sampling_batch)
            return step if pooled is None else step.with_pooled(*pooled)

    def _pool_async(self, hidden: torch.Tensor | None,
                    ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The rows of ``ranges`` on their way to the host: (a host tensor, the event after its copy)."""
        rows = gather_rows(hidden, ranges, on_device=True)
        return self._pinned_rows.copy(rows) if rows.device.type == "cuda" else (rows.cpu(), None)

    def _sample_async(self, logits: torch.Tensor, sample_seqs: list[int],
                      make_sampling_batch: MakeSamplingBatch | None) -> PendingStep:
        if make_sampling_batch is None or not sample_seqs:
            return PendingStep(None)
        out = self.sampler.sample(logits, make_sampling_batch(logits.device))
        tokens = out.sampled_token_ids
        if tokens.device.type != "cuda":
            return PendingStep(out)
        return PendingStep(out, *self._pinned_tokens.copy(tokens))

    def execute(self, entries: Sequence[SeqBatchEntry],
                make_sampling_batch: MakeSamplingBatch | None) -> tuple[SamplerOutput | None, Any]:
        with self.profiler:
            logits, sample_seqs, hidden = self.runner.execute(entries)
            if make_sampling_batch is None or not sample_seqs:
                return None, hidden
            # the batch is built while the device still runs the forward pass
            return self.sampler.sample(logits, make_sampling_batch(logits.device)), hidden

    def prompt_logits(self, hidden: Any, rows: slice) -> torch.Tensor:
        return self.runner.prompt_logits(hidden, rows)

    def hidden_rows(self, hidden: Any, ranges: list[tuple[int, int]]) -> torch.Tensor:
        return gather_rows(hidden, ranges)

    def rank_weights(self) -> list[RankWeights]:
        return [RankWeights.of(self.runner.model, self.runner.device)]

    def update_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        from plinth.model_registry.weight_update import update_weights

        return update_weights(self.runner.model, weights, images=self.runner.images)

    def apply_model(self, fn: Callable[[torch.nn.Module], Any]) -> list[Any]:
        return [fn(self.runner.model)]

    def sleep(self, level: int) -> int:
        return self.runner.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self.runner.wake_up(tags)

    def idle_work(self) -> bool:
        idle_work = getattr(self.runner, "idle_work", None)
        return bool(idle_work()) if idle_work is not None else False


class DistributedExecutor(Executor):
    """Start-up and step protocol shared by the multi-process and Ray executors.

    Subclasses start the workers (each joins the process groups) and implement
    :meth:`_call_all`, which calls one :class:`~plinth.distributed.worker.Worker` method on
    every rank and returns the results in rank order, raising :class:`WorkerDiedError` when a
    worker dies or does not answer in time.
    """

    def __init__(self, config: EngineConfig):
        par = config.parallel
        self.config = config
        self.world_size = par.world_size
        self.output_rank = ParallelLayout.output_rank(par.tensor_parallel_size, par.pipeline_parallel_size)
        self.step_timeout_s = env_seconds(STEP_TIMEOUT_ENV, 600.0)
        self.start_timeout_s = env_seconds(START_TIMEOUT_ENV, 900.0)
        self._dead: BaseException | None = None
        self._closed = False

    def _start(self) -> None:
        """Select the attention backend on rank 0, load every shard, size and allocate the KV cache."""
        try:
            self._start_workers()
            self.selection = self._call_one(0, "select_attention", timeout_s=self.start_timeout_s)
            fits = self._call_all("load", self.selection.winner, timeout_s=self.start_timeout_s)
            self.num_blocks = min(fits)
            self._call_all("init_cache", self.num_blocks, timeout_s=self.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%s: %d workers ready (tp %d x pp %d), %d KV blocks", type(self).__name__, self.world_size,
                    self.config.parallel.tensor_parallel_size, self.config.parallel.pipeline_parallel_size,
                    self.num_blocks)

    @abc.abstractmethod
    def _start_workers(self) -> None:
        """Start one worker per rank and have each join the process groups."""

    @abc.abstractmethod
    def _call_all(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every rank; results in rank order."""

    def _call_one(self, rank: int, method: str, *args: Any, timeout_s: float) -> Any:
        """Call ``Worker.<method>(*args)`` on one rank (default: through :meth:`_call_all` on all)."""
        return self._call_all(method, *args, timeout_s=timeout_s)[rank]

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(f"the workers are gone ({self._dead})")
        if self._closed:
            raise WorkerDiedError("the executor was shut down")

    def _fail(self, exc: BaseException) -> WorkerDiedError:
        """Record a fatal worker failure, stop every worker, return the error to raise."""
        err = exc if isinstance(exc, WorkerDiedError) else WorkerDiedError(
            f"a worker failed during a step: {type(exc).__name__}: {exc}")
        self._dead = err
        logger.error("%s; stopping all workers", err)
        self.shutdown()
        return err

    def _interrupted(self) -> None:
        """After Ctrl-C (KeyboardInterrupt) in the driver during a call: workers that finished it (its answers read
        and dropped) serve on; workers still busy are stopped, and the executor is dead from then on. The
        interrupt itself goes on to the caller either way (it is no worker failure)."""
        if self._workers_in_step():
            logger.warning("interrupted: the workers finished the step in hand, whose results are dropped")
            return
        self._dead = WorkerDiedError("interrupted while the workers were in the middle of a step")
        logger.warning("%s; stopping all workers", self._dead)
        self.shutdown()

    def _workers_in_step(self) -> bool:
        """Whether every worker answered the interrupted call (default: not known, so no)."""
        return False

    def _step_call(self, method: str, *args: Any) -> list[Any]:
        """A call of a step's work on every rank: a failure stops all workers (:meth:`_fail`), an interrupt is
        :meth:`_interrupted`."""
        try:
            return self._call_all(method, *args, timeout_s=self.step_timeout_s)
        except KeyboardInterrupt:
            self._interrupted()
            raise
        except BaseException as exc:
            raise self._fail(exc) from exc

    def execute(self, entries: Sequence[SeqBatchEntry],
                make_sampling_batch: MakeSamplingBatch | None) -> tuple[SamplerOutput | None, Any]:
        self._check_alive()
        batch = StepBatch.from_entries(entries)
        sampling = make_sampling_batch(torch.device("cpu")) if make_sampling_batch is not None else None
        results = self._step_call("execute", batch, pack_tensors(sampling))
        return unpack_tensors(results[self.output_rank], torch.device("cpu")), _RemoteHidden()

    def prompt_logits(self, hidden: Any, rows: slice) -> torch.Tensor:
        self._check_alive()
        return self._step_call("prompt_logits", rows.start, rows.stop)[self.output_rank]

    def hidden_rows(self, hidden: Any, ranges: list[tuple[int, int]]) -> torch.Tensor:
        self._check_alive()
        return self._step_call("hidden_rows", ranges)[self.output_rank]

    def rank_weights(self) -> list[RankWeights]:
        self._check_alive()
        try:
            return self._call_all("rank_weights", timeout_s=self.step_timeout_s)
        except WorkerDiedError as exc:
            raise self._fail(exc) from exc

    def update_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        self._check_alive()
        host = [(name, t.detach().cpu()) for name, t in weights]   # (what crosses to the workers)
        try:
            # every rank checks its part (stages hold other layers) before any rank writes
            self._call_all("update_weights", host, "check", timeout_s=self.start_timeout_s)
            return self._call_all("update_weights", None, "write", timeout_s=self.start_timeout_s)[0]
        except WorkerDiedError as exc:
            raise self._fail(exc) from exc

    def apply_model(self, fn: Callable[[torch.nn.Module], Any]) -> list[Any]:
        import pickle

        self._check_alive()
        try:
            fn_bytes = pickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - any pickling failure: say what reaches worker processes
            raise TypeError(f"apply_model: the function cannot reach the worker processes ({type(exc).__name__}: "
                            f"{exc}); pass a module-level function (functools.partial of one for arguments), "
                            "not a lambda or a nested function") from None
        try:
            return self._call_all("apply_model", fn_bytes, timeout_s=self.start_timeout_s)
        except WorkerDiedError as exc:
            raise self._fail(exc) from exc

    def sleep(self, level: int) -> int:
        self._check_alive()
        try:
            return sum(self._call_all("sleep", level, timeout_s=self.start_timeout_s))
        except WorkerDiedError as exc:
            raise self._fail(exc) from exc
        except Exception:   # a rank that could not sleep: the others wake again (the engine stays awake)
            from plinth.worker.sleep import SLEEP_TAGS

            if self._dead is None:   # (else that failure stopped the workers)
                self._call_all("wake_up", list(SLEEP_TAGS), timeout_s=self.start_timeout_s)
            raise

    def wake_up(self, tags: list[str]) -> None:
        self._check_alive()
        try:
            self._call_all("wake_up", list(tags), timeout_s=self.start_timeout_s)
        except WorkerDiedError as exc:
            raise self._fail(exc) from exc


class _RemoteHidden:
    """Stands for the hidden states a step left on the last-stage workers."""


def resolve_executor_name(config: EngineConfig, platform: Any) -> str:
    """``auto``: in-process for one rank; Ray when ``$RAY_ADDRESS`` names a cluster or when the
    ranks outnumber this machine's accelerators and Ray is installed; else one process per rank."""
    par = config.parallel
    name = par.distributed_executor
    if name == "uniproc" and par.world_size > 1:
        raise ConfigError(f"distributed_executor 'uniproc' runs one rank, but tensor_parallel_size x "
                          f"pipeline_parallel_size = {par.world_size}; use 'mp' or 'ray'")
    if name != "auto":
        return name
    if par.world_size == 1:
        return "uniproc"
    if os.environ.get("RAY_ADDRESS"):
        return "ray"
    if platform.device_type != "cpu" and platform.device_count() < par.world_size:
        import importlib.util

        if importlib.util.find_spec("ray") is not None:
            return "ray"
    return "mp"


def create_distributed_executor(name: str, config: EngineConfig) -> DistributedExecutor:
    """Start the workers of executor ``name`` (``mp`` or ``ray``)."""
    if name == "mp":
        from plinth.distributed.executor_mp import MultiprocExecutor

        return MultiprocExecutor(config)
    if name == "ray":
        from plinth.distributed.executor_ray import RayExecutor

        return RayExecutor(config)
    raise ConfigError(f"unknown distributed executor {name!r}")
