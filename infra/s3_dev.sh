#!/usr/bin/env bash
# A local S3 endpoint for development: moto's standalone server on loopback.
#   bash infra/s3_dev.sh [PORT]      then, in another shell:
#   export AWS_ENDPOINT_URL=http://127.0.0.1:PORT AWS_ACCESS_KEY_ID=dev AWS_SECRET_ACCESS_KEY=dev
#   .venv/bin/python -c "from dedloc_pipeline.storage.bucket import Bucket; Bucket('s3://collab').fs.mkdir('collab')"
#   make pretrain BUCKET=s3://collab/runs-root
set -euo pipefail
PORT=${1:-5555}
exec "${BIN:-.venv/bin}/python" -m moto.server -H 127.0.0.1 -p "$PORT"
