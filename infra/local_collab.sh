#!/usr/bin/env bash
# A whole collaboration on this machine: create the run, start volunteer workers, schedule rounds
# until ROUNDS states are committed, print the ledger, and stop everything (also on Ctrl-C).
# The Prefect deployment replaces the plain scheduler process here (see README).
set -euo pipefail
BIN=${BIN:-.venv/bin}
BUCKET=${BUCKET:-file://$PWD/.dedloc/bucket}
RUN=${RUN:-demo}
ROUNDS=${ROUNDS:-10}
WORKERS=${WORKERS:-2}
PRESET=${PRESET:-tiny}
TARGET=${TARGET:-128}
LOGS=${LOGS:-.dedloc/logs}
mkdir -p "$LOGS"

"$BIN/dedloc" init --bucket "$BUCKET" --run "$RUN" --preset "$PRESET" --target-batch "$TARGET"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
for i in $(seq 1 "$WORKERS"); do
  "$BIN/dedloc" worker --bucket "$BUCKET" --run "$RUN" --peer-id "local-$i" --threads 1 \
    --until-round "$ROUNDS" >"$LOGS/worker-$i.log" 2>&1 &
  pids+=($!)
done
echo "workers: ${#pids[@]} (logs in $LOGS); scheduling until state $ROUNDS is committed"
"$BIN/dedloc" aggregate --bucket "$BUCKET" --run "$RUN" --until-round "$ROUNDS" 2>"$LOGS/scheduler.log"
"$BIN/dedloc" status --bucket "$BUCKET" --run "$RUN"
