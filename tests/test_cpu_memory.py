"""Faulting in the CPU KV cache's calloc'd pages off the step path (plinth/worker/cpu_memory.py)."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from plinth.worker import cpu_memory
from plinth.worker.model_runner import _zeros

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise/mincore: Linux")


@linux_only
def test_populate_makes_fresh_calloc_pages_resident():
    cache = _zeros((64, 16, 4, 64), torch.bfloat16, torch.device("cpu"))     # 512 KiB, untouched
    if cpu_memory.resident_fraction(cache) > 0.5:
        pytest.skip("the allocator handed back pages that are already resident")
    if not cpu_memory.populate([cache]):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert cpu_memory.resident_fraction(cache) == 1.0
    assert torch.count_nonzero(cache) == 0                                   # still zeros


@linux_only
def test_background_thread_fills_the_cache_and_can_be_turned_off(monkeypatch):
    caches = [_zeros((128, 16, 2, 64), torch.bfloat16, torch.device("cpu")) for _ in range(3)]
    monkeypatch.setenv(cpu_memory.POPULATE_ENV, "0")
    assert cpu_memory.populate_in_background(caches) is None
    monkeypatch.setenv(cpu_memory.POPULATE_ENV, "1")
    started = cpu_memory.populate_in_background(caches)
    assert started is not None
    thread, _stop = started
    thread.join(timeout=30)
    assert not thread.is_alive()
    if not cpu_memory.populate(caches[:1]):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert all(cpu_memory.resident_fraction(c) == 1.0 for c in caches)


@linux_only
def test_the_thread_does_not_keep_a_dropped_cache_alive(monkeypatch):
    monkeypatch.setenv(cpu_memory.POPULATE_ENV, "1")
    cache = _zeros((16, 16, 2, 64), torch.bfloat16, torch.device("cpu"))
    ref = weakref.ref(cache)
    stop_thread = cpu_memory.populate_in_background([cache])
    assert stop_thread is not None
    stop_thread[1].set()
    stop_thread[0].join(timeout=30)
    del cache
    gc.collect()
    assert ref() is None


def test_no_thread_for_device_caches_or_empty_lists(monkeypatch):
    monkeypatch.setenv(cpu_memory.POPULATE_ENV, "1")
    assert cpu_memory.populate_in_background([]) is None
    assert cpu_memory.populate_in_background([torch.empty(0)]) is None
    assert cpu_memory.populate_in_background([torch.empty(4, device="meta")]) is None


@linux_only
def test_an_engine_pages_its_cpu_cache_in_once_built(tiny_llama_dir, monkeypatch):
    from plinth import LLM

    monkeypatch.setenv(cpu_memory.POPULATE_ENV, "1")
    with LLM(str(tiny_llama_dir), selection="off", cpu_kv_cache_bytes=8 << 20) as llm:
        runner = llm.engine.executor.runner
        assert runner.kv_populate is not None
        thread, _stop = runner.kv_populate
        thread.join(timeout=30)
        if not cpu_memory.populate(runner.kv_caches[:1]):
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
        assert all(cpu_memory.resident_fraction(c) == 1.0 for c in runner.kv_caches)
        assert len(llm.generate(["hello"], use_tqdm=False)[0].outputs[0].token_ids) > 0
