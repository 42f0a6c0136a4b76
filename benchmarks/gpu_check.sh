#!/usr/bin/env bash
# The GPU check of issue 38, as one script for a one-GPU machine with torch (CUDA) and transformers but no Ray or
# vLLM: the pinned-memory probe, the gpu_path cycle at `tiny` (the code path, seconds) and at `4b` (the figures).
# Figures go to $OUT (JSON). Try it on CPU first: OUT=/tmp/x SIZE=tiny benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/bidirl-gpu-check}; SIZE=${SIZE:-4b}; mkdir -p "$OUT"
# the 4B cycle writes an 8 GB model and a 48 GB snapshot: never into a RAM-backed /tmp beside an 80 GB host buffer
if df -T /tmp | grep -q tmpfs; then export TMPDIR=$PWD/.gpu-check-tmp; mkdir -p "$TMPDIR"; fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; PY=${PY:-python}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; free -g; df -h /tmp; nproc; lscpu | grep "Model name";
  $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > "$OUT/machine.txt" 2>&1
timeout 60 $PY benchmarks/pinned_probe.py > "$OUT/pinned_probe.json" 2> "$OUT/pinned_probe.err"
BIDIRL_GPU_PATH_OUT="$OUT/tiny.partial.json" $PY benchmarks/bench_gpu_path.py tiny > "$OUT/tiny.json" 2> "$OUT/tiny.err" \
  || { echo "tiny cycle failed"; tail -30 "$OUT/tiny.err"; exit 1; }
echo "tiny ok"
[ "$SIZE" = tiny ] && exit 0
BIDIRL_GPU_PATH_OUT="$OUT/$SIZE.partial.json" $PY benchmarks/bench_gpu_path.py "$SIZE" > "$OUT/$SIZE.json" 2> "$OUT/$SIZE.err"
rc=$?; tail -5 "$OUT/$SIZE.err" | grep -v "it/s" ; cat "$OUT/$SIZE.partial.json" | tr -d '\n ' | head -c 3000; echo; exit $rc
