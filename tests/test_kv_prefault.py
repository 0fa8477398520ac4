"""Faulting the CPU KV cache in while the engine is idle: every page becomes resident, in block order, with the
cache's contents unchanged; the engine does it only between requests, and a server's loop keeps serving when it
fails."""

from __future__ import annotations

import asyncio
import mmap
import resource
import sys
import time

import pytest
import torch

from plinth import LLM, SamplingParams
from plinth.worker.kv_prefault import PREFAULT_ENV, KVPrefaulter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux's")
PAGE = 4096


#: faults per page that still count as populated pages: the kernel may migrate a few resident pages while the test
#: runs (compaction under other processes' memory pressure), and a migrated page faults once more
RESIDENT = 0.02


def write_faults(t: torch.Tensor, lo: int = 0, hi: int | None = None) -> float:
    """Page faults per page when one byte of each page holding bytes [lo, hi) of ``t`` is written (with its
    own value): ~1 for pages not yet populated, ~0 (at most :data:`RESIDENT`) for populated ones."""
    b = t.view(-1).view(torch.uint8)[lo:hi].numpy()
    offsets = list(range(-b.ctypes.data % PAGE, b.size, PAGE))
    if not offsets:
        return 0.0
    values = [int(b[i]) for i in offsets]
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for i, v in zip(offsets, values, strict=True):   # no allocation in between: only the pages' own faults count
        b[i] = v
    return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / len(offsets)


@pytest.fixture
def fresh():
    """Makes float32 zero tensors on fresh anonymous mappings (4 KiB pages, none populated until touched), each
    starting at a 2 MiB boundary; unmapped after the test."""
    maps: list[mmap.mmap] = []
    align = 2 << 20

    def make(*shape: int) -> torch.Tensor:
        n = 4
        for d in shape:
            n *= d
        buf = mmap.mmap(-1, n + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_NOHUGEPAGE)
        maps.append(buf)
        whole = torch.frombuffer(buf, dtype=torch.uint8)
        skip = -whole.data_ptr() % align
        return whole[skip:skip + n].view(torch.float32).view(*shape)

    yield make
    for buf in maps:
        try:
            buf.close()
        except BufferError:   # a tensor still exports it: left to the garbage collector
            pass


def skip_without_populate(prefaulter: KVPrefaulter) -> None:
    if prefaulter.done and prefaulter.populated_bytes == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")


@linux_only
def test_pages_become_resident_in_block_order_and_contents_stay(fresh):
    blocks = 512
    caches = [fresh(2, blocks, 16, 4, 64) for _ in range(2)]   # 16 MiB each: keys and values 8 MiB apiece
    block_bytes = 16 * 4 * 64 * 4
    half = blocks * block_bytes
    caches[0][0, 3].fill_(1.5)     # a few written blocks (keys of block 3, values of block 200 and the last)
    caches[1][1, 200].fill_(-2.0)
    caches[1][1, blocks - 1, 7].fill_(4.0)
    before = [c.clone() for c in caches]

    window = 1 << 20
    p = KVPrefaulter(caches, blocks, window_bytes=window)
    more = [p.step() for _ in range(4)]   # the first window of each of the four regions
    skip_without_populate(p)
    assert all(more) and p.populated_bytes == 4 * window
    first = window // block_bytes    # blocks per window
    for c in caches:   # every cache's keys and values of the first blocks, not of the later ones
        assert write_faults(c, 0, first * block_bytes) <= RESIDENT
        assert write_faults(c, half, half + first * block_bytes) <= RESIDENT
        assert write_faults(c, first * block_bytes, 2 * first * block_bytes) > 0.9
        assert write_faults(c, half + (blocks - 10) * block_bytes, 2 * half) > 0.9
    steps = 4
    while True:
        done_before = p.populated_bytes
        more = p.step()
        assert p.populated_bytes - done_before <= window   # at most one window a step
        steps += 1
        if not more:
            break
    assert p.done and not p.step()
    assert steps == 4 * (half // window)
    assert p.populated_bytes == sum(c.numel() * c.element_size() for c in caches)
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c, b)
        assert write_faults(c) <= RESIDENT   # (the pages written above faulted already)


