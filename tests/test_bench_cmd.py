"""``plinth bench latency|throughput`` on the tiny-llama dummy preset, and the floor arithmetic."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from plinth import benchmarks_floor as floors
from plinth.entrypoints import bench_cmd
from plinth.entrypoints.cli import main

TINY = ["tiny-llama", "--load-format", "dummy", "--num-blocks", "64", "--selection", "off"]


def run_bench(capsys, tmp_path, mode: str, *argv: str) -> tuple[str, dict]:
    out_path = tmp_path / "result.json"
    rc = main(["--log-level", "WARNING", "bench", mode, *TINY, *argv, "--json", str(out_path)])
    assert rc == 0
    return capsys.readouterr().out, json.loads(out_path.read_text())


def test_latency_prints_and_writes_the_fields(capsys, tmp_path):
    text, r = run_bench(capsys, tmp_path, "latency", "--input-len", "16", "--output-len", "8", "--batch-size", "2",
                        "--num-iters", "2", "--num-iters-warmup", "1")
    assert r["mode"] == "latency" and r["model"] == "tiny-llama" and r["device"] == "cpu"
    assert (r["batch_size"], r["input_len"], r["output_len"], r["num_iters"]) == (2, 16, 8, 2)
    assert len(r["latencies_s"]) == 2 and all(t > 0 for t in r["latencies_s"])
    assert 0 < r["median_ttft_s"] < r["median_latency_s"]
    assert r["median_tpot_s"] > 0
    assert r["output_tokens_per_s"] == pytest.approx(2 * 8 / r["median_latency_s"])
    assert r["floor"] == floors.UNKNOWN
    for label in ("end-to-end latency", "time to first token", "time per output token", "output tokens/s",
                  floors.UNKNOWN):
        assert label in text


def test_model_as_a_flag_anywhere(capsys, tmp_path):
    """``--model`` (vLLM's spelling) names the model among the flags, where the positional cannot stand; two
    different models are a one-line error."""
    out_path = tmp_path / "r.json"
    rc = main(["--log-level", "WARNING", "bench", "latency", "--input-len", "8", "--output-len", "4", "--num-iters",
               "1", "--model", "tiny-llama", *TINY[1:], "--json", str(out_path)])
    assert rc == 0 and json.loads(out_path.read_text())["model"] == "tiny-llama"
    capsys.readouterr()
    assert main(["bench", "latency", *TINY, "--model", "llama-3-8b"]) == 2
    assert "two models given: 'tiny-llama' (positional) and --model 'llama-3-8b'" in capsys.readouterr().err
    assert main(["bench", "latency", "--model=", *TINY[1:]]) == 2
    assert "the model name is empty" in capsys.readouterr().err


def test_throughput_counts_every_token(capsys, tmp_path):
    text, r = run_bench(capsys, tmp_path, "throughput", "--num-prompts", "6", "--input-len-range", "4", "20",
                        "--output-len", "5", "--num-warmup-prompts", "1", "--prompt-seed", "3")
    expected = bench_cmd.random_prompts(6, (4, 20), 1024, 3)
    assert r["num_prompts"] == 6
    assert r["prompt_tokens"] == sum(len(p) for p in expected)
    assert r["output_tokens"] == 6 * 5
    assert r["elapsed_s"] > 0 and r["process_cpu_s"] > 0
    assert r["requests_per_s"] == pytest.approx(6 / r["elapsed_s"])
    assert r["output_tokens_per_s"] == pytest.approx(30 / r["elapsed_s"])
    assert r["total_tokens_per_s"] == pytest.approx((30 + r["prompt_tokens"]) / r["elapsed_s"])
    for label in ("requests/s", "output tokens/s", "total tokens/s", "elapsed"):
        assert label in text
    # a waiting queue smaller than the run: the prompts go in as room frees
    _, r = run_bench(capsys, tmp_path, "throughput", "--num-prompts", "6", "--input-len-range", "4", "20",
                     "--output-len", "5", "--num-warmup-prompts", "1", "--max-waiting-requests", "2")
    assert r["output_tokens"] == 6 * 5


def test_floor_fractions_on_a_known_device(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(floors, "device_name", lambda device: "NVIDIA H200 (pretend)")
    _, lat = run_bench(capsys, tmp_path, "latency", "--input-len", "8", "--output-len", "4", "--num-iters", "1",
                       "--num-iters-warmup", "0", "--dtype", "bfloat16")
    assert lat["floor_tpot_s"] == pytest.approx(lat["streamed_weight_bytes"] / 4.21e12)
    assert lat["tpot_floor_fraction"] == pytest.approx(lat["floor_tpot_s"] / lat["median_tpot_s"])
    _, tput = run_bench(capsys, tmp_path, "throughput", "--num-prompts", "2", "--input-len", "8",
                        "--output-len", "3", "--dtype", "bfloat16")
    tokens = tput["prompt_tokens"] + tput["output_tokens"]
    assert tput["floor_elapsed_s"] == pytest.approx(2 * tput["matmul_params"] * tokens / 760e12)
    assert tput["floor_fraction"] == pytest.approx(tput["floor_elapsed_s"] / tput["elapsed_s"])


@pytest.mark.parametrize("argv, message", [
    (["throughput", "--input-len-range", "10", "10"], "1 <= A < B"),
    (["latency", "--input-len-range", "1", "10"], "for the throughput benchmark"),
    (["latency", "--output-len", "0"], "--output-len must be >= 1"),
    (["throughput", "--prompt-seed", "-1"], "--prompt-seed must be >= 0"),
    (["latency", "--json", ""], "--json needs a file path"),
    (["latency", "--input-len", "2000", "--output-len", "100"], "exceeds the model length"),
    (["latency", "--max-num-seqs", "0"], "--max-num-seqs must be a positive integer, got 0"),
])
def test_bad_workloads_are_one_line_errors(capsys, argv, message):
    assert main(["--log-level", "WARNING", "bench", argv[0], *TINY, *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_random_prompts_are_seeded_and_in_range():
    a = bench_cmd.random_prompts(50, (128, 1024), 1000, seed=7)
    assert a == bench_cmd.random_prompts(50, (128, 1024), 1000, seed=7)
    assert a != bench_cmd.random_prompts(50, (128, 1024), 1000, seed=8)
    assert all(128 <= len(p) < 1024 for p in a)
    assert all(0 <= t < 1000 for p in a for t in p)
    assert [len(p) for p in bench_cmd.random_prompts(3, 17, 1000, seed=0)] == [17, 17, 17]


@pytest.mark.parametrize("tied", [False, True])
def test_weight_stats_against_a_hand_count(tied):
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    h, i, kv = 16, 32, 2 * 4  # kv = key/value width (2 heads x head size 4)
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h   # q, k, v, o, gate/up/down, two norms
    body = 2 * per_layer + h                                    # plus the final norm
    emb = 100 * h
    stats = floors.weight_stats(model)
    assert stats.params == body + emb + (0 if tied else emb)
    assert stats.matmul_params == body + emb   # the LM head reads the whole table; the lookup does not
    assert stats.streamed_bytes == 2 * stats.matmul_params


def test_weight_stats_counts_only_what_decode_reads_of_two_layouts():
    """A quantized layer whose kernel keeps a second layout for long inputs (``decode_tensors``) streams
    only the decode layout per step."""
    layer = torch.nn.Linear(4, 4, bias=True)
    del layer._parameters["weight"]
    layer.register_parameter("fast", torch.nn.Parameter(torch.zeros(8, dtype=torch.int32), requires_grad=False))
    layer.register_parameter("wide", torch.nn.Parameter(torch.zeros(100, dtype=torch.int32), requires_grad=False))
    model = torch.nn.Sequential(layer)
    assert floors.weight_stats(model).streamed_bytes == (8 + 100 + 4) * 4
    layer.decode_tensors = frozenset({"fast"})
    assert floors.weight_stats(model).streamed_bytes == (8 + 4) * 4


def test_weight_stats_count_the_experts_a_token_runs():
    """Of a mixture of experts, one token runs top_k of num_experts experts: the stacked expert weights count by
    that share (a hand count on a plinth layer and on transformers' gpt-oss of the same sizes)."""
    from plinth.model_registry.layers.moe import FusedMoE

    moe = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), FusedMoE(4, 1, 8, 6, renormalize=True))
    experts = 4 * (2 * 6 * 8 + 8 * 6)
    stats = floors.weight_stats(moe)
    assert stats.params == 8 * 16 + experts
    assert stats.matmul_params == 8 * 16 + experts // 4 and stats.streamed_bytes == 4 * stats.matmul_params
    cfg = transformers.GptOssConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2)
    hf = transformers.GptOssForCausalLM(cfg)
    stacked = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    assert stacked == 4 * (16 * 64 + 64 + 32 * 16 + 16)
    everything = floors.weight_stats(hf)
    assert everything.params - everything.matmul_params == 100 * 16 + stacked // 2   # the lookup, the idle half


