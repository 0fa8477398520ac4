"""``plinth bench latency|throughput``: offline benchmarks on random token ids.

latency: ``--batch-size`` requests of ``--input-len`` random tokens, each generating exactly
``--output-len`` tokens, run ``--num-iters`` times after ``--num-iters-warmup`` untimed runs (fresh
prompts every run, so the prefix cache never helps). Reports the median end-to-end latency, time to
first token (the prefill), time per output token (the decode steps) and output tokens/s.

throughput: ``--num-prompts`` requests submitted at once, of ``--input-len`` tokens or lengths
uniform in ``--input-len-range A B`` (``A <= len < B``, seeded), ``--output-len`` tokens each with
EOS ignored. Reports requests/s, output tokens/s, total (prompt + output) tokens/s and the elapsed time.

Both print the fraction of the physical floor on a known device (see ``plinth.benchmarks_floor``):
a decode step reading every weight once at copy bandwidth (latency) and ``2 * params * tokens``
FLOPs at the matmul rate (throughput). The engine waits for the device every step (it reads the
sampled tokens on the host), and the clock starts after a device synchronisation.

With ``--tensor-parallel-size`` / ``--pipeline-parallel-size`` the weights come from the workers
(each reports its shard) and the floors count the critical path: a decode step reads the largest
tensor-parallel shard of each stage, the stages one after another; the compute floor is the busiest
rank's share (every rank runs every token through its shard).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plinth import benchmarks_floor as floors
from plinth.core.request import SamplingParams
from plinth.entrypoints.engine_args import add_engine_args, engine_config_from_args

MODES = ("latency", "throughput")


def add_parser(subparsers: Any, name: str, help_text: str) -> None:
    p = subparsers.add_parser(name, help=help_text, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=MODES, help="which benchmark")
    add_engine_args(p, "bench")
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    g.add_argument("--input-len-range", type=int, nargs=2, metavar=("A", "B"), default=None,
                   help="throughput: prompt lengths uniform in [A, B) instead of --input-len")
    g.add_argument("--output-len", type=int, default=256, help="tokens generated per request (EOS ignored)")
    g.add_argument("--batch-size", type=int, default=1, help="latency: requests per run")
    g.add_argument("--num-iters", type=int, default=3, help="latency: timed runs")
    g.add_argument("--num-iters-warmup", type=int, default=1, help="latency: untimed runs first")
    g.add_argument("--num-prompts", type=int, default=1000, help="throughput: requests")
    g.add_argument("--num-warmup-prompts", type=int, default=4,
                   help="throughput: short untimed requests run first (0: none)")
    g.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompt token ids and lengths")
    g.add_argument("--json", default=None, metavar="PATH", help="write the results to this JSON file")
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------------------- workload

def random_prompts(num: int, lengths: int | tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of random token ids; ``lengths`` is one length or a range ``[a, b)``."""
    rng = np.random.default_rng(seed)
    if isinstance(lengths, int):
        lens = np.full(num, lengths)
    else:
        lens = rng.integers(lengths[0], lengths[1], size=num)
    return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lens]


def exact_length_params(output_len: int) -> SamplingParams:
    """Greedy, exactly ``output_len`` tokens: EOS ignored, no stop strings."""
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


@dataclasses.dataclass
class RunTiming:
    """One timed run of a batch of requests."""

    elapsed_s: float
    first_token_s: float       # until every request has its first token
    output_tokens: int
    prompt_tokens: int
    process_cpu_s: float       # CPU time of this process (all threads) over the run


