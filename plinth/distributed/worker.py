"""One rank of a distributed engine: its model shard, its KV cache, its part of each step.

The same :class:`Worker` runs inside a spawned process (:mod:`~plinth.distributed.executor_mp`)
and inside a Ray actor (:mod:`~plinth.distributed.executor_ray`). The driver calls, in order:
:meth:`Worker.init_distributed` (every rank at once), :meth:`Worker.select_attention` (rank 0),
:meth:`Worker.load` (every rank, with rank 0's choice; returns how many KV blocks fit here),
:meth:`Worker.init_cache` (every rank, with the smallest of those counts), then
:meth:`Worker.execute` once per step and :meth:`Worker.prompt_logits` when a step asked for
prompt logprobs. Under asynchronous scheduling (TP-only layouts, worker processes) steps come as
:meth:`Worker.launch` instead, and :meth:`Worker.collect` reads back the last one.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from plinth.config import DeviceConfig, EngineConfig
from plinth.core.logits_processors import resolve_processors
from plinth.core.sampler import Sampler, SamplerOutput, SamplingBatch
from plinth.distributed.communication import tp_broadcast
from plinth.distributed.messages import StepBatch, pack_tensors, unpack_tensors
from plinth.distributed.parallel_state import ParallelLayout, init_parallel_state
from plinth.distributed.pipeline import PipelineStage
from plinth.worker.batching import FlatBatch, TokenFeed
from plinth.worker.model_runner import ModelRunner, SeqBatchEntry
from plinth.worker.profiling import StepProfiler

logger = logging.getLogger(__name__)

#: run the platform's fast-path set-up (GPU: skinny decode GEMMs) in worker processes too
WORKER_FAST_PATH_ENV = "PLINTH_WORKER_FAST_PATH"


class Worker:
    """One rank.

    Args:
        config: the engine configuration (the same on every rank).
        rank: this worker's rank in ``[0, tp_size * pp_size)``.
        device_index: which local device this rank drives (ignored on CPU).
    """

    def __init__(self, config: EngineConfig, rank: int, device_index: int,
                 models: dict[str, Any] | None = None, plugins: dict[str, str] | None = None):
        self._staged_weights: list[tuple[str, torch.Tensor]] | None = None   # a weight update's, checked
        if plugins is not None:   # the driver's PluginManager.register_module calls
            from plinth.plugins import adopt_code_plugins

            adopt_code_plugins(plugins)
        if models is not None:   # the driver's ModelRegistry.register_model calls
            from plinth.model_registry.registry import ModelRegistry

            ModelRegistry.set_user_registrations(models)
        par = config.parallel
        self.config = config
        self.layout = ParallelLayout(rank, par.tensor_parallel_size, par.pipeline_parallel_size)
        self.device_index = device_index
        self.runner: ModelRunner | None = None
        self.stage: PipelineStage | None = None
        self._last_hidden: list[torch.Tensor] = []
        self._model: Any = None
        self._images: Any = None   # the image encoder (plinth.multimodal.runner.ImageFeatures) of an image model
        self._backend: Any = None
        self._num_blocks_fit = 0
        self.sampler = Sampler(config.model.seed, resolve_processors(config.model.logits_processors),
                               config.model.logprobs_mode)
        self.step_times: deque[tuple[float, float]] = deque(maxlen=4096)   # see take_step_times
        # asynchronous steps: the last launched step's sampled tokens on this device (they feed the next
        # step), and its output on its way to the host (output rank) until an answer carries it
        self._feed_tokens: torch.Tensor | None = None
        self._owes = False
        self._owed: _HostCopy | None = None
        self.profiler = StepProfiler(rank, self._sync)

        from plinth.model_registry.loader import resolve_dtype, resolve_model_source
        from plinth.platforms.selection import select_platform

        self.platform = select_platform(config.device.platform)
        if self.platform.device_type == "cpu":
            if "OMP_NUM_THREADS" not in os.environ:   # the ranks share the cores: do not oversubscribe them
                from plinth.platforms.cpu.platform import cpu_thread_count

                torch.set_num_threads(max(1, cpu_thread_count() // self.layout.world_size))
        else:
            self.platform.set_device(device_index)
        self.device = self.platform.device(device_index)
        self.source = resolve_model_source(config.model)
        self.hf = self.source.hf_config
        self.dtype = resolve_dtype(config.model, self.hf, self.platform.supported_dtypes())
        limit = getattr(self.hf, "max_position_embeddings", None) or 2048
        self.max_model_len = config.model.max_model_len or limit

    @property
    def pid(self) -> int:
        return os.getpid()

    def init_distributed(self, store: Any, timeout_s: float) -> int:
        """Join the process groups (on CUDA with TP, also set up the TP group's custom all-reduce,
        before any warm-up collective or graph capture); returns this process's id."""
        init_parallel_state(self.layout, self.platform.dist_backend, store, timeout_s, device=self.device)
        return os.getpid()

    def _spec(self) -> Any:
        from plinth.worker.setup import attention_spec

        spec = attention_spec(self.hf, self.dtype, self.config.cache.block_size, self.config.cache.kv_cache_dtype)
        tp = self.layout.tp_size
        kv = spec.num_kv_heads // tp if spec.num_kv_heads >= tp else 1
        return dataclasses.replace(spec, num_heads=spec.num_heads // tp, num_kv_heads=kv)

    def select_attention(self) -> Any:
        """Choose the attention backend on this rank's shapes (run on one rank, used by all).

        Returns:
            the :class:`~plinth.core.selection_records.SelectionResult` without its class object.
        """
        from plinth.attention_backends.probe import AttentionWorkload
        from plinth.core.selection import select_attention_backend

        sched = self.config.scheduler
        layers = self.hf.num_hidden_layers // self.layout.pp_size
        workload = AttentionWorkload.for_engine(*sched.limits,
                                                self.max_model_len, max(1, layers))
        result = select_attention_backend(self._spec(), self.platform, self.config.device, workload=workload)
        return dataclasses.replace(result, winner_cls=None)

    def load(self, backend_name: str) -> int:
        """Build this rank's model shard with the chosen backend and load its weights.

        Returns:
            how many KV blocks fit on this rank.
        """
        from plinth.core.selection import select_attention_backend
        from plinth.lora.layers import enable_lora_for
        from plinth.model_registry.interface import ModelContext
        from plinth.model_registry.loader import load_model
        from plinth.quantization.resolve import resolve_quantization
        from plinth.worker.setup import _num_blocks, allocate_recurrent_state, image_features

        forced = DeviceConfig(platform=self.config.device.platform, attention_backend=backend_name, selection="off")
        backend = select_attention_backend(self._spec(), self.platform, forced).instantiate()
        quant_method = resolve_quantization(self.config, self.source, self.platform, self.dtype, self.device)
        lay = self.layout
        ctx = ModelContext(hf_config=self.hf, dtype=self.dtype, device=self.device, attention_backend=backend,
                           block_size=self.config.cache.block_size, quant_method=quant_method,
                           tp_rank=lay.tp_rank, tp_size=lay.tp_size, pp_rank=lay.pp_rank, pp_size=lay.pp_size,
                           max_model_len=self.max_model_len)
        torch.manual_seed(self.config.model.seed)
        model = load_model(self.source, ctx, seed=self.config.model.seed)
        model.eval()
        # (the first pipeline stage embeds the images: later stages take only their rows and positions)
        self._images = (image_features(self.source, model, self.dtype, self.device, self.config.model.seed,
                                       self.config.model.enable_prompt_embeds) if lay.pp_rank == 0 else None)
        enable_lora_for(model, self.config)
        allocate_recurrent_state(model, self.config, self.platform, self.device)
        self._model, self._backend = model, backend
        block_size = self.config.cache.block_size
        bytes_per_block = ModelRunner.kv_bytes_per_block(model, backend, block_size, self._spec().cache_dtype)
        reserve = 0
        if self.device.type == "cuda":
            weights = torch.cuda.memory_allocated(self.device)
            self._profile_peak()
            if self._images is not None and self._images.encoder is not None:
                from plinth.worker.setup import profile_image_encoder

                profile_image_encoder(self._images, self.source, self.config, self.max_model_len)
            reserve = (torch.cuda.max_memory_allocated(self.device) - weights
                       + 4 * self.config.scheduler.max_num_seqs * self.hf.vocab_size * 4)
        config = self.config
        if self.platform.device_type == "cpu":   # the CPU budget is the whole engine's: split it over the ranks
            cache = dataclasses.replace(config.cache,
                                        cpu_kv_cache_bytes=max(1, config.cache.cpu_kv_cache_bytes // lay.world_size))
            config = dataclasses.replace(config, cache=cache)
        self._num_blocks_fit = _num_blocks(config, self.platform, {"device": self.device}, bytes_per_block,
                                           self.max_model_len, reserve)
        return self._num_blocks_fit

    @torch.inference_mode()
    def _profile_peak(self) -> None:
        """One step at the full token budget through this rank's stage (every rank runs it at once)."""
        n = self.config.scheduler.max_num_batched_tokens
        bs = self.config.cache.block_size
        self._make_runner(2)
        entries = [SeqBatchEntry([0] * min(bs, n - i), 0, [1], True) for i in range(0, n, bs)]
        torch.cuda.reset_peak_memory_stats(self.device)
        from plinth.lora.layers import products_forced

        with products_forced(self._model):
            self._run(entries)
        torch.cuda.synchronize(self.device)
        for layer in self._model.attention_layers():
            layer.kv_cache = None
        self.runner = self.stage = None

    def _make_runner(self, num_blocks: int) -> None:
        cfg = self.config
        self.runner = ModelRunner(self._model, self._backend, self.device, num_blocks, cfg.cache.block_size,
                                  self.max_model_len, self._spec().cache_dtype)
        self.runner.images = self._images
        if getattr(self._model, "checks_a_first_pass", False) and self.layout.pp_size == 1:
            from plinth.worker.setup import first_pass

            first_pass(self.runner)
        if self.layout.pp_size > 1:
            self.stage = PipelineStage(self.runner, self.layout, self.hf.hidden_size, self.dtype)

    def init_cache(self, num_blocks: int) -> int:
        """Allocate the KV cache (the same block count on every rank); set up the platform's fast path
        (accelerators); capture decode graphs where supported (single-stage runs, not ``enforce_eager``).
        Returns the cache's bytes on this rank."""
        from plinth.worker.setup import graph_blocker

        self._make_runner(num_blocks)
        assert self.runner is not None
        self._prepare_runner()
        dev = self.config.device
        if (not dev.enforce_eager and self.layout.pp_size == 1 and self.device.type == "cuda"
                and self.runner.graphs is None and self.platform.supports_graph_capture
                and getattr(self._backend, "graph_safe", False)
                and graph_blocker(self._model, self.device, self.dtype) is None):
            self._capture_decode_graphs()
        return self.runner.kv_cache_bytes

    def _prepare_runner(self) -> None:
        """The platform's own set-up of a built runner, as in a single-process engine: on CUDA/ROCm the
        skinny decode GEMMs, timed against the vendor GEMM per weight shape of this rank's shard. It
        only swaps local GEMM kernels (no collective), so ranks may choose differently; it runs before
        graph capture, which records the chosen kernels. Not on CPUs: there the fast path (prepacked
        copies sized against the machine's free memory, compiled decode steps) assumes one process.
        Off unless ``PLINTH_WORKER_FAST_PATH=1``: on two H200s it did not lower TP=2's batch-1 time per token
        (4.77 ms with it, 4.45-4.64 without; benchmarks/RESULTS.md)."""
        from plinth.config import env_flag

        prepare = getattr(self.platform, "prepare_runner", None)
        if prepare is not None and self.platform.device_type != "cpu" and env_flag(WORKER_FAST_PATH_ENV, False):
            prepare(self.runner, self.source, self.config)

    def _capture_decode_graphs(self) -> None:
        """Capture the decode graphs; with TP, graphs that hold the layers' collectives (NCCL's, and
        the kernels of the custom all-reduce for small tensors).

        Every TP rank captures at once (the driver calls :meth:`init_cache` on all of them), the same
        batch-size ladder in the same order (checked); first an eager warm-up collective creates the
        communicators and leaves no collective in flight. The capture runs in ``thread_local`` mode so
        that the NCCL watchdog thread, polling the warm-up's events, cannot invalidate it.
        """
        from plinth.distributed.communication import tp_warm_up
        from plinth.worker.cuda_graphs import DecodeGraphRunner, graph_batch_sizes

        runner = self.runner
        assert runner is not None
        max_num_seqs = self.config.scheduler.max_num_seqs
        mode = "global"
        if self.layout.tp_size > 1:
            tp_warm_up(self.device, self.dtype, graph_batch_sizes(max_num_seqs))
            mode = "thread_local"
        graphs = DecodeGraphRunner(runner.model, runner.backend, self.device, max_num_seqs,
                                   runner.max_blocks_per_seq, runner.block_size)
        graphs.capture(capture_error_mode=mode)
        runner.graphs = graphs

    def _run(self, entries: list[SeqBatchEntry] | FlatBatch) -> tuple[torch.Tensor | None, list[int]]:
        if self.stage is not None:
            logits, sample_seqs, self._last_hidden = self.stage.execute(entries)
            return logits, sample_seqs
        assert self.runner is not None
        logits, sample_seqs, hidden = self.runner.execute(entries)
        self._last_hidden = [hidden] if hidden is not None else []
        return logits, sample_seqs

    def execute(self, batch: StepBatch, sampling: SamplingBatch | None) -> SamplerOutput | None:
        """Run this rank's part of a step; the output rank samples the logits.

        Args:
            batch: the step's sequences.
            sampling: the sampled sequences' parameters (host tensors, packed by
                :func:`~plinth.distributed.messages.pack_tensors`), or ``None``.

        Returns:
            on the output rank, the sampled token ids (and logprobs) on the host, packed; else ``None``.
        """
        if self._owes:
            raise RuntimeError("a synchronous step while a launched step's output was not collected")
        self._feed_tokens = None
        with self.profiler:
            t0 = time.perf_counter()
            logits, sample_seqs = self._run(batch.flat())
            t1 = time.perf_counter()
            out = None
            if self.layout.is_output_rank and logits is not None and sampling is not None and sample_seqs:
                out = self.sampler.sample(logits, unpack_tensors(sampling, self.device))
                out = pack_tensors(unpack_tensors(out, torch.device("cpu")))   # waits for the step's tokens
            self.step_times.append((t1 - t0, time.perf_counter() - t1))
        return out

    def launch(self, batch: StepBatch, sampling: SamplingBatch | None,
               feed: tuple[np.ndarray, np.ndarray] | None) -> Any:
        """Queue one step (asynchronous scheduling) and answer with the previous launched step's output.

        The rows ``feed[0]`` of ``batch.token_ids`` take the tokens ``feed[1]`` of the previous launched
        step, which every rank holds on its device: the output rank samples them, then broadcasts them
        over the TP group. The output rank starts copying this step's sampler output to pinned host
        memory and answers with the previous step's (waiting for that copy only), so the device runs
        this step while the answer travels; other ranks answer ``None``.

        Args:
            batch: the step's sequences (fed rows hold placeholders).
            sampling: the sampled sequences' parameters, packed, or ``None``.
            feed: ``(rows, src)`` int64 arrays, or ``None``.

        Returns:
            the previous launched step's sampler output, packed (``None`` if it sampled nothing, off the
            output rank, or when no launched step was waiting to be read).
        """
        with self.profiler:
            t0 = time.perf_counter()
            # the sampling parameters go up first and without waiting: a blocking copy would hold this
            # process until the step now running finishes, and the answer below until this one does
            on_device = unpack_tensors(sampling, self.device, non_blocking=True) if sampling is not None else None
            flat = batch.flat()
            if feed is not None:
                if self._feed_tokens is None:
                    raise RuntimeError("a step fed by the previous step's tokens, but that step sampled nothing")
                flat = dataclasses.replace(flat, feed=TokenFeed(rows=np.asarray(feed[0]), src=np.asarray(feed[1]),
                                                                tokens=self._feed_tokens))
            logits, sample_seqs = self._run(flat)
            t1 = time.perf_counter()
            staged = None
            tokens = None
            if sampling is not None and sample_seqs:
                if self.layout.is_output_rank:
                    assert logits is not None
                    out = self.sampler.sample(logits, on_device)
                    tokens = out.sampled_token_ids
                    staged = _HostCopy(out)
                else:
                    tokens = torch.empty(len(sample_seqs), dtype=torch.int64, device=self.device)
                tp_broadcast(tokens)
            self._feed_tokens = tokens
            previous, owed = self._owed, self._owes
            self._owed, self._owes = staged, True
            answer = previous.packed() if owed and previous is not None else None
            self.step_times.append((t1 - t0, time.perf_counter() - t1))
            return answer

    def collect(self) -> Any:
        """The last launched step's sampler output, packed (``None``: see :meth:`launch`)."""
        owed, self._owed, self._owes = self._owed, None, False
        return owed.packed() if owed is not None else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Drop the model, its KV cache and its decode graphs; call before leaving the process groups.
        A captured graph that holds NCCL collectives keeps their communicator in use, and destroying the
        process group while such a graph is alive blocks."""
        self.runner = self.stage = None
        self._model = self._backend = None
        self._last_hidden = []
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def take_step_times(self) -> list[tuple[float, float]]:
        """The host seconds of the steps since the last call, each ``(run, sample)``: running the
        model (on accelerators: launching its kernels), then sampling and waiting for the tokens."""
        times = list(self.step_times)
        self.step_times.clear()
        return times

    def apply_model(self, fn_bytes: bytes) -> Any:
        """``fn(model)`` on this rank's model (``fn`` pickled by the driver: unpickled here, so a function this
        process cannot import is this call's error); its result, which must pickle to go back."""
        import pickle

        fn = pickle.loads(fn_bytes)
        result = fn(self._model)
        self._sync()
        try:
            pickle.dumps(result)
        except Exception as exc:  # noqa: BLE001 - any pickling failure: the call's error, not the worker's end
            raise TypeError(f"apply_model: the function's result on rank {self.layout.rank} cannot go back to the driver "
                            f"({type(exc).__name__}: {exc}); return plain values or CPU tensors") from None
        return result

    @property
    def _encoder_elsewhere(self) -> bool:
        """Whether the model takes images that another stage encodes (a later pipeline stage)."""
        return self.layout.pp_rank > 0 and getattr(self.source, "mm_config", None) is not None

    def update_weights(self, weights: list[tuple[str, torch.Tensor]] | None, phase: str) -> int:
        """New values for this rank's shard of the weights (see ``Executor.update_weights``), in two calls:
        ``"check"`` with the tensors (kept here), then ``"write"`` (``weights`` None: those kept) once every rank
        passed its check."""
        from plinth.model_registry.weight_update import update_weights

        if phase == "check":
            self._staged_weights = None
            update_weights(self._model, weights or [], "check", self._images,   # (host tensors: each loader copies
                           encoder_elsewhere=self._encoder_elsewhere)                # its part)
            self._staged_weights = weights
            return len(weights or ())
        staged, self._staged_weights = self._staged_weights, None
        if staged is None:
            raise RuntimeError("a weight update's write came without its check")
        count = update_weights(self._model, staged, "write", self._images, encoder_elsewhere=self._encoder_elsewhere)
        self._sync()
        return count

    def sleep(self, level: int) -> int:
        """Free this rank's KV cache (and on accelerators its weights); the device bytes freed."""
        assert self.runner is not None
        self._sync()
        return self.runner.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        """Take this rank's memory of ``tags`` again."""
        assert self.runner is not None
        self.runner.wake_up(tags)
        self._sync()

    def rank_weights(self) -> Any:
        """This rank's :class:`~plinth.distributed.executor.RankWeights`."""
        from plinth.distributed.executor import RankWeights

        return RankWeights.of(self._model, self.device, self.layout.tp_rank, self.layout.pp_rank)

    def hidden_rows(self, ranges: list[tuple[int, int]]) -> torch.Tensor | None:
        """Final hidden states of the rows ``[a, b)`` of the last step's flat batch, concatenated, float32 on the
        host (the output rank of the last stage; embeddings)."""
        from plinth.distributed.executor import gather_rows

        if not (self.layout.is_last_stage and self.layout.is_output_rank):
            return None
        return gather_rows(self._joined_hidden(), ranges)

    def _joined_hidden(self) -> torch.Tensor | None:
        """The last step's hidden states (its micro-batches' joined), ``None`` when it kept none."""
        if not self._last_hidden:
            return None
        return self._last_hidden[0] if len(self._last_hidden) == 1 else torch.cat(self._last_hidden)

    @torch.inference_mode()
    def prompt_logits(self, start: int, stop: int) -> torch.Tensor | None:
        """Logits of rows ``[start, stop)`` of the last step's flat batch (last stage; every TP rank of
        it takes part in the LM head's gather; the output rank returns them on the host)."""
        if not self.layout.is_last_stage:
            return None
        hidden = self._joined_hidden()
        assert hidden is not None, "prompt logits of a step that kept no hidden states"
        logits = self._model.compute_logits(hidden[start:stop])
        return logits.cpu() if self.layout.is_output_rank else None


class _HostCopy:
    """A sampler output being copied to pinned host memory behind an event (on the CPU: already there)."""

    def __init__(self, out: SamplerOutput):
        self.event: Any = None
        if out.sampled_token_ids.device.type == "cuda":
            self.host = _to_pinned(out)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = unpack_tensors(out, torch.device("cpu"))

    def packed(self) -> Any:
        """The output on the host, packed for the pipe (waits for the copy)."""
        if self.event is not None:
            self.event.synchronize()
        return pack_tensors(self.host)


def _to_pinned(obj: Any) -> Any:
    """``obj`` with every device tensor (also in tuples and dataclasses) copied to pinned host memory,
    asynchronously."""
    if isinstance(obj, torch.Tensor):
        host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
        host.copy_(obj, non_blocking=True)
        return host
    if isinstance(obj, tuple):
        return tuple(_to_pinned(x) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to_pinned(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj
