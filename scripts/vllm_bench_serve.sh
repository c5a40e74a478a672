#!/usr/bin/env bash
# vLLM's own load generator (`vllm bench serve`) against vLLM-CPU and against pdcluster, one after
# the other on this machine, same model, same workload; each server alone while it is measured.
#
#   scripts/vllm_bench_serve.sh MODEL_DIR OUT_DIR [extra `bench serve` arguments]
#
# Default workload: `--dataset-name prefix_repetition` (4 prefixes of 256 tokens, each prompt one of
# them plus 64 tokens of its own, 32 new tokens, 64 prompts at 4/s, ignore_eos), prefix caching on
# in both servers. vLLM's CPU build lives in its own venv (../shared/design/PEERS.md): VLLM_VENV,
# default /work/vllm-venv. pdcluster runs `pdcluster up` (PDCLUSTER_UP_ARGS, default 1 prefill + 1
# decode replica, `full`, cache-aware routing). Results: OUT_DIR/{vllm,pdcluster}.json (vLLM's result
# files) and the servers' logs; a summary line per server on stdout. ONLY=vllm or ONLY=pdcluster runs
# one side.
set -euo pipefail

MODEL=${1:?usage: $0 MODEL_DIR OUT_DIR [bench serve args]}
OUT=${2:?usage: $0 MODEL_DIR OUT_DIR [bench serve args]}
shift 2
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
PDCLUSTER=${PDCLUSTER:-$(dirname "$0")/../.venv/bin/pdcluster}
PDCLUSTER_UP_ARGS=${PDCLUSTER_UP_ARGS:---prefill 1 --decode 1 --strategy full --torch-threads 1}
PORT=${PORT:-8391}
MAX_LEN=${MAX_LEN:-2048}
WORKLOAD=(--dataset-name prefix_repetition --prefix-repetition-prefix-len 256
          --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 4
          --prefix-repetition-output-len 32 --num-prompts 64 --request-rate 4 --ignore-eos --seed 0)
if [[ $# -gt 0 ]]; then WORKLOAD=("$@"); fi

[[ -x "$VLLM_VENV/bin/python" ]] || { echo "no vLLM venv at $VLLM_VENV (see PEERS.md)" >&2; exit 2; }
mkdir -p "$OUT"
SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT

wait_ready() {  # the OpenAI server on $PORT lists a model within 5 minutes
    for _ in $(seq 300); do
        if curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; then return 0; fi
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited; see $OUT" >&2; exit 1; }
        sleep 1
    done
    echo "the server on port $PORT did not come up" >&2; exit 1
}

bench() {  # $1: result name; vLLM's client against the server on $PORT
    local name=$1 model_id
    model_id=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | "$VLLM_VENV/bin/python" -c \
        'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
    "$VLLM_VENV/bin/python" - --backend openai --base-url "http://127.0.0.1:$PORT" --model "$model_id" \
        --tokenizer "$MODEL" "${WORKLOAD[@]}" --save-result --result-dir "$OUT" \
        --result-filename "$name.json" > "$OUT/$name.client.log" 2>&1 <<'EOF'
import argparse, asyncio
if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    p = argparse.ArgumentParser(); add_cli_args(p); r = main(p.parse_args())
    if asyncio.iscoroutine(r): asyncio.run(r)
EOF
    "$VLLM_VENV/bin/python" -c 'import json, sys
r = json.load(open(sys.argv[1]))
keys = ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
print(sys.argv[2], " ".join(f"{k}={r.get(k, 0):.1f}" for k in keys))' "$OUT/$name.json" "$name"
}

ONLY=${ONLY:-}
if [[ -z "$ONLY" || "$ONLY" == vllm ]]; then
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL" --dtype float32 --max-model-len "$MAX_LEN" --enforce-eager --port "$PORT" \
        > "$OUT/vllm.server.log" 2>&1 &
    SERVER_PID=$!
    wait_ready
    bench vllm
    stop_server
fi
if [[ -z "$ONLY" || "$ONLY" == pdcluster ]]; then
    # shellcheck disable=SC2086  # PDCLUSTER_UP_ARGS is a list of flags
    "$PDCLUSTER" up --model "$MODEL" --http-port "$PORT" --admin-port 0 $PDCLUSTER_UP_ARGS \
        > "$OUT/pdcluster.server.log" 2>&1 &
    SERVER_PID=$!
    wait_ready
    bench pdcluster
    stop_server
fi
