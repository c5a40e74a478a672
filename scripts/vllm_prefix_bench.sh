#!/usr/bin/env bash
# vLLM's own client (`vllm bench serve --dataset-name prefix_repetition`) against pdcluster (prefix
# cache on, cache-aware routing, 1 prefill + 1 decode) and against vLLM-CPU's OpenAI server (its
# prefix caching on), the same model and load, one after the other in one run (issue 25).
# Not part of the test suite: it takes minutes and needs vLLM-CPU in its own venv (docs/performance.md).
#
# usage: scripts/vllm_prefix_bench.sh MODEL_DIR OUT_DIR [VLLM_PYTHON]
#   env: NUM_PROMPTS (64), PREFIX_LEN (256), SUFFIX_LEN (64), NUM_PREFIXES (4), OUTPUT_LEN (32),
#        PDCLUSTER (the pdcluster command; default: `python -m pdcluster` of this checkout's venv)
# Writes OUT_DIR/{pdcluster,vllm}.json (vLLM's result files) and the servers' logs.
set -euo pipefail
MODEL=$(realpath "$1"); OUT=$(realpath -m "$2"); VPY=${3:-/work/vllm-venv/bin/python}
mkdir -p "$OUT"
PD=${PDCLUSTER:-pdcluster}
PORT_PD=18080; PORT_VLLM=18090
RUNNER="$OUT/vllm_bench_serve.py"
cat > "$RUNNER" <<'PY'
import argparse, asyncio
if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    p = argparse.ArgumentParser(); add_cli_args(p); r = main(p.parse_args())
    if asyncio.iscoroutine(r): asyncio.run(r)
PY
PID=""
stop() { if [ -n "$PID" ]; then kill -TERM "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; PID=""; fi; }
trap stop EXIT
wait_models() {  # $1 port: /v1/models answers within 600 s, else fail
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$1/v1/models" > "$OUT/models.json"; then return 0; fi
    sleep 1
  done
  echo "server on port $1 did not answer /v1/models within 600 s" >&2; return 1
}
bench() {  # $1 port, $2 label
  local name; name=$(python3 -c "import json; print(json.load(open('$OUT/models.json'))['data'][0]['id'])")
  env -u PYTHONPATH "$VPY" "$RUNNER" --backend openai --base-url "http://127.0.0.1:$1" --model "$name" \
    --tokenizer "$MODEL" --dataset-name prefix_repetition --num-prompts "${NUM_PROMPTS:-64}" \
    --prefix-repetition-prefix-len "${PREFIX_LEN:-256}" --prefix-repetition-suffix-len "${SUFFIX_LEN:-64}" \
    --prefix-repetition-num-prefixes "${NUM_PREFIXES:-4}" --prefix-repetition-output-len "${OUTPUT_LEN:-32}" \
    --request-rate inf --ignore-eos --save-result --result-dir "$OUT" --result-filename "$2.json" \
    2>&1 | tee "$OUT/$2.txt"
}
$PD up --model "$MODEL" --prefill 1 --decode 1 --http-port $PORT_PD --admin-port 0 \
  --router-flag routing=cache-aware --log-dir "$OUT/pdcluster-logs" > "$OUT/pdcluster-up.log" 2>&1 &
PID=$!
wait_models $PORT_PD
bench $PORT_PD pdcluster
stop
VLLM_CPU_KVCACHE_SPACE=2 env -u PYTHONPATH "$VPY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --dtype float32 --max-model-len 512 --enforce-eager --enable-prefix-caching --port $PORT_VLLM \
  > "$OUT/vllm-server.log" 2>&1 &
PID=$!
wait_models $PORT_VLLM
bench $PORT_VLLM vllm
stop
