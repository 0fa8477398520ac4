"""The engine's per-step batch path: the persistent block table and flat batches against batches
rebuilt from the requests' own lists, the runner's vectorised inputs against a per-token loop, the
pinned-staging packing, and the block manager's decode fast path against its general path.

The scheduler workloads run through preemption, prefix-cache hits, chunked prefill, aborts and
stop-token finishes (each asserted to have happened), with the scheduler test's fake paged "model".
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from plinth.config import SchedulerConfig
from plinth.core.block_manager import BlockManager
from plinth.core.request import FinishReason, Request, SamplingParams
from plinth.core.scheduler import Scheduler, SchedulerOutput
from plinth.worker.batching import (
    BatchBuilder,
    FlatBatch,
    PersistentBlockTable,
    SeqBatchEntry,
    block_table_array,
)
from plinth.worker.model_runner import ModelRunner
from plinth.worker.staging import HostStaging

VOCAB = 500


def _fake_tokens(out: SchedulerOutput, slots: dict[tuple[int, int], int], bs: int) -> list[int | None]:
    """A deterministic function of each sequence's context, read through its block table."""
    for e in out.scheduled:
        for j, tok in enumerate(e.token_ids):
            p = e.num_computed_tokens + j
            slots[(e.request.block_ids[p // bs], p % bs)] = tok
    sampled: list[int | None] = []
    for e in out.scheduled:
        if not e.sample:
            sampled.append(None)
            continue
        acc = 7
        for p in range(e.num_computed_tokens + e.num_new_tokens):
            acc = (acc * 1_000_003 + slots[(e.request.block_ids[p // bs], p % bs)]) % 2_147_483_647
        sampled.append(acc % VOCAB)
    return sampled


def _workload(seed: int) -> list[Request]:
    """Prompts sharing prefixes (prefix-cache hits), long ones (chunked prefill), a stop token."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(24)]
    reqs = []
    for i in range(14):
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        prompt = (shared[: rng.choice((8, 16, 24))] + tail) if i % 2 else tail + shared[:5]
        params = SamplingParams(max_tokens=rng.randint(4, 28), stop_token_ids=[3] if i % 5 == 0 else [])
        reqs.append(Request(f"r{i}", prompt, params))
    return reqs


def _drive(scheduler: Scheduler, reqs: list[Request], on_step, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    slots: dict[tuple[int, int], int] = {}
    for r in reqs:
        scheduler.add_request(r)
    for step in range(3000):
        if not scheduler.has_unfinished_requests():
            break
        if step == 9:                                         # an abort, and a stop-string-like finish
            scheduler.abort(["r3"])
        if step == 14:
            scheduler.finish_request("r6", FinishReason.STOP, "x")
        out = scheduler.schedule()
        if not out.scheduled:
            continue
        on_step(out)
        tokens = _fake_tokens(out, slots, scheduler.block_manager.block_size)
        scheduler.update_from_output(out, [t if t is None or rng.random() > 0.02 else 3 for t in tokens])
    else:
        raise AssertionError("the workload did not finish")
    return {r.request_id: list(r.output_token_ids) for r in reqs}


def _scheduler(num_blocks: int, bm_cls: type[BlockManager] = BlockManager) -> Scheduler:
    bm = bm_cls(num_blocks, 4, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40), bm, 256)


def _assert_same_batch(got: FlatBatch, want: FlatBatch) -> None:
    for name in ("token_ids", "q_lens", "starts", "block_counts", "sample"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    width = int(want.block_counts.max())
    np.testing.assert_array_equal(got.block_tables[:, :width], want.block_tables[:, :width])
    assert not got.block_tables[:, width:].any(), "entries past a row's blocks must be 0"
    assert got.decode_only == want.decode_only
    np.testing.assert_array_equal(got.block_ids_flat(), want.block_ids_flat())


@pytest.mark.parametrize("num_blocks", [26, 200])
def test_incremental_block_table_equals_a_rebuilt_one(num_blocks):
    """Across preemption/resume, prefix-cache hits, aborts and finishes, every step's batch from the
    persistent table equals the batch built afresh from the requests' block lists."""
    sched = _scheduler(num_blocks)
    builder = BatchBuilder(max_blocks_per_seq=4, max_num_seqs=2)   # small: rows and width must grow
    seen = {"preempted": 0, "decode_only": 0, "mixed": 0}

    def check(out: SchedulerOutput) -> None:
        batch, sampled = builder.build(out)
        entries = [SeqBatchEntry(s.token_ids, s.num_computed_tokens, list(s.request.block_ids), s.sample)
                   for s in out.scheduled]
        _assert_same_batch(batch, FlatBatch.from_entries(entries))
        assert sampled == [s.request for s in out.scheduled if s.sample]
        assert builder.block_table.num_rows_in_use == len(sched.running)
        seen["preempted"] += len(out.preempted_request_ids)
        seen["decode_only" if batch.decode_only else "mixed"] += 1

    _drive(sched, _workload(1), check)
    stats = sched.block_manager.stats
    assert stats.hit_blocks > 0 and seen["mixed"] > 0 and seen["decode_only"] > 0
    if num_blocks == 26:
        assert seen["preempted"] > 0


class _SlowPathBlockManager(BlockManager):
    def _fits(self, request: Request, num_new_tokens: int) -> bool:
        return False


def test_block_manager_fast_path_leaves_the_same_state_as_the_general_path():
    fast, slow = _scheduler(26), _scheduler(26, _SlowPathBlockManager)
    states = {}

    def snapshot(name: str, sched: Scheduler):
        bm = sched.block_manager
        states.setdefault(name, []).append((
            {r.request_id: list(r.block_ids) for r in sched.running}, dict(bm._cache), list(bm._free),
            list(bm._ref), {k: list(v) for k, v in bm._chains.items()}, vars(bm.stats).copy()))

    out_fast = _drive(fast, _workload(2), lambda out: snapshot("fast", fast))
    out_slow = _drive(slow, _workload(2), lambda out: snapshot("slow", slow))
    assert out_fast == out_slow
    assert states["fast"] == states["slow"]
    assert fast.num_preemptions > 0 and fast.block_manager.stats.hit_blocks > 0


def test_persistent_block_table_rows():
    table = PersistentBlockTable(width=2, rows=1)
    a, b = [5, 6], [7]
    assert table.row("a", a) == 0
    rb = table.row("b", b)                                   # grows the rows
    a.extend([8, 9, 10])                                     # grows the width
    assert table.row("a", a) == 0
    np.testing.assert_array_equal(table.gather(np.array([0, rb]), 5), [[5, 6, 8, 9, 10], [7, 0, 0, 0, 0]])
    table.row("b", [4])                                      # a new list (freed and re-allocated): rewritten
    np.testing.assert_array_equal(table.gather(np.array([rb]), 2), [[4, 0]])
    table.release("a")
    assert not table.table[0].any()
    assert table.row("c", [1, 2]) == 0                       # the released row is reused, clean
    np.testing.assert_array_equal(table.gather(np.array([0]), 6), [[1, 2, 0, 0, 0, 0]])
    np.testing.assert_array_equal(table.counts(np.array([0, rb])), [2, 1])
    table.release("missing")


def test_flat_batch_is_a_sequence_of_entries():
    entries = [SeqBatchEntry([1, 2, 3], 0, [5], True), SeqBatchEntry([4], 7, [6, 7], False),
               SeqBatchEntry([9, 9], 2, [], True)]
    flat = FlatBatch.from_entries(entries)
    assert list(flat) == entries and len(flat) == 3
    assert flat[1] == entries[1] and flat[-1] == entries[2] and flat[0:2] == entries[:2]
    assert FlatBatch.from_entries(flat) is flat
    np.testing.assert_array_equal(flat.block_ids_flat(), [5, 6, 7])
    with pytest.raises(IndexError):
        flat[3]


def test_block_table_array_takes_padded_rows():
    rng = np.random.default_rng(0)
    lists = [list(rng.integers(1, 100, size=n)) for n in (0, 1, 5, 9, 3)]
    padded = block_table_array(lists, 9)
    for width, rows in ((4, None), (9, 8), (1, 5), (12, 6)):
        np.testing.assert_array_equal(block_table_array(padded, width, rows), block_table_array(lists, width, rows))


# ------------------------------------------------------------------ the runner's inputs


def _runner(block_size: int, staging: HostStaging | None = None) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size = block_size
    runner.device = torch.device("cpu")
    runner.staging = staging or HostStaging(torch.device("cpu"))
    runner.lora = None
    runner.shared_decode_rows = False
    return runner


def _reference_inputs(entries: list[SeqBatchEntry], bs: int) -> dict[str, list]:
    """The flat batch, one token at a time."""
    ref: dict[str, list] = {k: [] for k in ("input_ids", "positions", "slots", "qsl", "seq_lens", "ctx", "rows")}
    ref["qsl"].append(0)
    for e in entries:
        for j, tok in enumerate(e.token_ids):
            p = e.start_pos + j
            ref["input_ids"].append(tok)
            ref["positions"].append(p)
            ref["slots"].append(e.block_ids[p // bs] * bs + p % bs)
        ref["qsl"].append(ref["qsl"][-1] + len(e.token_ids))
        ref["seq_lens"].append(e.start_pos + len(e.token_ids))
        ref["ctx"].append(e.start_pos)
        if e.sample:
            ref["rows"].append(ref["qsl"][-1] - 1)
    return ref


@pytest.mark.parametrize("packed", [False, True])
def test_runner_inputs_equal_a_per_token_loop(packed):
    bs = 4
    rng = random.Random(3)
    runner = _runner(bs, HostStaging(torch.device("cpu"), packed=packed))
    for trial in range(30):
        entries = []
        for _ in range(rng.randint(1, 9)):
            q = 1 if trial % 3 == 0 else rng.randint(1, 11)
            start = rng.randint(0, 30)
            blocks = [rng.randint(1, 300) for _ in range(-(-(start + q) // bs) + rng.randint(0, 2))]
            entries.append(SeqBatchEntry([rng.randrange(VOCAB) for _ in range(q)], start, blocks,
                                         trial % 3 == 0 or rng.random() < 0.7))
        ref = _reference_inputs(entries, bs)
        for given in (entries, FlatBatch.from_entries(entries)):
            inputs = runner.prepare(given)
            md = inputs.metadata
            assert inputs.input_ids.tolist() == ref["input_ids"]
            assert inputs.positions.tolist() == ref["positions"]
            assert md.slot_mapping.tolist() == ref["slots"]
            assert md.query_start_loc.tolist() == ref["qsl"] == md.query_start_loc_cpu
            assert md.seq_lens.tolist() == ref["seq_lens"] == md.seq_lens_cpu
            assert md.context_lens.tolist() == ref["ctx"]
            assert inputs.sample_rows.tolist() == ref["rows"]
            assert inputs.sample_seqs == [i for i, e in enumerate(entries) if e.sample]
            width = -(-max(ref["seq_lens"]) // bs)
            assert md.block_tables.tolist() == block_table_array([e.block_ids for e in entries], width).tolist()
            assert (md.query_start_loc.dtype, md.seq_lens.dtype, md.block_tables.dtype, md.slot_mapping.dtype) == (
                torch.int32, torch.int32, torch.int32, torch.int64)
            assert md.max_query_len == max(len(e.token_ids) for e in entries)
            assert md.max_seq_len == max(ref["seq_lens"])


def test_packed_staging_reuses_its_buffer_without_aliasing():
    staging = HostStaging(torch.device("cpu"), packed=True)
    (a, b), (c,) = staging.upload([np.arange(5), np.array([[1, 2], [3, 4]])], [np.array([7, 8, 9])])
    assert a.tolist() == list(range(5)) and b.tolist() == [[1, 2], [3, 4]] and c.tolist() == [7, 8, 9]
    assert c.dtype == torch.int32 and b.dtype == torch.int64
    (d,), () = staging.upload([np.full(10_000, 3)], [])      # grows the buffer; earlier tensors untouched
    assert d.tolist() == [3] * 10_000 and a.tolist() == list(range(5))


def test_read_only_arrays_upload_without_a_warning():
    """Arrays handed over read-only (Ray's object store gives its actors such views) are uploaded as they are, with
    no torch warning about non-writable arrays (one per actor and step before)."""
    import warnings

    ids, lens = np.arange(6, dtype=np.int64), np.array([3, 3], dtype=np.int32)
    ids.flags.writeable = lens.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (t64,), (t32,) = HostStaging(torch.device("cpu")).upload([ids], [lens])
    assert t64.tolist() == list(range(6)) and t32.tolist() == [3, 3]
