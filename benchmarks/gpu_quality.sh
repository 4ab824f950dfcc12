#!/usr/bin/env bash
# The quality benchmark's measurement on a GPU: sahajBERT (ALBERT-large) pretrained by volunteer
# workers on one CUDA device over a fixed budget of rounds; reports samples/s, compute fraction and
# the held-out curve (benchmarks/quality.py). Run from the repository root, with the project
# installed (`pip install -e '.[eval,bench]'` beside a CUDA build of torch) and the corpus built
# (`make corpus`). Settings: PRESET, PEERS, ROUNDS, TARGET, SEQ, WARMUP, MICRO, DEVICE, OUT.
set -euo pipefail
PY=${PYTHON:-python}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() or '${DEVICE:-cuda}' == 'cpu' else 'no CUDA device')"
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
# The DeDLOC recipe's 5000 warmup steps outlast any short budget: warm up over a tenth of it.
exec "$PY" -m benchmarks.quality --preset "${PRESET:-sahajbert}" --device "${DEVICE:-cuda}" \
  --peers "${PEERS:-2}" --rounds "${ROUNDS:-60}" --target "${TARGET:-1024}" --seq "${SEQ:-128}" \
  --warmup "${WARMUP:-6}" --micro-batch "${MICRO:-64}" --no-reference --no-finetune \
  --out "${OUT:-.dedloc/bench/quality-gpu}"