def test_ceilings_table():
    assert floors.ceilings_for("NVIDIA H200").copy_bytes_per_s == 4.21e12
    assert floors.ceilings_for("nvidia h200 nvl").matmul_flops_per_s[torch.bfloat16] == 760e12
    assert floors.ceilings_for("NVIDIA A100-SXM4-80GB") is None
    stats = floors.WeightStats(params=10, matmul_params=8, streamed_bytes=16)
    h200 = floors.ceilings_for("H200")
    assert floors.decode_step_floor_s(stats, h200) == 16 / 4.21e12
    assert floors.compute_floor_s(stats, 5, torch.bfloat16, h200) == 2 * 8 * 5 / 760e12
    assert floors.compute_floor_s(stats, 5, torch.float32, h200) is None


# ----------------------------------------------------------------------------- tensor/pipeline parallel

# the tiny-llama preset: hidden 64, MLP 128, 2 layers, 4 query heads and 2 KV heads of 16, vocabulary 1024
H, MLP, LAYERS, VOCAB, KV = 64, 128, 2, 1024, 2 * 16
MATMUL = H * H + 2 * H * KV + H * H + 3 * H * MLP  # q, k, v, o, gate/up/down of one layer
NORMS = 2 * H                                      # the two norms of one layer
TEST_CPU = floors.DeviceCeilings("test CPU", 1e11, {torch.float32: 1e12})


