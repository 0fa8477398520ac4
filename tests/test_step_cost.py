"""The step cost model behind the inter-token latency target, and the scheduler's prefill allowance."""

from __future__ import annotations

import random

import pytest
from test_scheduler import make_scheduler, prompts, reference, req, run

from plinth.core.step_cost import StepCostModel


def feed(model: StepCostModel, a: float, b: float, c: float, n: int, noise: float = 0.0, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        p, d = rng.choice([0, 0, 16, 64, 200, 512]), rng.randint(0, 32)
        if p + d == 0:
            d = 1
        model.observe(p, d, (a + b * p + c * d) * (1 + rng.uniform(-noise, noise)))


def test_fit_recovers_the_step_costs():
    model = StepCostModel(refit_every=1)
    feed(model, 0.010, 0.0008, 0.0015, 64)
    a, b, c = model.coefficients()
    assert a == pytest.approx(0.010, rel=1e-6) and b == pytest.approx(0.0008, rel=1e-6)
    assert c == pytest.approx(0.0015, rel=1e-6)
    # 31 decodes cost 10 + 46.5 ms; 120 ms leaves 63.5 ms = 79 prefill tokens
    assert model.prefill_allowance(31, 0.120) == 79
    assert model.prefill_allowance(80, 0.120) == 0          # the decodes alone take longer


def test_noisy_steps_give_a_close_fit():
    model = StepCostModel(refit_every=1)
    feed(model, 0.010, 0.0008, 0.0015, 128, noise=0.1, seed=3)
    a, b, c = model.coefficients()
    assert b == pytest.approx(0.0008, rel=0.1) and c == pytest.approx(0.0015, rel=0.2)
    assert abs(model.prefill_allowance(31, 0.120) - 79) <= 12


def test_no_answer_until_the_steps_tell_the_costs_apart():
    model = StepCostModel(min_samples=8)
    assert model.prefill_allowance(4, 0.1) is None
    for _ in range(20):                 # decode-only steps: nothing says what a prefill token costs
        model.observe(0, 8, 0.02)
    assert model.coefficients() is None and model.prefill_allowance(8, 0.1) is None
    model.observe(0, 8, 0.0)            # a zero-length or empty step is ignored
    model.observe(0, 0, 0.05)
    for p in (16, 32, 64, 128):
        model.observe(p, 8, 0.02 + 0.001 * p)
    assert model.prefill_allowance(8, 0.1) == 80


def test_the_window_follows_a_change_of_costs():
    model = StepCostModel(window=32, refit_every=1)
    feed(model, 0.010, 0.0008, 0.0015, 32)
    feed(model, 0.010, 0.0016, 0.0015, 32, seed=1)      # prefill got twice as slow (another job on the cores)
    assert model.coefficients()[1] == pytest.approx(0.0016, rel=1e-6)


def test_decode_only_steps_keep_the_last_good_fit():
    model = StepCostModel(refit_every=1)
    feed(model, 0.010, 0.0008, 0.0015, 64)
    before = model.prefill_allowance(8, 0.1)
    for _ in range(200):                 # a long stretch of decodes only: the window holds no prefill
        model.observe(0, 8, 0.010 + 0.0015 * 8)
    assert model.prefill_allowance(8, 0.1) == before == 97          # (100 - 10 - 12) ms / 0.8 ms


def test_a_warm_up_outlier_does_not_skew_the_fit():
    """The first step of an engine compiles and warms caches: 3 s for a 256-token prefill. Left in, it made the
    fitted per-step cost seconds and the allowance 0 (and the decode cost negative)."""
    model = StepCostModel(refit_every=1)
    model.observe(256, 0, 3.0)
    feed(model, 0.010, 0.0008, 0.0015, 40, noise=0.05, seed=4)
    a, b, c = model.coefficients()
    assert b == pytest.approx(0.0008, rel=0.15) and a < 0.03 and c >= 0
    assert abs(model.prefill_allowance(31, 0.120) - 79) <= 15


def test_a_negative_term_is_dropped_and_the_rest_refitted():
    model = StepCostModel(refit_every=1)
    for p, d in ((0, 30), (64, 30), (128, 2), (256, 2), (32, 16), (200, 10), (16, 30), (100, 2)):
        model.observe(p, d, 0.005 + 0.001 * p + 0.002 * max(0, 20 - d))   # more decodes, shorter steps
    a, b, c = model.coefficients()
    assert c == 0.0 and b > 0 and a >= 0


def test_an_unphysical_fit_is_not_used():
    model = StepCostModel(refit_every=1)
    for p in (0, 64, 128, 256, 512, 64, 0, 256):
        model.observe(p, 4, 0.05 - 0.00005 * p)          # bigger chunks ran faster: noise, not a cost
    assert model.coefficients() is None


# ------------------------------------------------------------------ the scheduler's side

def _decoding_then_prompt(allowance, budget=64, **kw):
    """One request decoding, then a long prompt arrives: the first step that carries both."""
    sched = make_scheduler(num_blocks=128, block_size=4, budget=budget, **kw)
    calls = []
    if allowance is not None:
        sched.prefill_allowance = lambda decodes: calls.append(decodes) or allowance(decodes)
    sched.add_request(req("a", list(range(5)), max_tokens=20))
    out = sched.schedule()                                # a's prompt alone: no decodes, no allowance asked
    sched.update_from_output(out, [7] * len(out.scheduled))
    assert calls == []
    sched.add_request(req("b", list(range(100, 200)), max_tokens=4))
    out = sched.schedule()
    shares = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert out.num_scheduled_tokens == sum(shares.values())
    return shares, calls


def test_decoding_steps_prefill_only_the_allowance():
    shares, calls = _decoding_then_prompt(lambda decodes: 20)
    assert shares == {"a": 1, "b": 20} and calls == [1]


def test_the_allowance_never_drops_below_a_block():
    shares, _ = _decoding_then_prompt(lambda decodes: 0)
    assert shares == {"a": 1, "b": 4}


def test_no_fit_or_no_limit_keeps_the_budget():
    assert _decoding_then_prompt(lambda decodes: None)[0] == {"a": 1, "b": 63}
    assert _decoding_then_prompt(None)[0] == {"a": 1, "b": 63}
    assert _decoding_then_prompt(lambda decodes: 1000)[0] == {"a": 1, "b": 63}


def test_without_chunked_prefill_the_allowance_is_not_applied():
    shares, calls = _decoding_then_prompt(lambda decodes: 20, budget=128, enable_chunked_prefill=False)
    assert shares == {"a": 1, "b": 100} and calls == []


def test_outputs_are_unchanged_under_a_tight_allowance():
    """Small prefill chunks beside decodes change when tokens are computed, not which."""
    reqs = [req(f"r{i}", p, max_tokens=5 + i % 4) for i, p in enumerate(prompts(5, 10, 3, 40))]
    expected = reference(reqs)
    sched = make_scheduler(num_blocks=96, budget=48, max_seqs=4)
    sched.prefill_allowance = lambda decodes: max(0, 12 - 2 * decodes)
    seen = []

    def check(s, out):
        decodes = sum(1 for e in out.scheduled if e.is_decode)
        prefill = out.num_scheduled_tokens - decodes
        if decodes:
            seen.append(prefill)
            assert prefill <= max(12 - 2 * decodes, 4)

    assert run(sched, reqs, on_step=check) == expected
    assert any(seen)


# ------------------------------------------------------------------ the engine and the command line

def test_engine_times_its_steps_and_limits_prefill(tiny_llama_dir):
    from plinth import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4, itl_target_ms=50)
    engine = llm.engine
    assert engine.itl_target_ms == 50 and engine.scheduler.prefill_allowance is not None
    engine.step_cost.observe(0, 1, 0.010)      # seed a fit: 10 ms per step, 1 ms per prefill token
    for p in (8, 16, 32, 64, 8, 16, 32):
        engine.step_cost.observe(p, 1, 0.010 + 0.001 * p)
    engine.step_cost.observe(0, 4, 0.010)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", list(range(3, 10)), params)
    engine.step()
    engine.add_request("b", list(range(20, 120)), params)
    seen = []
    real = engine.scheduler.schedule

    def spy():
        out = real()
        seen.append({s.request.request_id: s.num_new_tokens for s in out.scheduled})
        return out

    engine.scheduler.schedule = spy
    real_observe, observed = engine.step_cost.observe, []
    engine.step_cost.observe = lambda *args: observed.append(args)   # keep the seeded fit for this step
    engine.step()
    # 50 ms target, 10 ms per step and decode, 1 ms per prefill token: 40 prompt tokens beside the decode
    assert seen[0]["a"] == 1 and 38 <= seen[0]["b"] <= 40
    assert observed and observed[0][:2] == (seen[0]["b"], 1)          # the step's prefill tokens and decodes
    engine.step_cost.observe = real_observe
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.step_cost._rows) > 10


