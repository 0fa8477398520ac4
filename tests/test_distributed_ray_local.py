"""The Ray executor's own local Ray instance (none started by the test): engines of one process share it, and the
last one to close stops it; a Ray session the user shuts down under an engine is a worker failure."""

from __future__ import annotations

import pytest
from test_distributed_helpers import ENGINE_KW, PROMPTS, greedy, save_family

from plinth import LLM
from plinth.core.async_engine import EngineDeadError

ray = pytest.importorskip("ray", reason="the Ray executor needs the ray package (pip install 'plinth-llm[ray]')")


@pytest.fixture()
def no_ray():
    if ray.is_initialized():
        pytest.skip("a Ray session is already running in this process")
    yield
    if ray.is_initialized():
        ray.shutdown()


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


def test_engines_share_the_local_instance_until_the_last_closes(tmp_path, no_ray, monkeypatch):
    path = save_family("llama", tmp_path)
    reference = tokens(LLM(str(path), **ENGINE_KW))
    real_init = ray.init

    def four_cpus(*args, **kw):   # two TP=2 engines need 4 CPUs in the instance, on any machine
        return real_init(*args, **{"num_cpus": 4, "log_to_driver": False, **kw})

    monkeypatch.setattr(ray, "init", four_cpus)
    a = LLM(str(path), tensor_parallel_size=2, distributed_executor="ray", **ENGINE_KW)
    b = LLM(str(path), tensor_parallel_size=2, distributed_executor="ray", **ENGINE_KW)
    try:
        a.close()   # b's actors run in the instance a started
        assert ray.is_initialized()
        assert tokens(b) == reference
    finally:
        b.close()
    assert not ray.is_initialized()   # the last engine that used it stopped it


def test_a_ray_session_shut_down_under_an_engine_is_a_worker_failure(tmp_path, no_ray):
    path = save_family("llama", tmp_path)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)   # the user's session
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor="ray", **ENGINE_KW)
    ray.shutdown()
    with pytest.raises(EngineDeadError, match="the Ray session this engine's workers ran in was shut down"):
        llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert not ray.is_initialized()   # no new instance was started behind the user's back
    llm.close()


def test_closing_an_engine_leaves_a_session_the_user_started_since(tmp_path, no_ray):
    """The instance an engine started was shut down by the user, who started a session of their own: closing the
    engine stops nothing of the user's."""
    path = save_family("llama", tmp_path)
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor="ray", **ENGINE_KW)
    ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    mine = ray.get_runtime_context().gcs_address
    llm.close()
    assert ray.is_initialized() and ray.get_runtime_context().gcs_address == mine
    assert ray.get(ray.put(7)) == 7
