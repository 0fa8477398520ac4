"""The model runner: owns the KV cache, turns a step's schedule into one flat batch, runs the model.

One runner per device (per rank). It knows nothing about scheduling policy: it receives, for each
scheduled sequence, which tokens to compute, where they start and which KV blocks the sequence owns.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from plinth.attention_backends.interface import AttentionBackend, AttentionMetadata, check_chunk_blocks
from plinth.worker.batching import FlatBatch, SeqBatchEntry
from plinth.worker.kv_prefault import PREFAULT_ENV, KVPrefaulter
from plinth.worker.staging import HostStaging

if TYPE_CHECKING:
    from plinth.worker.sleep import OffloadedTensors

__all__ = ["ModelRunner", "SeqBatchEntry", "StepInputs"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepInputs:
    """The flat batch of one step, on the device."""

    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    metadata: AttentionMetadata
    sample_rows: torch.Tensor    # [S] int64: rows of the flat batch whose logits are sampled
    sample_seqs: list[int]       # [S]: which entries those rows belong to (repeated for several rows of one)


def _shares_kv(layer: Any, backend: AttentionBackend, shape: Sequence[int]) -> bool:
    """Whether ``layer``'s keys and values are stored once (its values are its keys, the backend reads the cache
    through strides and lays it out as ``[2, ...]``)."""
    return bool(getattr(layer, "values_are_keys", False) and backend.shares_kv_cache and shape[0] == 2)


def _zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU from calloc'd memory (numpy), whose pages the OS zeroes on first touch,
    so a large KV cache costs no start-up time (``torch.zeros`` writes every byte).

    numpy advises transparent huge pages for arrays of 4 MiB or more, so where THP is in ``madvise`` mode the
    cache gets 2 MiB pages on first touch. Forcing 4 KiB pages instead made no difference beyond noise under
    ``benchmarks/serve_peers.sh`` at 8 and 32 streams (benchmarks/RESULTS.md, session 8); an earlier
    experiment that madvised huge pages explicitly had measured slower serving (318 vs 355 tok/s)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(*shape)


class ModelRunner:
    """Runs a model over the paged KV cache.

    Args:
        model: a plinth CausalLM (see plinth.model_registry.interface).
        backend: the selected attention backend instance (also held by the model's layers).
        device: where the model lives.
        num_blocks: KV blocks per layer (block 0 is the scratch block for padding).
        block_size: tokens per block.
        max_model_len: the longest sequence, bounds the block-table width (with ``num_blocks``).
        kv_dtype: the KV-cache dtype.
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 num_blocks: int, block_size: int, max_model_len: int, kv_dtype: torch.dtype):
        self.model = model
        self.backend = backend
        self.device = device
        self.num_blocks = num_blocks
        self.block_size = block_size
        # a sequence holds at most every block of the cache, whatever max_model_len says
        self.max_blocks_per_seq = min(-(-max_model_len // block_size), num_blocks)
        self.kv_dtype = kv_dtype
        self.kv_caches: list[torch.Tensor] = []
        #: faults the CPU cache's pages in while the engine is idle (see :meth:`idle_work`)
        self.prefaulter: KVPrefaulter | None = None
        t0 = time.perf_counter()
        self._allocate_kv()
        logger.info("KV cache: %d blocks x %d tokens, %s, %.1f MiB in %.2f s", num_blocks, block_size,
                    str(kv_dtype).removeprefix("torch."), self.kv_cache_bytes / 2**20, time.perf_counter() - t0)
        self.graphs = None   # a DecodeGraphRunner once capture_decode_graphs() ran
        #: speculative decoding: a decode step's rows may be one sequence's consecutive positions (its token and
        #: drafts); the attention metadata says so, and captured graphs are captured so
        self.shared_decode_rows = False
        self.staging = HostStaging(device)
        self.lora = getattr(model, "lora_state", None)   # a plinth.lora.layers.LoRAState with adapters enabled
        #: image inputs: the image encoder and its recent outputs (:class:`~plinth.multimodal.runner.ImageFeatures`)
        self.images: Any = None
        #: sleep mode: what is asleep (of :data:`~plinth.worker.sleep.SLEEP_TAGS`), the weights' offloaded
        #: storages, and what builds the decode steps again
        self.asleep: set[str] = set()
        self._offloaded: OffloadedTensors | None = None
        self._rebuild_graphs: Callable[[], Any] | None = None
        self._host_pool: torch.Tensor | None = None

    def _allocate_kv(self) -> None:
        """Allocate a zeroed KV cache for every attention layer (at start and on waking)."""
        model, backend, device, num_blocks = self.model, self.backend, self.device, self.num_blocks
        for layer in model.attention_layers():
            if getattr(layer, "attention_chunk", None):
                check_chunk_blocks(layer.attention_chunk, self.block_size, f"attention layer {layer.layer_idx}")
        stores = []   # the memory behind each cache (a shared cache's one half)
        caches = []
        try:
            for layer in model.attention_layers():
                shape = backend.kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
                shared = _shares_kv(layer, backend, shape)   # keys and values one tensor (first dimension stride 0)
                store = _zeros((1, *shape[1:]) if shared else shape, self.kv_dtype, device)
                stores.append(store)
                caches.append(store.expand(shape) if shared else store)
        except (MemoryError, torch.OutOfMemoryError) as exc:   # a --num-blocks far beyond the memory there is
            from plinth.config import ConfigError

            del stores, caches
            raise ConfigError(f"a KV cache of {num_blocks} blocks does not fit in the {device.type} memory "
                              f"({type(exc).__name__}); lower --num-blocks, or leave it unset to size the cache "
                              "from the memory there is") from None
        for layer, cache in zip(model.attention_layers(), caches, strict=True):
            layer.kv_cache = cache
            layer.block_size = self.block_size
        self.kv_caches = caches
        self.kv_cache_bytes = sum(c.numel() * c.element_size() for c in stores)
        if device.type == "cpu" and self.kv_caches:
            from plinth.config import env_flag

            if env_flag(PREFAULT_ENV, True):
                self.prefaulter = KVPrefaulter(stores, num_blocks)

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, backend: AttentionBackend, block_size: int,
                           kv_dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=kv_dtype).element_size()
        total = 0
        for layer in model.attention_layers():
            shape = backend.kv_cache_shape(1, block_size, layer.num_kv_heads, layer.head_size)
            total += int(np.prod(shape)) * elem // (2 if _shares_kv(layer, backend, shape) else 1)
        return total

    def idle_work(self) -> bool:
        """Do a few milliseconds of work that makes later steps faster (fault the next chunk of the CPU KV
        cache in); return whether any is left."""
        return self.prefaulter is not None and self.prefaulter.step()

    def sleep(self, level: int) -> int:
        """Give the KV cache's memory back (its contents are lost) and, on an accelerator, the weights' (level 1:
        copied to host memory; level 2: the parameters' values discarded); the device bytes freed. The decode
        steps built on their addresses (graphs, the CPU decode plan) are dropped, and built again on waking.
        See :mod:`plinth.worker.sleep`."""
        import gc

        from plinth.worker.sleep import OffloadedTensors

        if self.asleep:
            raise RuntimeError("the model runner is asleep already")
        if level >= 2 and self.device.type != "cpu":
            from plinth.errors import SleepModeError
            from plinth.model_registry.weight_update import update_problem

            problem = update_problem(self.model)
            if problem is not None:
                raise SleepModeError(f"sleep level 2 discards weights that update_weights() could not bring back: "
                                     f"{problem}; sleep(level=1) keeps them")
        # the weights first: a failure there (no host memory to pin) leaves everything as it was
        if self.device.type != "cpu":
            kv = frozenset(c.untyped_storage().data_ptr() for c in self.kv_caches)
            transient = getattr(self.model, "transient_tensors", None)
            scratch = frozenset(t.untyped_storage().data_ptr() for t in (transient() if transient else ()))
            self._offloaded = OffloadedTensors(self.model, self.device, discard_parameters=level >= 2,
                                               host_pool=self._host_pool, exclude=kv, scratch=scratch)
            self._host_pool = self._offloaded.pool   # kept for the next sleep (pinning costs 0.3-0.6 s a GB)
            self.asleep.add("weights")
        if self.graphs is not None:
            rebuilder = getattr(self.graphs, "rebuilder", None)
            self._rebuild_graphs = rebuilder() if rebuilder is not None else None
            if rebuilder is None:
                logger.warning("%s cannot be built again after sleeping: decode runs eagerly after waking",
                               type(self.graphs).__name__)
        self.graphs = None
        freed = self.kv_cache_bytes + (self._offloaded.nbytes if self._offloaded is not None else 0)
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        self.kv_caches = []
        self.prefaulter = None
        self.asleep.add("kv_cache")
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def wake_up(self, tags: Sequence[str]) -> None:
        """Take the memory of ``tags`` (of ``"weights"``, ``"kv_cache"``) again: the weights' values come back
        (zeros for parameters discarded at level 2), the KV cache is zeroed; once both are awake, the decode
        steps are built again.

        Raises:
            ConfigError: the device has no room for them now (what was asleep stays asleep).
        """
        if "weights" in tags and "weights" in self.asleep:
            assert self._offloaded is not None
            try:
                self._offloaded.restore()
            except torch.OutOfMemoryError:
                from plinth.config import ConfigError

                raise ConfigError(f"no room to wake the weights up: {self._offloaded.nbytes / 2**30:.2f} GiB are "
                                  f"needed on {self.device}; free that memory and wake up again") from None
            self._offloaded = None
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            from plinth.config import ConfigError

            try:
                self._allocate_kv()
            except ConfigError:
                raise ConfigError(f"no room to wake the KV cache up: {self.kv_cache_bytes / 2**30:.2f} GiB are "
                                  f"needed on {self.device}; free that memory and wake up again") from None
            self.asleep.discard("kv_cache")
        if not self.asleep and self._rebuild_graphs is not None:
            rebuild, self._rebuild_graphs = self._rebuild_graphs, None
            try:
                self.graphs = rebuild()
            except torch.OutOfMemoryError:
                logger.warning("no room to capture the decode steps again after waking: decode runs eagerly")

    def prepare(self, entries: Sequence[SeqBatchEntry] | FlatBatch) -> StepInputs:
        """Build the flat batch with numpy (no loop over sequences when given a :class:`FlatBatch`)."""
        batch = FlatBatch.from_entries(entries)
        bs = self.block_size
        num_seqs, num_tokens = batch.num_seqs, batch.num_tokens
        q_lens, starts = batch.q_lens, batch.starts
        seq_lens = starts + q_lens                                              # [N]
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
        max_blocks = -(-max_seq_len // bs) if num_seqs else 1
        tables = batch.block_tables                                             # [N, W] int32
        if tables.ndim != 2 or tables.shape[1] != max_blocks:
            tables = _fit_width(tables, num_seqs, max_blocks)
        if batch.decode_only:
            qsl = np.arange(num_seqs + 1, dtype=np.int64)
            positions = starts
            slot_mapping = tables[np.arange(num_seqs), starts // bs].astype(np.int64) * bs + starts % bs
        else:
            qsl = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(q_lens, out=qsl[1:])
            seq_of_token = np.repeat(np.arange(num_seqs), q_lens)              # [T]
            positions = np.arange(num_tokens, dtype=np.int64) - qsl[:-1][seq_of_token] + starts[seq_of_token]
            slot_mapping = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        if self.lora is not None:
            lora = batch.lora_slots
            self.lora.set_tokens(lora if lora is None or batch.decode_only else np.repeat(lora, q_lens))
        if batch.rope_shift is not None:   # multimodal RoPE: rotary positions apart from the cache's
            positions = positions + batch.rope_shift
        sample_seqs = np.flatnonzero(batch.sample)
        sample_rows = qsl[1:][sample_seqs] - 1                                  # [S]
        if batch.num_logits is not None:   # speculative decoding: the last k positions of such sequences
            k = batch.num_logits[sample_seqs]
            sample_seqs = np.repeat(sample_seqs, k)
            sample_rows = np.repeat(sample_rows + 1 - k, k) + (np.arange(len(sample_seqs)) - np.repeat(
                np.cumsum(k) - k, k))
        feed = batch.feed
        int64 = [batch.token_ids, positions, slot_mapping, sample_rows]
        if feed is not None:
            int64 += [feed.rows, feed.src]
        if batch.state_rows is not None:
            int64.append(batch.state_rows)
        if batch.token_types is not None:
            int64.append(batch.token_types)
        (input_ids, positions_t, slots, rows, *extra), (qsl_t, lens_t, ctx_t, tables_t) = self.staging.upload(
            int64, [qsl, seq_lens, starts, tables])
        token_types = extra.pop() if batch.token_types is not None else None
        state_rows = extra.pop() if batch.state_rows is not None else None
        fed = extra
        if feed is not None:   # the step in flight's sampled tokens, gathered on the device
            input_ids.index_copy_(0, fed[0], feed.tokens.index_select(0, fed[1]))
        metadata = AttentionMetadata(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            max_seq_len=max_seq_len,
            query_start_loc=qsl_t,
            seq_lens=lens_t,
            context_lens=ctx_t,
            slot_mapping=slots,
            block_tables=tables_t,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            rows_share_sequences=self.shared_decode_rows,
            state_rows=state_rows,
            state_rows_cpu=batch.state_rows.tolist() if batch.state_rows is not None else None,
            state_saves=_inner_saves(batch),
            image_spans=(_image_spans(batch.images, qsl, seq_lens)
                         if batch.images and getattr(self.model, "bidirectional_images", False) else None),
            token_types=token_types,
        )
        return StepInputs(input_ids=input_ids, positions=positions_t, metadata=metadata, sample_rows=rows,
                          sample_seqs=sample_seqs.tolist())

    def capture_decode_graphs(self, max_num_seqs: int) -> float:
        """Capture decode steps as CUDA graphs for batch sizes up to ``max_num_seqs``; returns seconds."""
        from plinth.worker.cuda_graphs import DecodeGraphRunner

        graphs = DecodeGraphRunner(self.model, self.backend, self.device, max_num_seqs, self.max_blocks_per_seq,
                                   self.block_size, shared_rows=self.shared_decode_rows)
        elapsed = graphs.capture()
        self.graphs = graphs
        return elapsed

    def compile_cpu_decode(self, max_num_seqs: int, sizes: Sequence[int] | None = None) -> None:
        """Run decode batches of up to ``max_num_seqs`` through compiled forward passes (CPU; compiled lazily)."""
        from plinth.worker.cpu_graphs import CompiledDecodeRunner, compile_batch_sizes

        self.graphs = CompiledDecodeRunner(self.model, self.backend, max_num_seqs, self.block_size,
                                           self.max_blocks_per_seq, sizes or compile_batch_sizes(max_num_seqs))

    @torch.inference_mode()
    def execute(self, entries: Sequence[SeqBatchEntry] | FlatBatch) -> tuple[torch.Tensor, list[int],
                                                                             torch.Tensor | None]:
        """Run one step.

        Args:
            entries: the step's sequences, as entries or (cheaper) as a :class:`FlatBatch`.

        Returns:
            (logits [S, vocab] float32 for the sampled sequences, their entry indices,
             hidden states [T, hidden] of the whole flat batch, or None for a replayed decode graph).
        """
        batch = FlatBatch.from_entries(entries)
        self.load_adapters(batch)
        feed = batch.feed
        if feed is not None and self.device.type == "cpu":   # the previous step's tokens are computed already
            batch = dataclasses.replace(batch, token_ids=feed.apply_on_host(batch.token_ids), feed=None)
            feed = None
        self.restore_states(batch)   # before any layer (and a graph's replay)
        if self.graphs is not None and batch.decode_only and 0 < batch.num_seqs <= self.graphs.max_size:
            # [B, W] rows, 0-padded: the graph runners copy them as they copy lists of block ids
            # only the CUDA graph runner takes a feed: a CPU runner's fed tokens were filled in above
            if self.lora is not None:   # a captured step always runs the adapters' products (base rows: zeros)
                self.lora.set_tokens(batch.lora_slots, rows=self.graphs.padded_size(batch.num_seqs))
            extra: dict[str, Any] = {} if feed is None else {"feed": feed}
            if batch.rope_shift is not None:
                extra["rope_shift"] = batch.rope_shift
            if batch.state_rows is not None:
                extra["state_rows"] = batch.state_rows
            logits = self.graphs.run(batch.token_ids, batch.starts, batch.block_tables, **extra)
            if logits is not None:   # None: this batch runs eagerly (a runner that could not compile)
                self.save_states(batch)
                return logits, list(range(batch.num_seqs)), None
        inputs = self.prepare(batch)
        self.backend.prepare(inputs.metadata)
        if batch.images:
            if self.images is None:
                raise RuntimeError("a batch with image inputs reached a runner without an image encoder")
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata,
                                image_embeds=self.images.rows(batch.images))
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        self.save_states(batch)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        return logits, inputs.sample_seqs, hidden

    def _on_device(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(self.device)

    def restore_states(self, batch: FlatBatch) -> None:
        """Before the layers: the sequences that start from a prefix-cache checkpoint's recurrent state take it."""
        checkpoints = batch.state_checkpoints
        if checkpoints is None or not len(checkpoints.restore_seqs) or not self._keeps_state():
            return
        assert batch.state_rows is not None
        rows = batch.state_rows[checkpoints.restore_seqs]
        self.model.ensure_state_rows(int(rows.max()) + 1)
        self.model.recurrent_state.restore(self._on_device(rows), self._on_device(checkpoints.restore_slots))

    def _keeps_state(self) -> bool:
        """Whether this runner's layers keep recurrent state (a pipeline stage of attention layers keeps none)."""
        return bool(getattr(self.model, "stage_has_state", False))

    def save_states(self, batch: FlatBatch) -> None:
        """After the layers: the checkpoint saves at the end of a sequence's tokens of the step (copies of its state
        row; those inside a prompt chunk were made by the layers)."""
        checkpoints = batch.state_checkpoints
        if checkpoints is None or not len(checkpoints.save_seqs) or not self._keeps_state():
            return
        assert batch.state_rows is not None
        at_end = checkpoints.save_offsets == batch.q_lens[checkpoints.save_seqs]
        if at_end.any():
            self.model.recurrent_state.save(self._on_device(batch.state_rows[checkpoints.save_seqs[at_end]]),
                                            self._on_device(checkpoints.save_slots[at_end]))

    def load_adapters(self, batch: FlatBatch) -> None:
        """Copy the step's new LoRA adapters into their slots (before anything of the step runs)."""
        for slot, adapter in batch.lora_loads:
            assert self.lora is not None, "a LoRA adapter sent to a runner without LoRA slots"
            self.lora.load(slot, adapter.modules, self.model)

    @torch.inference_mode()
    def prompt_logits(self, hidden: torch.Tensor, rows: slice) -> torch.Tensor:
        """Logits of a range of flat-batch rows (for prompt logprobs)."""
        return self.model.compute_logits(hidden[rows])


def _inner_saves(batch: FlatBatch) -> dict[int, list[tuple[int, int]]] | None:
    """The checkpoint saves the layers make: sequence index -> ``[(offset, slot)]`` (increasing offsets) for those
    inside a chunk."""
    c = batch.state_checkpoints
    if c is None or not len(c.save_seqs):
        return None
    inner: dict[int, list[tuple[int, int]]] = {}
    for i, o, slot in zip(c.save_seqs.tolist(), c.save_offsets.tolist(), c.save_slots.tolist(), strict=True):
        if o < batch.q_lens[i]:
            inner.setdefault(i, []).append((o, slot))
    for saves in inner.values():
        saves.sort()
    return inner or None


def _fit_width(tables: np.ndarray, rows: int, width: int) -> np.ndarray:
    """``[rows, width]`` int32: ``tables`` cut or 0-padded to ``width`` columns."""
    out = np.zeros((rows, width), dtype=np.int32)
    if tables.ndim == 2 and rows:
        w = min(width, tables.shape[1])
        out[:, :w] = tables[:, :w]
    return out


def _image_spans(images: Any, qsl: np.ndarray, seq_lens: np.ndarray,
                 ) -> tuple[tuple[int, int, int, int, int], ...]:
    """A step's image rows as :attr:`AttentionMetadata.image_spans` (each image's rows, their sequence, first position
    and the image's end position).

    Raises:
        RuntimeError: a chunk that ends inside an image (its later positions, which its rows see, not yet computed).
    """
    spans = []
    for first, rows, item, offset in images:
        if item.prompt:   # (a prompt given as embeddings: text, attended causally)
            continue
        seq = int(np.searchsorted(qsl, first, side="right")) - 1
        pos = item.offset + offset
        if item.end > int(seq_lens[seq]):
            raise RuntimeError(f"a prompt chunk ends at position {int(seq_lens[seq])}, inside an image "
                               f"({item.offset}..{item.end}) whose positions attend to each other")
        spans.append((seq, int(first), int(rows), pos, int(item.end)))
    return tuple(spans)
