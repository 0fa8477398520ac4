"""The engine's host time per decode step, split into phases, on a model whose compute is negligible.

    python benchmarks/host_overhead.py                                  # 64, 256 and 512 sequences
    python benchmarks/host_overhead.py --num-seqs 256 --profile 25      # plus the cProfile hot spots
    python benchmarks/host_overhead.py --no-tokenizer --json host.json  # dummy weights, no detokenization

A tiny random Llama (``--layers`` layers, hidden 64, a vocabulary of ``--vocab`` tokens) is saved with a
small byte-level BPE tokenizer trained in memory, so every step also detokenizes (``--no-tokenizer``
uses the ``tiny-llama`` dummy preset instead: no tokenizer, no text). ``N`` requests of ``--prompt-len``
random tokens are submitted at once (greedy, EOS ignored, exactly ``--output-len`` new tokens); once
every one is decoding, ``--steps`` decode steps of all ``N`` sequences are timed, twice:

* plain: ``engine.step()`` with a timer around the model's forward pass only; the host time of a
  step is its time minus its forward pass (medians over the steps are reported, and the best step);
  ``--final-only`` steps as the offline ``LLM.generate`` does (outputs only for finished requests);
* instrumented: the same steps with timers around each phase, which cost a little themselves:
  ``schedule`` (``Scheduler.schedule``), ``prepare`` (the runner's batch tensors), ``forward``
  (the model and the LM head), ``sampling`` (the sampling parameters and the sampler),
  ``detokenize`` (``IncrementalDetokenizer.add_tokens``) and ``other`` (the rest of ``step``:
  batch entries, ``update_from_output``, stop checks, building outputs).

The model's compute is not free (a [N, 64] x [64, vocab] LM head, attention over the context), so
``forward`` is listed to show how small it is next to the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

PHASES = ("schedule", "prepare", "forward", "sampling", "detokenize", "other")

CORPUS = [
    "Continuous batching keeps the accelerator busy while requests come and go.",
    "The scheduler picks decodes first, then prefill chunks, within a token budget.",
    "Paged attention stores keys and values in fixed-size blocks of the cache.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u4f60\u597d \U0001f600 0123456789 + - * / = ( ) [ ] { }",
] * 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=96, help="new tokens per request (>= warm-up + 2 x steps)")
    p.add_argument("--warmup-steps", type=int, default=8, help="decode steps run before timing")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps (each pass)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary of the saved model (>= the tokenizer's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-tokenizer", action="store_true", help="the tiny-llama dummy preset: no detokenization")
    p.add_argument("--final-only", action="store_true", help="step(final_only=True), as LLM.generate does")
    p.add_argument("--threads", type=int, default=1, help="torch threads (PLINTH_CPU_THREADS)")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="print the top K functions by own time")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.output_len < args.warmup_steps + 2 * args.steps + 1:
        p.error("--output-len must exceed --warmup-steps + 2 x --steps")
    return args


# ----------------------------------------------------------------------------------------- the model

def save_tiny_llama(path: Path, layers: int, vocab: int) -> Path:
    """A random Llama (hidden 64) and a byte-level BPE tokenizer trained on a few sentences."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 400), special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    config = transformers.LlamaConfig(
        vocab_size=max(vocab, len(fast)), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


