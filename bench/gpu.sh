#!/usr/bin/env bash
# Device checks on one NVIDIA H200 (never run in CI), under 10 minutes, nothing downloaded:
#
#   bash bench/gpu.sh            # full size, on the GPU
#   bash bench/gpu.sh --tiny     # the same parts at tiny sizes on the CPU (a check that they run)
#
# Each part of bench/gpu.py runs in its own process with its own time limit (their sum is 9.5 minutes),
# so one slow or failing part leaves the others' rows; a part that runs out of time prints a row saying so.
# Prints one markdown table (bench/README.md, "GPU checks", says what each row means).
set -uo pipefail
cd "$(dirname "$0")/.."

TINY=""
if [[ "${1:-}" == "--tiny" ]]; then
  TINY="--tiny"
  export JAX_PLATFORMS=cpu
fi
# Leave room for cuDNN workspaces next to 30-60 GB of weights; no preallocation surprises.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=(uv run --no-sync python bench/gpu.py $TINY)

echo "| part | what | time | work | MFU / ratio |"
echo "| --- | --- | --- | --- | --- |"
run() {  # run PART SECONDS
  local out rc
  out=$(timeout "$2" "${PY[@]}" --part="$1" 2>/tmp/md_gpu_$1.err)
  rc=$?
  # Each process prints its header, the peak row and its own rows; keep the rows after the header.
  printf '%s\n' "$out" | grep '^| ' | grep -v -e '^| part ' -e '^| ---' \
    | { [[ "$1" == flux ]] && cat || grep -v '^| peak '; }
  if [[ $rc -eq 124 ]]; then
    echo "| $1 | ran past its ${2} s limit | | | |"
  elif [[ $rc -ne 0 ]]; then
    echo "| $1 | failed (exit $rc): $(tail -n 1 /tmp/md_gpu_$1.err) | | | |"
  fi
}
run flux 150
run wan 180
run attention 90
run quant 120
run lora 30
