"""``plinth serve``'s per-step token budget: a smaller default on a CPU, the flag and other platforms untouched."""

from __future__ import annotations

import types

import pytest

from plinth.config import ConfigError, SchedulerConfig
from plinth.entrypoints import serve_cmd
from plinth.entrypoints.cli import build_parser


def serve_args(*flags: str):
    argv = ["serve", *flags]
    return build_parser(argv).parse_args(argv)


@pytest.fixture
def platform(monkeypatch):
    """Make platform selection report the device type a test asks for."""
    chosen = {"device_type": "cpu"}
    calls = []

    def select(forced=None):
        calls.append(forced)
        return types.SimpleNamespace(device_type=chosen["device_type"], name=chosen["device_type"],
                                     scheduler_defaults=lambda index=0: (256, 2048))

    monkeypatch.setattr("plinth.platforms.selection.select_platform", select)
    return chosen, calls


def test_cpu_serving_gets_the_serving_budget(platform):
    config = serve_cmd.serving_config(serve_args())
    assert config.scheduler.max_num_batched_tokens == serve_cmd.CPU_SERVE_TOKEN_BUDGET == 256
    # every running stream's decode must fit in a step
    config = serve_cmd.serving_config(serve_args("--max-num-seqs", "600"))
    assert config.scheduler.max_num_batched_tokens == 600


def test_the_forced_platform_is_the_one_asked(platform):
    _, calls = platform
    serve_cmd.serving_config(serve_args("--platform", "cpu"))
    assert calls == ["cpu"]


def test_explicit_budget_and_other_platforms_keep_their_values(platform):
    chosen, calls = platform
    assert serve_cmd.serving_config(serve_args("--max-num-batched-tokens", "4096")).scheduler.max_num_batched_tokens == 4096
    assert calls == []  # an explicit budget needs no platform probe
    chosen["device_type"] = "cuda"
    # None: the engine fills in the platform's default when it starts (resolve_scheduler_limits)
    assert serve_cmd.serving_config(serve_args()).scheduler.max_num_batched_tokens is None
    chosen["device_type"] = "cpu"
    # without chunked prefill a whole prompt must fit in one step: the engine default stays
    config = serve_cmd.serving_config(serve_args("--no-chunked-prefill"))
    assert config.scheduler.max_num_batched_tokens is None


def _gpu(total_bytes: int):
    """A CUDA platform object whose device 0 reports ``total_bytes`` of memory."""
    from plinth.platforms.cuda.platform import CudaPlatform

    class Sized(CudaPlatform):
        def total_memory(self, index: int = 0) -> int:
            return total_bytes

    return Sized()


def test_scheduler_defaults_follow_device_memory():
    from plinth.platforms.cpu.platform import CpuPlatform

    assert _gpu(141 * 2**30).scheduler_defaults(0) == (512, 2048)     # an H200
    assert _gpu(80 * 2**30).scheduler_defaults(0) == (512, 2048)      # an H100
    assert _gpu(24 * 2**30).scheduler_defaults(0) == (256, 2048)
    assert CpuPlatform().scheduler_defaults(0) == (256, 2048)


def test_engine_fills_only_the_unset_limits():
    from plinth.config import EngineConfig
    from plinth.worker.setup import resolve_scheduler_limits

    big = _gpu(141 * 2**30)
    cfg = resolve_scheduler_limits(EngineConfig.from_kwargs(model="m"), big)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (512, 2048)
    cfg = resolve_scheduler_limits(EngineConfig.from_kwargs(model="m", max_num_seqs=64), big)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (64, 2048)
    fixed = EngineConfig.from_kwargs(model="m", max_num_seqs=8, max_num_batched_tokens=100)
    assert resolve_scheduler_limits(fixed, big) is fixed


def test_a_bare_scheduler_takes_the_base_limits():
    from plinth.core.block_manager import BlockManager
    from plinth.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(), BlockManager(8, 16, False), 128)
    assert (sched.config.max_num_seqs, sched.config.max_num_batched_tokens) == (256, 2048)


def test_bad_budget_is_a_config_error(platform):
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        serve_cmd.serving_config(serve_args("--max-num-batched-tokens", "0"))
