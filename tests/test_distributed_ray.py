"""The Ray executor on a local Ray cluster started by the test: TP=2 greedy outputs and prompt logprobs equal the
single-process engine's."""

from __future__ import annotations

import pytest
from test_distributed_helpers import ENGINE_KW, run_greedy, save_family

from plinth.config import ConfigError, EngineConfig
from plinth.core.engine import LLMEngine

ray = pytest.importorskip("ray", reason="the Ray executor needs the ray package (pip install 'plinth-llm[ray]')")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def test_ray_tp2_equals_single_process(tmp_path, local_ray):
    path = save_family("qwen2", tmp_path)
    reference = run_greedy(LLMEngine(EngineConfig.from_kwargs(model=str(path), **ENGINE_KW)))
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), tensor_parallel_size=2,
                                                distributed_executor="ray", **ENGINE_KW))
    try:
        pids = engine.executor.worker_pids
        assert len(set(pids)) == 2 and engine.runner is None
        ranks = engine.executor.rank_weights()   # what plinth bench's floors read, from each actor
        assert [(r.tp_rank, r.pp_rank, r.device_name) for r in ranks] == [(0, 0, "cpu"), (1, 0, "cpu")]
        assert ranks[0].stats == ranks[1].stats and ranks[0].stats.params > 0
        result = run_greedy(engine)
    finally:
        engine.shutdown()
    for rid, (tokens, prompt_lps) in reference.items():
        assert result[rid][0] == tokens
        for ref_pos, got_pos in zip(prompt_lps, result[rid][1], strict=True):
            assert ref_pos.keys() == got_pos.keys()
            assert all(got_pos[t] == pytest.approx(lp, abs=1e-4) for t, lp in ref_pos.items())


def test_ray_ctrl_c_during_a_step_keeps_the_actors_serving(tmp_path, local_ray, monkeypatch):
    """Ctrl-C in the driver while the actors compute a step: KeyboardInterrupt reaches the caller (not a worker
    failure); the actors finish the step and the engine serves on with the reference tokens."""
    from test_distributed_helpers import PROMPTS, greedy

    from plinth import LLM, SamplingParams

    path = save_family("llama", tmp_path)
    reference = run_greedy(LLMEngine(EngineConfig.from_kwargs(model=str(path), **ENGINE_KW)))
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor="ray", **ENGINE_KW)
    try:
        real_wait, calls = ray.wait, []

        def interrupting(refs, **kw):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real_wait(refs, **kw)

        monkeypatch.setattr(ray, "wait", interrupting)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False)
        monkeypatch.setattr(ray, "wait", real_wait)
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [reference[f"r{i}"][0] for i in range(len(PROMPTS))]
    finally:
        llm.close()

def test_ray_cluster_too_small_fails_clearly(tmp_path, local_ray):
    path = save_family("llama", tmp_path)
    config = EngineConfig.from_kwargs(model=str(path), tensor_parallel_size=2, pipeline_parallel_size=2,
                                      distributed_executor="ray", **ENGINE_KW)
    with pytest.raises(ConfigError, match="needs 4 CPUs in the Ray cluster; it has 2"):
        LLMEngine(config)


def test_a_dead_actor_is_the_cause_even_when_a_peer_fails_first():
    """An actor killed mid-step leaves its peer's collective failing too; when the peer's error is seen first, the
    executor still reports the death (not the peer's gloo error) once the dead actor's call has failed."""
    from plinth.distributed.executor import WorkerDiedError
    from plinth.distributed.executor_ray import RayExecutor

    outcomes = {"r0": ray.exceptions.RayTaskError("call", "", RuntimeError("[gloo] Read error: Connection reset")),
                "r1": ray.exceptions.RayActorError()}

    class FakeRay:   # the two calls finish in rank order; each raises its outcome
        exceptions = ray.exceptions

        @staticmethod
        def wait(refs, num_returns=1, timeout=None):
            return refs[:num_returns], refs[num_returns:]

        @staticmethod
        def get(ref):
            raise outcomes[ref]

    executor = RayExecutor.__new__(RayExecutor)
    executor._ray = FakeRay
    with pytest.raises(WorkerDiedError, match="Ray worker 1 died"):
        executor._wait(["r0", "r1"], "execute", 10.0)
    outcomes["r1"] = RuntimeError("its own failure")   # no death: the first failure seen stands
    with pytest.raises(RuntimeError, match="gloo"):
        executor._wait(["r0", "r1"], "execute", 10.0)