def timed_run(engine: Any, prompts: list[list[int]], output_len: int, tag: str) -> RunTiming:
    """Submit ``prompts`` at once (as many as the waiting queue takes, the rest as room frees) and step the
    engine until all finish; every step syncs the device."""
    from plinth.entrypoints.generate_cmd import add_when_room

    params = exact_length_params(output_len)
    floors.synchronize(engine.device)
    t0, cpu0 = time.perf_counter(), time.process_time()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    started: set[str] = set()
    first_token_s = None
    finished: dict[str, Any] = {}

    def step() -> None:
        nonlocal first_token_s
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                finished[out.request_id] = out
        if first_token_s is None and len(started) == len(ids):
            first_token_s = time.perf_counter() - t0

    for rid, prompt in zip(ids, prompts, strict=True):
        add_when_room(engine, rid, prompt, params, step)
    while len(finished) < len(ids):
        step()
    elapsed = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0
    produced = [len(finished[r].outputs[0].token_ids) for r in ids]
    if any(n != output_len for n in produced) or any(finished[r].error for r in ids):
        errors = {finished[r].error for r in ids if finished[r].error}
        raise RuntimeError(f"requests did not generate exactly {output_len} tokens "
                           f"(got {min(produced)}..{max(produced)}){'; errors: ' + str(errors) if errors else ''}")
    return RunTiming(elapsed, first_token_s if first_token_s is not None else elapsed,
                     sum(produced), sum(len(p) for p in prompts), cpu_s)


# ----------------------------------------------------------------------------------------- benchmarks

def bench_latency(engine: Any, batch_size: int, input_len: int, output_len: int, num_iters: int,
                  num_warmup: int, seed: int = 0) -> dict[str, Any]:
    """Median latency of ``num_iters`` runs of one batch; fresh random prompts for each run."""
    runs: list[RunTiming] = []
    for it in range(num_warmup + num_iters):
        prompts = random_prompts(batch_size, input_len, engine.vocab_size, seed + 1000 * it)
        timing = timed_run(engine, prompts, output_len, f"lat{it}")
        if it >= num_warmup:
            runs.append(timing)
    latency = statistics.median(r.elapsed_s for r in runs)
    ttft = statistics.median(r.first_token_s for r in runs)
    tpot = statistics.median((r.elapsed_s - r.first_token_s) / (output_len - 1) for r in runs) \
        if output_len > 1 else None
    result = {
        "mode": "latency", "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "num_iters": num_iters, "latencies_s": [r.elapsed_s for r in runs],
        "median_latency_s": latency, "median_ttft_s": ttft, "median_tpot_s": tpot,
        "output_tokens_per_s": batch_size * output_len / latency,
    }
    result.update(_latency_floor(engine, batch_size * input_len, tpot))
    return result


def bench_throughput(engine: Any, prompts: list[list[int]], output_len: int, num_warmup: int = 0,
                     seed: int = 0) -> dict[str, Any]:
    """All ``prompts`` submitted at once; requests/s and tokens/s over the whole run.

    ``num_warmup`` prompts of the lengths of the first ones (other random tokens: no prefix-cache hits) run
    first, untimed, all at once, so that one-time costs of the step shapes the run meets (kernels compiled on
    first use, e.g. Triton's for mixed prefill and decode steps) stay out of the figure."""
    if num_warmup:
        warm = [random_prompts(1, len(p), engine.vocab_size, seed + 7919 + i)[0]
                for i, p in enumerate(prompts[:num_warmup])]
        timed_run(engine, warm, min(16, output_len), "warm")
    timing = timed_run(engine, prompts, output_len, "tput")
    elapsed = timing.elapsed_s
    total = timing.prompt_tokens + timing.output_tokens
    result = {
        "mode": "throughput", "num_prompts": len(prompts), "output_len": output_len,
        "prompt_tokens": timing.prompt_tokens, "output_tokens": timing.output_tokens, "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed, "output_tokens_per_s": timing.output_tokens / elapsed,
        "total_tokens_per_s": total / elapsed, "process_cpu_s": timing.process_cpu_s,
    }
    result.update(_compute_floor(engine, total, elapsed))
    return result


