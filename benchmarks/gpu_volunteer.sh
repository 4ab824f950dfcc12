#!/usr/bin/env bash
# Benchmark 10 on a lent GPU: one volunteer of a diloco run of causal-1b (TinyLlama-sized) with
# sparse pseudo-gradients, in bfloat16: tokens/s of computing, a round's overhead, peak GPU memory
# (benchmarks/volunteer_gpu.py). Run from the repository root with the project installed beside a
# CUDA build of torch; no data set needed (synthetic running text). Settings: PRESET, PRECISION,
# SEQ, MICRO, INNER, H, OUT. About 2 minutes on an H200 (most of it writing state 0's 4.4 GB).
set -euo pipefail
PY=${PYTHON:-python}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
exec "$PY" -m benchmarks.volunteer_gpu --preset "${PRESET:-causal-1b}" --device cuda \
  --precision "${PRECISION:-bf16}" --seq "${SEQ:-1024}" --micro-batch "${MICRO:-4}" \
  --inner-batch "${INNER:-16}" --h "${H:-8}" --out "${OUT:-.dedloc/bench/volunteer-gpu}"
