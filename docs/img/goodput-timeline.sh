#!/usr/bin/env bash
# Makes docs/img/goodput-timeline.png: a requeued `ftkit demo` job, simulated locally.
# SLURM_JOB_ID / SLURM_RESTART_COUNT / SLURM_GPUS_ON_NODE are set by hand (no SLURM involved);
# FTKIT_DEADLINE keeps the time budget from asking scontrol for the job's end time.
#   run 0: killed with kill -9 right after its first periodic progress record (a crash);
#   run 1: the "requeued" job resumes, is stopped by SIGUSR1 (save, exit, requeue);
#   run 2: resumes and completes.
set -euo pipefail
J=${1:-/tmp/goodput-demo}
OUT=${2:-docs/img/goodput-timeline.png}
rm -rf "$J"
export FTKIT_DEADLINE=$(( $(date +%s) + 86400 )) SLURM_JOB_ID=7001 SLURM_GPUS_ON_NODE=4 SLURM_JOB_NUM_NODES=1
demo() { SLURM_RESTART_COUNT=$1 python3 -m ftkit demo --no-live --jobdir "$J" --steps 2000 --step-time 0.02 \
         --save-every 150 > "$J.run$1.log" 2>&1 & }
progress() { grep -sc '"event": "progress", "rank": 0, "host": "[^"]*", "pid": [0-9]*, "step": [0-9]*, "steps": [0-9]*}' "$J/events.jsonl" 2>/dev/null; }
mkdir -p "$J"
demo 0; P=$!
until [ "$(progress || true)" -ge 1 ] 2>/dev/null; do sleep 0.02; done
kill -9 $P; wait $P || true
sleep 5  # "in the queue"
demo 1; P=$!
until grep -q '"step": 1200' "$J/events.jsonl"; do sleep 0.1; done
sleep 3; kill -USR1 $P; wait $P
sleep 5
demo 2; P=$!; wait $P
python3 -m ftkit report "$J" --plot "$OUT"