def parallel_weight_stats(ranks: Sequence[Any]) -> floors.WeightStats:
    """The weights of an engine's ranks (:class:`~plinth.distributed.executor.RankWeights`) as one
    :class:`~plinth.benchmarks_floor.WeightStats` for the floors; for one rank, that rank's own.

    ``params``: held by all ranks together (a replicated tensor counts once per rank);
    ``streamed_bytes``: a decode step's critical path, the largest TP shard of each pipeline stage summed
    over the stages; ``matmul_params``: the busiest rank's.
    """
    if not ranks:
        raise ValueError("no rank reported its weights")
    stages: dict[int, list[floors.WeightStats]] = {}
    for r in ranks:
        stages.setdefault(r.pp_rank, []).append(r.stats)
    return floors.WeightStats(
        params=sum(r.stats.params for r in ranks),
        matmul_params=max(r.stats.matmul_params for r in ranks),
        streamed_bytes=sum(max(s.streamed_bytes for s in stage) for stage in stages.values()),
    )


def _device_info(engine: Any) -> tuple[str, floors.DeviceCeilings | None, floors.WeightStats]:
    """The device's name and ceilings (those of the workers' devices), and the weight statistics."""
    ranks = engine.executor.rank_weights()
    name = ranks[0].device_name
    return name, floors.ceilings_for(name), parallel_weight_stats(ranks)


def _latency_floor(engine: Any, prefill_tokens: int, tpot: float | None) -> dict[str, Any]:
    name, ceilings, stats = _device_info(engine)
    out: dict[str, Any] = {"device": name, "params": stats.params, "streamed_weight_bytes": stats.streamed_bytes}
    if ceilings is None:
        return {**out, "floor": floors.UNKNOWN}
    step = floors.decode_step_floor_s(stats, ceilings)
    prefill = floors.compute_floor_s(stats, prefill_tokens, engine.dtype, ceilings)
    return {**out, "floor": f"{ceilings.name}: {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s copy",
            "floor_tpot_s": step, "tpot_floor_fraction": step / tpot if tpot else None,
            "floor_prefill_s": prefill}


def _compute_floor(engine: Any, tokens: int, elapsed: float) -> dict[str, Any]:
    name, ceilings, stats = _device_info(engine)
    out: dict[str, Any] = {"device": name, "params": stats.params, "matmul_params": stats.matmul_params}
    if ceilings is None:
        return {**out, "floor": floors.UNKNOWN}
    floor_s = floors.compute_floor_s(stats, tokens, engine.dtype, ceilings)
    if floor_s is None:
        return {**out, "floor": f"{ceilings.name}: matmul rate unknown for {engine.dtype}"}
    rate = ceilings.matmul_flops_per_s[engine.dtype]
    return {**out, "floor": f"{ceilings.name}: {rate / 1e12:.0f} TFLOP/s matmul", "floor_elapsed_s": floor_s,
            "floor_fraction": floor_s / elapsed}


# ----------------------------------------------------------------------------------------- command

