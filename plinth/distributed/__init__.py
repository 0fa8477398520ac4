"""Tensor and pipeline parallelism: process groups, workers and the executors that drive them.

``parallel_state``  the rank layout and this process's TP/PP groups (one module-level state per worker)
``communication``   the collectives layers use (TP all-reduce/all-gather, PP send/recv)
``pipeline``        one stage's share of a step, in micro-batches that overlap across stages
``messages``        the step's batch as flat arrays, sent to every worker
``worker``          one rank: its model shard, KV cache and sampler
``executor``        the Executor contract, the in-process executor, the choice of executor
``executor_mp``     one spawned process per rank on this machine
``executor_ray``    one Ray actor per rank, on a Ray cluster
``driver``          the engine side: layout checks and start-up without loading weights
"""