def build_engine(args: argparse.Namespace, model_dir: Path | None, max_num_seqs: int) -> Any:
    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine

    kwargs: dict[str, Any] = dict(
        dtype="float32", block_size=args.block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(2048, max_num_seqs * args.prompt_len),
        max_model_len=args.prompt_len + args.output_len + args.block_size,
        num_blocks=max_num_seqs * (-(-(args.prompt_len + args.output_len) // args.block_size)) + 8,
    )
    if model_dir is None:
        kwargs.update(model="tiny-llama", load_format="dummy")
    else:
        kwargs.update(model=str(model_dir))
    return LLMEngine(EngineConfig.from_kwargs(**kwargs))


# ----------------------------------------------------------------------------------------- timers

class PhaseTimers:
    """Accumulated nanoseconds per phase; ``wrap`` replaces an attribute with a timed version."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(PHASES, 0)
        self.cpu_ns = dict.fromkeys(PHASES, 0)   # this thread's CPU time (immune to other processes' load)
        self._undo: list[Callable[[], None]] = []
        self._depth = 0   # phases do not nest: an inner timed call inside an outer one is not counted twice

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        original = getattr(owner, name)
        had_own = name in vars(owner) if hasattr(owner, "__dict__") else False
        ns, cpu_ns = self.ns, self.cpu_ns

        @functools.wraps(original)
        def timed(*a: Any, **kw: Any) -> Any:
            if self._depth:
                return original(*a, **kw)
            self._depth += 1
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return original(*a, **kw)
            finally:
                ns[phase] += time.perf_counter_ns() - t0
                cpu_ns[phase] += time.thread_time_ns() - c0
                self._depth -= 1

        raw = vars(owner).get(name) if isinstance(owner, type) else None
        setattr(owner, name, staticmethod(timed) if isinstance(raw, classmethod) else timed)
        if isinstance(owner, type):
            self._undo.append(lambda: setattr(owner, name, raw))
        elif had_own:
            self._undo.append(lambda: setattr(owner, name, original))
        else:
            self._undo.append(lambda: delattr(owner, name))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def instrument(engine: Any, phases: tuple[str, ...] = PHASES) -> PhaseTimers:
    """Timers around the engine's phases (only those named in ``phases``)."""
    from plinth.core import sampler as sampler_mod
    from plinth.core.detokenizer import IncrementalDetokenizer

    t = PhaseTimers()
    runner = engine.runner
    targets = [
        (engine.scheduler, "schedule", "schedule"),
        (runner, "prepare", "prepare"),
        (runner.backend, "prepare", "prepare"),
        (runner.model, "forward", "forward"),
        (runner.model, "compute_logits", "forward"),
        (engine.executor.sampler, "sample", "sampling"),
        (IncrementalDetokenizer, "add_tokens", "detokenize"),
    ]
    if runner.graphs is not None:
        targets.append((runner.graphs, "inputs", "prepare"))
    # the sampling parameters: built per step by a builder (or, in older revisions, from the requests)
    builder = getattr(engine, "_sampling", None)
    targets.append((builder, "build", "sampling") if builder is not None
                   else (sampler_mod.SamplingBatch, "from_requests", "sampling"))
    for owner, name, phase in targets:
        if phase in phases:
            t.wrap(owner, name, phase)
    return t


@contextlib.contextmanager
def maybe_profile(enabled: bool) -> Iterator[cProfile.Profile | None]:
    if not enabled:
        yield None
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield prof
    finally:
        prof.disable()


# ----------------------------------------------------------------------------------------- the run

def decode_steps(engine: Any, n: int, steps: int, final_only: bool,
                 timers: PhaseTimers | None = None) -> dict[str, list[float]]:
    """Run ``steps`` decode steps of ``n`` sequences; per step: wall and thread-CPU seconds of the
    step and of its forward pass."""
    out: dict[str, list[float]] = {"step": [], "forward": [], "step_cpu": [], "forward_cpu": []}
    for _ in range(steps):
        f0 = timers.ns["forward"] if timers is not None else 0
        fc0 = timers.cpu_ns["forward"] if timers is not None else 0
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        engine.step(final_only=final_only)
        out["step"].append((time.perf_counter_ns() - t0) / 1e9)
        out["step_cpu"].append((time.thread_time_ns() - c0) / 1e9)
        out["forward"].append(((timers.ns["forward"] if timers is not None else 0) - f0) / 1e9)
        out["forward_cpu"].append(((timers.cpu_ns["forward"] if timers is not None else 0) - fc0) / 1e9)
    running = engine.scheduler.num_running
    if running != n:
        raise RuntimeError(f"expected {n} running sequences, found {running} (raise --output-len)")
    return out


def measure(engine: Any, args: argparse.Namespace, n: int, tag: str) -> dict[str, Any]:
    """Submit ``n`` requests, let them all reach decode, then time two passes of ``--steps`` steps."""
    from plinth.core.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = np.random.default_rng(n)
    vocab = engine.vocab_size
    for i in range(n):
        engine.add_request(f"{tag}-{i}", rng.integers(3, vocab, size=args.prompt_len).tolist(), params)
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step(final_only=args.final_only)
    for _ in range(args.warmup_steps):
        engine.step(final_only=args.final_only)
    # pass 1: only the forward pass is timed, so host time = step - forward, per step
    timers = instrument(engine, ("forward",))
    try:
        plain = decode_steps(engine, n, args.steps, args.final_only, timers)
    finally:
        timers.restore()
    host = [t - f for t, f in zip(plain["step"], plain["forward"], strict=True)]
    host_cpu = [t - f for t, f in zip(plain["step_cpu"], plain["forward_cpu"], strict=True)]
    # pass 2: every phase timed (the timers add a little)
    timers = instrument(engine)
    try:
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        with maybe_profile(args.profile > 0) as prof:
            decode_steps(engine, n, args.steps, args.final_only, timers)
        total_ns, total_cpu_ns = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
    finally:
        timers.restore()
    known = sum(v for k, v in timers.ns.items() if k != "other")
    timers.ns["other"] = max(0, total_ns - known)
    known_cpu = sum(v for k, v in timers.cpu_ns.items() if k != "other")
    timers.cpu_ns["other"] = max(0, total_cpu_ns - known_cpu)
    result = {
        "num_seqs": n,
        "step_ms": statistics.median(plain["step"]) * 1e3,
        "host_ms": statistics.median(host) * 1e3,
        "host_min_ms": min(host) * 1e3,
        "host_cpu_ms": statistics.median(host_cpu) * 1e3,
        "forward_ms": statistics.median(plain["forward"]) * 1e3,
        "instrumented_step_ms": total_ns / 1e6 / args.steps,
        "phases_ms": {k: v / 1e6 / args.steps for k, v in timers.ns.items()},
        "phases_cpu_ms": {k: v / 1e6 / args.steps for k, v in timers.cpu_ns.items()},
    }
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.profile)
        result["profile"] = buf.getvalue()
    engine.abort_request([f"{tag}-{i}" for i in range(n)])
    while engine.has_unfinished_requests():
        engine.step()
    return result


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PLINTH_CPU_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = None if args.no_tokenizer else save_tiny_llama(Path(tmp) / "tiny", args.layers, args.vocab)
        engine = build_engine(args, model_dir, max(args.num_seqs))
        results = []
        for n in args.num_seqs:
            r = measure(engine, args, n, f"n{n}")
            results.append(r)
            ph = r["phases_ms"]
            cpu = r["phases_cpu_ms"]
            print(f"N={n:4d}  step {r['step_ms']:6.2f} ms, host {r['host_ms']:6.2f} ms (best {r['host_min_ms']:.2f}, "
                  f"CPU {r['host_cpu_ms']:.2f}), forward {r['forward_ms']:6.2f} ms | phases, CPU ms per step: "
                  + "  ".join(f"{k} {cpu[k]:.2f}" for k in PHASES) + " | wall: "
                  + "  ".join(f"{ph[k]:.2f}" for k in PHASES), flush=True)
            if "profile" in r:
                print(r["profile"])
        engine.shutdown()
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; revision {git_revision()}")
    if args.json is not None:
        doc = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "revision": git_revision(), "load_average": load,
               "results": [{k: v for k, v in r.items() if k != "profile"} for r in results]}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
