#!/usr/bin/env bash
# Makes docs/img/goodput-timeline.png: a real `ftkit demo` job on the local SLURM cluster
# (scripts/slurm-cluster up), run by the `single` sbatch template and requeued by SLURM twice:
#   run 0: the trainer is killed with kill -9 after step 400 (a crash after progress):
#          the template's `ftkit requeue` requeues it;
#   run 1: resumes from the newest checkpoint, gets USR1 from `scancel --signal=USR1 --batch`
#          after step 1200 (what the time limit's signal does): saves, exits, requeued;
#   run 2: resumes and completes.
# After each requeue SLURM holds the job ~2 min (BeginTime); the script makes it eligible at
# once, so the queue time in the picture is a few seconds.
set -euo pipefail
J=${1:-/tmp/goodput-demo}
OUT=${2:-docs/img/goodput-timeline.png}
rm -rf "$J" "$J.sbatch"
mkdir -p "$J"
ftkit template single --set jobdir="$J" --set time=30 --set output="$J/job-%j.out" \
    --set error="$J/job-%j.out" --set python="$(command -v python3)" \
    --set command='"$PYTHON" -m ftkit demo --no-live --jobdir "$JOBDIR" --steps 2000 --step-time 0.02 --save-every 150' \
    -o "$J.sbatch"
JOB=$(sbatch --parsable "$J.sbatch")
LOG="$J/job-$JOB.out"
reached() { until grep -qs "step $1 " "$LOG"; do sleep 0.1; done; }
start_now() {  # once the requeued job is PENDING, in a later second than the requeue
    until [ "$(squeue -h -j "$JOB" -o %T)" = PENDING ]; do sleep 0.2; done
    sleep 1.2
    scontrol update jobid="$JOB" StartTime=now
}
reached 400
pkill -9 -f -- "ftkit demo --no-live --jobdir $J "
start_now
reached 1200
scancel --signal=USR1 --batch "$JOB"
start_now
until [ -z "$(squeue -h -j "$JOB" -o %T)" ]; do sleep 0.5; done
scontrol show job "$JOB" | grep -o 'JobState=[A-Z]* .*Restarts=[0-9]*' || true
ftkit report "$J" --plot "$OUT"