def _check(args: argparse.Namespace) -> None:
    from plinth.errors import CliError

    if args.task != "generate":
        raise CliError(f"plinth bench measures text generation; --task {args.task} is not one (its requests are "
                       f"prompts only: `plinth serve --task {args.task}` and a load client measure them)")
    positive = ["input_len", "output_len", "batch_size", "num_iters", "num_prompts"]
    for name in positive:
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("num_iters_warmup", "num_warmup_prompts", "prompt_seed"):   # numpy takes no negative seed
        if getattr(args, name) < 0:
            raise CliError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.input_len_range is not None:
        if args.mode != "throughput":
            raise CliError("--input-len-range is for the throughput benchmark")
        a, b = args.input_len_range
        if not 1 <= a < b:
            raise CliError(f"--input-len-range A B needs 1 <= A < B, got {a} {b}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise CliError(f"--max-num-seqs must be a positive integer, got {args.max_num_seqs}")
    if args.mode == "latency" and args.max_num_seqs is not None and args.batch_size > args.max_num_seqs:
        raise CliError(f"--batch-size {args.batch_size} exceeds --max-num-seqs {args.max_num_seqs}")


def run(args: argparse.Namespace) -> int:
    from plinth.core.engine import LLMEngine
    from plinth.errors import CliError

    _check(args)
    if args.json is not None and not args.json.strip():
        raise CliError("--json needs a file path")
    if args.json:   # before the benchmark runs, not after
        target = Path(args.json)
        parent = target.parent if target.parent != Path("") else Path(".")
        if target.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise CliError(f"cannot write --json {args.json!r}: " + ("it is a directory" if target.is_dir()
                                                                     else f"{parent} is not a writable directory"))
    longest = (args.input_len_range[1] - 1 if args.input_len_range else args.input_len) + args.output_len
    engine = LLMEngine(engine_config_from_args(args))
    try:
        if longest > engine.max_model_len:
            raise CliError(f"prompt + output of {longest} tokens exceeds the model length {engine.max_model_len}; "
                           f"shorten the workload or raise --max-model-len")
        if args.mode == "latency":
            result = bench_latency(engine, args.batch_size, args.input_len, args.output_len, args.num_iters,
                                   args.num_iters_warmup, args.prompt_seed)
        else:
            lengths = tuple(args.input_len_range) if args.input_len_range else args.input_len
            prompts = random_prompts(args.num_prompts, lengths, engine.vocab_size, args.prompt_seed)
            result = bench_throughput(engine, prompts, args.output_len, args.num_warmup_prompts, args.prompt_seed)
    finally:
        engine.shutdown()   # worker processes stop with the benchmark
    par = engine.config.parallel
    result.update(model=engine.served_model_name, dtype=str(engine.dtype).removeprefix("torch."),
                  load_format=args.load_format, attention_backend=engine.selection.winner if engine.selection else None,
                  tensor_parallel_size=par.tensor_parallel_size, pipeline_parallel_size=par.pipeline_parallel_size,
                  executor=type(engine.executor).__name__)
    print(format_result(result), flush=True)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def format_result(r: dict[str, Any]) -> str:
    """The human-readable report of a benchmark result."""
    head = f"{r['mode']}: {r.get('model')} ({r.get('dtype')}) on {r['device']}"
    tp, pp = r.get("tensor_parallel_size", 1), r.get("pipeline_parallel_size", 1)
    if tp * pp > 1:
        head += f" (tp {tp} x pp {pp}, {r.get('executor')})"
    if r["mode"] == "latency":
        tpot = r["median_tpot_s"]
        lines = [
            f"{head}, batch {r['batch_size']}, input {r['input_len']}, output {r['output_len']}, "
            f"median of {r['num_iters']}",
            f"  end-to-end latency     {r['median_latency_s']:.4f} s",
            f"  time to first token    {r['median_ttft_s'] * 1e3:.2f} ms",
            f"  time per output token  {tpot * 1e3:.3f} ms" if tpot else "  time per output token  n/a",
            f"  output tokens/s        {r['output_tokens_per_s']:.1f}",
        ]
        if "floor_tpot_s" in r:
            frac = r["tpot_floor_fraction"]
            lines.append(f"  floor                  {r['floor_tpot_s'] * 1e3:.3f} ms per decode step "
                         f"({r['streamed_weight_bytes'] / 1e9:.2f} GB of weights, {r['floor']})"
                         + (f": {frac:.1%} of the floor" if frac else ""))
        else:
            lines.append(f"  floor                  {r['floor']}")
    else:
        lines = [
            f"{head}, {r['num_prompts']} prompts ({r['prompt_tokens']} prompt tokens), output {r['output_len']} each",
            f"  elapsed                {r['elapsed_s']:.3f} s",
            f"  requests/s             {r['requests_per_s']:.2f}",
            f"  output tokens/s        {r['output_tokens_per_s']:.1f}",
            f"  total tokens/s         {r['total_tokens_per_s']:.1f}",
        ]
        if "floor_elapsed_s" in r:
            lines.append(f"  floor                  {r['floor_elapsed_s']:.3f} s ({r['floor']}): "
                         f"{r['floor_fraction']:.1%} of the floor")
        else:
            lines.append(f"  floor                  {r['floor']}")
    return "\n".join(lines)