def _run_parallel(monkeypatch, capsys, tmp_path, mode: str, argv: list[str]) -> tuple[str, dict, list[int]]:
    """Run the benchmark with worker processes; returns its output, its result and the workers' pids."""
    pids: list[int] = []
    bench = getattr(bench_cmd, f"bench_{mode}")

    def recording(engine, *args, **kwargs):
        pids.extend(engine.executor.worker_pids)
        return bench(engine, *args, **kwargs)

    monkeypatch.setattr(bench_cmd, f"bench_{mode}", recording)
    text, result = run_bench(capsys, tmp_path, mode, *argv, "--distributed-executor", "mp")
    return text, result, pids


def test_latency_with_tensor_parallel_workers(capsys, tmp_path, monkeypatch):
    """TP=2: each rank streams half of every matmul weight (the norms are replicated), so the decode
    floor is the larger shard's bytes; the worker processes stop with the command."""
    from test_distributed_helpers import wait_gone

    # the ranks report a CPU device; its ceilings are looked up here, in the driver
    monkeypatch.setattr(floors, "KNOWN_DEVICES", (("cpu", TEST_CPU),))
    argv = ["--input-len", "8", "--output-len", "6", "--num-iters", "2", "--num-iters-warmup", "1"]
    text, r, pids = _run_parallel(monkeypatch, capsys, tmp_path, "latency", [*argv, "--tensor-parallel-size", "2"])
    assert (r["tensor_parallel_size"], r["pipeline_parallel_size"], r["executor"]) == (2, 1, "MultiprocExecutor")
    assert len(r["latencies_s"]) == 2 and r["median_tpot_s"] > 0
    assert r["output_tokens_per_s"] == pytest.approx(6 / r["median_latency_s"])
    shard = LAYERS * (MATMUL // 2 + NORMS) + H + VOCAB * H // 2     # layers, final norm, half the LM head
    assert r["streamed_weight_bytes"] == 4 * shard
    assert r["params"] == 2 * (shard + VOCAB * H // 2)             # each rank also holds half the embedding
    assert r["floor_tpot_s"] == pytest.approx(4 * shard / 1e11)
    assert r["tpot_floor_fraction"] == pytest.approx(r["floor_tpot_s"] / r["median_tpot_s"])
    assert "tp 2 x pp 1, MultiprocExecutor" in text and "of the floor" in text
    assert len(set(pids)) == 2 and wait_gone(pids, 10.0) == []

    _, one = run_bench(capsys, tmp_path, "latency", *argv)   # one process: the whole model
    assert one["streamed_weight_bytes"] == 4 * (LAYERS * (MATMUL + NORMS) + H + VOCAB * H)
    assert one["params"] == LAYERS * (MATMUL + NORMS) + H + 2 * VOCAB * H
    assert one["tensor_parallel_size"] == 1 and one["executor"] == "UniprocExecutor"


def test_throughput_with_pipeline_stages(capsys, tmp_path, monkeypatch):
    """PP=2: a decode step runs both stages one after the other (floor: all the weights); the compute
    floor is the busier stage's, the last one with the LM head."""
    from test_distributed_helpers import wait_gone

    monkeypatch.setattr(floors, "KNOWN_DEVICES", (("cpu", TEST_CPU),))
    text, r, pids = _run_parallel(monkeypatch, capsys, tmp_path, "throughput",
                                  ["--num-prompts", "5", "--input-len", "8", "--output-len", "4",
                                   "--num-warmup-prompts", "1", "--pipeline-parallel-size", "2"])
    assert (r["tensor_parallel_size"], r["pipeline_parallel_size"]) == (1, 2)
    assert r["output_tokens"] == 5 * 4 and r["prompt_tokens"] == 5 * 8
    last_stage = MATMUL + NORMS + H + VOCAB * H          # one layer, the final norm, the LM head
    assert r["matmul_params"] == last_stage
    assert r["params"] == 2 * (MATMUL + NORMS) + H + 2 * VOCAB * H
    tokens = r["prompt_tokens"] + r["output_tokens"]
    assert r["floor_elapsed_s"] == pytest.approx(2 * last_stage * tokens / 1e12)
    assert "tp 1 x pp 2" in text
    assert len(set(pids)) == 2 and wait_gone(pids, 10.0) == []


def test_parallel_weight_stats_takes_the_critical_path():
    from plinth.distributed.executor import RankWeights

    def rank(tp: int, pp: int, params: int, matmul: int, streamed: int) -> RankWeights:
        return RankWeights(tp, pp, "cpu", floors.WeightStats(params, matmul, streamed))

    ranks = [rank(0, 0, 10, 8, 16), rank(1, 0, 12, 9, 18), rank(0, 1, 7, 7, 14), rank(1, 1, 7, 6, 12)]
    stats = bench_cmd.parallel_weight_stats(ranks)
    assert stats == floors.WeightStats(params=36, matmul_params=9, streamed_bytes=18 + 14)
    single = floors.WeightStats(5, 4, 8)
    assert bench_cmd.parallel_weight_stats([RankWeights(0, 0, "cpu", single)]) == single


@pytest.mark.parametrize("tied", [False, True])
def test_weight_stats_of_a_quantized_lm_head(tmp_path, tied):
    """With ``--quantize-lm-head`` a decode step reads the head's quantized copy, not its float weight: the
    float table counts once as a lookup when tied (the embedding) and is gone when untied; the CPU packing
    estimate leaves the head out (its gemm is the quantized kernel, not a packed copy)."""
    from conftest import save_tiny_model
    from test_quantization_support import load_plinth

    from plinth.worker.cpu_path import _packed_bytes

    path = save_tiny_model(tmp_path / "m", vocab_size=320, tie_word_embeddings=tied)
    plain, _b, _m = load_plinth(path, "int4")
    quant, _b, _m = load_plinth(path, "int4", quantize_lm_head=True)
    head_float = 320 * 64 * 4   # float32 model
    copy = sum(p.numel() * p.element_size() for p in quant.lm_head.quantized.parameters())
    assert 0 < copy < head_float / 4
    assert floors.weight_stats(quant).streamed_bytes == floors.weight_stats(plain).streamed_bytes - head_float + copy
    assert _packed_bytes(quant) == _packed_bytes(plain) - head_float
