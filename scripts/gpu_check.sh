#!/usr/bin/env bash
# `make gpu-check OUT=DIR`: every GPU test and benchmark on a machine with one NVIDIA GPU, logs and JSON
# into DIR, in under 8 minutes (each step has a timeout). It needs no .venv and no package registry:
# torch, triton, cupy and NCCL are expected installed; the rest comes from a carried wheelhouse
# (`make wheelhouse`, in .whl/ or wheelhouse/) when there is one, installed into a folder of its own
# (only what is not installed already; pip never looks for an index), and pdcluster runs from this
# checkout (PYTHONPATH). PYTHON=... picks the interpreter (default python3). The steps' limits add up to
# 475 s (install 30, nvidia-smi 10, tests 215, bench gpu 110, bench gpu-transfer 45, bench scaling 65);
# GPU_CHECK_*_S override four of them.
#
#   DIR/env.txt            interpreter, torch and its CUDA, cupy / NCCL, the matching gpu-cuXX extra
#   DIR/install.log        the wheelhouse install
#   DIR/nvidia-smi.txt     nvidia-smi and its device query
#   DIR/tests_gpu.log      python -m pytest -q tests/gpu   (+ DIR/tests_gpu.xml, junit)
#   DIR/bench_gpu.log      python -m pdcluster bench gpu   (+ DIR/bench_gpu.json, DIR/bench_gpu.png)
#   DIR/bench_gpu_transfer.log  python -m pdcluster bench gpu-transfer   (+ DIR/bench_gpu_transfer.json)
#   DIR/bench_scaling.log  python -m pdcluster bench scaling --quick on GPU replicas (+ DIR/scaling/scaling.json)
#   DIR/summary.txt        one line per step: exit code and seconds; pytest's last line
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || exit 1
SITE=${GPU_CHECK_SITE:-/tmp/pdcluster-site}
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # pdcluster from here, the wheels from SITE
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
failed=0

# step NAME SECONDS COMMAND...: run it with a deadline, its output into DIR/NAME.log, a summary line
step() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  [[ $rc -eq 124 || $rc -eq 137 ]] && echo "(timed out after ${limit} s)" >> "$OUT/$name.log"
  echo "$name: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$SUMMARY"
  [[ $rc -eq 0 ]] || failed=1
  return 0
}

# the wheels of the distributions this interpreter lacks, or has in another version (the generated gRPC
# and protobuf modules need their runtime's version or newer; not pdcluster: it runs from here)
missing_wheels() {
  "$PY" - "$1" <<'EOF'
import importlib.metadata as md, pathlib, sys
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    if name == "pdcluster":
        continue
    try:
        if md.version(name) == version:
            continue
    except md.PackageNotFoundError:
        pass
    print(wheel)
EOF
}

install() {
  local house=""
  for candidate in .whl wheelhouse; do [[ -d $candidate ]] && house=$candidate && break; done
  if [[ -z $house ]]; then
    echo "no .whl/ or wheelhouse/ folder: using what $PY has"
    return 0
  fi
  mapfile -t wheels < <(missing_wheels "$house")
  echo "wheelhouse $house: ${#wheels[@]} wheel(s) not installed yet, into $SITE"
  [[ ${#wheels[@]} -eq 0 ]] && return 0
  "$PY" -m pip install --no-index --no-deps --target "$SITE" "${wheels[@]}"
}

{
  echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)' 2>&1)"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
            "available", torch.cuda.is_available())' 2>&1 | tail -1
  "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -1
  "$PY" -c 'import cupy; print("cupy", cupy.__version__)' 2>&1 | tail -1
} > "$OUT/env.txt"

export PY SITE
export -f install missing_wheels
step install 30 bash -c install
"$PY" -c 'from replica.gpu_extras import gpu_extra_hint; print("gpu extra:", gpu_extra_hint() or "nothing to add")' \
  >> "$OUT/env.txt" 2>&1
"$PY" -c 'import pdcluster.cli' 2>> "$OUT/env.txt" || echo "pdcluster does not import: see env.txt" >> "$SUMMARY"
step nvidia-smi 10 bash -c 'nvidia-smi && nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id,driver_version \
  --format=csv'
mv "$OUT/nvidia-smi.log" "$OUT/nvidia-smi.txt"
step tests_gpu "${GPU_CHECK_TESTS_S:-215}" "$PY" -m pytest -q -p no:cacheprovider tests/gpu \
  --junitxml "$OUT/tests_gpu.xml"
echo "  pytest: $(grep -E '(passed|failed|skipped|error)' "$OUT/tests_gpu.log" | tail -1)" >> "$SUMMARY"
step bench_gpu "${GPU_CHECK_BENCH_S:-110}" "$PY" -m pdcluster bench gpu --json "$OUT/bench_gpu.json" \
  --plot "$OUT/bench_gpu.png"
# KV over cuda-ipc and staged tcp, 2 GiB of weights over cuda-ipc, each against its ceiling in the same run
step bench_gpu_transfer "${GPU_CHECK_TRANSFER_S:-45}" "$PY" -m pdcluster bench gpu-transfer --device cuda \
  --kv-size 1GiB --weights-size 2GiB --timeout 35 --json "$OUT/bench_gpu_transfer.json"
echo "  $(grep -E 'goals met' "$OUT/bench_gpu_transfer.log" | tail -1)" >> "$SUMMARY"
# burst -> first token: a live scale-up over cuda-ipc against stop-the-world from disk, GPU replicas, same run
step bench_scaling "${GPU_CHECK_SCALING_S:-65}" "$PY" -m pdcluster bench scaling --quick --device cuda \
  --fabric cuda-ipc --systems live stop-the-world --out "$OUT/scaling" --work /tmp/pdcluster-scaling-work
echo "gpu-check: $([[ $failed -eq 0 ]] && echo passed || echo FAILED), results in $OUT" | tee -a "$SUMMARY"
exit "$failed"
