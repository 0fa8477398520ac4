"""The step profiler (PLINTH_PROFILE_DIR / PLINTH_PROFILE_STEPS): window, output, bad settings."""

from __future__ import annotations

import json

import pytest
import torch

from plinth.config import ConfigError
from plinth.worker.profiling import PROFILE_DIR_ENV, PROFILE_STEPS_ENV, StepProfiler, union_us


def test_off_without_a_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(PROFILE_DIR_ENV, raising=False)
    monkeypatch.setenv(PROFILE_STEPS_ENV, "not checked when off")
    prof = StepProfiler(0, lambda: None)
    for _ in range(3):
        prof.before_step()
        prof.after_step()
    assert prof.directory is None and list(tmp_path.iterdir()) == []


def test_profiles_the_window_of_steps_and_writes_a_summary(monkeypatch, tmp_path):
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path / "prof"))
    monkeypatch.setenv(PROFILE_STEPS_ENV, "2:3")
    syncs = []
    prof = StepProfiler(1, lambda: syncs.append(prof._step))
    x = torch.randn(64, 64)
    for step in range(8):
        prof.before_step()
        assert (prof._prof is not None) == (2 <= step < 5), step
        x = x @ x.t() / 64
        prof.after_step()
    assert syncs == [2, 5]   # at the window's two ends
    (summary_file,) = [p for p in (tmp_path / "prof").glob("rank1-pid*.json") if not p.name.endswith(".trace.json")]
    summary = json.loads(summary_file.read_text())
    assert summary["rank"] == 1 and summary["steps"] == 3 and summary["first_step"] == 2
    assert summary["wall_ms_per_step"] > 0 and summary["device_busy_ms_per_step"] == 0   # no device here
    assert list((tmp_path / "prof").glob("rank1-pid*.trace.json"))


@pytest.mark.parametrize("raw", ["20", "a:b", "-1:4", "3:0"])
def test_a_malformed_window_is_a_config_error(monkeypatch, tmp_path, raw):
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(PROFILE_STEPS_ENV, raw)
    with pytest.raises(ConfigError, match=PROFILE_STEPS_ENV):
        StepProfiler(0, lambda: None)


def test_union_of_intervals():
    assert union_us([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert union_us([]) == 0.0


def test_the_in_process_engine_profiles_its_steps(monkeypatch, tmp_path, tiny_llama_dir):
    from plinth import LLM, SamplingParams

    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path / "prof"))
    monkeypatch.setenv(PROFILE_STEPS_ENV, "1:2")
    with LLM(str(tiny_llama_dir), dtype="float32", selection="off") as llm:
        llm.generate("hello there", SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    (summary_file,) = [p for p in (tmp_path / "prof").glob("rank0-pid*.json") if not p.name.endswith(".trace.json")]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == 2 and summary["first_step"] == 1 and summary["wall_ms_per_step"] > 0