@linux_only
def test_a_cache_without_a_block_dimension_is_populated_front_to_back(fresh):
    cache = fresh(8, 262_144)   # 8 MiB, no dimension of 5
    cache[7, -1] = 9.0
    p = KVPrefaulter([cache], 5, window_bytes=1 << 20)
    more = p.step()
    skip_without_populate(p)
    assert more and write_faults(cache, 0, 1 << 20) <= RESIDENT and write_faults(cache, 1 << 20, 2 << 20) > 0.9
    steps = 1
    while p.step():
        steps += 1
    assert steps + 1 == 8   # one window a step
    assert write_faults(cache) <= RESIDENT and p.populated_bytes == cache.numel() * 4
    assert cache[7, -1].item() == 9.0 and cache.sum().item() == 9.0


def test_prefaulter_refuses_what_it_cannot_describe():
    with pytest.raises(ValueError, match="contiguous CPU"):
        KVPrefaulter([torch.zeros(4, 6).t()], 4)
    with pytest.raises(ValueError, match="power of two"):
        KVPrefaulter([torch.zeros(4, 6)], 4, window_bytes=3 << 20)


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@linux_only
def test_engine_idle_work_faults_the_cache_in_only_between_requests(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    engine = llm.engine
    reference = [o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "0123"], greedy(), use_tqdm=False)]
    runner = engine.executor.runner
    assert runner.prefaulter is not None
    engine.add_request("busy", "Paris is", greedy())
    assert engine.idle_work() is False and runner.prefaulter.populated_bytes == 0   # a request runs: no work
    while engine.has_unfinished_requests():
        engine.step()
    calls = 0
    while engine.idle_work():
        calls += 1
    skip_without_populate(runner.prefaulter)
    assert runner.prefaulter.done and calls >= 1
    assert runner.prefaulter.populated_bytes == runner.kv_cache_bytes
    assert max(write_faults(c) for c in runner.kv_caches) <= RESIDENT
    again = [o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "0123"], greedy(), use_tqdm=False)]
    assert again == reference


def test_prefault_switch_off(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv(PREFAULT_ENV, "0")
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    assert llm.engine.executor.runner.prefaulter is None
    assert llm.engine.idle_work() is False


def serve_one(front, prompt: str) -> list[int]:
    async def main() -> list[int]:
        last: list[int] = []
        async for out in front.generate("r", prompt, greedy()):
            last = list(out.outputs[0].token_ids)
        return last

    return asyncio.run(asyncio.wait_for(main(), 60))


def wait_for(cond, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_server_loop_does_idle_work_until_none_is_left(tiny_llama_dir):
    from plinth.core.async_engine import AsyncLLMEngine

    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    engine = llm.engine
    reference = llm.generate("The quick brown fox", greedy(), use_tqdm=False)[0].outputs[0].token_ids
    calls = []
    pieces = iter([True, True, False])
    engine.idle_work = lambda: calls.append(engine.has_unfinished_requests()) or next(pieces)
    front = AsyncLLMEngine(engine)
    try:
        wait_for(lambda: len(calls) == 3)
        assert serve_one(front, "The quick brown fox") == reference
        time.sleep(0.05)
        assert calls == [False, False, False]   # never while a request ran, and not again once none was left
    finally:
        front.shutdown()


def test_failing_idle_work_does_not_stop_the_server_loop(tiny_llama_dir):
    from plinth.core.async_engine import AsyncLLMEngine

    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    engine = llm.engine
    reference = llm.generate("0123", greedy(), use_tqdm=False)[0].outputs[0].token_ids
    calls = []

    def broken() -> bool:
        calls.append(1)
        raise RuntimeError("madvise exploded")

    engine.idle_work = broken
    front = AsyncLLMEngine(engine)
    try:
        wait_for(lambda: calls)
        assert front.is_healthy
        assert serve_one(front, "0123") == reference
        assert len(calls) == 1 and front.is_healthy
    finally:
        front.shutdown()
