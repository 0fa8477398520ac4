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
        return types.SimpleNamespace(device_type=chosen["device_type"], name=chosen["device_type"])

    monkeypatch.setattr("plinth.platforms.selection.select_platform", select)
    return chosen, calls


def test_cpu_serving_gets_the_serving_budget(platform):
    config = serve_cmd.serving_config(serve_args())
    assert config.scheduler.max_num_batched_tokens == serve_cmd.CPU_SERVE_TOKEN_BUDGET == 512
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
    engine_default = SchedulerConfig().max_num_batched_tokens
    assert serve_cmd.serving_config(serve_args()).scheduler.max_num_batched_tokens == engine_default
    chosen["device_type"] = "cpu"
    # without chunked prefill a whole prompt must fit in one step: the engine default stays
    config = serve_cmd.serving_config(serve_args("--no-chunked-prefill"))
    assert config.scheduler.max_num_batched_tokens == engine_default


def test_bad_budget_is_a_config_error(platform):
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        serve_cmd.serving_config(serve_args("--max-num-batched-tokens", "0"))
