#!/usr/bin/env bash
# The GPU checks and headline figures in one go (one H200 or more), results under OUT (default gpu-suite/):
#   benchmarks/gpu_suite.sh [OUT] [PARTS]
# PARTS (comma-separated, default tests,int4,fp8,moe,tp): tests = every GPU test file (it also fills Triton's
# cache, so the timed parts that follow are not compiling); int4 = batch-1 decode of the Llama-3-8B dummy
# preset in bf16, int4 and int4 with --quantize-lm-head (and where an int4 step with it spends its time); fp8 = workload (b) throughput, bf16 against fp8;
# moe = one Qwen3-30B-A3B-shaped MoE layer with bf16, FP8 and INT4 experts (benchmarks/moe_experts.py);
# tp = with two or more GPUs, the two-GPU tests and TP=2 against TP=1 (benchmarks/tp_gpu.py).
set -u
OUT=${1:-gpu-suite}
PARTS=${2:-tests,int4,fp8,moe,tp}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
has() { [[ ",$PARTS," == *",$1,"* ]]; }
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus; parts: $PARTS; results in $OUT"
if has tests; then
  python3 -m pytest -q tests/test_w4a16_cuda_gpu.py tests/test_triton_attention_gpu.py tests/test_triton_ops_gpu.py \
    tests/test_quantization_gpu.py tests/test_gpu_engine.py tests/test_async_scheduling.py 2>&1 | tail -5 | tee "$OUT/tests.txt"
fi
if has int4; then
  python3 benchmarks/quant_gpu.py --parts latency --configs bf16,int4,int4+head --iters 2 --batch 1 \
    --out "$OUT/int4_latency.json" 2>&1 | grep -E '^latency|"tpot_ms"|"error"' | tee "$OUT/int4_latency.txt"
  python3 benchmarks/step_timeline_gpu.py --batch-sizes 1 \
    --engine-kwargs '{"quantization": "int4", "quantize_lm_head": true}' --out "$OUT/int4_head_timeline.json" 2>&1 \
    | grep -v -i warn | tail -14 | tee "$OUT/int4_head_timeline.txt"
fi
if has fp8; then
  python3 benchmarks/quant_gpu.py --parts throughput --throughput-configs bf16,fp8 --num-prompts 512 \
    --out "$OUT/fp8_throughput.json" 2>&1 | grep -E '^throughput|"output_tok_s"|"error"' | tee "$OUT/fp8_throughput.txt"
fi
if has moe; then
  python3 benchmarks/moe_experts.py --device cuda --dtype bfloat16 --iters 20 --out "$OUT/moe_experts.json" 2>&1 \
    | tail -4 | tee "$OUT/moe_experts.txt"
fi
if has tp && [ "$gpus" -ge 2 ]; then
  python3 -m pytest -q tests/test_custom_all_reduce.py tests/test_distributed_async.py -k gpu 2>&1 | tail -3 \
    | tee "$OUT/tp_tests.txt"
  python3 benchmarks/tp_gpu.py --layouts 2x1,1x1 --iters 3 --out "$OUT/tp.json" 2>&1 | tail -8 | tee "$OUT/tp.txt"
fi