def test_off_by_default_and_not_with_asynchronous_steps(tiny_llama_dir, caplog):
    from plinth import LLM
    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine

    llm = LLM(str(tiny_llama_dir), dtype="float32")
    assert llm.engine.itl_target_ms == 0 and llm.engine.scheduler.prefill_allowance is None
    assert llm.engine.step_cost is None
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", async_scheduling=True,
                                                itl_target_ms=80))
    assert engine.async_scheduling and engine.itl_target_ms == 0 and engine.scheduler.prefill_allowance is None
    assert "itl_target_ms applies to synchronous steps" in caplog.text
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", itl_target_ms=80,
                                                enable_chunked_prefill=False))
    assert engine.itl_target_ms == 0 and "itl_target_ms needs chunked prefill" in caplog.text


def test_the_flag_and_bad_values():
    from plinth.config import ConfigError, SchedulerConfig
    from plinth.entrypoints.cli import build_parser

    def parsed(*argv):
        return build_parser(list(argv)).parse_args(list(argv))

    assert parsed("serve").itl_target_ms == 0
    assert parsed("serve", "--itl-target-ms", "90").itl_target_ms == 90
    for bad in (-1, float("inf"), float("nan"), True, "100", None):
        with pytest.raises(ConfigError, match="itl_target_ms"):
            SchedulerConfig(itl_target_ms=bad)
