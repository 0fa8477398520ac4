"""One Ray actor per rank (``--distributed-executor ray``), for engines larger than one machine.

The actors are placed with a placement group, one bundle per rank (a GPU each on CUDA, a CPU
each on CPUs), ``PACK``ed so the ranks of a small engine share a node. The executor joins the
Ray cluster at ``$RAY_ADDRESS`` (``ray.init(address="auto")``), or uses the one this process
already joined, or starts a local one (Ray's own local instance, which Ray binds to the machine's address; stopped
again when the last engine of this process that uses it shuts down). Each step's batch is put in the object store once
and handed to every actor; the ranks meet through a ``TCPStore`` hosted by the driver on its node address. A CPU rank
reserves one CPU, and Ray limits the actor's threads to it (``OMP_NUM_THREADS=1``, unless the environment sets it).

A dead actor surfaces as Ray's ``RayActorError`` and becomes
:class:`~plinth.distributed.executor.WorkerDiedError`; actors die with their owner, so no
worker outlives the driver.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

from plinth.config import ConfigError, EngineConfig
from plinth.distributed.executor import (
    INTERRUPT_DRAIN_S,
    STEP_TIMEOUT_ENV,
    DistributedExecutor,
    WorkerDiedError,
)

logger = logging.getLogger(__name__)

#: after one actor's call raised: how long the others may take to show that one of them died (the real cause)
DEATH_WAIT_S = 2.0

#: the local Ray instance this process's executors started: its GCS address (None: none runs), and how many live
#: executors use it (the last one to shut down stops it)
_LOCAL_RAY: dict[str, Any] = {"address": None, "users": 0}


def _session(ray: Any) -> str | None:
    """The GCS address of the Ray session this process is joined to (None: none)."""
    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


class RayWorker:
    """The actor body: a :class:`~plinth.distributed.worker.Worker` behind one generic ``call``."""

    def __init__(self, config: EngineConfig, rank: int, models: dict[str, Any] | None = None,
                 plugins: dict[str, str] | None = None):
        import ray

        if ray.util.get_node_ip_address().startswith("127."):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # a loopback-only cluster
        from plinth.distributed.worker import Worker

        self.worker = Worker(config, rank, 0, models=models, plugins=plugins)   # Ray shows each actor its own device

    def init_distributed(self, host: str, port: int, timeout_s: float) -> int:
        import torch.distributed as dist

        store = dist.TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        return self.worker.init_distributed(store, timeout_s)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(DistributedExecutor):
    """Ray actors, one per rank.

    Raises:
        ConfigError: ray is not installed, or the cluster has fewer GPUs (or CPUs) than ranks.
    """

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self._out_of_step = False   # a call interrupted before every actor finished it
        try:
            import ray
        except ModuleNotFoundError as exc:
            raise ConfigError("--distributed-executor ray needs the ray package: pip install 'plinth-llm[ray]'") \
                from exc
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from plinth.model_registry.registry import ModelRegistry
        from plinth.platforms.selection import select_platform
        from plinth.plugins import get_plugin_manager

        models = ModelRegistry.user_registrations()   # before a cluster starts: a class that cannot go stops here
        plugins = get_plugin_manager().code_registrations()   # and a plugin module that cannot be imported there
        self._ray = ray
        self._owns_ray = False
        self._actors: list[Any] = []
        self._pids: list[int] = []
        self._pg: Any = None
        self._store: Any = None
        self._session: str | None = None   # the Ray session the actors run in (its GCS address)
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(address="auto")
            else:   # a cluster of this machine only (Ray may still bind it to the machine's address)
                ray.init(include_dashboard=False, _node_ip_address="127.0.0.1")
                _LOCAL_RAY.update(address=_session(ray), users=0)
        self._session = _session(ray)
        if _LOCAL_RAY["address"] is not None and _LOCAL_RAY["address"] == self._session:
            _LOCAL_RAY["users"] += 1   # the instance plinth started: another engine of this process may use it too
            self._owns_ray = True
        try:
            platform = select_platform(config.device.platform)
            resource = "GPU" if platform.device_type == "cuda" else "CPU"
            have = ray.cluster_resources().get(resource, 0)
            if have < self.world_size:
                raise ConfigError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} needs "
                                  f"{self.world_size} {resource}s in the Ray cluster; it has {have:g}")
            self._pg = placement_group([{resource: 1}] * self.world_size, strategy="PACK")
            try:
                ray.get(self._pg.ready(), timeout=self.start_timeout_s)
            except ray.exceptions.GetTimeoutError as exc:
                raise ConfigError(f"the Ray cluster could not place {self.world_size} {resource} bundles within "
                                  f"{self.start_timeout_s:.0f} s") from exc
            actor_cls = ray.remote(RayWorker)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                            placement_group_bundle_index=rank)
                self._actors.append(actor_cls.options(
                    num_cpus=1 if resource == "CPU" else 0, num_gpus=1 if resource == "GPU" else 0,
                    scheduling_strategy=strategy, name=None).remote(config, rank, models, plugins))
        except BaseException:
            self.shutdown()
            raise
        self._start()

    def _start_workers(self) -> None:
        import torch.distributed as dist

        host = self._ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.start_timeout_s))
        self._pids = self._wait([a.init_distributed.remote(host, self._store.port, self.step_timeout_s)
                                 for a in self._actors], "init_distributed", self.start_timeout_s)

    @property
    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def _check_ray(self) -> None:
        """Raises WorkerDiedError when the Ray session the actors ran in is gone (``ray.shutdown()`` by the user):
        a call would otherwise start a new, empty local Ray instance."""
        if _session(self._ray) != self._session:
            raise WorkerDiedError("the Ray session this engine's workers ran in was shut down")

    def _call_all(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        self._check_alive()
        self._check_ray()
        ray = self._ray
        refs_args = [ray.put(a) if not isinstance(a, (int, float, str, type(None))) else a for a in args]
        return self._wait([a.call.remote(method, *refs_args) for a in self._actors], method, timeout_s)

    def _call_one(self, rank: int, method: str, *args: Any, timeout_s: float) -> Any:
        self._check_alive()
        self._check_ray()
        return self._wait([self._actors[rank].call.remote(method, *args)], method, timeout_s)[0]

    def _wait(self, refs: list[Any], method: str, timeout_s: float) -> list[Any]:
        """Results in order; the first failure among the finished calls is raised at once."""
        ray = self._ray
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            try:
                ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            except KeyboardInterrupt:   # Ctrl-C in the driver: the actors finish the call in hand (dropped)
                self._out_of_step = True
                _, left = ray.wait(pending, num_returns=len(pending), timeout=INTERRUPT_DRAIN_S)
                self._out_of_step = bool(left)
                raise
            if not ready:
                raise WorkerDiedError(f"Ray worker(s) did not answer {method!r} within {timeout_s:.0f} s "
                                      f"(${STEP_TIMEOUT_ENV} raises the limit)")
            for ref in ready:
                try:
                    results[index[ref]] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise WorkerDiedError(f"Ray worker {index[ref]} died: {exc}") from exc
                except ray.exceptions.RayTaskError as exc:   # the worker raised: re-raise its own error,
                    # unless a peer's death caused it (a collective cut short): then report the death
                    self._raise_a_death(pending, index)
                    cause = getattr(exc, "cause", None)
                    raise (cause if isinstance(cause, BaseException) else exc) from None
        return results

    def _raise_a_death(self, pending: list[Any], index: dict[Any, int]) -> None:
        """Raises WorkerDiedError for an actor among ``pending`` that died (waiting briefly for their calls)."""
        ray = self._ray
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_WAIT_S) if pending else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise WorkerDiedError(f"Ray worker {index[ref]} died: {exc}") from exc
            except Exception:  # noqa: BLE001, S112 - its own failure: the first one seen is raised
                continue

    def _workers_in_step(self) -> bool:
        return not self._out_of_step

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray if hasattr(self, "_ray") else None
        if ray is None:
            return
        # (the user may have shut the session down, or joined another since: nothing of this engine is left to stop)
        alive = _session(ray) == self._session
        for actor in self._actors if alive else ():
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - gone already: what was being stopped is stopped
                logger.debug("stopping a Ray actor: %s", exc)
        self._actors = []
        if self._pg is not None and alive:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception as exc:  # noqa: BLE001 - as above
                logger.debug("removing the placement group: %s", exc)
        self._pg = None
        self._store = None
        if self._owns_ray:
            self._owns_ray = False
            if _LOCAL_RAY["address"] == self._session:
                _LOCAL_RAY["users"] = max(0, _LOCAL_RAY["users"] - 1)
                if _LOCAL_RAY["users"] == 0:   # the last engine of this process using it
                    _LOCAL_RAY.update(address=None)
                    if alive:
                        ray.shutdown()
